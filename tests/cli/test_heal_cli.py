"""The trainer's --on-failure heal for real: 4 ranks as 2 nodes under mpirun --with-ft ulfm.
A rank (or a whole node) is lost; the survivors shrink and go on, replacements are spawned,
join at a step boundary with the lost ranks' numbers and take their state from a live peer
(the rejoin of a full-size resume, which checks the shared state by digest on every rank);
the job ends at full size with the replacements' rows continuing the dead ranks' files.

The survivors wait for their replacements at the first step boundary
(LSGD_HPC_HEAL_BLOCKING=1): on 2 cores a replacement that starts while 3 ranks train takes
longer than these short budgets. Every job runs under a timeout."""

import json
import os
import signal
import subprocess
import sys
import time

import h5py
import pytest

from lsgd_hpc.comm.ulfm import RECOVERABLE_SPAWNS
from lsgd_hpc.testing import kill_session, mpi_env, mpirun_cmd, session_pids
from mpi_util import run_mpi

# Open MPI's runtime ends every process of a spawned job when one of them dies, unless the
# job is recoverable: the heal command lines of docs/cluster.md and the SLURM template say so
ULFM = ["--with-ft", "ulfm", *RECOVERABLE_SPAWNS]
STEPS = 20
TIMEOUT = 240
BLOCKING = {"LSGD_HPC_HEAL_BLOCKING": "1"}


def train(tmp_path, *args, env=None, check=True, steps=STEPS, np_=4):
    run_dir = tmp_path / "run"
    proc = run_mpi(np_, [sys.executable, "-m", "lsgd_hpc.train", "--max-steps", str(steps),
                       "--eval-every", "10", "--ranks-per-node", "2", "--run-dir", str(run_dir),
                       "--on-failure", "heal", *args], timeout=TIMEOUT, mpi_args=ULFM,
                   check=check, cwd=tmp_path, env=dict(BLOCKING, **(env or {})))
    return proc, run_dir


def rows(run_dir, rank, group):
    with h5py.File(run_dir / "metrics" / f"rank{rank:05d}.h5", "r", locking=False) as f:
        if group not in f:
            return {}
        g = f[group]
        n = min(len(g[k]) for k in g)
        return {k: g[k][:n].tolist() for k in g}


def check_healed(proc, run_dir, replaced, steps=STEPS):
    """The job finished its budget at full size; every rank's /faults has the loss and the
    heal; the replacements' rows continue the dead ranks' files after the event."""
    out = proc.stdout[-3000:] + proc.stderr[-3000:]
    record = json.loads((run_dir / "complete.json").read_text())
    assert record["status"] == "complete" and record["world_size"] == 4, out
    assert record["step"] == steps and record["lost_ranks"] == [], out
    assert "rejoin" in proc.stdout + proc.stderr, out
    assert f"rank(s) {replaced[0]}" in proc.stderr, out
    heal_steps = set()
    for rank in range(4):
        faults = rows(run_dir, rank, "faults")
        heals = [i for i, r in enumerate(faults["replaced_ranks"]) if r]
        assert len(heals) == 1, (rank, faults)
        i = heals[0]
        assert faults["replaced_ranks"][i].decode() == ",".join(map(str, replaced)) or \
            faults["replaced_ranks"][i].decode() == f"{replaced[0]}-{replaced[-1]}", faults
        assert faults["world_size_after"][i] == 4
        assert faults["replace_seconds"][i] > 0 and faults["recovery_seconds"][i] >= 0
        # the replacements' nodes (emulated: --ranks-per-node 2, "node K")
        assert faults["replaced_nodes"][i].decode() == ",".join(
            dict.fromkeys(f"node {r // 2}" for r in replaced)), faults
        heal_steps.add(faults["step"][i])
        train_steps = rows(run_dir, rank, "train")["step"]
        assert train_steps[-1] == steps, (rank, train_steps[-5:])
        if rank in replaced:     # after the heal, every step to the end, once
            after = [s for s in train_steps if s >= faults["step"][i]]
            assert after == list(range(faults["step"][i], steps + 1)), train_steps
        else:                    # a survivor: every step (a step cut off by the loss and
            # dropped is taken again: its row may come twice)
            assert sorted(set(train_steps)) == list(range(1, steps + 1)), train_steps
            assert train_steps.count(faults["step"][i]) == 1, train_steps
        if rank not in replaced:   # survivors recorded the loss before the heal
            lost = [r for r in faults["lost_ranks"] if r]
            assert lost, faults
    assert len(heal_steps) == 1, heal_steps


