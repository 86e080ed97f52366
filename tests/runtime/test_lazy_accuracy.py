"""RunMetrics.log_step with the accuracy as a tensor (the trainer's per-sample hits): the row
keeps the tensor (no reduction, no device sync per step) until the rows are written, read back
or mirrored, and the value written is the one the eager ``float(hits.float().mean())`` gives,
across flushes, batch sizes and the rows left at close; a resume drops deferred rows with the
others; under mpirun, a short trainer run's /train accuracies are k / batch, none NaN."""

import math
import sys
from types import SimpleNamespace

import h5py
import pytest
import torch

from lsgd_hpc.runtime.metrics import SCHEMA_VERSION
from lsgd_hpc.runtime.run_metrics import RunMetrics
from lsgd_hpc.runtime.trackers import Tracker
from mpi_util import run_mpi


def fake_comm():
    return SimpleNamespace(stats=SimpleNamespace(bytes_sent=0, bytes_recv=0, seconds=0.0,
                                                 overhead_seconds=0.0, probe_seconds=0.0))


def writer(path, **kw):
    return RunMetrics(str(path), {"schema_version": SCHEMA_VERSION, "rank": 0},
                      fake_comm(), **kw)


def batches(n, seed=0):
    """``n`` (step, hits) pairs: batch sizes that vary (a short last batch, an LM's B x T),
    hit rates that give means that are not exact in binary."""
    g = torch.Generator().manual_seed(seed)
    shapes = [(32,), (32,), (7,), (3,), (32,), (8, 17), (32,), (100,)]
    return [(s, torch.rand(shapes[s % len(shapes)], generator=g) < 0.37 + 0.05 * (s % 7))
            for s in range(1, n + 1)]


def eager(hits):
    return float(hits.float().mean())


def file_column(path, name="accuracy"):
    with h5py.File(path, "r", locking=False) as f:
        return f["train"][name][()].tolist()


def test_deferred_until_written_and_the_same_values(tmp_path):
    path = tmp_path / "rank00000.h5"
    w = writer(path, flush_every=5, flush_seconds=1e9)
    rows = batches(23)
    for i, (s, hits) in enumerate(rows):
        w.log_step(s, 1.0 / s, hits, lr=0.1)
        if (i + 1) % 5:
            # kept as the tensor itself until the flush: nothing reduced, nothing read
            assert w.rows["train"]["accuracy"][-1] is hits
    w.log_step(24, 0.5, 0.25, lr=0.1)                  # a number still goes in as it is
    want = [eager(h) for _, h in rows] + [0.25]
    # the rows since the last flush (steps 21-24) are read back through column()
    assert w.column("train", "accuracy") == want
    assert all(not isinstance(v, torch.Tensor) for v in w.rows["train"]["accuracy"])
    w.log_step(25, 0.5, rows[0][1], lr=0.1)            # left for close() to write
    w.close()
    assert file_column(path) == want + [eager(rows[0][1])]
    assert file_column(path, "step") == list(range(1, 26))
    assert any(v != round(v * 32) / 32 for v in want)  # means that are not k/32 were checked


def test_a_tracker_gets_the_number_as_the_row_comes(tmp_path):
    seen = []

    class Recorder(Tracker):
        def log_scalars(self, step, scalars):
            seen.append((step, scalars.get("train/accuracy")))

    w = writer(tmp_path / "rank00000.h5", trackers=[Recorder()])
    rows = batches(4, seed=1)
    for s, hits in rows:
        w.log_step(s, 1.0, hits)
        assert seen[-1] == (s, eager(hits))            # mirrored now, not at the flush
    w.close()
    assert file_column(tmp_path / "rank00000.h5") == [eager(h) for _, h in rows]


def test_a_resume_drops_the_deferred_rows_with_the_others(tmp_path):
    path = tmp_path / "rank00000.h5"
    w = writer(path, flush_every=1000, flush_seconds=1e9)
    rows = batches(6, seed=2)
    for s, hits in rows[:3]:
        w.log_step(s, 1.0, hits)
    w.flush()
    for s, hits in rows[3:]:                           # after the checkpoint: dropped
        w.log_step(s, 1.0, hits)
    w.load_existing({"train": 3, "eval": 0})
    w.log_step(4, 1.0, 0.5)
    w.flush()
    assert file_column(path) == [eager(h) for _, h in rows[:3]] + [0.5]


@pytest.mark.mpi
def test_a_short_trainer_run_writes_every_accuracy(tmp_path):
    run_dir = tmp_path / "run"
    # 23 steps, a flush every 5 rows: the last 3 rows are written by the trainer's close
    run_mpi(1, [sys.executable, "-m", "lsgd_hpc.train", "--algorithm", "allreduce",
                "--dataset", "digits", "--model", "digits_cnn", "--batch-size", "32",
                "--max-steps", "23", "--eval-every", "10", "--flush-every", "5",
                "--run-dir", str(run_dir)], timeout=240)
    acc = file_column(run_dir / "metrics" / "rank00000.h5")
    assert len(acc) == 23 and not any(math.isnan(a) for a in acc), acc
    assert all(a * 32 == round(a * 32) and 0 <= a <= 1 for a in acc), acc
    assert len(set(acc)) > 3, acc                      # the model learns: not one figure
