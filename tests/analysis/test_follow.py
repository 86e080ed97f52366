"""``python -m lsgd_hpc.summary RUN_DIR --follow``: progress lines of a run being written.

- rows written by the real MetricsWriter from a thread (two ranks, periodic flushes) while
  ``summary --follow --interval 0.2`` runs as a subprocess: several lines with increasing
  steps, and the end once every rank reached total_steps (or closed its file);
- no metrics yet: it says so once and waits; --timeout stops it (exit 1, one line why);
  Ctrl-C exits 0 without a traceback (also when the suite runs as a background job, which
  ignores SIGINT); a file being replaced is read again next time;
- under mpirun, a real 2-rank training run followed while it runs.
"""

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from lsgd_hpc.analysis import follow as fl
from lsgd_hpc.runtime.metrics import SCHEMA_VERSION, MetricsWriter, encode_config, rank_file
from mpi_util import REPO, kill_session, mpi_env, mpirun_cmd

TOTAL = 60


def writers(run_dir, config, world=2, flush_seconds=0.1):
    return [MetricsWriter(rank_file(str(run_dir), r),
                          {"schema_version": SCHEMA_VERSION, "rank": r, "world_size": world,
                           "algorithm": "lsgd", "config": encode_config(config),
                           "start_time": "2026-12-03T00:00:00+00:00"},
                          flush_every=10 ** 6, flush_seconds=flush_seconds)
            for r in range(world)]


def write_run(ws, steps=TOTAL, pause=0.04, close=False, leaders=True):
    """Every rank logs a train row per step, an evaluation every 10 and a global election
    every 5; flushes when due (time-based), like the trainer."""
    for s in range(1, steps + 1):
        for r, w in enumerate(ws):
            w.log("train", step=s, epoch=s / 20, wall_time=0.05 * s, loss=1.0 / s + r,
                  accuracy=0.5, lr=0.1, comm_bytes_sent=100 * s, comm_bytes_recv=100 * s,
                  comm_seconds=0.0, compute_seconds=0.0, overhead_seconds=0.0,
                  probe_seconds=0.0, eval_seconds=0.0, checkpoint_seconds=0.0,
                  metrics_seconds=0.0, training_time=0.05 * s)
            if s % 10 == 0:
                w.log("eval", step=s, epoch=s / 20, wall_time=0.05 * s, training_time=0.05 * s,
                      test_loss=0.5, test_accuracy=0.5 + 0.1 * r)
            if leaders and s % 5 == 0:
                w.log("leader", step=s, scope=0, leader_rank=(s // 5) % 2, score=0.1)
            w.maybe_flush()
        time.sleep(pause)
    for w in ws:
        w.close() if close else w.flush()


@contextlib.contextmanager
def sigint_default_in_children():
    """Processes started inside get SIGINT's default action, as a command typed at a terminal
    does, also when this one ignores it. A suite started as a background job of a
    non-interactive shell (``make test > log 2>&1 &``) ignores SIGINT; an ignored signal stays
    ignored through fork and exec, and a Python started so keeps ignoring it (no
    KeyboardInterrupt handler), so Ctrl-C would never reach it. exec resets a caught signal to
    its default action: SIGINT is caught (and dropped) here while the child is started."""
    if signal.getsignal(signal.SIGINT) != signal.SIG_IGN:
        yield
        return
    signal.signal(signal.SIGINT, lambda signum, frame: None)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)


def catches(pid, sig):
    """Whether the process has a handler for ``sig`` (its caught-signals mask in /proc)."""
    with open(f"/proc/{pid}/status") as fh:
        mask = next(int(ln.split()[1], 16) for ln in fh if ln.startswith("SigCgt:"))
    return bool(mask & (1 << (sig - 1)))


def summary(*args):
    with sigint_default_in_children():
        return subprocess.Popen([sys.executable, "-m", "lsgd_hpc.summary", *map(str, args)],
                                cwd=REPO, env=mpi_env(), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)


def finish(proc, timeout=60):
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"summary --follow hung\n{out}\n{err}")
    return proc.returncode, out.splitlines(), err


