"""The library's run-time helpers at world size 1 (no mpirun): the fixes the examples needed.

- open_metrics + log_step/log_eval work for every method, whose files have extra columns
  (async LSGD's staleness, local SGD's T, EASGD's centre figures);
- open_metrics on an existing rank file leaves it for Checkpointer.restore, which takes the
  rows up to the checkpoint back from it (it used to be replaced by an empty file first);
- CommStats.reset; aggregate reads an EASGD library run without centre figures.
"""

import h5py
import numpy as np
import pytest
import torch
from torch import nn

import lsgd_hpc
from lsgd_hpc.analysis import aggregate
from lsgd_hpc.methods import METHODS


@pytest.fixture(scope="module")
def comm():
    return lsgd_hpc.init(backend="mpi", device="cpu", abort_on_exception=False)


def train(model, opt, method, metrics, steps):
    g = torch.Generator().manual_seed(method.steps)
    for _ in range(steps):
        x = torch.randn(8, 4, generator=g)
        loss = nn.functional.mse_loss(model(x), x[:, :2])
        opt.zero_grad()
        loss.backward()
        method.step(loss)
        metrics.log_step(method.steps, loss.item())
        if method.done:
            break


@pytest.mark.parametrize("name", list(METHODS))
def test_metrics_of_every_method(comm, name, tmp_path):
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    method = METHODS[name](model, opt, comm, max_steps=6)
    metrics = lsgd_hpc.open_metrics(str(tmp_path), comm, method=method)
    train(model, opt, method, metrics, 6)
    metrics.log_eval(method.steps, 0.5, 0.75)
    metrics.flush()
    with h5py.File(tmp_path / "metrics" / "rank00000.h5", "r") as f:
        assert f.attrs["algorithm"] == name
        assert len(f["train"]["loss"]) == method.steps and list(f["eval"]["test_loss"]) == [0.5]
        if name == "easgd":
            assert np.isnan(f["eval"]["center_test_accuracy"][0])
    run = aggregate.read_run(tmp_path)
    assert aggregate.leader_rule(run) == "rank0"      # no centre figures were logged
    assert aggregate.eval_table(run)["acc_leader"][-1] == 0.75
    method.close()


def test_reopened_metrics_resume_from_checkpoint(comm, tmp_path):
    def fresh():
        torch.manual_seed(0)
        model = nn.Linear(4, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        method = lsgd_hpc.LocalSGD(model, opt, comm, local_steps=2, max_steps=10)
        metrics = lsgd_hpc.open_metrics(str(tmp_path), comm, method=method)
        ckpt = lsgd_hpc.Checkpointer(str(tmp_path), comm, model=model, optimizer=opt,
                                     method=method, metrics=metrics)
        return model, opt, method, metrics, ckpt

    model, opt, method, metrics, ckpt = fresh()
    train(model, opt, method, metrics, 4)
    assert ckpt.save() == 4
    train(model, opt, method, metrics, 2)          # rows past the checkpoint: dropped
    metrics.flush()
    model, opt, method, metrics, ckpt = fresh()    # the job restarted
    assert ckpt.restore() == 4
    assert metrics.row_counts()["train"] == 4
    train(model, opt, method, metrics, 6)
    metrics.flush()
    with h5py.File(tmp_path / "metrics" / "rank00000.h5", "r") as f:
        assert list(f["train"]["step"]) == list(range(1, 11))


def test_comm_stats_reset(comm):
    comm.stats.bytes_sent += 10
    comm.stats.reset()
    assert comm.stats.bytes_sent == 0 and comm.stats.seconds == 0.0


def test_open_metrics_takes_columns_of_your_own(comm, tmp_path):
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    method = lsgd_hpc.EASGD(model, opt, comm, max_steps=4)
    metrics = lsgd_hpc.open_metrics(str(tmp_path), comm, method=method,
                                    extra_columns={"eval": {"val_loss": "f8"},
                                                   "train": {"grad_norm": "f8"}})
    train(model, opt, method, metrics, 2)
    metrics.log_step(method.steps, 0.1, grad_norm=3.5)
    metrics.log_eval(method.steps, 0.5, 0.75, val_loss=0.25)
    metrics.log_eval(method.steps, 0.4, 0.8)
    metrics.flush()
    with h5py.File(tmp_path / "metrics" / "rank00000.h5", "r") as f:
        assert list(f["eval"]["val_loss"][:1]) == [0.25] and np.isnan(f["eval"]["val_loss"][1])
        assert np.isnan(f["eval"]["center_test_loss"][0])          # the method's own, kept
        assert f["train"]["grad_norm"][-1] == 3.5
    method.close()
    for bad, what in [({"eval": {"test_loss": "f8"}}, "already has"),
                      ({"eval": {"center_test_loss": "f8"}}, "already has"),
                      ({"evals": {"x": "f8"}}, "no group")]:
        torch.manual_seed(0)
        method = lsgd_hpc.EASGD(model, opt, comm, max_steps=4)
        with pytest.raises(ValueError, match=what):
            lsgd_hpc.open_metrics(str(tmp_path / "bad"), comm, method=method, extra_columns=bad)
        method.close()
