"""Checkpoint sets: the manifest, pruning to the newest KEEP sets, and the fallback to the
previous complete set when the newest is damaged; then --checkpoint-every, pruning, the step
learning-rate schedule and the fallback in a real 2-rank run that resumes to the same metrics
as the uninterrupted run."""

import json
import os
import sys

import h5py
import numpy as np
import pytest
import torch

from lsgd_hpc.runtime import checkpoint as ck
from lsgd_hpc.runtime.metrics import TIME_COLUMNS
from mpi_util import run_mpi

WORLD = 2


def save_set(run_dir, step, world=WORLD, commit=True):
    for r in range(world):
        ck.save_rank(str(run_dir), step, r, {"step": step, "rank": r,
                                             "flat": torch.full((1000,), float(step + r))})
    if commit:
        ck.commit_set(str(run_dir), step, world)


def sets(run_dir):
    return sorted(d for d in os.listdir(run_dir / "checkpoints") if d.startswith("step"))


def rank_file(run_dir, step, rank):
    return run_dir / "checkpoints" / f"step{step:09d}" / f"rank{rank:05d}.pt"


def test_commit_writes_a_manifest_and_keeps_the_newest_two_sets(tmp_path):
    for step in (10, 20, 30):
        save_set(tmp_path, step)
    assert sets(tmp_path) == ["step000000020", "step000000030"]
    man = json.loads((tmp_path / "checkpoints" / "step000000030" / "manifest.json").read_text())
    assert man["step"] == 30 and man["world_size"] == WORLD
    assert man["sizes"] == [rank_file(tmp_path, 30, r).stat().st_size for r in range(WORLD)]
    assert ck.latest_checkpoint(str(tmp_path)) == {"step": 30, "world_size": WORLD,
                                                   "folder": "step000000030"}
    assert ck.load_rank(str(tmp_path), 30, 1)["rank"] == 1


def test_a_survivors_set_names_its_writers_and_resumes_at_full_size_only(tmp_path):
    for r in range(3):
        ck.save_rank(str(tmp_path), 8, r, {"rank": r})
    ck.commit_set(str(tmp_path), 8, 3, ranks=[0, 2, 3], initial_size=4)
    latest = ck.latest_checkpoint(str(tmp_path))
    assert latest == {"step": 8, "world_size": 3, "folder": "step000000008",
                      "ranks": [0, 2, 3], "initial_size": 4}
    assert ck.resume_problem("RUN", latest, 4) is None
    for size in (3, 2, 5):
        assert ck.resume_problem("RUN", latest, size) == (
            "the checkpoint in RUN was written by the 3 ranks that survived the loss of 1 of "
            f"4; resume it with 4 ranks (the lost ranks rejoin), this job has {size}")
    plain = {"step": 8, "world_size": 2}
    assert ck.resume_problem("RUN", plain, 2) is None
    assert "written by 2 ranks; this job has 3" in ck.resume_problem("RUN", plain, 3)
    with pytest.raises(ValueError):
        ck.commit_set(str(tmp_path), 8, 3, ranks=[0, 2], initial_size=4)


