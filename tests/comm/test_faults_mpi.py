"""on_failure="shrink" for real: 4 ranks as 2 nodes under ``mpirun --with-ft ulfm``, ranks
killed by the testing hook or from outside (SIGKILL), the survivors finishing their step budget
with each method's invariants holding (tests/drivers/ft_loop.py prints what is checked).
Every job runs under a timeout, so a hang fails the test."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import h5py
import pytest

from mpi_util import REPO, kill_session, mpi_env, mpirun_cmd, run_mpi

DRIVER = str(REPO / "tests" / "drivers" / "ft_loop.py")
ULFM = ["--with-ft", "ulfm"]
STEPS = 16
TIMEOUT = 300


def _results(proc) -> list:
    return [json.loads(line.split(" ", 1)[1]) for line in proc.stdout.splitlines()
            if line.startswith("FTRESULT ")]


def run_ft(tmp_path, method, *args, check=True, mpi_args=ULFM, np_=4):
    run_dir = tmp_path / "run"
    proc = run_mpi(np_, [sys.executable, DRIVER, method, str(run_dir), "--steps", str(STEPS),
                         *args], timeout=TIMEOUT, mpi_args=mpi_args, check=check)
    return proc, _results(proc), run_dir


def check_survivors(proc, res, lost, steps=STEPS):
    """Every survivor finished the budget, in one world of the right size, and heard of
    the failure through its callback."""
    out = proc.stdout[-3000:] + proc.stderr[-3000:]
    n = 4 - len(lost)
    assert len(res) == n, out
    assert sorted(r["initial_rank"] for r in res) == sorted(set(range(4)) - set(lost)), out
    assert {r["size"] for r in res} == {n}
    assert sorted(r["rank"] for r in res) == list(range(n))
    assert {r["steps"] for r in res} == {steps}, out
    assert all(r["finite"] for r in res)
    for r in res:
        assert sorted(r["lost"]) == sorted(lost)
        heard = sorted(x for e in r["events"] for x in e["lost"])
        assert heard == sorted(lost), r["events"]
        assert r["events"][-1]["size"] == n
    # the same events (steps) on every survivor
    assert len({json.dumps([(e["lost"], e["step"]) for e in r["events"]]) for r in res}) == 1


def faults_rows(run_dir, rank):
    with h5py.File(run_dir / "metrics" / f"rank{rank:05d}.h5", "r") as f:
        if "faults" not in f:
            return []
        g = f["faults"]
        return [{k: g[k][i] for k in g} for i in range(len(g["step"]))]


# the state each method must hold equal on every survivor: the driver's digest
SHARED = {"allreduce", "easgd", "diloco", "slowmo", "local-sgd"}


@pytest.mark.mpi
@pytest.mark.parametrize("method", ["lsgd", "allreduce", "easgd", "local-sgd", "diloco",
                                    "slowmo", "gossip"])
def test_every_method_survives_a_lost_rank(tmp_path, capsys, method):
    proc, res, run_dir = run_ft(tmp_path, method, "--kill", "1:5")
    check_survivors(proc, res, [1])
    if method in SHARED:
        assert len({r["digest"] for r in res}) == 1, [r["digest"] for r in res]
    if method == "gossip":
        assert {r["topology_n"] for r in res} == {3}
        assert "GossipSGD: topology ring rebuilt over the 3 survivors" in proc.stderr
    if method == "lsgd":
        assert {json.dumps(r["pulls_done"]) for r in res if r["node_index"] == 1}.__len__() == 1
        assert len({r["pulls_done"]["0"] for r in res}) == 1       # global pulls
    # the /faults row of every survivor, and the dead rank's file readable to its last flush
    for r in res:
        rows = faults_rows(run_dir, r["initial_rank"])
        assert len(rows) == 1 and rows[0]["lost_ranks"] == b"1"
        assert rows[0]["world_size_after"] == 3 and rows[0]["n_lost"] == 1
        assert rows[0]["lost_nodes"] == b""          # rank 0 is still on node 0
        assert rows[0]["recovery_seconds"] < 60
    with h5py.File(run_dir / "metrics" / "rank00001.h5", "r") as f:
        assert "faults" not in f and len(f["train"]["step"]) >= 1
    # what `python -m lsgd_hpc.summary RUN_DIR` prints (in-process: the same main())
    from lsgd_hpc.analysis.summary import main as summary_main
    assert summary_main([str(run_dir)]) == 0
    printed = capsys.readouterr().out
    assert "failure: rank(s) 1 lost; 3 rank(s) went on" in printed
    assert "lost (recovery at step" in printed


@pytest.mark.mpi
def test_lsgd_loses_a_whole_node_and_goes_on_single_node(tmp_path):
    """Both ranks of node 1 at once, with bf16 pulls: the survivors are one node, LSGD runs
    single-level from then on."""
    proc, res, run_dir = run_ft(tmp_path, "lsgd", "--kill", "2:5,3:5", "-o",
                                "comm_dtype=\"bf16\"")
    check_survivors(proc, res, [2, 3])
    # the node is named where its last rank was found gone (one event, or two)
    rows = faults_rows(run_dir, 0)
    assert [r["lost_nodes"] for r in rows][-1] == b"node 1", rows
    assert "and node(s) node 1;" in proc.stderr
    assert {r["n_nodes"] for r in res} == {1}
    assert {r["multi_level"] for r in res} == {False}
    assert sorted(r["local_rank"] for r in res) == [0, 1]


@pytest.mark.mpi
def test_lsgd_leader_killed_between_election_and_broadcast(tmp_path):
    """The global leader of step 8 dies after its election, before its broadcast: nobody has
    its copy, so nobody pulled (on every survivor), and it is never elected again."""
    proc, res, run_dir = run_ft(tmp_path, "lsgd", "--kill", "leader:8")
    died = [int(re.search(r"inject_failures: rank (\d+) ", line).group(1))
            for line in proc.stderr.splitlines() if "inject_failures: rank" in line]
    assert len(died) == 1, proc.stderr[-3000:]
    check_survivors(proc, res, died)
    # global pulls at steps 4, 12 and 16; the one of step 8 was lost with its leader
    assert {r["pulls_done"]["0"] for r in res} == {3}
    for r in res:
        with h5py.File(run_dir / "metrics" / f"rank{r['initial_rank']:05d}.h5", "r") as f:
            step, scope, leader = (f["leader"][k][:] for k in ("step", "scope", "leader_rank"))
        after = leader[(step > 8) & (scope == 0)]
        assert len(after) and died[0] not in after.tolist()


@pytest.mark.mpi
def test_rank0_lost_the_lowest_survivor_takes_its_part(tmp_path):
    """Rank 0 dies: rank 1 becomes rank 0, commits the checkpoints (at the new size) and
    reports; the replicas stay bit-identical."""
    proc, res, run_dir = run_ft(tmp_path, "allreduce", "--kill", "0:6", "--checkpoint-every",
                                "4")
    check_survivors(proc, res, [0])
    assert len({r["digest"] for r in res}) == 1
    latest = json.loads((run_dir / "checkpoints" / "latest.json").read_text())
    assert latest["step"] == STEPS and latest["world_size"] == 3
    assert "[lsgd_hpc] lost rank(s) 0" in proc.stderr


@pytest.mark.mpi
def test_two_failures_at_different_steps(tmp_path):
    proc, res, run_dir = run_ft(tmp_path, "easgd", "--kill", "1:4,3:10")
    check_survivors(proc, res, [1, 3])
    assert len({r["digest"] for r in res}) == 1
    assert [e["size"] for e in res[0]["events"]] == [3, 2]
    rows = faults_rows(run_dir, 0)
    assert [int(r["world_size_after"]) for r in rows] == [3, 2]


@pytest.mark.mpi
def test_a_rank_killed_from_outside(tmp_path):
    """A real SIGKILL from another process while the job runs (rank 2 waits at step 6 until
    it is killed; the others are blocked in their next collective meanwhile)."""
    run_dir = tmp_path / "run"
    cmd = mpirun_cmd(4, [sys.executable, DRIVER, "local-sgd", str(run_dir), "--steps",
                         str(STEPS), "--park", "2:6"], ULFM)
    p = subprocess.Popen(cmd, env=mpi_env(), cwd=REPO, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        marker = run_dir / "park.2"
        deadline = time.monotonic() + TIMEOUT
        while not marker.exists():
            assert p.poll() is None, p.communicate()
            assert time.monotonic() < deadline, "rank 2 never reached step 6"
            time.sleep(0.2)
        time.sleep(1.0)
        os.kill(int(marker.read_text()), signal.SIGKILL)
        out, err = p.communicate(timeout=TIMEOUT)
    finally:
        if p.poll() is None:
            kill_session(p.pid)
            p.kill()
    assert p.returncode == 0, err[-4000:]
    res = _results(subprocess.CompletedProcess(cmd, 0, out, err))
    check_survivors(subprocess.CompletedProcess(cmd, 0, out, err), res, [2])
    assert len({r["digest"] for r in res}) == 1


@pytest.mark.mpi
def test_fewer_survivors_than_min_ranks_end_the_job(tmp_path):
    t0 = time.monotonic()
    proc, res, _ = run_ft(tmp_path, "lsgd", "--kill", "1:5", "--min-ranks", "4", check=False)
    assert proc.returncode == 3, proc.stderr[-3000:]      # EXIT_UNRECOVERABLE, no abort
    assert res == []
    lines = [ln for ln in proc.stderr.splitlines() if "ending the job" in ln]
    assert len(lines) == 3 and len(set(lines)) == 1, proc.stderr[-3000:]
    assert lines[0].endswith("fewer than min_ranks=4; ending the job")
    assert "MPI_ABORT" not in proc.stderr and "Traceback" not in proc.stderr
    assert time.monotonic() - t0 < TIMEOUT


@pytest.mark.mpi
@pytest.mark.fast
def test_shrink_without_ulfm_is_refused_on_every_rank(tmp_path):
    """Plain mpirun: Shrink would be a Dup; every rank refuses with one line (exit 2)."""
    proc, res, _ = run_ft(tmp_path, "lsgd", check=False, mpi_args=[])
    assert proc.returncode == 2, proc.stdout + proc.stderr[-2000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("rank refused:")]
    assert len(lines) == 4
    assert len(set(lines)) == 1 and "mpirun --with-ft ulfm" in lines[0]


@pytest.mark.mpi
def test_async_lsgd_refuses_shrink(tmp_path):
    proc, res, _ = run_ft(tmp_path, "lsgd-async", check=False, np_=2)
    assert proc.returncode == 2
    lines = [line for line in proc.stdout.splitlines() if line.startswith("method refused:")]
    assert len(lines) == 2 and "AsyncLeaderSGD does not support on_failure='shrink'" in lines[0]
