"""Checkpoint sets of format 2 (lsgd_hpc/runtime/checkpoint.py): what a group of ranks holds
alike is written once (the replica of allreduce SGD: once for the whole job), every rank's own
state apart; saves are asynchronous (the step waits for a host copy, a thread writes), a rank
killed during its write leaves the previous set the newest, and sets of format 1 (one full
file per rank) still resume.

The real runs: allreduce SGD on the synthetic set. The bytes of a set are measured at 4 ranks
with mlp_wide (33.7 MB of model and optimizer state a rank, two steps); the resumes run at 2
ranks with the small mlp (what they check depends on neither the size nor the rank count: the
replica is written once, each rank's own state apart) and are compared row for row with the
uninterrupted run."""

import json
import os
import shutil
import sys
import threading
import types

import h5py
import numpy as np
import pytest
import torch

from lsgd_hpc.comm.base import CommStats
from lsgd_hpc.runtime import checkpoint as ck
from lsgd_hpc.runtime import checkpoint_layout as layout
from lsgd_hpc.runtime.metrics import TIME_COLUMNS
from mpi_util import run_mpi

#: the resumes' world; the bytes of a set are measured at REPLICA_WORLD
WORLD, REPLICA_WORLD = 2, 4


# -- the split by the methods' declarations (no MPI) -----------------------------------------
def test_replica_name_is_the_rules_one():
    from lsgd_hpc.methods.rules.state import REPLICA
    assert layout.REPLICA == REPLICA


def _method(shared_state, workers=None):
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    inner = types.SimpleNamespace(shared_state=shared_state)
    rule = inner if workers is None else types.SimpleNamespace(rule=inner)
    return types.SimpleNamespace(rule=rule, model=model, optimizer=opt, workers=workers,
                                 state_dict=dict, load_state_dict=dict)


def test_shared_parts_follow_the_declarations():
    m = _method(("replica",))                                     # allreduce SGD
    objects = {"model": m.model, "optimizer": m.optimizer, "method": m, "sampler": object()}
    assert layout.shared_parts(objects) == [("world", ("model",)), ("world", ("optimizer",))]
    d = _method(("prev", "outer"), workers=types.SimpleNamespace(size=2, index=3))  # DiLoCo
    objects = {"model": d.model, "optimizer": d.optimizer, "method": d}
    assert layout.shared_parts(objects) == [
        ("worker3", ("model",)), ("worker3", ("optimizer",)),
        ("world", ("method", "rule", "rule", "prev")),
        ("world", ("method", "rule", "rule", "outer"))]
    e = _method(("center",))                                      # EASGD, one rank a worker
    assert layout.shared_parts({"method": e, "optimizer": e.optimizer}) == [
        ("world", ("method", "rule", "center"))]


def test_split_and_join_give_the_state_back():
    state = {"objects": {"model": {"w": torch.ones(3)}, "method": {"steps": 4, "rule": {
        "center": torch.zeros(2), "losses": [1.0]}}}, "torch_rng": torch.get_rng_state()}
    whole = layout.host_copy(state)
    parts = [("world", ("model",)), ("world", ("method", "rule", "center")),
             ("world", ("method", "rule", "absent"))]
    own, shared = layout.split_state(layout.host_copy(state), parts, ["world"])
    assert set(own["objects"]) == {"method"} and "center" not in own["objects"]["method"]["rule"]
    assert set(shared["world"]) == {"model", "method/rule/center"}
    back = layout.join_state(own, shared)
    assert torch.equal(back["objects"]["model"]["w"], whole["objects"]["model"]["w"])
    assert torch.equal(back["objects"]["method"]["rule"]["center"], torch.zeros(2))
    assert "shared_parts" not in back


# -- asynchronous saves in one process (a one-rank communicator) --------------------------------
class OneRank:
    rank, size, fault_tolerance = 0, 1, None
    device = torch.device("cpu")

    def __init__(self):
        self.stats = CommStats()

    def allgather_object(self, obj):
        return [obj]

    def barrier(self):
        pass


class Counter:
    def __init__(self):
        self.n = 0

    def state_dict(self):
        return {"n": self.n}

    def load_state_dict(self, state):
        self.n = state["n"]


