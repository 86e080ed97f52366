"""--backend torch --on-failure shrink for real: torchft's lighthouse started and stopped by
the test, every worker a replica group of its own process (as one torchrun per replica group
starts them), a worker SIGKILLed from outside mid-run. The survivors finish the budget, the
shared state is checked equal by the recovery itself (a digest allgather; a mismatch ends
the job), /faults holds one row per survivor, and the exit statuses are right. Every job runs
under a timeout. The in-process part: the timeout hierarchy and the refusals."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import h5py
import pytest

from mpi_util import REPO

torchft = pytest.importorskip("torchft", reason="torchft is not installed (make venv installs "
                                                "torchft-nightly)")

#: the failure timeout of these jobs: short, so that a recovery costs seconds here
FAILURE_TIMEOUT = 3.0
JOB_TIMEOUT = 150
ALGORITHMS = ["allreduce", "lsgd", "lsgd-async", "easgd", "local-sgd", "diloco", "slowmo",
              "gossip"]


class Lighthouse:
    """``python -m lsgd_hpc.lighthouse`` on a free port, stopped (SIGTERM) by ``stop``."""

    def __init__(self, folder: Path):
        self.log = open(folder / "lighthouse.err", "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "lsgd_hpc.lighthouse", "--port", "0", "--failure-timeout",
             str(FAILURE_TIMEOUT)], stdout=subprocess.PIPE, stderr=self.log, text=True,
            cwd=REPO)
        line = self.proc.stdout.readline()          # the first line, printed once it listens
        assert line.startswith("TORCHFT_LIGHTHOUSE=http://"), line
        self.address = line.strip().split("=", 1)[1]

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=20)
        finally:
            self.log.close()


@pytest.fixture(scope="module")
def lighthouse(tmp_path_factory):
    """One lighthouse for the module's jobs (each job's workers have replica ids of their
    own; a job whose workers are gone leaves no quorum behind that the next one waits on)."""
    lh = Lighthouse(tmp_path_factory.mktemp("lighthouse"))
    yield lh
    assert lh.stop() == 0                      # it ends cleanly on SIGTERM


def start_workers(tmp_path, lighthouse, n, args, launcher=(), policy="shrink", ids=None,
                  restarted=False):
    """n workers (replica groups 0..n-1, or ``ids``) of the trainer; (processes, their
    output files). ``restarted``: as torchrun starts a worker again
    (TORCHELASTIC_RESTART_COUNT=1)."""
    procs, outs = [], []
    for r in (range(n) if ids is None else ids):
        env = dict(os.environ, REPLICA_GROUP_ID=str(r), NUM_REPLICA_GROUPS=str(n),
                   TORCHFT_LIGHTHOUSE=lighthouse.address, OMP_NUM_THREADS="1",
                   PYTHONUNBUFFERED="1")
        if restarted:
            env["TORCHELASTIC_RESTART_COUNT"] = "1"
        out = tmp_path / f"worker{r}{'.restarted' if restarted else ''}.out"
        with open(out, "w") as f:
            procs.append(subprocess.Popen(
                [*launcher, *([] if launcher else [sys.executable]), "-m", "lsgd_hpc.train",
                 "--backend", "torch", "--on-failure", policy, "--failure-timeout",
                 str(FAILURE_TIMEOUT), "--ranks-per-node", "2", "--run-dir",
                 str(tmp_path / "run"), *args],
                stdout=f, stderr=subprocess.STDOUT, env=env, cwd=tmp_path,
                start_new_session=True))
        outs.append(out)
    return procs, outs


def start_training(tmp_path, lighthouse, n, algorithm, steps, *args, policy="shrink"):
    """n workers training ``algorithm`` for ``steps`` steps, returned once worker 0 logged
    step 20 (mid-run: a kill from here on lands in training)."""
    procs, outs = start_workers(tmp_path, lighthouse, n,
                                ["--algorithm", algorithm, "--max-steps", str(steps),
                                 "--eval-every", "20", *args], policy=policy)
    wait_for(outs[0], r"step\s+20/", procs)
    return procs, outs


def wait_all(procs, outs, timeout=JOB_TIMEOUT):
    """Every worker's exit status; a job past ``timeout`` is killed and fails the test."""
    deadline = time.monotonic() + timeout
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(timeout=max(1.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            for q in procs:
                if q.poll() is None:
                    os.killpg(q.pid, signal.SIGKILL)
            text = "\n".join(f"--- {o.name}\n{o.read_text()[-3000:]}" for o in outs)
            pytest.fail(f"a worker hung past {timeout} s:\n{text}")
    return codes


def wait_for(path: Path, pattern: str, procs, timeout=90.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if re.search(pattern, path.read_text()):
            return
        if any(p.poll() is not None for p in procs):
            break
        time.sleep(0.05)
    pytest.fail(f"{path.name} never showed {pattern!r}:\n{path.read_text()[-3000:]}")


def rank_pid(launcher_pid: int, timeout: float = 30.0) -> int:
    """The trainer's process under a launcher (torchrun's agent starts it as its child)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        todo = [launcher_pid]
        while todo:
            pid = todo.pop()
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
            except OSError:
                continue
            if pid != launcher_pid and b"lsgd_hpc.train" in cmd:
                return pid
            todo += [int(k) for k in kids]
        time.sleep(0.1)
    pytest.fail(f"no trainer under launcher {launcher_pid}")


def faults_of(run_dir: Path, rank: int) -> dict:
    with h5py.File(run_dir / "metrics" / f"rank{rank:05d}.h5", "r") as f:
        return {k: f["faults"][k][:].tolist() for k in f["faults"]}


def last_step(run_dir: Path, rank: int) -> int:
    with h5py.File(run_dir / "metrics" / f"rank{rank:05d}.h5", "r") as f:
        return int(f["train"]["step"][-1])


# -- every method survives a worker SIGKILLed from outside --------------------------------------
#: the methods whose shrink is tested alone; every other one's is the first half of its heal
#: test below (the survivors recover exactly as under shrink before the worker rejoins)
SHRINK_ONLY = ["allreduce", "lsgd-async"]
#: the methods whose heal is tested with a plain restart (allreduce SGD's under torchrun)
HEALED = [a for a in ALGORITHMS if a not in ("allreduce", "lsgd-async")]


@pytest.mark.replicas
@pytest.mark.parametrize("algorithm", SHRINK_ONLY)
def test_a_worker_killed_from_outside_and_the_survivors_finish(tmp_path, lighthouse, algorithm):
    """3 workers as nodes {0, 1} and {2}; worker 1 SIGKILLed once worker 0 logged step 20:
    workers 0 and 2 finish the 100 steps (exit 0), each with one /faults row naming worker 1
    and a world of 2 after it; the killed one's status is -9. (lsgd-async refuses heal; the
    other methods' shrink is tested in their heal test.)"""
    steps = 100
    procs, outs = start_training(tmp_path, lighthouse, 3, algorithm, steps)
    procs[1].send_signal(signal.SIGKILL)
    codes = wait_all(procs, outs)
    text = outs[0].read_text() + outs[2].read_text()
    assert codes == [0, -signal.SIGKILL, 0], (codes, text[-4000:])
    assert re.search(r"lost rank\(s\) 1 \(initial numbering\); 2 of 3 ranks go on", text), text
    run = tmp_path / "run"
    for r in (0, 2):
        rows = faults_of(run, r)
        assert rows["world_size_after"] == [2] and rows["n_lost"] == [1], rows
        if algorithm != "lsgd-async":          # (its ranks take uneven numbers of steps)
            assert last_step(run, r) == steps
    assert re.search(r"done: \d+ steps" if algorithm == "lsgd-async" else f"done: {steps} steps",
                     outs[0].read_text())


@pytest.mark.replicas
def test_a_whole_node_lost_in_two_kills_seconds_apart(tmp_path, lighthouse):
    """LSGD, 4 workers as 2 nodes: worker 3 killed at step 20, worker 2 two seconds later
    (two recoveries, or one if the second death comes before the first quorum); node 0
    finishes alone, its leader elections among the survivors only."""
    steps = 160
    procs, outs = start_training(tmp_path, lighthouse, 4, "lsgd", steps)
    procs[3].send_signal(signal.SIGKILL)
    time.sleep(2.0)
    procs[2].send_signal(signal.SIGKILL)
    codes = wait_all(procs, outs)
    text = outs[0].read_text()
    assert codes == [0, 0, -signal.SIGKILL, -signal.SIGKILL], (codes, text[-4000:])
    run = tmp_path / "run"
    for r in (0, 1):
        rows = faults_of(run, r)
        assert sum(rows["n_lost"]) == 2 and rows["world_size_after"][-1] == 2, rows
        assert last_step(run, r) == steps
    with h5py.File(run / "metrics" / "rank00000.h5", "r") as f:
        leaders = f["leader"]["leader_rank"][:]
        steps_logged = f["leader"]["step"][:]
    after = leaders[steps_logged > max(faults_of(run, 0)["step"])]
    assert len(after) and set(after.tolist()) <= {0, 1}, after


@pytest.mark.replicas
def test_a_silent_worker_counts_as_lost_after_the_failure_timeout(tmp_path, lighthouse):
    """Worker 1 stopped (SIGSTOP: alive, but silent, its heartbeats too): the others' next
    collective times out after the failure timeout, the lighthouse leaves worker 1 out, and
    workers 0 and 2 finish without it. (Woken, worker 1 would find itself out of the quorum
    and end after its quorum timeout, 60 s: it is killed instead.)"""
    steps = 150
    procs, outs = start_training(tmp_path, lighthouse, 3, "allreduce", steps)
    procs[1].send_signal(signal.SIGSTOP)
    t0 = time.monotonic()
    wait_for(outs[0], r"lost rank\(s\) 1 \(initial numbering\)", procs)
    noticed = time.monotonic() - t0
    for p in (procs[0], procs[2]):
        p.wait(timeout=JOB_TIMEOUT)
    procs[1].send_signal(signal.SIGKILL)
    codes = wait_all(procs, outs)
    assert codes == [0, -signal.SIGKILL, 0], (codes, outs[0].read_text()[-2000:])
    assert FAILURE_TIMEOUT <= noticed < 6 * FAILURE_TIMEOUT + 10, noticed
    assert last_step(tmp_path / "run", 0) == steps


@pytest.mark.replicas
def test_the_survivors_checkpoint_resumes_at_full_size(tmp_path, lighthouse):
    """Allreduce SGD, 3 workers, checkpoints every 20 steps: worker 2 killed, the survivors
    save their sets (a transaction over torchft's quorum) to step 60; the job started again
    with all 3 workers and --resume goes on from step 60 to 80, worker 2 rejoining with the
    replica; the replicas are checked bit-identical every 10 steps on the way."""
    args = ["--checkpoint-every", "20", "--check-replicas-every", "10"]
    procs, outs = start_training(tmp_path, lighthouse, 3, "allreduce", 60, *args)
    procs[2].send_signal(signal.SIGKILL)
    assert wait_all(procs, outs) == [0, 0, -signal.SIGKILL], outs[0].read_text()[-3000:]
    procs, outs = start_workers(tmp_path, lighthouse, 3, ["--algorithm", "allreduce",
                                                          "--max-steps", "80", "--resume",
                                                          *args])
    codes = wait_all(procs, outs)
    text = outs[0].read_text()
    assert codes == [0, 0, 0], (codes, text[-3000:])
    assert re.search(r"resumed the survivors' checkpoint of step 60 at the full 3 ranks: "
                     r"rank\(s\) 2 rejoin", text), text
    assert "done: 80 steps" in text
    for r in range(3):
        assert last_step(tmp_path / "run", r) == 80


@pytest.mark.replicas
def test_fewer_workers_than_min_ranks_end_every_survivor_with_one_line(tmp_path, lighthouse):
    """--min-ranks 3 of 3 workers: one killed, and both survivors end with the same one line
    and exit 3 (UnrecoverableFailure), no hang."""
    procs, outs = start_training(tmp_path, lighthouse, 3, "allreduce", 400,
                                 "--min-ranks", "3")
    procs[2].send_signal(signal.SIGKILL)
    codes = wait_all(procs, outs)
    assert codes == [3, 3, -signal.SIGKILL], (codes, outs[0].read_text()[-3000:])
    lines = [[ln for ln in o.read_text().splitlines() if "fewer than min_ranks=3" in ln]
             for o in outs[:2]]
    assert len(lines[0]) == len(lines[1]) == 1 and lines[0] == lines[1], lines


@pytest.mark.replicas
def test_torchrun_per_replica_group(tmp_path, lighthouse):
    """torchft's convention: one torchrun per replica group (its own store and agent); a clean
    run of 2 workers ends with exit 0 on both, no /faults row."""
    torchrun = [str(Path(sys.executable).with_name("torchrun")), "--nproc-per-node", "1",
                "--standalone", "--no-python"]
    procs, outs = start_workers(tmp_path, lighthouse, 2, ["--max-steps", "20",
                                                          "--eval-every", "10"],
                                launcher=[*torchrun, sys.executable])
    codes = wait_all(procs, outs)
    assert codes == [0, 0], [o.read_text()[-3000:] for o in outs]
    assert "done: 20 steps" in outs[0].read_text()
    assert "2 workers in quorum through lighthouse" in outs[0].read_text()
    for r in (0, 1):                                  # no recovery, no /faults row
        with h5py.File(tmp_path / "run" / "metrics" / f"rank{r:05d}.h5", "r") as f:
            assert "faults" not in f or len(f["faults"]["step"]) == 0


# -- heal: a restarted worker joins the running job ---------------------------------------------
def heal_rows(run_dir: Path, rank: int) -> list:
    """The /faults rows of heals in a rank's file: (step, replaced ranks, world after)."""
    rows = faults_of(run_dir, rank)
    return [(s, r.decode(), w) for s, r, w in zip(rows["step"], rows["replaced_ranks"],
                                                   rows["world_size_after"]) if r]


@pytest.mark.replicas
def test_a_worker_restarted_by_torchrun_joins_and_the_job_ends_at_full_size(tmp_path,
                                                                          lighthouse):
    """Allreduce SGD, 3 workers each under its own ``torchrun --max-restarts 1``: worker 1's
    trainer SIGKILLed from outside (torchrun sees it die and starts it again); the survivors
    go on with 2, the restarted one joins at their next poll of the quorum, every worker
    resumes the survivors' checkpoint at full size (the joined one with the replica of a
    survivor), the replicas are checked bit-identical every 10 steps to the end, all 3 exit 0
    with every file at the last step, and the heal is a /faults row on every rank."""
    torchrun = [str(Path(sys.executable).with_name("torchrun")), "--nproc-per-node", "1",
                "--standalone", "--max-restarts", "1", "--no-python"]
    steps = 500
    procs, outs = start_workers(tmp_path, lighthouse, 3,
                                ["--algorithm", "allreduce", "--max-steps", str(steps),
                                 "--eval-every", "20", "--check-replicas-every", "10",
                                 "--straggler", "0:0.03"],
                                launcher=[*torchrun, sys.executable], policy="heal")
    wait_for(outs[0], r"step\s+20/", procs)
    trainer = rank_pid(procs[1].pid)             # torchrun's child: the trainer itself
    os.kill(trainer, signal.SIGKILL)
    codes = wait_all(procs, outs, timeout=JOB_TIMEOUT + 60)
    text = outs[0].read_text()
    assert codes == [0, 0, 0], (codes, text[-4000:], outs[1].read_text()[-3000:])
    assert "lost rank(s) 1 (initial numbering)" in text, text[-3000:]
    assert "heal: worker(s) 1 restarted and in torchft's quorum" in text, text[-3000:]
    assert re.search(r"resumed the survivors' checkpoint of step \d+ at the full 3 ranks: "
                     r"rank\(s\) 1 rejoin with the replica of rank 0", text), text[-3000:]
    run = tmp_path / "run"
    for r in range(3):
        assert last_step(run, r) == steps
        (heal,) = heal_rows(run, r)
        assert heal[1:] == ("1", 3), heal


@pytest.mark.replicas
@pytest.mark.parametrize("algorithm", HEALED)
def test_every_method_heals_a_restarted_worker(tmp_path, lighthouse, algorithm):
    """2 workers (cheap: the 3-worker layouts are the shrink, torchrun and two-loss tests);
    worker 1 SIGKILLed at step 20 (status -9): worker 0 recovers as under shrink (its
    /faults row: worker 1 lost, a world of 1); worker 1 started again at once as torchrun
    would joins, both end at the last step with exit 0, the heal row on both (the restored
    shared state is checked by digest in the resume, a mismatch ends the job). Allreduce
    SGD's heal is the torchrun test above; lsgd-async refuses heal."""
    steps = 300
    args = ["--algorithm", algorithm, "--max-steps", str(steps), "--eval-every", "20",
            "--straggler", "0:0.03"]
    procs, outs = start_workers(tmp_path, lighthouse, 2, args, policy="heal")
    wait_for(outs[0], r"step\s+20/", procs)
    procs[1].send_signal(signal.SIGKILL)
    again, again_outs = start_workers(tmp_path, lighthouse, 2, args, policy="heal", ids=[1],
                                      restarted=True)
    codes = wait_all([procs[0], procs[1], again[0]], [outs[0], outs[1], again_outs[0]])
    text = outs[0].read_text()
    assert codes == [0, -signal.SIGKILL, 0], (codes, text[-4000:],
                                              again_outs[0].read_text()[-2000:])
    assert re.search(r"lost rank\(s\) 1 \(initial numbering\); 1 of 2 ranks go on", text), text
    assert "heal: rank(s) 1 joined" in text, text[-3000:]
    run = tmp_path / "run"
    for r in range(2):
        assert last_step(run, r) == steps
        assert [h[1:] for h in heal_rows(run, r)] == [("1", 2)]
    rows = faults_of(run, 0)                          # the shrink before the heal
    assert rows["world_size_after"] == [1, 2] and rows["n_lost"] == [1, 0], rows


@pytest.mark.replicas
def test_a_worker_of_two_ranks_loses_one_and_goes_on(tmp_path, lighthouse):
    """LSGD between workers of 2 ranks (--worker-ranks 2; every rank its own replica group):
    rank 3 SIGKILLed, its worker goes on with rank 2 alone, and ranks 0-2 end at the last
    step with exit 0, each with the /faults row of the loss."""
    steps = 200
    procs, outs = start_training(tmp_path, lighthouse, 4, "lsgd", steps, "--worker-ranks", "2")
    procs[3].send_signal(signal.SIGKILL)
    codes = wait_all(procs, outs)
    text = outs[0].read_text()
    assert codes == [0, 0, 0, -signal.SIGKILL], (codes, text[-4000:])
    assert "lost rank(s) 3 (initial numbering); 3 of 4 ranks go on" in text, text[-3000:]
    run = tmp_path / "run"
    for r in range(3):
        assert last_step(run, r) == steps
        rows = faults_of(run, r)
        assert rows["world_size_after"][-1] == 3 and sum(rows["n_lost"]) == 1, rows


@pytest.mark.replicas
def test_two_lost_workers_restarted_one_at_a_time_each_join(tmp_path, lighthouse):
    """LSGD, 4 workers as 2 nodes: workers 2 and 3 (node 1) SIGKILLed together; worker 3
    restarted at once joins a world of 3 (worker 2 still missing: the checkpoint resumed
    with the ranks there are), then worker 2 restarted joins the full 4. Every worker ends
    at the last step with exit 0, two heal rows on the survivors, and LSGD's elections go
    on over all four."""
    steps = 700
    args = ["--algorithm", "lsgd", "--max-steps", str(steps), "--eval-every", "20",
            "--straggler", "0:0.03"]
    procs, outs = start_workers(tmp_path, lighthouse, 4, args, policy="heal")
    wait_for(outs[0], r"step\s+20/", procs)
    for p in procs[2:]:
        p.send_signal(signal.SIGKILL)
    wait_for(outs[0], r"heal: waiting for worker\(s\) 2,3", procs[:2])
    late, late_outs = start_workers(tmp_path, lighthouse, 4, args, policy="heal", ids=[3],
                                    restarted=True)
    wait_for(outs[0], r"heal: rank\(s\) 3 joined", procs[:2] + late)
    later, later_outs = start_workers(tmp_path, lighthouse, 4, args, policy="heal", ids=[2],
                                      restarted=True)
    codes = wait_all(procs[:2] + late + later, outs[:2] + late_outs + later_outs,
                     timeout=JOB_TIMEOUT + 60)
    text = outs[0].read_text()
    assert codes == [0, 0, 0, 0], (codes, text[-4000:])
    assert "heal: rank(s) 2 joined" in text, text[-3000:]
    run = tmp_path / "run"
    for r in range(4):
        assert last_step(run, r) == steps
    assert [h[1:] for h in heal_rows(run, 0)] == [("3", 3), ("2", 4)]
    assert "4 ranks on 2 node(s)" in text, text[-3000:]


# -- in-process: the timeouts and the refusals ------------------------------------------------
def test_the_timeout_hierarchy_follows_from_one_figure():
    from lsgd_hpc.comm.replicas import FailureTimeouts
    for detect in (0.5, 3.0, 10.0, 30.0):
        t = FailureTimeouts(detect)
        assert t.cross == detect < t.intra < t.quorum       # between < inside < start-up
        assert t.quorum >= 60
        # the lighthouse gives up on a silent worker before a collective does, after ten
        # heartbeats or more
        assert 10 * t.heartbeat <= t.heartbeat_timeout < t.cross
    with pytest.raises(ValueError, match="failure_timeout must be > 0"):
        FailureTimeouts(0)


@pytest.mark.parametrize("args,env,message", [
    (["--on-failure", "shrink"], {}, "set REPLICA_GROUP_ID, NUM_REPLICA_GROUPS, "
                                     "TORCHFT_LIGHTHOUSE"),
    (["--on-failure", "shrink"], {"REPLICA_GROUP_ID": "2", "NUM_REPLICA_GROUPS": "2",
                                  "TORCHFT_LIGHTHOUSE": "http://h:1"},
     "REPLICA_GROUP_ID must be in 0..NUM_REPLICA_GROUPS-1, got 2 of 2"),
    (["--on-failure", "heal"], {}, "set REPLICA_GROUP_ID, NUM_REPLICA_GROUPS, "
                                   "TORCHFT_LIGHTHOUSE"),
    (["--on-failure", "heal", "--spares", "1"], {}, "--spares: is for --backend mpi"),
    (["--on-failure", "heal", "--worker-ranks", "2"], {},
     "--worker-ranks: 2 is not supported with --backend torch --on-failure heal yet"),
    (["--failure-timeout", "5"], {}, "--failure-timeout: is for --backend torch with "
                                     "--on-failure shrink"),
])
def test_refusals_name_the_option(tmp_path, args, env, message):
    from lsgd_hpc.cli.config import ConfigError, parse_config
    backend = [] if "--failure-timeout" in args else ["--backend", "torch"]
    with pytest.raises(ConfigError) as err:
        parse_config([*backend, *args, "--run-dir", str(tmp_path / "r")], env)
    assert message in str(err.value), str(err.value)


def test_the_library_refuses_workers_of_several_ranks_only_under_torch_heal():
    """What lsgd_hpc.comm.stack.compose asks the session's fault tolerance before it builds
    workers that span ranks: torchft's heal refuses them (one line), its shrink and ULFM's
    engine do not."""
    from types import SimpleNamespace
    from lsgd_hpc.comm.faults import FaultTolerance
    from lsgd_hpc.comm.replicas import ReplicaFaultTolerance
    heal, shrink = SimpleNamespace(policy="heal"), SimpleNamespace(policy="shrink")
    problem = ReplicaFaultTolerance.workers_problem(heal, 2)
    assert problem.startswith("worker_ranks=2 is not supported with on_failure='heal' on the "
                              "torch backend yet") and "\n" not in problem
    assert ReplicaFaultTolerance.workers_problem(shrink, 2) is None
    assert FaultTolerance.workers_problem(heal, "node") is None


def test_the_job_rank_of_a_replica_group():
    """The rank that prints a start-up error once, and the world size check, count every
    replica group's ranks (torchrun's RANK and WORLD_SIZE are the group's)."""
    from lsgd_hpc.comm.launcher import env_rank, launcher_world_size
    env = {"REPLICA_GROUP_ID": "3", "NUM_REPLICA_GROUPS": "4"}
    assert env_rank(env) == 3 and launcher_world_size(env) == (None, None)
    env.update(RANK="1", WORLD_SIZE="2", LOCAL_RANK="1", MASTER_ADDR="h", MASTER_PORT="1",
               TORCHELASTIC_RUN_ID="x")
    assert env_rank(env) == 7 and launcher_world_size(env) == ("torchrun", 8)
