"""benchmarks/compressed_allreduce.py runs as run_all runs it (its own mpirun job of 4 ranks as
2 nodes) on a tiny budget and writes its keys: per variant the steps to the target, the bytes
per step between the nodes and the priced time; the ratios to fp32 and their targets."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from mpi_util import REPO, mpi_env

sys.path.insert(0, str(REPO / "benchmarks"))
import compressed_allreduce as bench  # noqa: E402


@pytest.mark.mpi
@pytest.mark.timeout(300)
def test_quick_run_writes_its_keys(tmp_path):
    out = tmp_path / "out.json"
    p = subprocess.run([sys.executable, str(REPO / "benchmarks" / "compressed_allreduce.py"),
                        "--out", str(out), "--quick", "--steps", "10", "--model", "digits_cnn"],
                       cwd=REPO, env=mpi_env(), capture_output=True, text=True, timeout=280)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    res = json.loads(out.read_text())
    assert res["status"] == "ok" and res["seeds"] == [0] and res["max_steps"] == 10
    assert set(res["variants"]) == {label for label, _ in bench.VARIANTS}
    fp32 = res["variants"]["fp32"]
    for label, v in res["variants"].items():
        (r,) = v["runs"]
        assert r["node_of"] == [0, 0, 1, 1], r            # 4 ranks as 2 nodes
        assert v["bytes_per_step"] > 0 and v["priced_s_per_step"] > r["seconds_per_step"]
        assert 0 <= v["final_accuracy"] <= 1
    # the bytes between the nodes: int8 a quarter of fp32's plus the scales (and rank 0's
    # float32 broadcast of the BatchNorm statistics); top-k 1 % far less
    ratios = res["ratios"]
    assert 0.24 < ratios["int8 + EF"]["bytes"] < 0.3, ratios
    assert ratios["top-k 1 % int2 + EF"]["bytes"] < 0.05, ratios
    assert res["ratio"] == ratios["int8 + EF"]["bytes"] and res["target"] == "<= 0.3"
    assert set(res["extra_targets"]) == {f"compressed_allreduce_{k}_{m}" for k in ("int8", "topk")
                                        for m in ("bytes", "steps")}
    assert [r["label"] for r in res["rows"]] == [f"compressed_allreduce {label}"
                                                 for label, _ in bench.VARIANTS]
    assert fp32["bytes_per_step"] > fp32["bytes_per_step_all_ranks"] / 4 - 1


def test_registered_in_run_all():
    import run_all
    (b,) = [b for b in run_all.BENCHES if b.key == "compressed_allreduce"]
    assert b.driver and b.module == "compressed_allreduce"
