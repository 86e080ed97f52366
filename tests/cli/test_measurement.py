"""Honest measurement under mpirun: training time, consensus distance, the stop flag, options."""

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import h5py
import numpy as np
import pytest

from mpi_util import REPO, kill_session, mpi_env, mpirun_cmd, run_mpi
from test_reliability import _check_one_line

DRIVER = str(REPO / "tests" / "parallel" / "train_driver.py")
BODIES = str(REPO / "tests" / "parallel" / "test_measurement_parallel.py")
ALGS = ["lsgd", "easgd", "allreduce", "local-sgd", "diloco", "slowmo", "gossip"]


def read(run_dir: Path, rank: int) -> dict:
    with h5py.File(run_dir / "metrics" / f"rank{rank:05d}.h5", "r", locking=False) as f:
        return {g: {c: f[g][c][()] for c in f[g]} for g in f}


@pytest.mark.mpi
@pytest.mark.parametrize("np_,rpn", [(2, 1), (4, 2)])
def test_measurement_bodies_under_mpirun(np_, rpn):
    """Consensus distance equal across methods; LSGD options and Nesterov by hand."""
    proc = run_mpi(np_, [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                         BODIES], timeout=600, env={"LSGD_TEST_RPN": str(rpn)})
    assert proc.stdout.count(" passed") >= np_, proc.stdout[-3000:]
    assert " failed" not in proc.stdout


@pytest.mark.mpi
def test_training_time_leaves_out_a_slow_evaluation(tmp_path):
    """Every evaluation of a model sleeps 0.25 s (EASGD evaluates two models); probes off."""
    sleep = 0.25
    run_mpi(2, [sys.executable, DRIVER, str(tmp_path / "r"), ",".join(ALGS), "--",
                "--max-steps", "6", "--eval-every", "2", "--consensus-every", "0"],
            timeout=900, env={"LSGD_EVAL_SLEEP": str(sleep)})
    for alg in ALGS:
        per_eval = sleep * (2 if alg == "easgd" else 1)
        for rank in (0, 1):
            m = read(tmp_path / f"r-{alg}", rank)
            t, e = m["train"], m["eval"]
            assert list(e["step"]) == [2, 4, 6]
            # the /train row of step 6 is written before that step's evaluation: it holds
            # the two evaluations before it, booked as evaluation and left out
            slept = 2 * per_eval
            assert t["eval_seconds"][-1] >= slept
            assert t["wall_time"][-1] - t["training_time"][-1] >= slept
            left_out = (t["eval_seconds"] + t["probe_seconds"] + t["checkpoint_seconds"]
                        + t["metrics_seconds"])
            assert np.allclose(t["training_time"], t["wall_time"] - left_out, rtol=0,
                               atol=1e-9)
            assert np.all(np.diff(t["training_time"]) >= 0) and t["training_time"][0] > 0
            # each evaluation row has the training time reached when it started: the k-th
            # lies at least k-1 slow evaluations below its wall time
            gap = e["wall_time"] - e["training_time"]
            assert np.all(gap >= per_eval * np.arange(3))
            # --consensus-every 0: no probe at all, for every method
            assert len(m["consensus"]["step"]) == 0 and np.all(t["probe_seconds"] == 0)
    # aggregate puts accuracy against the training time by default, and reports it
    from lsgd_hpc.analysis import aggregate as agg
    res = agg.aggregate([tmp_path / f"r-{alg}" for alg in ALGS], tmp_path / "agg",
                        warn=lambda m: None)
    assert next(iter(agg.PLOTS)) == "test_acc_vs_training_time.png"
    assert (tmp_path / "agg" / "test_acc_vs_training_time.png").is_file()
    for row in res["summary"]:
        assert row["training_time"] <= row["wall_time"] - 2 * sleep
    for run in res["runs"]:
        tab = agg.eval_table(run)
        want = [max(read(run.path, r)["eval"]["training_time"][k] for r in (0, 1))
                for k in range(3)]
        assert np.allclose(tab["training_time"], want)