@pytest.mark.mpi
@pytest.mark.parametrize("algorithm", ["lsgd", "allreduce", "easgd", "local-sgd", "diloco",
                                       "slowmo"])
def test_a_lost_rank_is_replaced(tmp_path, algorithm):
    """Every method (lsgd-async is refused; gossip: the hot-spare test below): rank 1 dies
    at step 8; the job ends with 4 ranks, the replacement's rows continue rank 1's file."""
    proc, run_dir = train(tmp_path, "--algorithm", algorithm, "--inject-failure", "1:8",
                          "--flush-every", "5")
    check_healed(proc, run_dir, [1])


@pytest.mark.mpi
def test_a_lost_node_then_a_lost_rank_are_replaced(tmp_path):
    """Both ranks of node 1 die at once at step 8: two replacements join as node 1 again.
    Then rank 1 dies at step 20: a second heal. The job ends at full size, and every process
    exits (Open MPI 5's MPI_Finalize waited forever, in most such runs, on the connection of
    the first replacements to rank 1, which died after it; a healed job's communicators are
    now freed before it)."""
    steps = 36
    proc, run_dir = train(tmp_path, "--inject-failure", "2:8,3:8,1:20", steps=steps)
    out = proc.stderr[-3000:]
    assert "lost rank(s) 2,3 " in proc.stderr, out
    assert "heal: rank(s) 2,3 joined on node(s) node 1; 4 ranks on 2 node(s)" in proc.stderr
    assert "heal: rank(s) 1 joined on node(s) node 0; 4 ranks on 2 node(s)" in proc.stderr
    record = json.loads((run_dir / "complete.json").read_text())
    assert record["status"] == "complete" and record["world_size"] == 4, out
    for rank in range(4):
        faults = rows(run_dir, rank, "faults")
        heals = [(r.decode(), n.decode()) for r, n in
                 zip(faults["replaced_ranks"], faults["replaced_nodes"]) if r]
        assert heals == [("2,3", "node 1"), ("1", "node 0")], (rank, faults)
        train_steps = rows(run_dir, rank, "train")["step"]
        assert train_steps[-1] == steps, (rank, train_steps[-5:])
        if rank == 0:            # never lost: every step (the others' files keep what the
            # dead ranks had flushed, then their replacements' rows from the heal on)
            assert sorted(set(train_steps)) == list(range(1, steps + 1)), train_steps


@pytest.mark.mpi
def test_a_replacement_that_dies_while_joining_is_spawned_again(tmp_path):
    """Rank 1 dies at step 8; its first replacement dies as it joins (the testing hook's
    point "join": SIGKILL before it says ready). The survivors take it for dead once it is
    not ready within LSGD_HPC_HEAL_TIMEOUT (MPI does not tell them), spawn another, which
    joins: the job ends at full size. Every process exits (no hang in MPI_Finalize on the
    dead replacement's connection), and mpirun exits 0: the spawned jobs are recoverable."""
    proc, run_dir = train(tmp_path, "--inject-failure", "1:8,1:8:join",
                          env={"LSGD_HPC_HEAL_TIMEOUT": "20"})
    assert "a replacement kills itself while joining" in proc.stderr, proc.stderr[-3000:]
    assert "heal: the replacement(s) for rank(s) 1 died before joining; spawning again " \
           "(try 2 of 3)" in proc.stderr, proc.stderr[-3000:]
    check_healed(proc, run_dir, [1])