@pytest.mark.parametrize("damage", ["truncate", "delete", "garbage_appended", "zeroed_tail"])
def test_damaged_newest_set_falls_back_to_the_previous(tmp_path, damage):
    for step in (10, 20):
        save_set(tmp_path, step)
    f = rank_file(tmp_path, 20, 1)
    data = f.read_bytes()
    if damage == "truncate":          # a full disk, a copy cut short
        f.write_bytes(data[: len(data) // 2])
    elif damage == "delete":          # a node's scratch lost
        f.unlink()
    elif damage == "garbage_appended":
        f.write_bytes(data + b"x" * 10)
    else:                             # same size, the zip's end record overwritten
        f.write_bytes(data[:-64] + b"\0" * 64)
    ptr = ck.latest_checkpoint(str(tmp_path))
    assert ptr == {"step": 10, "world_size": WORLD, "folder": "step000000010", "skipped": [20]}
    assert ck.load_rank(str(tmp_path), ptr["step"], 1)["step"] == 10


def test_unreadable_pointer_still_finds_the_newest_intact_set(tmp_path):
    for step in (10, 20):
        save_set(tmp_path, step)
    (tmp_path / "checkpoints" / "latest.json").write_text("{not json")
    assert ck.latest_checkpoint(str(tmp_path))["step"] == 20
    (tmp_path / "checkpoints" / "latest.json").unlink()
    assert ck.latest_checkpoint(str(tmp_path))["step"] == 20


def test_a_set_never_committed_is_not_resumed_from(tmp_path):
    save_set(tmp_path, 10)
    save_set(tmp_path, 20, commit=False)     # killed before rank 0 committed it
    assert ck.latest_checkpoint(str(tmp_path))["step"] == 10


def test_nothing_intact_is_none(tmp_path):
    assert ck.latest_checkpoint(str(tmp_path)) is None       # no checkpoints folder at all
    save_set(tmp_path, 10)
    save_set(tmp_path, 20)
    for step in (10, 20):
        rank_file(tmp_path, step, 0).write_bytes(b"PK")
    assert ck.latest_checkpoint(str(tmp_path)) is None


def test_commit_after_a_fallback_drops_the_abandoned_newer_set(tmp_path):
    for step in (10, 20, 30):
        save_set(tmp_path, step)
    rank_file(tmp_path, 30, 0).unlink()
    assert ck.latest_checkpoint(str(tmp_path))["step"] == 20
    save_set(tmp_path, 25)                   # the resumed run checkpoints again
    assert sets(tmp_path) == ["step000000020", "step000000025"]
    assert ck.latest_checkpoint(str(tmp_path))["step"] == 25


def test_commit_refuses_a_set_with_a_missing_rank(tmp_path):
    save_set(tmp_path, 10, commit=False)
    rank_file(tmp_path, 10, 1).unlink()
    with pytest.raises(RuntimeError, match=r"ranks \[1\] did not save"):
        ck.commit_set(str(tmp_path), 10, WORLD)


# -------------------------------------------------------------------------- a real run

LR = 0.05
SHORT = ["--algorithm", "lsgd", "--max-steps", "30", "--checkpoint-every", "10",
         "--eval-every", "10", "--seed", "5", "--lr", str(LR), "--lr-schedule", "step"]
TIMING = TIME_COLUMNS      # measured times: differ between two runs of one seed


def read(run_dir, rank):
    with h5py.File(run_dir / "metrics" / f"rank{rank:05d}.h5", "r") as f:
        return {g: {c: f[g][c][()] for c in f[g]} for g in f}


@pytest.mark.mpi
def assert_same_rows(run, reference, equal_nan=False):
    """Every rank's metrics equal ``reference`` row for row (measured times: as many rows)."""
    for r in range(WORLD):
        again = read(run, r)
        assert again.keys() == reference[r].keys()
        for g in reference[r]:
            for c in reference[r][g]:
                if c in TIMING:
                    assert len(again[g][c]) == len(reference[r][g][c])
                else:
                    assert np.array_equal(again[g][c], reference[r][g][c],
                                          equal_nan=equal_nan), (r, g, c)


def resumes_like_the_uninterrupted_run(run, args, sets_kept=None):
    """Train ``args`` (24 steps, checkpoints at 20 and 24) into ``run``; damage rank 0's file
    of the newest set; resume: the resume falls back to step 20 and every rank's rows equal
    the uninterrupted run's. Returns the uninterrupted run's rows."""
    proc = run_mpi(WORLD, [sys.executable, "-m", "lsgd_hpc.train", "--run-dir", str(run),
                           *args], timeout=300)
    assert "done: 24 steps" in proc.stdout
    if sets_kept is not None:
        assert sets(run) == sets_kept
    reference = [read(run, r) for r in range(WORLD)]
    f = rank_file(run, 24, 0)
    f.write_bytes(f.read_bytes()[:100])
    proc = run_mpi(WORLD, [sys.executable, "-m", "lsgd_hpc.train", "--run-dir", str(run),
                           "--resume", *args], timeout=300)
    assert "resumed at step 20" in proc.stdout
    assert_same_rows(run, reference, equal_nan=True)
    return reference


@pytest.mark.mpi
def test_checkpoint_every_prunes_and_resume_falls_back(tmp_path):
    run = tmp_path / "run"
    proc = run_mpi(WORLD, [sys.executable, "-m", "lsgd_hpc.train", "--run-dir", str(run),
                           *SHORT], timeout=300)
    assert "done: 30 steps" in proc.stdout
    # --checkpoint-every 10 wrote sets at 10, 20, 30; pruning kept the newest two
    assert sets(run) == ["step000000020", "step000000030"]
    reference = [read(run, r) for r in range(WORLD)]
    # the step schedule: x0.1 from 50 % of the 30 steps, x0.01 from 75 % (the rate of step s
    # is set at s - 1 steps done)
    for ref in reference:
        want = [LR * 0.1 ** (int(s - 1 >= 15) + int(s - 1 >= 22.5))
                for s in ref["train"]["step"]]
        assert np.allclose(ref["train"]["lr"], want, rtol=1e-12, atol=0)
        assert sorted(set(np.round(ref["train"]["lr"] / LR, 12))) == [0.01, 0.1, 1.0]
    # the newest set is damaged on one rank: resuming must start from step 20 and redo
    # steps 21..30, ending with exactly the rows of the uninterrupted run
    f = rank_file(run, 30, 1)
    f.write_bytes(f.read_bytes()[:100])
    proc = run_mpi(WORLD, [sys.executable, "-m", "lsgd_hpc.train", "--run-dir", str(run),
                           "--resume", *SHORT], timeout=300)
    assert "resumed at step 20" in proc.stdout
    assert "step(s) 30 damaged or incomplete" in proc.stdout
    assert_same_rows(run, reference)
    assert sets(run) == ["step000000020", "step000000030"]
    assert ck.latest_checkpoint(str(run))["step"] == 30


@pytest.mark.mpi
@pytest.mark.parametrize("method", [
    ["--algorithm", "diloco", "--local-steps", "8"],
    ["--algorithm", "slowmo", "--local-steps", "2", "--slowmo-every", "8"],
    ["--algorithm", "diloco", "--local-steps", "6", "--fragments", "2",
     "--fragment-sync-delay", "2", "--fragment-update-alpha", "0.5"],
    ["--algorithm", "lsgd", "--tau-local", "4", "--tau-global", "4", "--pull-delay", "3",
     "--ranks-per-node", "1"]],
    ids=["diloco", "slowmo", "streaming-diloco", "lsgd-pull-delay"])
def test_outer_state_resumes_exactly(tmp_path, method):
    """DiLoCo's x_prev and outer momentum, SlowMo's x_old and u: a run resumed from step 20
    (mid-period: the outer/slow step at 24 needs the state of step 16) ends with exactly
    the rows of the uninterrupted run. Streaming DiLoCo (a fragment syncs every 3 steps,
    its allreduce started 2 steps before): at step 20 fragment 0's allreduce, started at 19
    for the sync at 21, is in flight; the checkpoint completes it and the resumed run applies
    it at 21. LSGD with --pull-delay 3 (2 ranks as 2 nodes): the broadcast of the election
    at 20 is in flight; the pull lands at 23 in both runs."""
    run = tmp_path / "run"
    args = [*method, "--max-steps", "24", "--checkpoint-every", "10", "--eval-every", "8",
            "--seed", "7", "--lr-schedule", "step", "--consensus-every", "4"]
    resumes_like_the_uninterrupted_run(run, args, ["step000000020", "step000000024"])
