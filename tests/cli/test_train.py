"""End-to-end training under mpirun: accuracy, HDF5 schema, elections, bytes, determinism."""

import json
import math
import os
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
import yaml

from mpi_util import REPO, run_mpi

DRIVER = str(REPO / "tests" / "parallel" / "train_driver.py")
ALGS = ["lsgd", "allreduce", "easgd", "local-sgd", "diloco", "slowmo", "gossip"]
ROOT_ATTRS = ["schema_version", "rank", "world_size", "local_rank", "node_index", "n_nodes",
              "hostname", "algorithm", "config", "lsgd_hpc_version", "git_sha",
              "torch_version", "mpi_library", "slurm_job_id", "start_time"]
TRAIN_COLS = ["step", "epoch", "wall_time", "loss", "accuracy", "lr", "comm_bytes_sent",
              "comm_bytes_recv", "comm_seconds", "compute_seconds"]
EVAL_COLS = ["step", "epoch", "wall_time", "test_loss", "test_accuracy"]


def read(run_dir: Path, n: int) -> list:
    out = []
    for r in range(n):
        with h5py.File(run_dir / "metrics" / f"rank{r:05d}.h5", "r") as f:
            out.append({"attrs": dict(f.attrs),
                        **{g: {c: f[g][c][()] for c in f[g]} for g in f}})
    return out


# digits_cnn's size, worked out from its layers (not from the package's FlatParams):
# conv3x3 1->16 without bias, BatchNorm(16), conv3x3 16->32 without bias, BatchNorm(32),
# linear 32*2*2 -> 10 with bias. BatchNorm has a weight and a bias per channel (parameters)
# and a running mean and variance per channel (floats that travel with the model).
DIGITS_PARAMS = (1 * 16 * 3 * 3) + 2 * 16 + (16 * 32 * 3 * 3) + 2 * 32 + (32 * 2 * 2 * 10 + 10)
DIGITS_BN_FLOATS = 2 * 16 + 2 * 32
assert (DIGITS_PARAMS, DIGITS_BN_FLOATS) == (6138, 96)
GRAD_BYTES = 4 * DIGITS_PARAMS                        # float32 gradients
PARAM_BYTES = 4 * DIGITS_PARAMS                       # float32 parameters (no BN statistics)
MODEL_BYTES = 4 * (DIGITS_PARAMS + DIGITS_BN_FLOATS)  # float32 parameters + BN statistics
ELECTION_BYTES = 16                                   # one MPI DOUBLE_INT {double; int} padded


@pytest.fixture(scope="module")
def all_runs(tmp_path_factory):
    """Every algorithm, 4 ranks as 2 nodes, on digits, in one MPI job."""
    base = tmp_path_factory.mktemp("algs")
    run_mpi(4, [sys.executable, DRIVER, str(base / "run"), ",".join(ALGS), "--",
                "--ranks-per-node", "2", "--local-steps", "8", "--seed", "3"], timeout=600)
    return {a: read(base / f"run-{a}", 4) for a in ALGS}


@pytest.mark.mpi
@pytest.mark.parametrize("alg", ALGS)
def test_every_algorithm_learns_digits(all_runs, alg):
    ranks = all_runs[alg]
    final = [r["eval"]["test_accuracy"][-1] for r in ranks]
    assert np.mean(final) >= 0.90, (alg, final)
    if alg == "easgd":
        assert ranks[0]["eval"]["center_test_accuracy"][-1] >= 0.90