def test_save_returns_before_the_write_and_wait_commits(tmp_path, monkeypatch):
    release = threading.Event()
    real = ck.atomic_write

    def slow(path, write, before_rename=None):
        if path.endswith(".pt"):
            assert release.wait(30)
        real(path, write, before_rename)
    monkeypatch.setattr(ck, "atomic_write", slow)
    c = Counter()
    saver = ck.Checkpointer(str(tmp_path), OneRank(), counter=c)
    c.n = 7
    assert saver.save() == 0
    c.n = 8                          # the step goes on: the set holds the copy taken at save
    assert ck.latest_checkpoint(str(tmp_path)) is None          # still being written
    release.set()
    saver.wait()
    latest = ck.latest_checkpoint(str(tmp_path))
    assert latest["step"] == 0 and latest["format"] == 2 and latest["shared"] == {}
    c2 = Counter()
    assert ck.Checkpointer(str(tmp_path), OneRank(), counter=c2).restore() == 0
    assert c2.n == 7


def test_a_set_no_writer_saw_complete_is_committed_at_the_next_wait(tmp_path, monkeypatch):
    """A shared file system may show a rank the others' markers late: then no writer commits,
    and the next collective point (wait, save) does."""
    monkeypatch.setattr(ck._Write, "_complete", lambda self: False)
    c = Counter()
    saver = ck.Checkpointer(str(tmp_path), OneRank(), counter=c)
    saver.save()
    saver._pending.thread.join()
    assert ck.latest_checkpoint(str(tmp_path)) is None
    saver.wait()
    assert ck.latest_checkpoint(str(tmp_path))["step"] == 0


def test_a_failed_write_is_raised_at_the_next_collective_point(tmp_path, monkeypatch):
    c = Counter()
    saver = ck.Checkpointer(str(tmp_path), OneRank(), sync=True, counter=c)
    saver.save()                                                  # a complete set first
    saver.sync = False

    def broken(path, write, before_rename=None):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(ck, "atomic_write", broken)
    c.n = 5
    saver.save()
    with pytest.raises(RuntimeError, match="rank 0 could not write its files.*No space"):
        saver.wait()
    assert ck.latest_checkpoint(str(tmp_path))["step"] == 0       # the previous set stays


# -- real runs: allreduce SGD, 2 ranks (the bytes of a set: 4) --------------------------------
ARGS = ["--algorithm", "allreduce", "--dataset", "synthetic", "--model", "mlp",
        "--max-steps", "30", "--checkpoint-every", "10", "--eval-every", "10", "--seed", "3",
        "--lr-schedule", "step", "--consensus-every", "5"]
WIDE = ["--algorithm", "allreduce", "--dataset", "synthetic", "--model", "mlp_wide",
        "--max-steps", "2", "--checkpoint-every", "2", "--eval-every", "2", "--seed", "3"]
TRAIN = [sys.executable, "-m", "lsgd_hpc.train"]


def read(run_dir, rank):
    with h5py.File(run_dir / "metrics" / f"rank{rank:05d}.h5", "r") as f:
        return {g: {c: f[g][c][()] for c in f[g]} for g in f}


def assert_same_run(run, reference):
    """Every rank's metrics equal the uninterrupted run's row for row (measured times: as
    many rows), and the final models are bit for bit the same."""
    for r in range(WORLD):
        again = read(run, r)
        assert again.keys() == reference["rows"][r].keys()
        for g, cols in reference["rows"][r].items():
            for c, want in cols.items():
                if c in TIME_COLUMNS:
                    assert len(again[g][c]) == len(want)
                else:
                    assert np.array_equal(again[g][c], want, equal_nan=True), (r, g, c)
    final = ck.latest_checkpoint(str(run))["step"]
    for r in range(WORLD):
        model = ck.load_rank(str(run), final, r)["objects"]["model"]
        assert all(torch.equal(model[k], reference["model"][k]) for k in model)


def set_bytes(run_dir, step):
    folder = run_dir / "checkpoints" / f"step{step:09d}"
    return sum(f.stat().st_size for f in folder.iterdir())


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    run = tmp_path_factory.mktemp("layout") / "reference"
    proc = run_mpi(WORLD, [*TRAIN, "--run-dir", str(run), *ARGS], timeout=400)
    assert "done: 30 steps" in proc.stdout
    return {"run": run, "rows": [read(run, r) for r in range(WORLD)],
            "model": ck.load_rank(str(run), 30, 0)["objects"]["model"]}


