"""scripts/gpu_check.sh without a GPU: its argument errors and its --dry-run report.

The script itself is meant for a GPU machine (H200, 16 cores, no network); here only what it
does before it runs anything, and the report's shape, which a real run shares.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from mpi_util import REPO

SCRIPT = REPO / "scripts" / "gpu_check.sh"
sys.path.insert(0, str(REPO / "scripts"))
from gpu_check_report import RECORD_KEYS, REPORT_KEYS  # noqa: E402

METHODS = ("lsgd", "lsgd-async", "allreduce", "easgd", "local-sgd", "gossip")


def run(*args, env=None, cwd=REPO, timeout=120):
    e = dict(os.environ, LSGD_PYTHON=sys.executable, PYTHONPATH=str(REPO))
    e.pop("OUT", None)
    e.update(env or {})
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True,
                          env=e, cwd=cwd, timeout=timeout)


@pytest.mark.parametrize("args,needle", [
    (["--steps", "x"], "--steps x"),
    (["--steps", "0"], "--steps 0"),
    (["--timeout", "-5"], "--timeout -5"),
    (["--budget"], "--budget needs"),
    (["--out"], "--out needs"),
    (["--out", "/nonexistent/dir/r.json"], "does not exist"),
    (["--frobnicate"], "unknown argument --frobnicate"),
])
def test_argument_errors_exit_2_with_one_line(args, needle, tmp_path):
    p = run("--dry-run", *args, cwd=tmp_path, timeout=30)
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpu_check.sh: error:") and needle in lines[0]
    assert not list(tmp_path.iterdir()), "nothing is written on an argument error"


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_dry_run_report_shape(tmp_path):
    p = run("--dry-run", env={"OUT": str(tmp_path)}, cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    report = json.loads((tmp_path / "gpu_check.json").read_text())     # $OUT/gpu_check.json
    assert tuple(report) == REPORT_KEYS and report["status"] == "dry-run"
    runs = {r["name"]: r for r in report["runs"]}
    for r in report["runs"]:
        assert tuple(r) == RECORD_KEYS, r
        assert r["status"] in ("dry-run", "not available"), r
    backends = report["trainer"]["backends"]
    for m in METHODS:
        assert m in report["trainer"]["methods"]
        for np_ in (2, 4):
            for backend in ("torch", "mpi"):
                r = runs[f"train-{m}-np{np_}-{backend}"]
                if backend in backends:
                    assert r["status"] == "dry-run"
                    cmd = " ".join(r["command"])
                    assert f"-np {np_}" in cmd and f"--algorithm {m}" in cmd
                    assert "--device cuda" in cmd and f"--backend {backend}" in cmd
                else:
                    assert r["status"] == "not available"
        assert any(n.startswith(f"resnet20-{m}-np4-") for n in runs)
        assert any(n.startswith(f"bf16-{m}-np2-") for n in runs)
    assert {"facts", "ompi_cuda_support", "collectives-np2-cuda", "collectives-np4-cuda"} <= \
        set(runs)
    assert "--device cuda" in " ".join(runs["collectives-np4-cuda"]["command"])
    # torchft's NCCL groups: a worker killed, the survivor going on; the trainer's heal
    try:
        import torchft.manager  # noqa: F401
        have_torchft = True
    except ImportError:
        have_torchft = False
    for pg in ("baby-nccl", "nccl"):
        r = runs[f"torchft-{pg}-kill"]
        assert r["status"] == ("dry-run" if have_torchft else "not available"), r
        if have_torchft:
            cmd = " ".join(r["command"])
            assert "benchmarks/torch_ft_kill_check.py" in cmd and f"--pg {pg}" in cmd
            assert "--device cuda" in cmd and "--workers 2" in cmd
    trainer = runs["torchft-trainer-heal"]
    if have_torchft:
        assert "--trainer allreduce --heal" in " ".join(trainer["command"])
    # the commands are listed on stdout
    assert p.stdout.count("[dry-run] ") == sum(r["status"] == "dry-run" for r in runs.values())
    # --out wins over $OUT
    other = tmp_path / "other.json"
    assert run("--dry-run", "--out", str(other), env={"OUT": str(tmp_path / "x")}).returncode == 0
    assert json.loads(other.read_text())["status"] == "dry-run"
