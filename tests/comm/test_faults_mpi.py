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


def check_survivors(proc, res, lost, steps=STEPS, np_=4):
    """Every survivor finished the budget, in one world of the right size, and heard of
    the failure through its callback."""
    out = proc.stdout[-3000:] + proc.stderr[-3000:]
    n = np_ - len(lost)
    assert len(res) == n, out
    assert sorted(r["initial_rank"] for r in res) == sorted(set(range(np_)) - set(lost)), out
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


METHODS = ["lsgd", "allreduce", "easgd", "local-sgd", "diloco", "slowmo", "gossip"]


@pytest.fixture(scope="module")
def lost_rank_runs(tmp_path_factory):
    """Each method's job that loses rank 1 at step 5, with a checkpoint every 4 steps (sets
    of the 3 survivors at steps 8, 12 and 16), run once: the test of its survivors and the
    full-size resume of its last set read it."""
    runs = {}

    def get(method):
        if method not in runs:
            runs[method] = run_ft(tmp_path_factory.mktemp(method), method, "--kill", "1:5",
                                  "--checkpoint-every", "4", *LOST_RANK_EXTRA.get(method, ()))
        return runs[method]
    return get


# Allreduce SGD trains one replica over all ranks and takes no workers: its lost-rank job asks
# for worker_ranks=node too, which makes it the job of the "allreduce, node-one" case of
# test_workers_go_on_with_the_ranks_they_have_left as well (4 ranks as 2 nodes, rank 1 lost at
# step 5): one job, read by both tests (and resumed by the full-size resume's job)
LOST_RANK_EXTRA = {"allreduce": ("-o", "worker_ranks=node")}


@pytest.mark.mpi
@pytest.mark.parametrize("method", METHODS)
def test_every_method_survives_a_lost_rank(lost_rank_runs, capsys, method):
    proc, res, run_dir = lost_rank_runs(method)
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


# workers that span ranks under shrink: (ranks, ranks per node, worker_ranks, kills, lost):
# 4 ranks as 2 nodes with a worker per node, one rank of worker 0 lost (or all of worker
# 1); 8 ranks as 2 nodes with workers of 2 ranks, one rank of worker 0 lost at step 5 and
# the whole of worker 3 at step 9
WORKER_JOBS = {
    "node-one": (4, 2, "node", "1:5", [1]),
    "node-whole": (4, 2, "node", "2:5,3:5", [2, 3]),
    "k2-both": (8, 4, 2, "1:5,6:9,7:9", [1, 6, 7]),
}
# the case of allreduce, node-one reads the lost-rank job of allreduce (lost_rank_runs), which
# runs with worker_ranks=node: it runs on the worker (xdist) that runs that job
SHARED_WORKER_CASE = ("allreduce", "node-one")
WORKER_CASES = [(m, "node-one") for m in ("lsgd", "diloco", "local-sgd")] + \
    [pytest.param(*SHARED_WORKER_CASE,
                  marks=pytest.mark.xdist_group("module:test_faults_mpi"))] + \
    [("diloco", "node-whole")] + \
    [(m, "k2-both") for m in ("lsgd", "diloco", "local-sgd", "allreduce")]


