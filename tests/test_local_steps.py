"""Local SGD's automatic T: the decay fits and the seed's laws, and an auto run under mpirun."""

import math
import sys

import h5py
import numpy as np
import pytest

from lsgd_hpc.algorithms.local_sgd import choose_local_steps, fit_decay
from mpi_util import run_mpi


def test_fit_recognises_geometric_decay():
    losses = [2.0 * 0.97 ** t for t in range(1, 80)]
    law, rate, r2 = fit_decay(losses)
    assert law == "geometric" and rate == pytest.approx(0.97, rel=1e-9) and r2 > 0.999


def test_fit_recognises_power_decay():
    losses = [3.0 * t ** -0.5 for t in range(1, 80)]
    law, rate, r2 = fit_decay(losses)
    assert law == "power" and rate == pytest.approx(0.5, rel=1e-9) and r2 > 0.999


def test_fit_refuses_a_loss_that_does_not_decay():
    assert fit_decay([1.0 + 0.01 * t for t in range(50)])[0] == "none"
    assert fit_decay([1.0, 2.0])[0] == "none"


def test_geometric_law_grows_like_log_of_cost_ratio():
    rho = 0.9
    ts = [choose_local_steps("geometric", rho, ratio, 10 ** 6) for ratio in (10, 100, 1000)]
    assert ts == [math.ceil(math.log(r) / math.log(1 / rho)) for r in (10, 100, 1000)]
    # log law: equal steps for each factor of 10
    assert ts[2] - ts[1] == pytest.approx(ts[1] - ts[0], abs=1)


def test_power_law_grows_like_a_power_of_cost_ratio():
    beta = 0.5
    assert choose_local_steps("power", beta, 10.0, 10 ** 6) == 100      # 10 ** (1 / 0.5)
    assert choose_local_steps("power", 1.0, 37.0, 10 ** 6) == 37
    assert choose_local_steps("power", beta, 1e4, 500) == 500            # clipped to t_max
    assert choose_local_steps("geometric", 0.9, 0.5, 100) == 1           # step dearer: T = 1
    assert choose_local_steps("none", math.nan, 10.0, 100) is None


@pytest.mark.mpi
def test_auto_local_steps_run_logs_the_same_T_on_every_rank(tmp_path):
    run_mpi(2, [sys.executable, "-m", "lsgd_hpc.train", "--algorithm", "local-sgd",
                "--local-steps", "auto", "--max-steps", "120", "--run-dir", str(tmp_path)],
            timeout=300)
    ts = []
    for r in range(2):
        with h5py.File(tmp_path / "metrics" / f"rank{r:05d}.h5", "r") as f:
            ts.append(f["train"]["local_steps"][()])
            steps = f["train"]["step"][()]
            cons = f["consensus"]["step"][()]
    assert np.array_equal(ts[0], ts[1]) and len(ts[0]) == 120
    assert np.all(ts[0] >= 1)
    # an averaging round every T steps, with the T in force at the time
    assert len(cons) >= 120 // max(ts[0].max(), 1)
    assert set(cons) <= set(steps)
