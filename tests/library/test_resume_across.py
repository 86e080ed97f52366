"""One checkpoint format: a run the trainer started resumes in a library loop with the same
model and optimizer, and a library loop's checkpoint resumes in the trainer; either way the
result is bit for bit the trainer's uninterrupted run."""

import sys

import pytest
import torch

from lsgd_hpc.runtime import checkpoint as ck
from mpi_util import REPO, run_mpi

WORLD = 2
STEPS, HALF = 24, 12
#: the trainer's run, written out as a user's loop: the same data order (ShardedSampler), the
#: same seeds, optimizer, method options (the digits preset) and checkpoint objects
LOOP = r'''
import sys
import torch
import lsgd_hpc
from lsgd_hpc.data import load_dataset
from lsgd_hpc.models.zoo import build_model

run_dir, stop_at = sys.argv[1], int(sys.argv[2])
comm = lsgd_hpc.init(backend="mpi", device="cpu")
ds = load_dataset("digits", None, 0)
torch.manual_seed(0)                               # the trainer's --seed 0: the same x_0
model = build_model("digits_cnn", ds.num_classes, ds.input_shape)
torch.manual_seed(0 * 100003 + comm.rank)
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
method = lsgd_hpc.LeaderSGD(model, opt, comm, max_steps=STEPS,
                            **lsgd_hpc.DATASETS["digits"].preset("lsgd"))
sampler = lsgd_hpc.ShardedSampler(ds.n_train, comm, batch_size=32, seed=0)
metrics = lsgd_hpc.open_metrics(run_dir, comm, method=method)
ckpt = lsgd_hpc.Checkpointer(run_dir, comm, model=model, optimizer=opt, method=method,
                             sampler=sampler, metrics=metrics)
resumed = ckpt.restore()
loss_fn = torch.nn.CrossEntropyLoss()
while method.steps < stop_at:
    for idx in sampler:
        x, y = ds.normalize(ds.x_train[idx]), ds.y_train[idx]
        out = model(x)
        loss = loss_fn(out, y)
        method.zero_grad()
        loss.backward()
        method.step(float(loss))
        metrics.log_step(method.steps, float(loss), lr=0.05)
        if method.steps == stop_at:
            break
ckpt.save()
if comm.rank == 0:
    print("library loop: resumed at", resumed, "ended at", method.steps)
'''.replace("STEPS", str(STEPS))

TRAIN = [sys.executable, "-m", "lsgd_hpc.train", "--algorithm", "lsgd", "--eval-every", "6"]


def final_models(run_dir):
    step = ck.latest_checkpoint(str(run_dir))["step"]
    return [ck.load_rank(str(run_dir), step, r)["objects"]["model"] for r in range(WORLD)]


def assert_same_models(a, b):
    for ma, mb in zip(a, b):
        assert ma.keys() == mb.keys()
        for k in ma:
            assert torch.equal(ma[k], mb[k]), k


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    run = tmp_path_factory.mktemp("resume") / "reference"
    run_mpi(WORLD, [*TRAIN, "--max-steps", str(STEPS), "--run-dir", str(run)], timeout=300)
    return final_models(run)


@pytest.mark.mpi
def test_trainer_checkpoint_resumes_in_a_library_loop(tmp_path, reference):
    run = tmp_path / "run"
    run_mpi(WORLD, [*TRAIN, "--max-steps", str(HALF), "--run-dir", str(run)], timeout=300)
    script = tmp_path / "loop.py"
    script.write_text(LOOP)
    out = run_mpi(WORLD, [sys.executable, str(script), str(run), str(STEPS)], timeout=300,
                  cwd=REPO)
    assert f"library loop: resumed at {HALF} ended at {STEPS}" in out.stdout
    assert_same_models(final_models(run), reference)


@pytest.mark.mpi
def test_library_checkpoint_resumes_in_the_trainer(tmp_path, reference):
    run = tmp_path / "run"
    script = tmp_path / "loop.py"
    script.write_text(LOOP)
    out = run_mpi(WORLD, [sys.executable, str(script), str(run), str(HALF)], timeout=300,
                  cwd=REPO)
    assert f"library loop: resumed at None ended at {HALF}" in out.stdout
    out = run_mpi(WORLD, [*TRAIN, "--max-steps", str(STEPS), "--run-dir", str(run), "--resume"],
                  timeout=300)
    assert f"resumed at step {HALF}" in out.stdout
    assert_same_models(final_models(run), reference)
