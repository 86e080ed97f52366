"""tests/mpi_util.py's horovod_available: False only when Horovod is absent; every other
failure surfaces. Each case runs in a fresh interpreter with a stand-in `horovod` package
first on the path, so the answer does not depend on whether this venv has Horovod."""

import subprocess
import sys

import pytest

from mpi_util import REPO, mpi_env

PROBE = ("import sys; sys.path.insert(0, sys.argv[1]); import mpi_util; "
         "print('AVAILABLE', mpi_util.horovod_available())")


def run_probe(site):
    return subprocess.run([sys.executable, "-c", PROBE, str(REPO / "tests")],
                          env=mpi_env({"PYTHONPATH": f"{site}:{REPO}"}), capture_output=True,
                          text=True, timeout=120)


def fake_horovod(tmp_path, torch_body):
    pkg = tmp_path / "horovod"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    if torch_body is not None:
        (pkg / "torch.py").write_text(torch_body)
    return tmp_path


def test_not_installed_is_false(tmp_path):
    # an empty folder first on the path: whether or not the venv has Horovod, hide it
    (tmp_path / "horovod.py").write_text("raise ModuleNotFoundError(\"No module named "
                                         "'horovod'\", name='horovod')\n")
    proc = run_probe(tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "AVAILABLE False" in proc.stdout


def test_package_without_torch_module_is_false(tmp_path):
    proc = run_probe(fake_horovod(tmp_path, None))
    assert "AVAILABLE False" in proc.stdout, proc.stderr


def test_mpi4py_is_imported_before_horovod(tmp_path):
    body = ("import sys\nif 'mpi4py.MPI' not in sys.modules:\n"
            "    raise RuntimeError('horovod.torch imported before mpi4py')\n")
    proc = run_probe(fake_horovod(tmp_path, body))
    assert proc.returncode == 0, proc.stderr
    assert "AVAILABLE True" in proc.stdout


@pytest.mark.parametrize("body,error", [
    ("raise ImportError('libhorovod.so: undefined symbol: _ZN5torch')\n", "undefined symbol"),
    ("raise RuntimeError('Horovod was built against another torch')\n", "another torch"),
    ("import a_module_horovod_needs\n", "a_module_horovod_needs"),
])
def test_broken_horovod_surfaces(tmp_path, body, error):
    proc = run_probe(fake_horovod(tmp_path, body))
    assert proc.returncode != 0 and "AVAILABLE" not in proc.stdout
    assert error in proc.stderr
