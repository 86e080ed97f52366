"""The examples run as the README says, on 4 ranks as 2 "nodes" (--ranks-per-node 2), briefly.

examples/own_loop.py trains the user's own MLP on digits with every method of METHODS in turn
(one mpirun job, --method all) and aggregates the runs: each method's reported model reaches
85% test accuracy in 100 steps, and summary.csv has one row per method.
examples/char_lm.py trains a tiny byte-level transformer for 40 steps: the held-out loss
starts near ln 256 and falls by at least 1.5 nats/byte.
"""

import csv
import math
import re
import sys

import pytest

from mpi_util import REPO, run_mpi

from lsgd_hpc.methods import METHODS


@pytest.mark.mpi
@pytest.mark.timeout(600)
def test_own_loop_every_method(tmp_path):
    run_dir = tmp_path / "own"
    res = run_mpi(4, [sys.executable, str(REPO / "examples" / "own_loop.py"), "--method", "all",
                      "--ranks-per-node", "2", "--max-steps", "100", "--eval-every", "50",
                      "--run-dir", str(run_dir)], timeout=420)
    acc = {m.group(1): float(m.group(2)) for m in
           re.finditer(r"^(\S+): test accuracy of the reported model ([\d.]+)%", res.stdout, re.M)}
    assert set(acc) == set(METHODS), res.stdout
    assert all(a >= 85.0 for a in acc.values()), acc
    with open(run_dir / "aggregate" / "summary.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert sorted(r["algorithm"] for r in rows) == sorted(METHODS)
    for name in METHODS:
        assert len(list((run_dir / name / "metrics").glob("rank*.h5"))) == 4


@pytest.mark.mpi
@pytest.mark.timeout(600)
def test_char_lm_held_out_loss_falls(tmp_path):
    run_dir = tmp_path / "lm"
    res = run_mpi(4, [sys.executable, str(REPO / "examples" / "char_lm.py"),
                      "--ranks-per-node", "2", "--method", "lsgd", "--steps", "40",
                      "--d-model", "64", "--layers", "2", "--context", "32",
                      "--eval-every", "20", "--run-dir", str(run_dir)], timeout=420)
    m = re.search(r"held-out loss ([\d.]+) -> ([\d.]+) nats/byte \(perplexity ([\d.]+)\)",
                  res.stdout)
    assert m, res.stdout
    initial, final, ppl = map(float, m.groups())
    assert abs(initial - math.log(256)) < 0.6, initial
    assert final <= initial - 1.5, (initial, final)
    assert abs(ppl - math.exp(final)) / ppl < 0.01
    assert "MiB sent" in res.stdout and "training time" in res.stdout
    assert len(list((run_dir / "metrics").glob("rank*.h5"))) == 4
    # the validation windows (other files than the held-out ones): a column of the example's
    # own through open_metrics(extra_columns=...), falling with the held-out loss
    import h5py
    with h5py.File(run_dir / "metrics" / "rank00000.h5", "r") as f:
        val, test = f["eval"]["val_loss"][()], f["eval"]["test_loss"][()]
    assert len(val) == len(test) == 3 and not (val == test).any()
    assert val[-1] <= val[0] - 1.0 and abs(test[-1] - final) < 1e-3, (val, test)