@pytest.mark.mpi
@pytest.mark.parametrize("alg", ALGS)
def test_hdf5_schema(all_runs, alg):
    for rank, f in enumerate(all_runs[alg]):
        a = f["attrs"]
        assert set(ROOT_ATTRS) <= set(a), set(ROOT_ATTRS) - set(a)
        assert a["schema_version"] == 1 and a["rank"] == rank and a["world_size"] == 4
        assert a["n_nodes"] == 2 and a["node_index"] == rank // 2 and a["local_rank"] == rank % 2
        assert a["algorithm"] == alg and json.loads(a["config"])["algorithm"] == alg
        assert a["mpi_library"] and "T" in a["start_time"]
        n = len(f["train"]["step"])
        assert all(len(f["train"][c]) == n for c in TRAIN_COLS)
        assert list(f["train"]["step"]) == list(range(1, n + 1))
        assert all(np.all(np.diff(f["train"][c]) >= 0) for c in
                   ("comm_bytes_sent", "comm_bytes_recv", "comm_seconds", "compute_seconds",
                    "overhead_seconds", "wall_time"))
        assert all(c in f["eval"] for c in EVAL_COLS) and len(f["eval"]["step"]) >= 2
        assert {"step", "scope", "leader_rank", "score"} <= set(f["leader"])
        assert {"step", "distance"} <= set(f["consensus"])


@pytest.mark.mpi
def test_elections_agree_and_leader_has_lowest_score(all_runs):
    ranks = all_runs["lsgd"]
    node_of = [0, 0, 1, 1]
    rows = {}
    for r, f in enumerate(ranks):
        L = f["leader"]
        for step, scope, lead, score in zip(L["step"], L["scope"], L["leader_rank"], L["score"]):
            rows.setdefault((int(step), int(scope), node_of[r] if scope == 1 else -1), []).append(
                (r, int(lead), float(score)))
    scopes = {k[1] for k in rows}
    assert scopes == {0, 1}
    for (step, scope, node), members in rows.items():
        want = [0, 1, 2, 3] if scope == 0 else [m for m in range(4) if node_of[m] == node]
        assert sorted(m[0] for m in members) == want
        leaders = {m[1] for m in members}
        assert len(leaders) == 1, (step, scope, members)      # all members agree
        best = min((s if math.isfinite(s) else math.inf, r) for r, _, s in members)[1]
        assert leaders == {best}, (step, scope, members)     # lowest score, lowest rank
    # global every tau_global = 8 steps, local every tau_local = 4 (digits defaults)
    g_steps = sorted({k[0] for k in rows if k[1] == 0})
    assert g_steps[:3] == [8, 16, 24]


def per_step(f, column):
    """Bytes of one rank in each logged step (the columns are cumulative; log_every is 1)."""
    t = f["train"]
    assert list(t["step"]) == list(range(1, len(t["step"]) + 1))
    return np.diff(np.concatenate([[0], t[column]])), np.asarray(t["step"])


BN_BYTES = 4 * DIGITS_BN_FLOATS


@pytest.mark.mpi
@pytest.mark.parametrize("alg,every,sent,recv", [
    # gradient allreduce every step, and BatchNorm statistics broadcast from rank 0 (as DDP)
    ("allreduce", 1, lambda r: GRAD_BYTES + (BN_BYTES if r == 0 else 0),
     lambda r: GRAD_BYTES + (BN_BYTES if r != 0 else 0)),
    # model allreduce every T = 8 steps
    ("local-sgd", 8, lambda r: MODEL_BYTES, lambda r: MODEL_BYTES),
    # DiLoCo: the pseudo-gradient and BatchNorm statistics every H = 8 steps; SlowMo: local
    # SGD's model allreduce every T = 8 steps, the slow step sends nothing
    ("diloco", 8, lambda r: MODEL_BYTES, lambda r: MODEL_BYTES),
    ("slowmo", 8, lambda r: MODEL_BYTES, lambda r: MODEL_BYTES),
    # model allreduce every tau = 4 steps
    ("easgd", 4, lambda r: MODEL_BYTES, lambda r: MODEL_BYTES),
    # ring of 4: the model to and from 2 neighbours every step
    ("gossip", 1, lambda r: 2 * MODEL_BYTES, lambda r: 2 * MODEL_BYTES),
])
def test_bytes_per_step_exact(all_runs, alg, every, sent, recv):
    for rank, f in enumerate(all_runs[alg]):
        for column, want in (("comm_bytes_sent", sent(rank)), ("comm_bytes_recv", recv(rank))):
            d, steps = per_step(f, column)
            expected = np.where(steps % every == 0, want, 0)
            assert np.array_equal(d, expected), (alg, rank, column, d[:10], expected[:10])


