"""Local SGD's automatic T: the estimator on synthetic curves, its limits, and auto runs.

Closed forms the estimator must recover (c = round seconds / step seconds):
    geometric L = a rho^s:   T* = log c / log(1/rho)       power L = a s^-beta:   T* = c^(1/beta)
Tolerance: the law exactly, the rate to 1e-6 (relative), and T within one step of ceil(T*)
(a rate recovered to 1e-9 can still move a T* that is an exact integer across the ceiling).
"""

import math
import sys

import h5py
import numpy as np
import pytest

from lsgd_hpc.methods.rules.auto_period import (LAW_FIXED, LAW_GEOMETRIC, LAW_GEOMETRIC_ASSUMED,
                                                LAW_NAMES, LAW_NONE, LAW_POWER, DecayStatistics,
                                                choose_local_steps, decay_statistics, decide)
from mpi_util import run_mpi

T_MAX = 1024
POWER = (2.0, 0.5)          # L = 2 s^-0.5
GEOMETRIC = (3.0, 0.995)    # L = 3 * 0.995^s


def _jump(k: int) -> float:
    """The loss factor an averaging round leaves on segment k: up and down, up to e^0.3."""
    return math.exp(0.3 * math.sin(1.7 * k))


def synthetic_segments(law: str, end: int, window: int = 200, seg_len: int = 8,
                       noise: float = 0.0, seed: int = 0, drop: float = 1.0):
    """The last ``window`` steps up to ``end`` of a loss curve with the given local law, cut
    into segments of ``seg_len`` steps, each segment moved by an averaging jump (and, with
    ``drop`` < 1, lowered by that factor at every averaging, as when averaging helps)."""
    rng = np.random.default_rng(seed)
    steps = np.arange(max(1, end - window + 1), end + 1)
    segments = []
    for k, start in enumerate(range(0, len(steps), seg_len)):
        s = steps[start:start + seg_len]
        if law == "power":
            loss = POWER[0] * s.astype(float) ** -POWER[1]
        else:
            loss = GEOMETRIC[0] * GEOMETRIC[1] ** s.astype(float)
        loss = loss * _jump(k) * drop ** k * np.exp(noise * rng.standard_normal(len(s)))
        segments.append(list(zip(s.tolist(), loss.tolist())))
    return segments


def closed_form(law: str, c: float) -> int:
    if law == "power":
        t = c ** (1 / POWER[1])
    else:
        t = math.log(c) / math.log(1 / GEOMETRIC[1])
    return min(math.ceil(t), T_MAX)


@pytest.mark.parametrize("end", [50, 400, 3000])
@pytest.mark.parametrize("law", ["power", "geometric"])
@pytest.mark.parametrize("c", [10.0, 30.0])
def test_estimator_recovers_law_rate_and_T_at_any_step(law, end, c):
    d = decide(decay_statistics(synthetic_segments(law, end)), c, T_MAX)
    assert d.law == (LAW_POWER if law == "power" else LAW_GEOMETRIC), d.reason
    assert d.rate == pytest.approx(POWER[1] if law == "power" else GEOMETRIC[1], rel=1e-6)
    assert d.r2 == pytest.approx(1.0, abs=1e-6)
    assert abs(d.T - closed_form(law, c)) <= 1, (d, closed_form(law, c))


def test_the_issue_case_a_late_power_law_is_not_called_geometric():
    # L = 2 s^-0.5 on steps 2801..3000 in one piece: numbered 1..200 it looked geometric
    segment = [[(s, 2.0 * s ** -0.5) for s in range(2801, 3001)]]
    d = decide(decay_statistics(segment), 10.0, 390)
    assert d.law == LAW_POWER and d.rate == pytest.approx(0.5, rel=1e-6) and d.T in (100, 101)


@pytest.mark.parametrize("law", ["power", "geometric"])
def test_averaging_jumps_do_not_enter_the_fit(law):
    # every averaging round lowers the loss by 10%: progress that is not local
    segments = synthetic_segments(law, 400, drop=0.9)
    right = decide(decay_statistics(segments), 10.0, T_MAX)
    # the same points as one piece: the fit takes the averaging drops for local decay
    wrong = decide(decay_statistics([[p for seg in segments for p in seg]]), 10.0, T_MAX)
    assert right.T == closed_form(law, 10.0)
    assert abs(wrong.T - closed_form(law, 10.0)) > 10, wrong


