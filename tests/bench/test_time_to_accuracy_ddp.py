"""time_to_accuracy.py's DDP method: torch DDP trains the allreduce run's configuration."""

from __future__ import annotations

import json
import sys

import pytest

from mpi_util import REPO, run_mpi

sys.path.insert(0, str(REPO / "benchmarks"))
import time_to_accuracy as tta  # noqa: E402

pytestmark = pytest.mark.slow


def test_ddp_run_matches_lsgd_hpc_allreduce_on_the_same_configuration(tmp_path, monkeypatch):
    """One job as the benchmark runs it (2 ranks, gloo on loopback): lsgd_hpc's allreduce
    SGD, then DDP on the same command line. Same data shards, initial model, learning rate,
    momentum and weight decay give the same test accuracy at every evaluation (up to
    floating-point summation order: two test images); DDP's file reads as any run's, with
    its evaluations left out of its training time."""
    def argv(name):
        return [*tta.common_options(12, 4), "--consensus-every", "0", "--algorithm",
                "allreduce", "--seed", "3", "--run-dir", str(tmp_path / name)]
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"argvs": [argv("allreduce"), {"ddp": argv("ddp")}],
                                "probe_out": str(tmp_path / "probe.json"),
                                "ranks_per_node": 1}))
    run_mpi(2, [sys.executable, str(REPO / "benchmarks" / "time_to_accuracy.py"), "--job",
                str(spec)], timeout=300, env={"GLOO_SOCKET_IFNAME": "lo"})
    monkeypatch.setattr(tta, "NP", 2)
    ours, ddp = tta.read_run(tmp_path / "allreduce", 2.0), tta.read_run(tmp_path / "ddp", 2.0)
    assert [p["step"] for p in ddp["curve"]] == [p["step"] for p in ours["curve"]] == [4, 8, 12]
    acc_ours = [p["accuracy"] for p in ours["curve"]]
    acc_ddp = [p["accuracy"] for p in ddp["curve"]]
    assert acc_ours[-1] > acc_ours[0] + 0.05          # it learns: the match is not trivial
    for a, b in zip(acc_ours, acc_ddp):
        assert abs(a - b) <= 2 / 360 + 1e-9, (acc_ours, acc_ddp)
    from lsgd_hpc.models.zoo import build_model, count_parameters
    n_params = count_parameters(build_model(tta.MODEL, 10, (1, 8, 8)))
    assert ddp["bytes_sent_per_step"] == 4 * n_params
    times = [p["time"] for p in ddp["curve"]]
    assert 0 < times[0] < times[1] < times[2]
    import h5py
    with h5py.File(tmp_path / "ddp" / "metrics" / "rank00000.h5", "r") as f:
        train = f["train"]
        assert train.attrs.get("algorithm") is None and f.attrs["algorithm"] == "ddp"
        assert train["eval_seconds"][-1] > 0
        # training time = wall time less the evaluations before that step
        gap = train["wall_time"][-1] - train["training_time"][-1]
        assert abs(gap - train["eval_seconds"][-1]) < 1e-9