@pytest.mark.mpi
def test_lsgd_bytes_per_step_exact(all_runs):
    """4 ranks as nodes {0,1} and {2,3}, tau_local 4, tau_global 8. Every 4 steps a node
    election and a broadcast of the model from the node's leader; every 8 steps also a world
    election and a broadcast from the global leader. Every rank but the leader receives the
    model's parameters once per pull (--lsgd-bn keep: BatchNorm statistics stay local and are
    not sent); the broadcast tree is free, but each receiver is fed by one send."""
    runs = all_runs["lsgd"]
    node_of = [0, 0, 1, 1]
    leaders = {}
    for r, f in enumerate(runs):
        L = f["leader"]
        for step, scope, lead in zip(L["step"], L["scope"], L["leader_rank"]):
            key = (int(step), "global" if scope == 0 else node_of[r])
            assert leaders.setdefault(key, int(lead)) == int(lead)
    sent = np.array([per_step(f, "comm_bytes_sent")[0] for f in runs])
    recv = np.array([per_step(f, "comm_bytes_recv")[0] for f in runs])
    steps = per_step(runs[0], "comm_bytes_sent")[1]
    for i, step in enumerate(steps):
        want_recv = np.zeros(4, dtype=np.int64)
        want_total_sent = 0
        if step % 4 == 0:
            for r in range(4):
                local_leader = leaders[(int(step), node_of[r])]
                want_recv[r] += ELECTION_BYTES + (PARAM_BYTES if r != local_leader else 0)
            want_total_sent += 4 * ELECTION_BYTES + 2 * PARAM_BYTES    # 1 receiver per node
        if step % 8 == 0:
            g = leaders[(int(step), "global")]
            for r in range(4):
                want_recv[r] += ELECTION_BYTES + (PARAM_BYTES if r != g else 0)
            want_total_sent += 4 * ELECTION_BYTES + 3 * PARAM_BYTES    # 3 receivers
        assert np.array_equal(recv[:, i], want_recv), (int(step), recv[:, i], want_recv)
        assert sent[:, i].sum() == want_total_sent, (int(step), sent[:, i], want_total_sent)
        if step % 4 == 0:  # the leader itself sends the model at least once
            assert sent[leaders[(int(step), node_of[0])], i] >= ELECTION_BYTES + PARAM_BYTES
    assert {k[1] for k in leaders} == {"global", 0, 1} and len(steps) >= 40


@pytest.mark.mpi
def test_consensus_logged_on_the_same_steps_for_every_method(all_runs):
    # every --consensus-every (10) steps, for every method alike
    for alg in ALGS:
        c = all_runs[alg][0]["consensus"]
        assert list(c["step"]) == [s for s in all_runs[alg][0]["train"]["step"] if s % 10 == 0]


@pytest.mark.mpi
def test_allreduce_replicas_bit_identical(all_runs):
    import torch
    from lsgd_hpc.runtime.checkpoint import latest_checkpoint, load_rank
    # the final checkpoint holds each rank's model (parameters and buffers)
    run_dir = None
    for r in all_runs["allreduce"]:
        run_dir = json.loads(r["attrs"]["config"])["run_dir"]
    ptr = latest_checkpoint(run_dir)
    models = [load_rank(run_dir, ptr["step"], r)["objects"]["model"] for r in range(4)]
    assert all(torch.equal(models[0][k], m[k]) for m in models[1:] for k in models[0])
    losses = [r["eval"]["test_loss"][-1] for r in all_runs["allreduce"]]
    assert len(set(losses)) == 1


