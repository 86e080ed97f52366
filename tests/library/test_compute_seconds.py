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

#: the trainer, run as ``python -m lsgd_hpc.train`` runs it, with its metrics writer kept:
#: the trainer's own compute_seconds (cli/train.py) and the writer's clock on the same run
TRAINER_SPY = '''
import json
import sys

import lsgd_hpc
from lsgd_hpc.cli import train
from lsgd_hpc.runtime import run_metrics

writers = []


def spy(*args, **kwargs):
    writers.append(run_metrics.open_metrics(*args, **kwargs))
    return writers[-1]


lsgd_hpc.open_metrics = spy
out, argv = sys.argv[1], sys.argv[2:]
status = train.main(argv)
w = writers[0]
with open(f"{out}.{w.comm.rank}", "w") as fh:
    json.dump({"trainer": w.compute_seconds,
               "library": w._compute_base + w._compute_measured,
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
    """The same trainer run, two measures of compute_seconds: the trainer's own (the loop in
    cli/train.py) and the library writer's clock; within 20 %. (Their steps agree within a
    few per cent; 200 steps, so that a rank that loses the shared cores for a time slice
    inside one clock's window but not the other's moves the totals little.)"""
    script = tmp_path / "spy.py"
    script.write_text(TRAINER_SPY)
    out = tmp_path / "times"
    run_mpi(2, [sys.executable, str(script), str(out), "--max-steps", "200", "--eval-every",
                "100", "--run-dir", str(tmp_path / "cli"), "--seed", "0"], timeout=240)
    for rank in range(2):
        t = json.loads((tmp_path / f"times.{rank}").read_text())
        assert t["trainer"] > 0 and t["library"] > 0, t
        assert abs(t["library"] - t["trainer"]) <= 0.2 * t["trainer"], t