@pytest.mark.mpi
def test_consensus_measured_before_the_communication(tmp_path):
    """Local SGD averages every 5 steps and is measured every 5 steps: the distance is the
    spread just before the average (after it, it would be exactly 0); allreduce SGD's
    replicas are identical, so its distance is exactly 0."""
    run_mpi(2, [sys.executable, DRIVER, str(tmp_path / "r"), "local-sgd,allreduce", "--",
                "--max-steps", "15", "--local-steps", "5", "--consensus-every", "5",
                "--eval-every", "15"], timeout=300)
    for rank in (0, 1):
        loc, ar = read(tmp_path / "r-local-sgd", rank), read(tmp_path / "r-allreduce", rank)
        assert list(loc["consensus"]["step"]) == [5, 10, 15]
        assert np.all(loc["consensus"]["distance"] > 0)
        assert list(ar["consensus"]["step"]) == [5, 10, 15]
        assert np.all(ar["consensus"]["distance"] == 0)
        assert np.all(loc["train"]["probe_seconds"][4:] > 0)


def _wait_for_rows(run_dir: Path, ranks: int, rows: int, proc, deadline: float) -> None:
    while time.time() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"training ended early ({proc.returncode})")
        try:
            if all(len(read(run_dir, r)["train"]["step"]) >= rows for r in range(ranks)):
                return
        except (OSError, KeyError):
            pass                         # not written yet
        time.sleep(0.5)
    raise AssertionError(f"no {rows} rows in {run_dir} in time")


@pytest.mark.mpi
def test_sigusr1_stops_every_rank_at_one_step_then_resume(tmp_path):
    """SIGUSR1 to mpirun (forwarded to every rank, as SLURM's warning is): the ranks agree
    through the non-blocking flag, all checkpoint the same step, and a resume continues."""
    run_dir = tmp_path / "run"
    args = ["--algorithm", "lsgd", "--ranks-per-node", "2", "--run-dir", str(run_dir),
            "--flush-every", "5", "--eval-every", "50", "--seed", "2"]
    cmd = mpirun_cmd(4, [sys.executable, "-m", "lsgd_hpc.train", *args, "--epochs", "1000"])
    proc = subprocess.Popen(cmd, env=mpi_env(), cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        _wait_for_rows(run_dir, 4, 20, proc, time.time() + 240)
        proc.send_signal(signal.SIGUSR1)
        out, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            kill_session(proc.pid)
            proc.wait()
    assert proc.returncode == 143, (proc.returncode, err[-3000:])
    assert "Traceback" not in err
    stop = int(out.split("stop requested: checkpoint at step ")[1].split()[0])
    assert stop % 10 == 0 and stop >= 20          # an agreement step (--stop-check-every 10)
    pointer = json.loads((run_dir / "checkpoints" / "latest.json").read_text())
    assert pointer["step"] == stop and pointer["world_size"] == 4
    for r in range(4):
        steps = read(run_dir, r)["train"]["step"]
        assert list(steps) == list(range(1, stop + 1)), r     # every rank stopped there
    # stopped on purpose: the completion record says so (and not complete, for a job check)
    record = json.loads((run_dir / "complete.json").read_text())
    assert (record["status"], record["step"], record["requeued"], record["exit_status"],
            record["world_size"], record["lost_ranks"]) == ("stopped", stop, False, 143, 4, [])
    proc2 = run_mpi(4, [sys.executable, "-m", "lsgd_hpc.train", *args, "--resume",
                        "--epochs", "1000", "--max-steps", str(stop + 12)], timeout=400)
    assert f"resumed at step {stop}" in proc2.stdout
    for r in range(4):
        assert list(read(run_dir, r)["train"]["step"]) == list(range(1, stop + 13))
    # the resumed run's record replaced the stop's
    record = json.loads((run_dir / "complete.json").read_text())
    assert (record["status"], record["step"], record["total_steps"]) == \
        ("complete", stop + 12, stop + 12)


BAD = [
    (["--consensus-every", "-1"], "--consensus-every"),
    (["--bn-recompute", "-3"], "--bn-recompute"),
    (["--stop-check-every", "0"], "--stop-check-every"),
    (["--nesterov", "--momentum", "0"], "--nesterov"),
    (["--lsgd-bn", "average"], "--lsgd-bn"),
]


def test_new_options_bad_values_one_line(tmp_path, forked_cli):
    for args, option in BAD:
        _check_one_line(forked_cli.run(["--run-dir", str(tmp_path / "never"), *args]), option)