def progress_lines(lines):
    return [ln for ln in lines if ln.startswith("elapsed ")]


def steps_of(lines):
    out = []
    for ln in progress_lines(lines):
        field = ln.split(" | ")[1].split()[1].split("/")[0]
        out.append(int(field.split("-")[-1]) if field != "-" else -1)
    return out


@pytest.mark.parametrize("rule", ["total_steps", "close"])
def test_follow_a_run_being_written(tmp_path, rule):
    config = {"total_steps": TOTAL} if rule == "total_steps" else {}
    proc = summary(tmp_path, "--follow", "--interval", "0.2")   # before any file exists
    first = proc.stdout.readline()                  # it is waiting: now the run starts
    ws = writers(tmp_path, config)
    t = threading.Thread(target=write_run, args=(ws,), kwargs={"close": rule == "close"})
    t.start()
    rc, lines, err = finish(proc)
    t.join()
    lines = [first.rstrip("\n")] + lines
    assert rc == 0, (lines, err)
    assert err == ""
    assert lines[0] == f"waiting for metrics files in {tmp_path / 'metrics'} ..."
    assert sum(ln.startswith("waiting") for ln in lines) == 1
    steps = steps_of(lines)
    assert len([s for s in steps if s > 0]) >= 3, lines
    assert steps == sorted(steps) and steps[-1] == TOTAL, lines
    last = progress_lines(lines)[-1]
    assert f"step {TOTAL}" in last and "test acc 55.00% (best 60.00%)" in last
    assert "leader 0" in last and "sent 11.72 KiB" in last           # 2 x 6000 bytes
    assert lines[-1] == ("run ended: every rank reached step 60 of 60" if rule == "total_steps"
                         else "run ended: every rank's metrics file is closed (2 ranks)")


def test_a_run_that_stops_short_times_out(tmp_path):
    ws = writers(tmp_path, {"total_steps": TOTAL})
    write_run(ws, steps=20, pause=0)                     # preempted at step 20
    t0 = time.monotonic()
    rc, lines, err = finish(summary(tmp_path, "--follow", "--interval", "0.2", "--timeout", "1"))
    assert rc == 1 and err == "", (lines, err)
    assert 1 <= time.monotonic() - t0 < 30
    assert steps_of(lines) and set(steps_of(lines)) == {20}
    assert lines[-1] == (f"stopped following: no metrics file changed in {tmp_path} for 1 s "
                         "(the run has not ended)")


def test_nothing_ever_appears_times_out(tmp_path):
    out, ticks = [], iter(range(100))
    rc = fl.follow(tmp_path / "none", interval=1, timeout=3, out=out.append,
                   clock=lambda: float(next(ticks)), sleep=lambda s: None)
    assert rc == 1
    assert out == [f"waiting for metrics files in {tmp_path / 'none' / 'metrics'} ...",
                   f"stopped following: no metrics file appeared in {tmp_path / 'none'} "
                   "for 3 s (the run has not ended)"]


def test_ctrl_c_is_quiet_and_exit_0(tmp_path):
    ws = writers(tmp_path, {"total_steps": TOTAL})
    write_run(ws, steps=5, pause=0)
    proc = summary(tmp_path, "--follow", "--interval", "0.2")
    try:
        line = proc.stdout.readline()                     # it is following
        assert line.startswith("elapsed "), line
        # Python installs its SIGINT handler before it runs any code: caught by now, unless
        # the child was started ignoring SIGINT (then the signal below would never reach it)
        assert catches(proc.pid, signal.SIGINT), "summary --follow does not catch SIGINT"
    except BaseException:
        proc.kill()                                       # not left following forever
        proc.communicate()
        raise
    proc.send_signal(signal.SIGINT)
    rc, lines, err = finish(proc)
    assert rc == 0 and err == "", err