@pytest.mark.mpi
def test_a_replacement_lost_in_its_resume_leaves_a_single_survivor_that_heals_again(tmp_path):
    """Ranks 1, 2 and 3 die at step 8: a single survivor spawns three replacements, which
    join; then rank 2's dies in the healed world's restore, before its first step (the
    hook's point "resume"). Its siblings of the same spawn live on (a recoverable spawn).
    The restore is a transaction: the survivor and the two replacements left recover and
    restore the join's checkpoint again as 3 of 4 ranks (the survivor from its own file,
    ranks 1 and 3 rejoining), go on, and rank 2 is replaced once more: the job ends at full
    size, exit 0. (The restore used to refuse the survivor's own set there and abort.)"""
    steps = 24
    proc, run_dir = train(tmp_path, "--inject-failure", "1:8,2:8,3:8,2:8:resume", steps=steps)
    err = proc.stderr
    out = err[-3000:]
    assert "lost rank(s) 1-3 (initial numbering) and node(s) node 1; 1 of 4 ranks go on" \
        in err, out
    assert "a replacement (rank 2) kills itself in its resume" in err, out
    assert "lost rank(s) 2 (initial numbering); 3 of 4 ranks go on" in err, out
    assert "resumed the checkpoint of step 8 with the 3 of 4 ranks left (rank(s) 2 lost " \
           "since it was written): rank(s) 1,3 rejoin with" in err, out
    assert "heal: rank(s) 2 joined on node(s) node 1; 4 ranks on 2 node(s)" in err, out
    record = json.loads((run_dir / "complete.json").read_text())
    assert record["status"] == "complete" and record["world_size"] == 4, out
    assert record["step"] == steps and record["lost_ranks"] == [], out
    for rank in range(4):
        faults = rows(run_dir, rank, "faults")
        heals = [r.decode() for r in faults["replaced_ranks"] if r]
        assert heals[-1] == "2", (rank, faults)
        assert rows(run_dir, rank, "train")["step"][-1] == steps, rank
    # every step to the end in the survivor's file, once each after the first heal
    assert sorted(set(rows(run_dir, 0, "train")["step"])) == list(range(1, steps + 1))


@pytest.mark.mpi
def test_a_survivor_lost_during_the_join_ends_the_job_with_a_checkpoint(tmp_path):
    """Rank 1 dies at step 8; as the survivors merge with its replacement, rank 2 dies too
    (the testing hook's point "merge"). Open MPI's MPI_Intercomm_merge never returns from
    that: instead of hanging, every process of the join ends itself once
    LSGD_HPC_HEAL_JOIN_TIMEOUT (5 s here) has passed, with one line each; the job ends
    non-zero and leaves the checkpoint the survivors saved for the join (step 8, ranks 0, 2,
    3), from which --resume goes on (the survivors' full-size resume, tested elsewhere)."""
    t0 = time.monotonic()
    proc, run_dir = train(tmp_path, "--inject-failure", "1:8,2:8:merge", check=False,
                          env={"LSGD_HPC_HEAL_JOIN_TIMEOUT": "5"})
    out = proc.stderr[-3000:]
    assert proc.returncode not in (0, None), out
    assert "rank 2 kills itself at step 8 (merge)" in proc.stderr, out
    ended = [line for line in proc.stderr.splitlines()
             if "the join did not end within 5 s" in line]
    assert sorted(line.rpartition("ending this ")[2].split()[0] for line in ended) == \
        ["replacement", "survivor", "survivor"], out
    assert time.monotonic() - t0 < TIMEOUT / 2, out
    latest = json.loads((run_dir / "checkpoints" / "latest.json").read_text())
    assert latest["step"] == 8 and latest["ranks"] == [0, 2, 3], latest
    assert not (run_dir / "complete.json").exists()
    assert rows(run_dir, 0, "train")["step"][-1] == 8