def copy_run(reference, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(reference["run"], run)
    return run


@pytest.mark.mpi
def test_one_replica_is_written(tmp_path):
    four, one = tmp_path / "four", tmp_path / "one"
    run_mpi(REPLICA_WORLD, [*TRAIN, "--run-dir", str(four), *WIDE], timeout=300)
    run_mpi(1, [*TRAIN, "--run-dir", str(one), *WIDE], timeout=300)
    latest = json.loads((four / "checkpoints" / "latest.json").read_text())
    assert latest["format"] == 2 and latest["shared"]["world"]["ranks"] == [0, 1, 2, 3]
    four_bytes, single = set_bytes(four, 2), set_bytes(one, 2)
    assert single > 30e6                       # mlp_wide: 33.7 MB of state a rank
    assert four_bytes <= 1.3 * single, (four_bytes, single)


@pytest.mark.mpi
def test_a_resume_is_bit_exact(reference, tmp_path):
    run = copy_run(reference, tmp_path)
    latest = json.loads((run / "checkpoints" / "latest.json").read_text())
    assert latest["format"] == 2 and latest["shared"]["world"]["ranks"] == list(range(WORLD))
    # the newest set's shared file is damaged: the resume falls back to step 20
    f = run / "checkpoints" / "step000000030" / "shared-world.pt"
    f.write_bytes(f.read_bytes()[:1000])
    proc = run_mpi(WORLD, [*TRAIN, "--run-dir", str(run), "--resume", *ARGS], timeout=400)
    assert "resumed at step 20" in proc.stdout
    assert_same_run(run, reference)


@pytest.mark.mpi
def test_a_kill_during_an_asynchronous_write_leaves_the_previous_set(reference, tmp_path):
    run = tmp_path / "run"
    proc = run_mpi(WORLD, [*TRAIN, "--run-dir", str(run), *ARGS, "--inject-failure",
                           "1:20:save"], timeout=400, check=False)
    assert proc.returncode != 0
    assert "rank 1 kills itself at step 20 (save)" in proc.stderr
    assert ck.latest_checkpoint(str(run))["step"] == 10
    assert json.loads((run / "checkpoints" / "latest.json").read_text())["step"] == 10
    proc = run_mpi(WORLD, [*TRAIN, "--run-dir", str(run), "--resume", *ARGS], timeout=400)
    assert "resumed at step 10" in proc.stdout
    assert_same_run(run, reference)


def write_format_1(run, step):
    """The set of ``step`` as versions before format 2 wrote it: one full file per rank, a
    manifest without ``format``; newer sets gone."""
    full = [ck.load_rank(str(run), step, r) for r in range(WORLD)]
    ckpts = run / "checkpoints"
    for d in ckpts.iterdir():
        if d.is_dir() and d.name > f"step{step:09d}":
            shutil.rmtree(d)
    (ckpts / "latest.json").unlink()
    folder = ckpts / f"step{step:09d}"
    for f in folder.iterdir():
        f.unlink()
    for r, state in enumerate(full):
        ck.save_rank(str(run), step, r, state)
    ck.commit_set(str(run), step, WORLD)


@pytest.mark.mpi
def test_a_set_of_format_1_resumes(reference, tmp_path):
    run = copy_run(reference, tmp_path)
    write_format_1(run, 20)
    latest = ck.latest_checkpoint(str(run))
    assert latest == {"step": 20, "world_size": WORLD, "folder": "step000000020"}
    # a full file per rank: the replica is in every rank's file again
    sizes = [os.path.getsize(run / "checkpoints" / "step000000020" / f"rank{r:05d}.pt")
             for r in range(WORLD)]
    assert min(sizes) > 0.9 * os.path.getsize(
        reference["run"] / "checkpoints" / "step000000020" / "shared-world.pt")
    proc = run_mpi(WORLD, [*TRAIN, "--run-dir", str(run), "--resume", *ARGS], timeout=400)
    assert "resumed at step 20" in proc.stdout
    assert_same_run(run, reference)
    assert ck.latest_checkpoint(str(run))["format"] == 2           # written anew as format 2