def test_a_fit_that_explains_nothing_is_rejected():
    rng = np.random.default_rng(1)
    noise = [[(s, float(v)) for s, v in zip(range(a, a + 8), 1 + 0.3 * rng.random(8))]
             for a in range(1, 400, 8)]
    d = decide(decay_statistics(noise), 10.0, T_MAX)
    assert d.law == LAW_NONE and d.T is None
    assert "does not decay" in d.reason or "rejected" in d.reason
    # a real but weak decay under heavy noise: significant slope, R^2 below the threshold
    weak = synthetic_segments("geometric", 400, noise=0.2, seed=2)
    d = decide(decay_statistics(weak), 10.0, T_MAX)
    assert d.law == LAW_NONE and d.r2 < 0.1 and d.T is None, d


def test_laws_that_fit_equally_well_fall_back_to_the_geometric_law_and_say_so():
    # late in training, with noise, s and log s are both straight over a short window
    noisy = synthetic_segments("power", 3000, noise=1e-3, seed=3)
    d = decide(decay_statistics(noisy), 10.0, T_MAX)
    assert d.law == LAW_GEOMETRIC_ASSUMED, d
    assert 0 < d.rate < 1 and d.T == choose_local_steps(LAW_GEOMETRIC, d.rate, 10.0, T_MAX)
    assert LAW_NAMES[d.law] == "geometric (assumed)"


def test_too_little_evidence_keeps_T():
    assert decide(DecayStatistics(), 10.0, T_MAX).T is None
    few = synthetic_segments("power", 10, window=10, seg_len=2)   # 5 segments of 2: dof 4
    assert decide(decay_statistics(few), 10.0, T_MAX).law == LAW_NONE


@pytest.mark.parametrize("c", [1e-3, 0.5, 1.0])
def test_a_round_no_dearer_than_a_step_gives_T_1(c):
    assert choose_local_steps(LAW_POWER, 0.5, c, 100) == 1          # was 2 under the power law
    assert choose_local_steps(LAW_GEOMETRIC, 0.9, c, 100) == 1
    for law in ("power", "geometric"):
        assert decide(decay_statistics(synthetic_segments(law, 400)), c, T_MAX).T == 1
    assert decide(DecayStatistics(), c, T_MAX).T == 1                # no fit needed for that


def test_the_closed_forms():
    rho = 0.9
    assert [choose_local_steps(LAW_GEOMETRIC, rho, c, 10 ** 6) for c in (10, 100, 1000)] == \
        [math.ceil(math.log(c) / math.log(1 / rho)) for c in (10, 100, 1000)]
    assert choose_local_steps(LAW_POWER, 0.5, 10.0, 10 ** 6) == 100          # 10 ** 2
    assert choose_local_steps(LAW_POWER, 1.0, 37.0, 10 ** 6) == 37
    assert choose_local_steps(LAW_POWER, 0.5, 1e4, 500) == 500               # clipped
    assert choose_local_steps(LAW_NONE, math.nan, 10.0, 100) is None
    assert choose_local_steps(LAW_FIXED, 0.5, 10.0, 100) is None


BETAS = [1e-4, 1e-3, 3e-3, 0.01, 0.1, 0.5, 1.0, 3.0]
RATIOS = [1e-9, 0.5, 1.0, 1.0 + 1e-12, 1.5, 10.0, 1e3, 1e6, 1e9]


def test_no_exception_for_extreme_rates_and_ratios():
    # the issue's crash: inv_r ** (1/beta) overflowed for beta = 0.003
    assert choose_local_steps(LAW_POWER, 0.003, 10.0, 390) == 390
    for c in RATIOS:
        for beta in BETAS:
            t = choose_local_steps(LAW_POWER, beta, c, 390)
            assert isinstance(t, int) and 1 <= t <= 390
        for rho in (1e-300, 1e-6, 0.5, 0.999, 1 - 1e-12):
            t = choose_local_steps(LAW_GEOMETRIC, rho, c, 390)
            assert isinstance(t, int) and 1 <= t <= 390
    for bad in (math.nan, math.inf, -1.0, 0.0):
        assert choose_local_steps(LAW_POWER, 0.5, bad, 100) is None
        assert choose_local_steps(LAW_POWER, bad, 10.0, 100) is None