@pytest.mark.mpi
def test_a_hot_spare_takes_the_place_of_a_lost_rank(tmp_path):
    """--spares 1 (5 ranks started, 4 train), gossip (the method the spawn tests above leave
    to this one): rank 1 dies, the spare takes its number and node group; nothing is
    spawned, and the spare has no metrics file of its own."""
    proc, run_dir = train(tmp_path, "--algorithm", "gossip", "--spares", "1",
                          "--inject-failure", "1:8", "--flush-every", "5", np_=5)
    assert "hot spare(s) take rank(s) 1 (0 of 1 spare(s) left)" in proc.stderr, proc.stderr
    assert "spawning" not in proc.stderr
    assert sorted(p.name for p in (run_dir / "metrics").glob("rank*.h5")) == [
        f"rank{r:05d}.h5" for r in range(4)]
    check_healed(proc, run_dir, [1])


def _python_ranks(sid: int) -> dict:
    """World rank -> pid of the job's ranks (their OMPI_COMM_WORLD_RANK)."""
    out = {}
    for pid in session_pids(sid):
        try:
            with open(f"/proc/{pid}/environ", "rb") as fh:
                env = dict(i.split(b"=", 1) for i in fh.read().split(b"\0") if b"=" in i)
            if not os.path.basename(os.readlink(f"/proc/{pid}/exe")).startswith("python"):
                continue
        except OSError:
            continue
        if b"OMPI_COMM_WORLD_RANK" in env:
            out.setdefault(int(env[b"OMPI_COMM_WORLD_RANK"]), pid)
    return out


@pytest.mark.mpi
def test_a_rank_killed_from_outside_is_replaced(tmp_path):
    """SIGKILL from outside (as a crash would), while the job trains: the job heals and
    finishes at full size."""
    run_dir = tmp_path / "run"
    steps = 300
    cmd = mpirun_cmd(4, [sys.executable, "-m", "lsgd_hpc.train", "--max-steps", str(steps),
                         "--eval-every", "100", "--ranks-per-node", "2", "--run-dir",
                         str(run_dir), "--on-failure", "heal", "--algorithm", "allreduce",
                         "--straggler", "0:0.01"], ULFM)
    p = subprocess.Popen(cmd, env=mpi_env(BLOCKING), cwd=tmp_path, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:        # until training has begun
            if (run_dir / "metrics" / "rank00003.h5").exists() and len(_python_ranks(p.pid)) == 4:
                break
            time.sleep(0.2)
        time.sleep(2.0)
        os.kill(_python_ranks(p.pid)[3], signal.SIGKILL)
        out, err = p.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        kill_session(p.pid)
        out, err = p.communicate()
        pytest.fail(f"the healed job hung\n{out[-3000:]}\n{err[-3000:]}")
    assert p.returncode == 0, out[-3000:] + err[-3000:]
    check_healed(subprocess.CompletedProcess(cmd, 0, out, err), run_dir, [3], steps=steps)


def test_a_replacement_nobody_takes_in_leaves():
    """A replacement whose survivors all died would wait in MPI for good: its watchdog ends
    it (status 1, one line) once the join's time is up (here 0.5 s), even while the main
    thread is blocked."""
    code = ("import time; from lsgd_hpc.comm.heal import _leave_unless_joined; "
            "_leave_unless_joined(0.5); time.sleep(30)")
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, env=mpi_env())
    assert proc.returncode == 1, proc.stderr
    assert "this replacement was not taken in within 0 s" in proc.stderr or \
        "this replacement was not taken in within 1 s" in proc.stderr, proc.stderr
    assert time.monotonic() - t0 < 20


@pytest.mark.mpi
def test_heal_is_refused_where_it_cannot_work(tmp_path):
    """lsgd-async (uneven steps) and a run without ULFM: one line, exit 2, on every rank."""
    proc, _ = train(tmp_path, "--algorithm", "lsgd-async", check=False, np_=2)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "heal needs step boundaries that every rank shares" in proc.stderr
    run_dir = tmp_path / "run2"
    proc = run_mpi(2, [sys.executable, "-m", "lsgd_hpc.train", "--max-steps", "4",
                       "--run-dir", str(run_dir), "--on-failure", "heal"], timeout=TIMEOUT,
                   mpi_args=[], check=False, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "ULFM" in proc.stderr and "heal" in proc.stderr
