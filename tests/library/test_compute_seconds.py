"""``compute_seconds`` of a library loop: ``open_metrics(..., method=method)`` times the steps
itself (the first forward in training mode to the end of ``method.step``, less the
communication inside), so a user's loop writes what the trainer writes. Real mpirun jobs."""

import json
import sys

import h5py
import numpy as np
import pytest

from mpi_util import run_mpi

#: a user's loop as docs/library.md writes it (no compute timing of its own), with an
#: evaluation inside ``measuring()`` every 20 steps
USER_LOOP = '''
import sys
import torch
import torch.nn.functional as F
import lsgd_hpc

torch.set_num_threads(1)
torch.manual_seed(0)
comm = lsgd_hpc.init(device="cpu")
model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
method = lsgd_hpc.LeaderSGD(model, opt, comm, tau_local=4, tau_global=8, max_steps=40)
metrics = lsgd_hpc.open_metrics(sys.argv[1], comm, method=method)
g = torch.Generator().manual_seed(comm.rank)
x, y = torch.randn(40 * 32, 64, generator=g), torch.randint(0, 10, (40 * 32,), generator=g)
while not method.done:
    i = method.steps
    loss = F.cross_entropy(model(x[32 * i:32 * i + 32]), y[32 * i:32 * i + 32])
    opt.zero_grad()
    loss.backward()
    method.step(loss)
    metrics.log_step(method.steps, loss.item())
    if method.steps % 20 == 0:
        model.eval()
        with torch.no_grad(), metrics.measuring():
            metrics.log_eval(method.steps, float(F.cross_entropy(model(x), y)), 0.0)
        model.train()
metrics.close()
'''

#: the trainer, run as ``python -m lsgd_hpc.train`` runs it, with its metrics writer kept and a
#: stopwatch of the test's own around every step, as the trainer timed them before it took the
#: writer's clock: from the batch handed to the loop to the end of ``method.step``, less the
#: communication in between (the comm's seconds, overhead and probes, the worker's traffic)
TRAINER_SPY = '''
import json
import sys
import time

import lsgd_hpc
from lsgd_hpc.cli import train
from lsgd_hpc.runtime import run_metrics

writers = []
stopwatch = {"seconds": 0.0, "steps": 0, "start": None}


def spy(*args, **kwargs):
    writers.append(run_metrics.open_metrics(*args, **kwargs))
    return writers[-1]


def comm_seconds(trainer):
    s, w = trainer.comm.stats, trainer.method.worker_stats
    return (s.seconds + s.overhead_seconds + s.probe_seconds
            + (w.seconds if w is not None else 0.0))


connect = train.Trainer.connect


def timed_connect(self, comm, stop):
    connect(self, comm, stop)
    from_step = self.batches.from_step

    def batches(step):
        for batch in from_step(step):
            stopwatch["start"] = (time.perf_counter(), comm_seconds(self))
            yield batch

    def ended():
        t, c = stopwatch["start"]
        stopwatch["seconds"] += (time.perf_counter() - t) - (comm_seconds(self) - c)
        stopwatch["steps"] += 1

    self.batches.from_step = batches
    self.method.step_listeners.append(ended)
    return self


lsgd_hpc.open_metrics = spy
train.Trainer.connect = timed_connect
out, argv = sys.argv[1], sys.argv[2:]
status = train.main(argv)
w = writers[0]
with open(f"{out}.{w.comm.rank}", "w") as fh:
    json.dump({"writer": w.compute_seconds, "own": w._compute_own,
               "stopwatch": stopwatch["seconds"], "steps": stopwatch["steps"],
               "training_time": w.training_time()}, fh)
train.close_torch_world(status)
sys.exit(status)
'''


@pytest.mark.mpi
def test_user_loop_writes_compute_seconds(tmp_path):
    script = tmp_path / "loop.py"
    script.write_text(USER_LOOP)
    run = tmp_path / "run"
    run_mpi(2, [sys.executable, str(script), str(run)], timeout=180)
    for rank in range(2):
        with h5py.File(run / "metrics" / f"rank{rank:05d}.h5", "r") as f:
            compute = f["train/compute_seconds"][:]
            training = f["train/training_time"][:]
            comm_s = f["train/comm_seconds"][:]
        assert len(compute) == 40
        assert compute[-1] > 0, f"rank {rank} wrote compute_seconds {compute[-1]}"
        assert np.all(np.diff(compute) > 0), "one more step, more compute"
        # compute and communication both fit in the training time
        assert compute[-1] + comm_s[-1] <= training[-1] * 1.001 + 1e-3, \
            (compute[-1], comm_s[-1], training[-1])


@pytest.mark.mpi
def test_library_clock_agrees_with_the_trainer(tmp_path):
    """The trainer's compute_seconds is the library writer's clock (it keeps no clock of its
    own), and that clock agrees within 20 % with an outside stopwatch of the same run's steps.
    (Their steps agree within a few per cent; 200 steps, so that a rank that loses the shared
    cores for a time slice inside one clock's window but not the other's moves the totals
    little.)"""
    script = tmp_path / "spy.py"
    script.write_text(TRAINER_SPY)
    out = tmp_path / "times"
    run_mpi(2, [sys.executable, str(script), str(out), "--max-steps", "200", "--eval-every",
                "100", "--run-dir", str(tmp_path / "cli"), "--seed", "0"], timeout=240)
    for rank in range(2):
        t = json.loads((tmp_path / f"times.{rank}").read_text())
        assert t["own"] is None, f"the trainer wrote a compute figure of its own: {t}"
        assert t["steps"] == 200, t
        assert t["writer"] > 0 and t["stopwatch"] > 0, t
        assert abs(t["writer"] - t["stopwatch"]) <= 0.2 * t["stopwatch"], t
        assert t["writer"] <= t["training_time"], t
        # what the trainer's file holds at its last step is the writer's figure
        with h5py.File(tmp_path / "cli" / "metrics" / f"rank{rank:05d}.h5", "r") as f:
            assert f["train/step"][-1] == 200
            assert f["train/compute_seconds"][-1] == pytest.approx(t["writer"], rel=1e-9), t
