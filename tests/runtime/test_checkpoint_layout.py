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


#: Several runs of the trainer in one mpirun job (a rank's python, torch and MPI start-up
#: costs seconds; the suite's time), one after another: for each [NAME, ARGS...],
#: lsgd_hpc.train's main with ARGS, as `python -m lsgd_hpc.train ARGS` runs it, its standard
#: output also kept in FOLDER/NAME.rankR.out. A run that fails ends the job with its status.
JOB = """
import contextlib, io, json, os, sys
from lsgd_hpc.cli import train
from lsgd_hpc.comm.launcher import env_rank
folder = sys.argv[1]
for name, *args in json.load(open(os.path.join(folder, "runs.json"))):
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            status = train.main(args)
    finally:
        with open(os.path.join(folder, f"{name}.rank{env_rank()}.out"), "w") as f:
            f.write(out.getvalue())
        print(out.getvalue(), end="", flush=True)
    if status != 0:
        sys.exit(status)
"""


def run_job(folder, runs, check=True):
    """``runs`` ([NAME, ARGS...] each) in one job of WORLD ranks; the job, and each run's
    standard output (every rank's, rank 0's first) by name."""
    (folder / "runs.json").write_text(json.dumps(runs))
    (folder / "job.py").write_text(JOB)
    proc = run_mpi(WORLD, [sys.executable, str(folder / "job.py"), str(folder)], timeout=400,
                   check=check)
    outs = {}
    for name, *_ in runs:
        files = [folder / f"{name}.rank{r}.out" for r in range(WORLD)]
        outs[name] = "".join(f.read_text() for f in files if f.exists())
    return proc, outs


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every 2-rank run of the tests below, in two jobs. The first: the uninterrupted
    reference, then the same run with rank 1 killed during its asynchronous write at step 20
    (it ends the job). Then three copies are prepared (what each test checks of a copy before
    its resume is kept here), and the second job resumes all three: the reference whose
    newest set's shared file is damaged, the killed run, the reference with its set of step
    20 written as format 1."""
    base = tmp_path_factory.mktemp("layout")
    ref, killed = base / "reference", base / "killed"
    first, outs = run_job(base, [["reference", "--run-dir", str(ref), *ARGS],
                                 ["killed", "--run-dir", str(killed), *ARGS,
                                  "--inject-failure", "1:20:save"]], check=False)
    assert "done: 30 steps" in outs["reference"], first.stdout[-3000:] + first.stderr[-3000:]
    reference = {"run": ref, "rows": [read(ref, r) for r in range(WORLD)],
                 "model": ck.load_rank(str(ref), 30, 0)["objects"]["model"]}
    seen = {"killed": {"returncode": first.returncode, "stderr": first.stderr,
                       "latest": ck.latest_checkpoint(str(killed)),
                       "latest.json": json.loads((killed / "checkpoints" /
                                                  "latest.json").read_text())}}
    damaged = base / "damaged"
    shutil.copytree(ref, damaged)
    seen["damaged"] = {"latest.json": json.loads((damaged / "checkpoints" /
                                                   "latest.json").read_text())}
    # the newest set's shared file is damaged: the resume falls back to step 20
    f = damaged / "checkpoints" / "step000000030" / "shared-world.pt"
    f.write_bytes(f.read_bytes()[:1000])
    format1 = base / "format1"
    shutil.copytree(ref, format1)
    write_format_1(format1, 20)
    seen["format1"] = {"latest": ck.latest_checkpoint(str(format1)), "sizes": [
        os.path.getsize(format1 / "checkpoints" / "step000000020" / f"rank{r:05d}.pt")
        for r in range(WORLD)]}
    _, outs = run_job(base, [[name, "--run-dir", str(run), "--resume", *ARGS] for name, run in
                             (("damaged", damaged), ("killed", killed), ("format1", format1))])
    for name, run in (("damaged", damaged), ("killed", killed), ("format1", format1)):
        seen[name].update(run=run, stdout=outs[name])
    return reference, seen


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
def test_a_resume_is_bit_exact(runs):
    reference, seen = runs
    latest = seen["damaged"]["latest.json"]
    assert latest["format"] == 2 and latest["shared"]["world"]["ranks"] == list(range(WORLD))
    # the newest set's shared file was damaged (the runs fixture): the resume falls back to 20
    assert "resumed at step 20" in seen["damaged"]["stdout"]
    assert_same_run(seen["damaged"]["run"], reference)


@pytest.mark.mpi
def test_a_kill_during_an_asynchronous_write_leaves_the_previous_set(runs):
    reference, seen = runs
    killed = seen["killed"]
    assert killed["returncode"] != 0
    assert "rank 1 kills itself at step 20 (save)" in killed["stderr"]
    assert killed["latest"]["step"] == 10
    assert killed["latest.json"]["step"] == 10
    assert "resumed at step 10" in killed["stdout"]
    assert_same_run(killed["run"], reference)


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
def test_a_set_of_format_1_resumes(runs):
    reference, seen = runs
    format1 = seen["format1"]
    assert format1["latest"] == {"step": 20, "world_size": WORLD, "folder": "step000000020"}
    # a full file per rank: the replica is in every rank's file again
    assert min(format1["sizes"]) > 0.9 * os.path.getsize(
        reference["run"] / "checkpoints" / "step000000020" / "shared-world.pt")
    assert "resumed at step 20" in format1["stdout"]
    assert_same_run(format1["run"], reference)
    assert ck.latest_checkpoint(str(format1["run"]))["format"] == 2   # written anew as format 2
