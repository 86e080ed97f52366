"""The trainer's --on-failure shrink for real: 4 ranks as 2 nodes under mpirun --with-ft ulfm,
ranks killed by --inject-failure; the survivors finish the budget, the lowest survivor takes
rank 0's lines, /faults and summary name the lost ranks. Every job runs under a timeout."""

import json
import re
import sys

import h5py
import pytest

from mpi_util import run_mpi

ULFM = ["--with-ft", "ulfm"]
STEPS = 40
TIMEOUT = 240


def train(tmp_path, *args, mpi_args=ULFM, check=True, steps=STEPS, np_=4):
    run_dir = tmp_path / "run"
    proc = run_mpi(np_, [sys.executable, "-m", "lsgd_hpc.train", "--max-steps", str(steps),
                       "--eval-every", "20", "--ranks-per-node", "2", "--run-dir", str(run_dir),
                       *args], timeout=TIMEOUT, mpi_args=mpi_args, check=check, cwd=tmp_path)
    return proc, run_dir


def error_lines(text):
    return [ln for ln in text.splitlines() if ln.startswith("lsgd_hpc.train: error:")]


def faults_of(run_dir, rank):
    with h5py.File(run_dir / "metrics" / f"rank{rank:05d}.h5", "r") as f:
        g = f["faults"]
        return {k: g[k][:].tolist() for k in g}


@pytest.mark.mpi
@pytest.mark.parametrize("algorithm,kill", [("lsgd", "0:15"), ("allreduce", "3:15")])
def test_a_lost_rank_and_the_survivors_finish(tmp_path, capsys, algorithm, kill):
    """Rank 0 killed (LSGD: its lines move to the lowest survivor) or rank 3 (allreduce SGD):
    exit 0, every survivor at step 25 (the budget), one /faults row naming the lost rank on
    each."""
    steps = 25
    proc, run_dir = train(tmp_path, "--algorithm", algorithm, "--on-failure", "shrink",
                          "--inject-failure", kill, steps=steps)
    lost = int(kill.split(":")[0])
    out = proc.stdout + proc.stderr[-3000:]
    assert f"done: {steps} steps" in proc.stdout, out
    assert re.search(rf"lost rank\(s\) {lost} \(initial numbering\); 3 of 4 ranks go on", out)
    survivors = [r for r in range(4) if r != lost]
    for r in survivors:
        rows = faults_of(run_dir, r)
        assert len(rows["step"]) == 1 and rows["world_size_after"] == [3], rows
        with h5py.File(run_dir / "metrics" / f"rank{r:05d}.h5", "r") as f:
            assert int(f["train"]["step"][-1]) == steps
    # what `python -m lsgd_hpc.summary RUN_DIR` prints (in-process: the same main())
    from lsgd_hpc.analysis.summary import main as summary_main
    assert summary_main([str(run_dir)]) == 0
    printed = capsys.readouterr().out
    assert f"failure: rank(s) {lost} lost; 3 rank(s) went on" in printed, printed
    assert re.search(rf"^\s+{lost}\s+\d+ .* lost \(recovery at step", printed, re.M)


