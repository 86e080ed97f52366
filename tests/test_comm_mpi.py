"""Run the communication-interface tests for real under mpirun, on each backend."""

import pytest

from mpi_util import REPO, horovod_available, run_mpi

BACKENDS = ["mpi", pytest.param("horovod", marks=pytest.mark.skipif(
    not horovod_available(), reason="Horovod is not installed in this venv (make horovod)"))]


@pytest.mark.mpi
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("np_", [2, 4, 5])
def test_comm_interface_under_mpirun(np_, backend):
    import sys
    proc = run_mpi(np_, [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                         str(REPO / "tests" / "parallel" / "test_comm_parallel.py")],
                   timeout=240, env={"LSGD_TEST_BACKEND": backend})
    # every rank's pytest reports its own pass line
    assert proc.stdout.count(" passed") >= np_, proc.stdout[-3000:]