@pytest.mark.mpi
@pytest.mark.parametrize("method,job", WORKER_CASES)
def test_workers_go_on_with_the_ranks_they_have_left(tmp_path, request, method, job):
    """A worker that loses some of its ranks goes on with the rest (its replicas identical,
    its gradient averaged over fewer ranks), a worker that loses all of them leaves the
    world of workers, and every survivor finishes the budget with the method's shared state
    equal everywhere. Allreduce SGD trains one replica over all ranks already: it runs
    without workers and recovers as a rank-level method."""
    np_, rpn, k, kills, lost = WORKER_JOBS[job]
    if (method, job) == SHARED_WORKER_CASE:      # the same job as the lost-rank test's
        assert (np_, rpn, kills) == (4, 2, "1:5") and LOST_RANK_EXTRA[method] == \
            ("-o", f"worker_ranks={k}")
        proc, res, _ = request.getfixturevalue("lost_rank_runs")(method)
    else:
        proc, res, _ = run_ft(tmp_path, method, "--kill", kills, "--rpn", str(rpn),
                              "-o", f"worker_ranks={k}", np_=np_)
    check_survivors(proc, res, lost, np_=np_)
    if method in SHARED:
        assert len({r["digest"] for r in res}) == 1, [r["digest"] for r in res]
    if method == "allreduce":
        assert all("worker" not in r for r in res)
        return
    size = 2 if k == "node" else k
    by_worker = {}
    for r in res:
        by_worker.setdefault(r["worker"], []).append(r)
    expected = {}                 # initial worker -> its surviving ranks
    for rank in sorted(set(range(np_)) - set(lost)):
        expected.setdefault(rank // size, []).append(rank)
    assert {r["n_workers"] for r in res} == {len(expected)}
    assert sorted(sorted(r["initial_rank"] for r in rs) for rs in by_worker.values()) == \
        sorted(expected.values())
    for rs in by_worker.values():
        assert len({r["replica"] for r in rs}) == 1, [r["replica"] for r in rs]
        assert {r["worker_size"] for r in rs} == {len(rs)}


@pytest.mark.mpi
def test_full_size_resume_of_the_survivors_sets_rank_1_rejoins(lost_rank_runs, tmp_path):
    """A job at the full 4 ranks resumes each method's last set (step 16, written by initial
    ranks 0, 2 and 3; one job, the runs in turn): rank 1 rejoins with the parameters of the
    method's kind and a fresh optimizer state, and every rank finishes 4 more steps with the
    method's shared state equal everywhere."""
    runs = {m: lost_rank_runs(m)[2] for m in METHODS + ["lsgd-async"]}
    label = {}
    for m, run_dir in runs.items():
        latest = json.loads((run_dir / "checkpoints" / "latest.json").read_text())
        assert (latest["ranks"], latest["initial_size"]) == ([0, 2, 3], 4)
        label[m] = latest["step"]           # the most steps a rank took (async: uneven)
        assert label[m] == 16 or m == "lsgd-async"
    proc = run_mpi(4, [sys.executable, DRIVER, ",".join(runs),
                       ",".join(str(d) for d in runs.values()), "--steps", str(STEPS + 4),
                       "--resume"], timeout=TIMEOUT, mpi_args=ULFM)
    out = proc.stdout[-3000:] + proc.stderr[-3000:]
    res = {}
    for r in _results(proc):
        res.setdefault(r["method"], {})[r["initial_rank"]] = r
    assert sorted(res) == sorted(runs), out
    lines = [ln for ln in proc.stderr.splitlines() if "at the full 4 ranks: rank(s) 1 rejoin" in ln]
    assert len(lines) == len(runs), out
    for method, by_rank in res.items():
        assert sorted(by_rank) == [0, 1, 2, 3], (method, out)
        after = {r: v["after_restore"] for r, v in by_rank.items()}
        assert {a["step"] for a in after.values()} == {label[method]}
        assert all(a["rejoined"] == [1] for a in after.values())
        if method == "lsgd-async":       # its steps together reach its budgets
            assert sum(v["steps"] for v in by_rank.values()) >= 4 * (STEPS + 4)
        else:
            assert {v["steps"] for v in by_rank.values()} == {STEPS + 4}
        assert all(v["finite"] for v in by_rank.values())
        if method in SHARED:
            assert len({v["digest"] for v in by_rank.values()}) == 1, method
        # the survivors keep their momentum; rank 1's optimizer starts fresh (a replica of
        # allreduce SGD takes rank 0's, which keeps the replicas bit-identical)
        assert all(after[r]["opt_state"] > 0 for r in (0, 2, 3)), method
        assert after[1]["opt_state"] == (after[0]["opt_state"] if method == "allreduce" else 0)
        flat1 = after[1]["flat"]
        if method in ("lsgd", "lsgd-async"):    # the global leader's (a survivor's)
            leader = after[1]["leader"]
            assert leader in (0, 2, 3) and {a["leader"] for a in after.values()} == {leader}
            assert flat1 == after[leader]["flat"], method
        elif method == "allreduce":
            assert {a["flat"] for a in after.values()} == {flat1}
        elif method == "easgd":
            assert flat1 == after[0]["center"] and len({a["center"] for a in after.values()}) == 1
        elif method == "diloco":
            assert after[1]["params"] == after[0]["prev"]
        elif method == "slowmo":
            assert after[1]["params"] == after[0]["old"]
        else:                           # local SGD, gossip: the lowest survivor's
            assert flat1 == after[0]["flat"], method
        # rank 1's metrics: its rows up to its death (step 5), then from the set's step on
        # (async: from the step count it took over, the lowest survivor's; the set's label
        # is the most steps any rank took)
        with h5py.File(runs[method] / "metrics" / "rank00001.h5", "r") as f:
            steps = f["train"]["step"][:].tolist()
        later = [s for s in steps if s > 5]
        assert all(s <= 5 for s in steps[:len(steps) - len(later)])
        assert later == list(range(later[0], later[0] + len(later))), (method, steps)
        assert later[0] == label[method] + 1 if method != "lsgd-async" else \
            5 < later[0] <= label[method] + 1, (method, steps)


@pytest.mark.mpi
def test_lsgd_loses_a_whole_node_and_goes_on_single_node(tmp_path):
    """Both ranks of node 1 at once, with bf16 pulls: the survivors are one node, LSGD runs
    single-level from then on."""
    proc, res, run_dir = run_ft(tmp_path, "lsgd", "--kill", "2:5,3:5", "--hidden", "64", "-o",
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
@pytest.mark.parametrize("wire", [['comm_dtype="int8"'], ['comm_dtype="int2"', "topk=0.1"]],
                         ids=["int8", "topk-int2"])
def test_compressed_with_error_feedback_survives_a_lost_rank(tmp_path, wire):
    """DiLoCo's outer allreduce in int8, or its top-k 10 % with int2 values, hierarchical
    (node sums in float32, the compressed exchange between the node roots, residuals on the
    roots): rank 2, the root of node 1, lost; rank 3 becomes that node's root, the nodes
    are 2 and 1 ranks (still hierarchical); the 3 survivors' outer state equal, every value
    finite, the residuals still fed back (non-zero) on both roots afterwards, none on the
    other rank."""
    options = [a for w in wire for a in ("-o", w)]
    proc, res, run_dir = run_ft(tmp_path, "diloco", "--kill", "2:7", "--hidden", "64",
                                *options, "-o", "error_feedback=true")
    check_survivors(proc, res, [2])
    assert len({r["digest"] for r in res}) == 1
    roots = [r for r in res if r["local_rank"] == 0]
    assert len(roots) == 2 and all(r["residual_norm"] > 0 for r in roots), res
    assert all(r["residual_norm"] == 0 for r in res if r["local_rank"] != 0), res


@pytest.mark.mpi
def test_streaming_diloco_survives_a_lost_rank(tmp_path):
    """Streaming DiLoCo, 2 fragments, H 4, the fragment allreduce one step behind (tau 1):
    rank 1 dies at step 5 with a fragment's allreduce in flight. The survivors redo it over
    themselves from their saved contributions, so no outer step is lost (16 / (4 / 2) = 8),
    and x_prev, every fragment's outer momentum and the count agree."""
    proc, res, run_dir = run_ft(tmp_path, "diloco", "--kill", "1:5", "-o", "local_steps=4",
                                "-o", "fragments=2", "-o", "fragment_sync_delay=1")
    check_survivors(proc, res, [1])
    assert len({r["digest"] for r in res}) == 1
    assert {r["outer_steps"] for r in res} == {STEPS // 2}


@pytest.mark.mpi
def test_lsgd_pull_delay_survives_a_lost_rank(tmp_path):
    """--pull-delay 1: the leaders' broadcasts run behind a step of compute, on communicators
    of their own, when rank 1 dies. A broadcast in flight is completed on every survivor of
    its group or dropped on all: the survivors of a node have pulled as often as each other,
    every survivor as often globally, and the delayed broadcasts go on after the recovery."""
    proc, res, run_dir = run_ft(tmp_path, "lsgd", "--kill", "1:5", "--hidden", "64", "-o",
                                "pull_delay=1")
    check_survivors(proc, res, [1])
    assert len({r["pulls_done"]["0"] for r in res}) == 1          # global pulls
    node1 = [r["pulls_done"]["1"] for r in res if r["node_index"] == 1]
    assert len(node1) == 2 and len(set(node1)) == 1
    step = res[0]["events"][0]["step"]
    # global pulls land one step after the elections at 4, 8, 12 (16's would land at 17);
    # one elected at the failure's step may be lost with it, none after it
    assert res[0]["pulls_done"]["0"] >= 1 + (STEPS - 1 - step) // 4, (step, res[0])


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
def test_a_rank_killed_while_a_checkpoint_is_written(tmp_path):
    """Rank 2 dies in the save of step 8, its file written and the set not committed: the
    4-rank set of step 8 is never committed (latest.json never points at it); the survivors
    recover and save it again as the 3 of them, and a resume takes complete sets only."""
    proc, res, run_dir = run_ft(tmp_path, "easgd", "--kill", "2:8:save", "--checkpoint-every",
                                "4")
    check_survivors(proc, res, [2])
    assert "rank 2 kills itself at step 8 (save)" in proc.stderr
    ckpts = run_dir / "checkpoints"
    eight = json.loads((ckpts / "step000000008" / "manifest.json").read_text()) \
        if (ckpts / "step000000008").exists() else None
    # (pruned once newer sets are complete; if it is still there, it is the survivors')
    assert eight is None or (eight["world_size"], eight["ranks"]) == (3, [0, 1, 3])
    latest = json.loads((ckpts / "latest.json").read_text())
    assert (latest["step"], latest["world_size"], latest["ranks"]) == (STEPS, 3, [0, 1, 3])
    from lsgd_hpc.runtime.checkpoint import latest_checkpoint
    assert latest_checkpoint(str(run_dir))["step"] == STEPS
    # the event's step: the save of step 8 was under way
    assert {e["step"] for r in res for e in r["events"]} == {8}


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
            time.sleep(0.1)
        time.sleep(0.5)             # the others into their next collective meanwhile
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
    """Plain mpirun: Shrink would be a Dup; every rank refuses with one line (exit 2). (2 ranks:
    the refusal comes in init, before the layout or the method.)"""
    proc, res, _ = run_ft(tmp_path, "lsgd", check=False, mpi_args=[], np_=2)
    assert proc.returncode == 2, proc.stdout + proc.stderr[-2000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("rank refused:")]
    assert len(lines) == 2
    assert len(set(lines)) == 1 and "mpirun --with-ft ulfm" in lines[0]


@pytest.mark.mpi
def test_async_lsgd_survives_a_lost_rank(lost_rank_runs):
    """AsyncLeaderSGD (ranks take uneven steps, rounds decided by non-blocking probes):
    rank 1 dies at its step 5 with probes and broadcasts in flight on both levels. The
    survivors drop the probes, finish or drop each round's broadcast together, and go on
    until their steps together reach their budgets; their rounds agree on each level."""
    proc, res, run_dir = lost_rank_runs("lsgd-async")
    out = proc.stdout[-3000:] + proc.stderr[-3000:]
    assert sorted(r["initial_rank"] for r in res) == [0, 2, 3], out
    assert {r["size"] for r in res} == {3} and all(r["finite"] for r in res)
    assert len({json.dumps([(e["lost"], e["step"]) for e in r["events"]]) for r in res}) == 1
    assert sum(r["steps"] for r in res) >= 3 * STEPS, [r["steps"] for r in res]
    assert len({r["rounds"]["0"] for r in res}) == 1, [r["rounds"] for r in res]
    node1 = [r["rounds"].get("1") for r in res if r["node_index"] == 1]
    assert len(node1) == 2 and len(set(node1)) == 1, [r["rounds"] for r in res]
