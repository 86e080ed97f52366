"""The communication-interface and update-rule tests, for real under mpirun, on each backend.

tests/parallel/*.py hold test bodies that hold at any world size; each case here starts
them under one `mpirun -np N` (ranks grouped K per node), under a timeout so that a hang
fails instead of stalling the suite. The same bodies run at size 1 in the plain pytest run.
"""

import sys

import pytest

from mpi_util import REPO, horovod_available, run_mpi

BACKENDS = ["mpi", pytest.param("horovod", marks=pytest.mark.skipif(
    not horovod_available(), reason="Horovod is not installed in this venv (make horovod)")),
    "torch"]
FILES = [str(REPO / "tests" / "parallel" / f) for f in
         ("test_comm_parallel.py", "test_algorithms_parallel.py", "test_netprobe_parallel.py",
          "test_overlap_parallel.py")]


@pytest.mark.mpi
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("np_,rpn", [(2, 1), (4, 2), (5, 2)])
def test_parallel_bodies_under_mpirun(np_, rpn, backend):
    proc = run_mpi(np_, [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                         *FILES],
                   timeout=300, env={"LSGD_TEST_RPN": str(rpn), "LSGD_TEST_BACKEND": backend})
    # every rank's pytest reports its own pass line, and nothing failed
    assert proc.stdout.count(" passed") >= np_, proc.stdout[-3000:]
    assert " failed" not in proc.stdout
