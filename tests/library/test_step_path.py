"""The per-step path at world size 1 (no mpirun): what ``Method.step``, ``Method.zero_grad``
and ``RunMetrics.log_step`` do every step without building anything per step.

- ``log_step``'s row of the schema's columns alone, appended to the columns in place, is the
  row the general path (a row dictionary through ``log``) writes, value for value (the clock
  made the same), across flushes, with deferred accuracies;
- AllreduceSGD leaves a loss tensor unread (no device sync per step); LeaderSGD, whose
  scores are the losses, reads it;
- ``zero_grad`` after ``optimizer.zero_grad()`` points the gradients back into the flat
  buffer and zeroes them.
"""

import math
import time
from types import SimpleNamespace

import h5py
import numpy as np
import pytest
import torch
from torch import nn

import lsgd_hpc
from lsgd_hpc.methods import METHODS
from lsgd_hpc.runtime import run_metrics
from lsgd_hpc.runtime.metrics import GROUPS, SCHEMA_VERSION
from lsgd_hpc.runtime.run_metrics import RunMetrics


@pytest.fixture(scope="module")
def comm():
    return lsgd_hpc.init(backend="mpi", device="cpu", abort_on_exception=False)


class ThroughLog(RunMetrics):
    """Every /train row through ``log`` (a subclass's own ``log``: the general path)."""

    def log(self, group, **row):
        super().log(group, **row)


def _rows(writer_class, path, monkeypatch):
    """A writer's file after 13 steps (flushes every 5 rows), on a clock that ticks 0.25 s a
    call and counters that grow every step, each column's values unlike any other's."""
    ticks = iter(np.arange(1, 10_000) * 0.25)
    monkeypatch.setattr(run_metrics.time, "perf_counter", lambda: float(next(ticks)))
    stats = SimpleNamespace(bytes_sent=0, bytes_recv=0, seconds=0.0, overhead_seconds=0.0,
                            probe_seconds=0.0)
    w = writer_class(str(path), {"schema_version": SCHEMA_VERSION, "rank": 0},
                     SimpleNamespace(stats=stats), flush_every=5, flush_seconds=1e9)
    g = torch.Generator().manual_seed(0)
    for step in range(1, 14):
        stats.bytes_sent += 100 * step
        stats.bytes_recv += 7 * step
        stats.seconds += 0.001 * step
        stats.overhead_seconds += 0.002 * step
        stats.probe_seconds += 0.003 if step % 2 else 0.0
        w.eval_seconds += 0.01 if step % 4 == 0 else 0.0
        w.checkpoint_seconds += 0.02 if step % 5 == 0 else 0.0
        hits = torch.rand(32, generator=g) < 0.6 if step % 3 else 0.5
        w.log_step(step, 1.0 / step, hits, lr=0.1 * step, epoch=step / 7)
    w.close()
    with h5py.File(path, "r") as f:
        rows = {c: f["train"][c][()] for c in f["train"]}
    return w, rows


def test_log_step_appends_the_rows_log_writes(tmp_path, monkeypatch):
    fast, fast_rows = _rows(RunMetrics, tmp_path / "fast.h5", monkeypatch)
    general, general_rows = _rows(ThroughLog, tmp_path / "general.h5", monkeypatch)
    assert fast._schema_appends and general._schema_appends == ()   # the two paths taken
    assert set(fast_rows) == set(general_rows) == set(GROUPS["train"])
    for c in GROUPS["train"]:
        assert fast_rows[c].dtype == general_rows[c].dtype, c
        np.testing.assert_array_equal(fast_rows[c], general_rows[c], err_msg=c)
    assert list(fast_rows["step"]) == list(range(1, 14))
    assert fast_rows["comm_bytes_sent"][-1] == sum(100 * s for s in range(1, 14))
    assert fast_rows["accuracy"][2] == 0.5 and 0 < fast_rows["accuracy"][0] < 1


def test_log_step_with_columns_of_your_own_goes_through_log(comm, tmp_path):
    w = lsgd_hpc.open_metrics(str(tmp_path), comm, extra_columns={"train": {"tokens": "i8"}})
    w.log_step(1, 0.5, tokens=64)
    w.log_step(2, 0.25)
    with pytest.raises(KeyError, match="unknown"):
        w.log_step(3, 0.125, nope=1.0)
    assert w._schema_appends == ()
    assert w.rows["train"]["tokens"][:1] == [64] and math.isnan(w.rows["train"]["tokens"][1])


class CountedLoss(torch.Tensor):
    """A loss tensor that counts how often it is read as a number."""

    reads = 0

    def __float__(self):
        CountedLoss.reads += 1
        return super().__float__()

    def item(self):
        CountedLoss.reads += 1
        return super().item()


@pytest.mark.parametrize("name, reads", [("allreduce", 0), ("lsgd", 1)])
def test_the_loss_is_read_only_by_methods_that_use_it(comm, name, reads):
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    method = METHODS[name](model, opt, comm, max_steps=3)
    x = torch.randn(8, 4)
    loss = nn.functional.mse_loss(model(x), x[:, :2])
    opt.zero_grad()
    loss.backward()
    counted = loss.detach().as_subclass(CountedLoss)
    CountedLoss.reads = 0
    method.step(counted)
    assert CountedLoss.reads == reads and method.steps == 1
    if name == "lsgd":                    # the leader's score: the losses it was given
        assert list(method.rule.losses) == [pytest.approx(float(loss.detach()))]
    method.step(0.25)                     # a float goes through as it is
    assert method.steps == 2
    method.close()


def test_zero_grad_points_the_gradients_back_into_the_flat_buffer(comm):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    method = lsgd_hpc.AllreduceSGD(model, opt, comm)
    flat = method.flat.grad
    lo, hi = flat.data_ptr(), flat.data_ptr() + flat.numel() * flat.element_size()
    for zero in (opt.zero_grad, method.zero_grad):
        zero()
        nn.functional.mse_loss(model(torch.randn(8, 4)), torch.zeros(8, 2)).backward()
        method.zero_grad()
        assert all(lo <= p.grad.data_ptr() < hi and not p.grad.any()
                   for p in model.parameters())
        nn.functional.mse_loss(model(torch.randn(8, 4)), torch.zeros(8, 2)).backward()
        assert flat.abs().sum() > 0                  # backward accumulated into the buffer
        method.step()
    method.close()
