"""End-to-end training under mpirun: accuracy, HDF5 schema, elections, bytes, determinism."""

import json
import math
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
import yaml

from mpi_util import REPO, run_mpi

DRIVER = str(REPO / "tests" / "parallel" / "train_driver.py")
ALGS = ["lsgd", "allreduce", "easgd", "local-sgd", "gossip"]
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


def model_bytes() -> int:
    from lsgd_hpc.comm import FlatParams
    from lsgd_hpc.models import build_model
    return FlatParams(build_model("digits_cnn", 10, (1, 8, 8))).nbytes


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


@pytest.mark.mpi
def test_bytes_per_step_match_each_method(all_runs):
    nbytes = model_bytes()

    def sent_per_step(alg, rank):
        t = all_runs[alg][rank]["train"]
        return np.diff(np.concatenate([[0], t["comm_bytes_sent"]])), t["step"]

    # allreduce: the fused gradient (params only) every step, on every rank
    d, steps = sent_per_step("allreduce", 1)
    grads = d[0]
    assert grads > 0 and np.all(d == grads)
    # local SGD, T = 8: the whole model once per period, nothing in between
    d, steps = sent_per_step("local-sgd", 2)
    assert np.all(d[steps % 8 != 0] == 0) and np.all(d[steps % 8 == 0] == nbytes)
    # gossip on a ring of 4: the model to each of 2 neighbours every step
    d, _ = sent_per_step("gossip", 3)
    assert np.all(d == 2 * nbytes)
    # LSGD: traffic only on multiples of tau_local = 4 (local) and 8 (global)
    d, steps = sent_per_step("lsgd", 1)
    assert np.all(d[steps % 4 != 0] == 0) and np.any(d[steps % 4 == 0] > 0)
    # EASGD (tau = tau_local = 4): one model-sized allreduce per round
    d, steps = sent_per_step("easgd", 0)
    assert np.all(d[steps % 4 != 0] == 0) and np.all(d[steps % 4 == 0] == nbytes)
    # the consensus distance is logged at every averaging round
    c = all_runs["local-sgd"][0]["consensus"]
    assert list(c["step"]) == [s for s in all_runs["local-sgd"][0]["train"]["step"] if s % 8 == 0]


@pytest.mark.mpi
def test_allreduce_replicas_bit_identical(all_runs):
    import torch
    from lsgd_hpc.checkpoint import latest_checkpoint, load_rank
    # the final checkpoint holds each rank's flat parameters
    run_dir = None
    for r in all_runs["allreduce"]:
        run_dir = json.loads(r["attrs"]["config"])["run_dir"]
    ptr = latest_checkpoint(run_dir)
    flats = [load_rank(run_dir, ptr["step"], r)["flat"] for r in range(4)]
    assert all(torch.equal(flats[0], f) for f in flats[1:])
    losses = [r["eval"]["test_loss"][-1] for r in all_runs["allreduce"]]
    assert len(set(losses)) == 1


@pytest.mark.mpi
def test_lsgd_default_run_and_determinism(all_runs, tmp_path):
    """`python -m lsgd_hpc.train` as a user runs it; same seed and size -> same results."""
    run_dir = tmp_path / "lsgd"
    proc = run_mpi(4, [sys.executable, "-m", "lsgd_hpc.train", "--run-dir", str(run_dir),
                       "--ranks-per-node", "2", "--local-steps", "8", "--seed", "3"],
                   timeout=300)
    assert "step" in proc.stdout and "leader" in proc.stdout and "ETA" in proc.stdout
    assert "\r" not in proc.stdout
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert cfg["algorithm"] == "lsgd" and cfg["world_size"] == 4 and cfg["n_nodes"] == 2
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
                "--run-dir", str(run_dir), "--ranks-per-node", "2", "--local-steps", "8",
                "--seed", "3"], timeout=400)
    hvd = read(run_dir, 4)
    for a, b in zip(all_runs["lsgd"], hvd):
        assert np.array_equal(a["leader"]["leader_rank"], b["leader"]["leader_rank"])
        assert np.array_equal(a["leader"]["step"], b["leader"]["step"])
        assert np.array_equal(a["eval"]["test_accuracy"], b["eval"]["test_accuracy"])
        assert np.allclose(a["train"]["loss"], b["train"]["loss"], rtol=1e-6, atol=1e-7)
        assert np.array_equal(a["train"]["comm_bytes_sent"], b["train"]["comm_bytes_sent"])
