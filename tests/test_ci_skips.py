"""The skip policy of tests/conftest.py: a cluster, netns or horovod test may skip (naming what
is missing) in a developer's `make test`, but with CI=true that skip is a failure."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent

SAMPLE = '''
import pytest

@pytest.mark.cluster
def test_needs_cluster():
    pytest.skip("not root: the emulated cluster needs root")

@pytest.mark.netns
def test_needs_namespaces():
    pytest.skip("no unshare on PATH")

def test_horovod_backend():          # marked by name
    pytest.skip("Horovod not installed")

def test_plain_skip():
    pytest.skip("an ordinary skip")

def test_passes():
    assert True
'''


def _run(tmp_path: Path, ci: str) -> subprocess.CompletedProcess:
    shutil.copy(HERE / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_sample.py").write_text(SAMPLE)
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    cluster: x\n    netns: x\n"
                                        "    horovod: x\n")
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    if ci:
        env["CI"] = ci
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-rfs", "-p",
                           "no:cacheprovider", str(tmp_path)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("ci", ["", "true"])
def test_required_skips_fail_under_ci(tmp_path, ci):
    proc = _run(tmp_path, ci)
    out = proc.stdout
    if not ci:
        assert proc.returncode == 0, out
        assert "1 passed, 4 skipped" in out, out
        return
    assert proc.returncode == 1, out
    assert "3 failed, 1 passed, 1 skipped" in out, out
    for name, marker, reason in [
            ("test_needs_cluster", "cluster", "the emulated cluster needs root"),
            ("test_needs_namespaces", "netns", "no unshare on PATH"),
            ("test_horovod_backend", "horovod", "Horovod not installed")]:
        (line,) = [l for l in out.splitlines() if l.startswith(f"FAILED test_sample.py::{name}")]
        assert f"CI=true: a {marker} test must run in CI, but it skipped" in line, line
        assert reason in line, line
    assert "an ordinary skip" in out                 # still a skip
