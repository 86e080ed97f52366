"""benchmarks/_common.check_layout: a benchmark or experiment that claims a multi-node layout
or a link rate checks it on what its own run reported, and fails instead of writing figures.

`make bench` once wrote "1gbit"/"10gbit" figures measured over shared memory: every rank on
one node (node_of [0, 0, 0, 0]), the probe's "link" 20x faster than 1 Gbit/s; nothing said so.
"""

from __future__ import annotations

import json
import sys

import pytest

from mpi_util import REPO, mpi_env, mpirun_cmd, run_group

sys.path.insert(0, str(REPO / "benchmarks"))
from _common import LayoutError, check_layout, rate_bps  # noqa: E402


def probe(gbps: float) -> dict:
    """netprobe's result shape with the given bandwidth between nodes."""
    bps = gbps * 1e9 / 8
    link = {"pairs": [[0, 2]], "one_way_s": [3e-5, 6e-4, 2 ** 20 / bps], "latency_s": 3e-5,
            "bandwidth_Bps": bps, "alpha_s": 3e-5, "beta_s_per_byte": 1 / bps}
    return {"sizes": [8, 65536, 2 ** 20], "repeats": 10, "n_nodes": 2, "intra": dict(link),
            "inter": link}


def test_rate_bps():
    assert rate_bps("1gbit") == 1e9 and rate_bps("10gbit") == 1e10
    assert rate_bps("500mbit") == 5e8 and rate_bps("2gbps") == 1.6e10
    with pytest.raises(ValueError):
        rate_bps("fast")


@pytest.mark.parametrize("rate,measured", [("1gbit", 0.79), ("1gbit", 1.23), ("10gbit", 2.85),
                                           ("10gbit", 17.7)])
def test_good_layout_passes(rate, measured):
    """2 nodes x 2 ranks; bandwidths as measured on the emulated cluster (1.2x at 1 Gbit/s,
    0.3-0.8x at 10 Gbit/s on a loaded machine)."""
    out = check_layout("bench", [0, 0, 1, 1], 2, probe(measured), rate)
    assert out["nodes"] == 2 and out["ranks_per_node"] == [2, 2]
    assert out["measured_gbps"] == pytest.approx(measured)
    # the layout alone (no rate claimed)
    assert check_layout("bench", [0, 1, 0, 1], 2)["nodes"] == 2


def test_all_ranks_on_one_node_fails():
    with pytest.raises(LayoutError, match=r"bench: the ranks ran on 1 node\(s\).*not the 2"):
        check_layout("bench", [0, 0, 0, 0], 2, probe(1.2), "1gbit")
    with pytest.raises(LayoutError):
        check_layout("bench", [], 2)
    with pytest.raises(LayoutError, match="3 node"):
        check_layout("bench", [0, 1, 2, 2], 2)


@pytest.mark.parametrize("rate,measured", [("1gbit", 20.0), ("1gbit", 13.5), ("10gbit", 108.0),
                                           ("10gbit", 1.0)])
def test_bandwidth_far_from_the_claimed_rate_fails(rate, measured):
    """Shared memory read as a link (20-100x a 1 Gbit/s rate), or a 1 Gbit/s limit on a run
    claimed at 10 Gbit/s."""
    with pytest.raises(LayoutError, match=r"measured .* Gbit/s between nodes, .*x the claimed"):
        check_layout("bench", [0, 0, 1, 1], 2, probe(measured), rate)


def test_no_inter_node_probe_fails():
    single = {**probe(1.0), "n_nodes": 1, "inter": None}
    with pytest.raises(LayoutError, match="no bandwidth between nodes"):
        check_layout("bench", [0, 0, 1, 1], 2, single, "1gbit")
    with pytest.raises(LayoutError, match="no bandwidth between nodes"):
        check_layout("bench", [0, 0, 1, 1], 2, None, "1gbit")


@pytest.mark.mpi
@pytest.mark.timeout(180)
def test_time_to_accuracy_job_refuses_to_train(tmp_path):
    """time_to_accuracy's MPI job (also scale_model's) run where the claimed cluster is not
    (one machine, so one node by host name): it checks before training, writes the error
    beside the probe and exits non-zero. (The bandwidth side is left to the unit tests:
    shared memory between two oversubscribed ranks on a loaded machine reads anything.)"""
    ranks_per_node, needle = None, "ran on 1 node(s)"
    run_dir = tmp_path / "run"
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({
        "argvs": [["--dataset", "digits", "--max-steps", "2", "--run-dir", str(run_dir)]],
        "probe_out": str(tmp_path / "probe.json"), "ranks_per_node": ranks_per_node,
        "expect": {"what": "time_to_accuracy 1gbit", "nodes": 2, "rate": "1gbit"}}))
    cmd = mpirun_cmd(2, [sys.executable, str(REPO / "benchmarks" / "time_to_accuracy.py"),
                         "--job", str(spec)])
    p = run_group(cmd, env=mpi_env(), cwd=REPO, timeout=150)
    assert p.returncode not in (0, None), p.stdout + p.stderr
    got = json.loads((tmp_path / "probe.json").read_text())
    assert needle in (got["layout_error"] or ""), got
    assert needle in p.stderr
    assert not run_dir.exists(), "it trained anyway"


def test_latency_bound_probe_reads_the_fit():
    """Shared memory on a loaded machine: 6 ms per message whatever its size, so size/time
    says 1.1 Gbit/s; the fit's 1/beta says 5.8 and the check refuses it."""
    p = probe(1.0)
    p["inter"].update(bandwidth_Bps=140759698.0, beta_s_per_byte=1.388e-09,
                      one_way_s=[0.006, 0.00608, 0.00745])
    with pytest.raises(LayoutError, match="5.76 Gbit/s"):
        check_layout("bench", [0, 0, 1, 1], 2, p, "1gbit")


def test_torch_vs_ddp_is_checked_like_the_other_network_benchmarks(monkeypatch):
    """make bench's torch_vs_ddp (lsgd_hpc --backend torch against DDP, both gloo) runs on the
    emulated 1 Gbit/s cluster and, like peers_network, probes the layout before anything is
    timed: a wrong layout fails it without figures (nothing is launched)."""
    import peers
    import run_all
    bench = {b.key: b for b in run_all.BENCHES}["torch_vs_ddp"]
    assert bench.module == "peers" and bench.driver
    assert bench.kwargs["network"] == "1gbit" and bench.kwargs["torch_backend"]
    assert peers.TORCH_METHODS == ["lsgd_hpc_torch", "ddp"]

    class FakeCluster:
        mpirun_args: list = []

        def __init__(self, rate, log):
            pass

        def missing(self):
            return None

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return None

    def no_launch(*args, **kwargs):
        raise AssertionError("launched a timed job despite the layout error")

    monkeypatch.setattr(peers, "Cluster", FakeCluster)
    monkeypatch.setattr(peers, "_check_cluster",
                        lambda *a, **k: "peers 1gbit: ran on 1 node(s), expected 2")
    monkeypatch.setattr(peers, "_launch", no_launch)
    res = peers.run(log=lambda m: None, **bench.kwargs)
    assert res["status"].startswith("failed: layout check") and res["ratio"] is None, res
    assert "ran on 1 node(s)" in res["rows"][0]["figures"]
    assert "--backend torch" in res["rows"][0]["compared"]
