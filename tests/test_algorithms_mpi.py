"""The update-rule tests under mpirun, with ranks grouped into nodes, on each backend."""

import sys

import pytest

from mpi_util import REPO, horovod_available, run_mpi

BACKENDS = ["mpi", pytest.param("horovod", marks=pytest.mark.skipif(
    not horovod_available(), reason="Horovod is not installed in this venv (make horovod)"))]


@pytest.mark.mpi
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("np_,rpn", [(2, 1), (4, 2), (5, 2)])
def test_update_rules_under_mpirun(np_, rpn, backend):
    proc = run_mpi(np_, [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                         str(REPO / "tests" / "parallel" / "test_algorithms_parallel.py")],
                   timeout=240, env={"LSGD_TEST_RPN": str(rpn), "LSGD_TEST_BACKEND": backend})
    assert proc.stdout.count(" passed") >= np_, proc.stdout[-3000:]