@pytest.mark.parametrize("beta", BETAS)
def test_the_estimator_end_to_end_never_raises(beta):
    # a clean power law with a tiny exponent is still fitted; T goes to the cap for dear rounds
    segs = [[(s, 2.0 * s ** -beta) for s in range(a, a + 8)] for a in range(2801, 3001, 8)]
    for c in RATIOS:
        d = decide(decay_statistics(segs), c, T_MAX)
        assert d.law == LAW_POWER and d.rate == pytest.approx(beta, rel=1e-4)
        assert 1 <= d.T <= T_MAX
        assert d.T == (1 if c <= 1 else choose_local_steps(LAW_POWER, d.rate, c, T_MAX))
    odd = [[(1, 0.0), (2, 0.0), (3, math.nan)], [(4, math.inf), (5, 1e-320), (6, -1.0)],
           [(7, 1.0)], [(8, 1.0), (9, 1.0)]] * 5
    for c in RATIOS + [math.nan, math.inf, 0.0]:
        d = decide(decay_statistics(odd), c, T_MAX)
        assert d.T is None or 1 <= d.T <= T_MAX


def test_evidence_adds_across_ranks():
    # what the allreduce does: the sum of per-rank statistics is the fit of all segments
    a = synthetic_segments("power", 400, seed=4, noise=0.01)
    b = synthetic_segments("geometric", 400, seed=5, noise=0.01)
    summed = np.add(decay_statistics(a).as_vector(), decay_statistics(b).as_vector())
    np.testing.assert_allclose(summed, decay_statistics(a + b).as_vector(), rtol=1e-12)


# Ranks with different evidence ending on the same T, under mpirun -np 2, 4 and 5 on both
# backends: tests/parallel/test_algorithms_parallel.py::
# test_auto_local_steps_ranks_with_different_evidence_end_on_the_same_T (run by
# tests/test_parallel_mpi.py).


def _columns(run_dir, rank):
    """/train columns, the averaging rounds' steps (the steps that sent bytes: local SGD
    communicates only when it averages) and the law codes."""
    with h5py.File(run_dir / "metrics" / f"rank{rank:05d}.h5", "r") as f:
        cols = {k: f["train"][k][()] for k in ("step", "local_steps", "local_law")}
        sent = np.diff(np.concatenate([[0], f["train"]["comm_bytes_sent"][()]]))
        return cols, cols["step"][sent > 0], f.attrs["local_law_codes"]


@pytest.mark.mpi
def test_an_auto_run_changes_T_on_every_rank_alike(tmp_path):
    # One averaging round taken to cost half a local step: at the first estimate (the first
    # round at step >= 50) T must drop from its initial 4 to 1 on every rank, fit or no fit.
    run_mpi(2, [sys.executable, "-m", "lsgd_hpc.train", "--algorithm", "local-sgd",
                "--local-steps", "auto", "--local-steps-cost-ratio", "0.5", "--max-steps", "72",
                "--eval-every", "1000", "--run-dir", str(tmp_path)], timeout=300)
    (cols0, cons0, codes), (cols1, cons1, _) = _columns(tmp_path, 0), _columns(tmp_path, 1)
    for k in cols0:
        assert np.array_equal(cols0[k], cols1[k]), k
    assert np.array_equal(cons0, cons1)
    T, law, steps = cols0["local_steps"], cols0["local_law"], cols0["step"]
    assert len(T) == 72 and T[0] == 4
    assert T[-1] == 1, "T never changed"
    changed = int(steps[np.argmax(T != 4)])
    assert changed == 52                 # the first averaging round at step >= 50 (4 | 52)
    assert set(law[:changed - 1]) == {LAW_NONE}
    # averaging rounds every 4 steps up to the change, then every step
    assert list(cons0) == list(range(4, 53, 4)) + list(range(53, 73))
    assert "1=geometric" in codes and "2=power" in codes