def test_bad_options_exit_2(tmp_path, capsys):
    from lsgd_hpc.analysis.summary import main
    for args, says in [(["--interval", "1"], "--interval and --timeout go with --follow"),
                       (["--follow", "--interval", "0"], "--interval: must be a positive"),
                       (["--follow", "--timeout", "-1"], "--timeout: must be a positive")]:
        with pytest.raises(SystemExit) as exc:
            main([str(tmp_path), *args])
        err = capsys.readouterr().err
        assert exc.value.code == 2 and err.startswith("lsgd_hpc.summary: error: "), err
        assert says in err and len(err.splitlines()) == 1, err


def test_a_file_being_replaced_keeps_its_last_rows(tmp_path):
    ws = writers(tmp_path, {"total_steps": TOTAL}, world=1)
    write_run(ws, steps=10, pause=0)
    reader = fl.CachedReader()
    path = rank_file(str(tmp_path), 0)
    assert list(reader(path)["train"]["step"]) == list(range(1, 11))
    with open(path, "r+b") as fh:                     # half there (not how the writer does it)
        fh.truncate(1000)
    assert list(reader(path)["train"]["step"]) == list(range(1, 11))
    os.remove(path)                                   # vanished
    assert list(reader(path)["train"]["step"]) == list(range(1, 11))
    fresh = fl.CachedReader()
    with pytest.raises(OSError):
        fresh(path)
    assert fresh.failed == {path}
    # follow: no warning about it, the other rank's progress goes on being shown
    ws = writers(tmp_path / "two", {"total_steps": TOTAL})
    write_run(ws, steps=10, pause=0)
    with open(rank_file(str(tmp_path / "two"), 1), "r+b") as fh:
        fh.truncate(1000)
    out, err = [], []
    ticks = iter(range(100))
    rc = fl.follow(tmp_path / "two", interval=1, timeout=2, out=out.append, err=err.append,
                   clock=lambda: float(next(ticks)), sleep=lambda s: None)
    assert rc == 1 and err == [], err
    assert "step 10/60 (1 of 2 ranks)" in out[0]


def test_progress_line_of_async_ranks_and_no_elections(tmp_path):
    ws = writers(tmp_path, {"total_steps": 10, "algorithm": "allreduce"})
    for w in ws:
        w.attrs["algorithm"] = "allreduce"
    write_run(ws[:1], steps=12, pause=0, leaders=False)
    write_run(ws[1:], steps=8, pause=0, leaders=False)
    from lsgd_hpc.analysis.rundir import read_run
    run = read_run(tmp_path)
    p = fl.progress(run)
    line = fl.format_progress(p)
    assert line.startswith("elapsed 0:00:00 | step 8-12/10 | epoch 0.60 | loss ")
    assert "leader" not in line and line.endswith(" | - steps/s")
    assert fl.run_ended(run) == "the 2 ranks together took 20 of 2 x 10 steps"


@pytest.mark.mpi
def test_follow_a_real_training_run(tmp_path):
    run_dir = tmp_path / "run"
    job = subprocess.Popen(
        mpirun_cmd(2, [sys.executable, "-m", "lsgd_hpc.train", "--max-steps", "150",
                       "--eval-every", "25", "--run-dir", str(run_dir), "--flush-every", "5",
                       "--flush-seconds", "0.5",
                       # 30 ms a step on rank 0 (so on both: they average every step): the run
                       # lasts 4.5 s or more, several of the follower's polls even when it
                       # starts late on a loaded machine (at full speed 150 steps took about
                       # as long as the follower's start-up, and CI saw one poll once)
                       "--straggler", "0:0.03"]),
        cwd=tmp_path, env=mpi_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, start_new_session=True)
    try:
        rc, lines, err = finish(summary(run_dir, "--follow", "--interval", "0.5"),
                                timeout=240)
        job_out, job_err = job.communicate(timeout=60)
    finally:
        if job.poll() is None:
            kill_session(job.pid)
    assert job.returncode == 0, job_err[-3000:]
    assert rc == 0, (lines, err)
    assert len(progress_lines(lines)) >= 2, lines
    assert lines[-1] == "run ended: every rank reached step 150 of 150", lines
    assert "step 150/150" in progress_lines(lines)[-1]