@pytest.mark.mpi
def test_lsgd_default_run_and_determinism(all_runs, tmp_path):
    """`python -m lsgd_hpc.train` as a user runs it; same seed and size -> same results."""
    run_dir = tmp_path / "lsgd"
    proc = run_mpi(4, [sys.executable, "-m", "lsgd_hpc.train", "--run-dir", str(run_dir),
                       "--ranks-per-node", "2", "--seed", "3"], timeout=300)
    assert "step" in proc.stdout and "leader" in proc.stdout and "ETA" in proc.stdout
    assert "\r" not in proc.stdout
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert cfg["algorithm"] == "lsgd" and cfg["world_size"] == 4 and cfg["n_nodes"] == 2
    # the run's completion record (RUN_DIR/complete.json): its budget, done
    record = json.loads((run_dir / "complete.json").read_text())
    assert record["status"] == "complete" and record["step"] == record["total_steps"] \
        == cfg["total_steps"], record
    assert (record["world_size"], record["initial_size"], record["lost_ranks"],
            record["requeued"], record["exit_status"]) == (4, 4, [], False, 0), record
    assert record["seconds"] > 0 and record["wall_time"].endswith("+00:00")
    assert not list(run_dir.glob("complete.json.tmp*"))
    again = read(run_dir, 4)
    for a, b in zip(all_runs["lsgd"], again):
        for g, cols in (("train", ("loss", "accuracy")), ("eval", ("test_loss", "test_accuracy")),
                        ("leader", ("leader_rank", "score")), ("consensus", ("distance",))):
            for c in cols:
                assert np.array_equal(a[g][c], b[g][c]), (g, c)


@pytest.mark.mpi
@pytest.mark.skipif(not __import__("mpi_util").horovod_available(),
                    reason="Horovod is not installed in this venv (make horovod)")
def test_horovod_backend_same_leaders_and_accuracies(all_runs, tmp_path):
    """--backend horovod, same seed, 4 ranks as 2 nodes: the same elections and results."""
    run_dir = tmp_path / "hvd"
    run_mpi(4, [sys.executable, "-m", "lsgd_hpc.train", "--backend", "horovod",
                "--run-dir", str(run_dir), "--ranks-per-node", "2", "--seed", "3"],
            timeout=400)
    hvd = read(run_dir, 4)
    for a, b in zip(all_runs["lsgd"], hvd):
        assert np.array_equal(a["leader"]["leader_rank"], b["leader"]["leader_rank"])
        assert np.array_equal(a["leader"]["step"], b["leader"]["step"])
        assert np.array_equal(a["eval"]["test_accuracy"], b["eval"]["test_accuracy"])
        assert np.allclose(a["train"]["loss"], b["train"]["loss"], rtol=1e-6, atol=1e-7)
        assert np.array_equal(a["train"]["comm_bytes_sent"], b["train"]["comm_bytes_sent"])


@pytest.mark.parametrize("script, ok, says", [
    ("exit 0", True, "scontrol requeue 7: ok"),
    ("echo 'Requested operation is presently disabled' >&2; exit 1", False,
     "scontrol requeue 7: Requested operation is presently disabled"),
    # the requeue's SIGTERM reached scontrol (it runs in the job's step) before it returned
    ("kill -TERM $$", True, "scontrol requeue 7: sent; SLURM ended this step (signal 15)"),
])
def test_requeue_reports_what_scontrol_did(tmp_path, monkeypatch, capsys, script, ok, says):
    from lsgd_hpc.cli import train as train_mod
    fake = tmp_path / "scontrol"
    fake.write_text(f"#!/bin/sh\n[ \"$1 $2\" = \"requeue 7\" ] || exit 9\n{script}\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    assert train_mod._requeue({"SLURM_JOB_ID": "7"}) is ok
    assert says in capsys.readouterr().out
    assert train_mod._requeue({}) is False          # not a SLURM job: nothing to requeue