@pytest.mark.mpi
def test_a_whole_node_lost_lsgd_goes_on_single_node(tmp_path):
    """Node 1's two ranks die at step 12; node 0 finishes the 40 steps alone (checkpoints at
    20 and 40, of the 2 survivors). Then the job at its full 4 ranks resumes that set to
    step 50: ranks 2 and 3 rejoin with the global leader's parameters."""
    proc, run_dir = train(tmp_path, "--on-failure", "shrink", "--inject-failure", "2:12,3:12",
                          "--checkpoint-every", "20")
    out = proc.stdout + proc.stderr[-3000:]
    assert f"done: {STEPS} steps" in proc.stdout, out
    # the survivors share the training set from the next epoch boundary on
    m = re.search(r"data: the 2 ranks left share the training set from step (\d+) \(the next "
                  r"epoch\) on", proc.stdout)
    assert m, out
    boundary = int(m.group(1))
    for r in (0, 1):                       # one or two events, the node's two ranks in all
        rows = faults_of(run_dir, r)
        assert sum(rows["n_lost"]) == 2 and rows["world_size_after"][-1] == 2, rows
        assert rows["lost_nodes"][-1] == b"node 1", rows
        with h5py.File(run_dir / "metrics" / f"rank{r:05d}.h5", "r") as f:
            spe = json.loads(f.attrs["config"])["steps_per_epoch"]
            epoch = dict(zip(f["train"]["step"][:].tolist(), f["train"]["epoch"][:].tolist()))
        assert boundary % spe == 0 and 12 <= boundary < STEPS, (boundary, spe)
        assert epoch[boundary] == pytest.approx(boundary / spe)
        # twice the samples per rank: twice the steps per epoch after the boundary
        slope = (epoch[STEPS] - epoch[boundary]) / (STEPS - boundary)
        assert slope == pytest.approx(1 / (2 * spe), rel=0.1), (slope, spe)
    latest = json.loads((run_dir / "checkpoints" / "latest.json").read_text())
    assert (latest["step"], latest["ranks"], latest["initial_size"]) == (STEPS, [0, 1], 4)

    # the requeued job at full size; a job of the survivors' 2 ranks is refused first
    two = run_mpi(2, [sys.executable, "-m", "lsgd_hpc.train", "--ranks-per-node", "2",
                      "--run-dir", str(run_dir), "--resume"], timeout=TIMEOUT, check=False,
                  cwd=tmp_path)
    lines = error_lines(two.stderr)
    assert two.returncode == 2 and len(lines) == 1, two.stderr[-2000:]      # (from rank 0)
    assert "resume it with 4 ranks (the lost ranks rejoin)" in lines[0]
    again, _ = train(tmp_path, "--resume", "--max-steps", str(STEPS + 10), mpi_args=[])
    out = again.stdout + again.stderr[-3000:]
    assert f"done: {STEPS + 10} steps" in again.stdout, out
    assert re.search(rf"checkpoint of step {STEPS} at the full 4 ranks: rank\(s\) 2,3 rejoin "
                     r"with the global leader's parameters \(rank [01]\)", again.stderr), out
    rows = {}
    for r in range(4):
        with h5py.File(run_dir / "metrics" / f"rank{r:05d}.h5", "r") as f:
            rows[r] = dict(zip(f["train"]["step"][:].tolist(), f["train"]["epoch"][:].tolist()))
    for r in (2, 3):    # the rows they flushed before they died (none here), then from 41 on
        assert all(s <= 12 for s in rows[r] if s <= STEPS)
        assert sorted(s for s in rows[r] if s > 12) == list(range(STEPS + 1, STEPS + 11))
    # a new epoch over the 4 ranks begins at the resumed step (the survivors' epoch under
    # way is cut short), the same on every rank
    assert len({json.dumps({s: v[s] for s in range(STEPS + 1, STEPS + 11)})
                for v in rows.values()}) == 1
    first = rows[0][STEPS + 1] - 1 / spe
    assert first == pytest.approx(round(first)) and first >= rows[0][STEPS] - 1e-9
    assert rows[0][STEPS + 10] - rows[0][STEPS + 1] == pytest.approx(9 / spe)


@pytest.mark.mpi
def test_fewer_survivors_than_min_ranks_end_every_survivor_with_one_line(tmp_path):
    proc, _ = train(tmp_path, "--on-failure", "shrink", "--min-ranks", "4",
                    "--inject-failure", "1:10", check=False)
    assert proc.returncode == 3, proc.stdout + proc.stderr[-3000:]
    lines = error_lines(proc.stderr)
    assert len(lines) == 3 and len(set(lines)) == 1 and "min_ranks" in lines[0], proc.stderr


@pytest.mark.mpi
@pytest.mark.fast
def test_shrink_without_ulfm_is_refused_before_training(tmp_path):
    """(2 ranks, one node: the refusal comes before the layout matters, as at 4.)"""
    proc, _ = train(tmp_path, "--on-failure", "shrink", mpi_args=[], check=False, np_=2)
    assert proc.returncode == 2, proc.stdout + proc.stderr[-3000:]
    lines = error_lines(proc.stderr)
    assert lines and len(set(lines)) == 1 and "--with-ft ulfm" in lines[0], proc.stderr
    assert "step " not in proc.stdout


@pytest.mark.mpi
def test_inject_failure_under_abort_ends_the_job(tmp_path):
    """The testing hook kills its rank under the default --on-failure abort too (it was once
    a no-op there): plain mpirun, the job ends with the killed rank named, not at step 40.
    (Synchronous saves: an asynchronous one of step 4 may still be written when rank 1 dies
    at 5, and then the set of step 2 is the newest.)"""
    proc, run_dir = train(tmp_path, "--inject-failure", "1:5", "--checkpoint-every", "2",
                          "--checkpoint-sync", mpi_args=[], check=False)
    assert proc.returncode not in (0, None), proc.stdout[-2000:]
    assert "inject_failures: rank 1 kills itself at step 5" in proc.stderr, proc.stderr[-3000:]
    assert f"done: {STEPS} steps" not in proc.stdout
    assert '"step": 4' in (run_dir / "checkpoints" / "latest.json").read_text()
