"""`python -m lsgd_hpc.data fetch cifar10`, as a user on a compute node without internet
meets it: the download cannot connect (every proxy variable points at a closed local port, so
the test never reaches the network), and the command says so in one line and exits 1,
leaving nothing that passes for a staged data set. The successful download needs internet
and the real archive (its md5 is checked), which this test suite does not have."""

import subprocess
import sys

import pytest

from mpi_util import REPO, mpi_env

CLOSED = "http://127.0.0.1:9"   # the discard port; nothing listens on it


def data_cli(*args, env=None):
    e = mpi_env(env)
    return subprocess.run([sys.executable, "-m", "lsgd_hpc.data", *args], capture_output=True,
                          text=True, env=e, cwd=REPO, timeout=300)


@pytest.mark.slow
def test_fetch_without_network_is_one_line_exit_1(tmp_path):
    root = tmp_path / "cifar"
    proxies = {k: CLOSED for k in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY")}
    proxies.update(no_proxy="", NO_PROXY="")
    proc = data_cli("fetch", "cifar10", "--root", str(root), env=proxies)
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert lines[0].startswith(f"lsgd_hpc.data: error: downloading CIFAR-10 into {root} failed")
    assert "fetch needs internet: run it on a login node" in lines[0]
    # nothing half-staged: the check refuses the folder and says how to stage it
    assert not (root / "cifar-10-batches-py").exists()
    check = data_cli("check", "cifar10", "--root", str(root))
    assert check.returncode == 2 and "lsgd_hpc.data fetch cifar10 --root" in check.stderr


def test_fetch_into_a_root_that_cannot_be_made_exit_2(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    proc = data_cli("fetch", "cifar10", "--root", str(blocker / "cifar"))
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"lsgd_hpc.data: error: cannot create --root {blocker / 'cifar'}: Not a directory"]
