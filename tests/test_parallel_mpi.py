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
          "test_overlap_parallel.py", "test_library_parallel.py", "test_streaming_parallel.py",
          "test_workers_parallel.py", "test_quantized_parallel.py")]


def _layout(np_, rpn, backend, *marks):
    name, backend_marks = (backend, ()) if isinstance(backend, str) else \
        (backend.values[0], backend.marks)
    return pytest.param(np_, rpn, name, marks=[*marks, *backend_marks],
                        id=f"{np_}-{rpn}-{name}")


#: 2 ranks (the fast set) and 5 ranks as nodes of 2, 2 and 1 on every backend; 4 ranks as two
#: even nodes on MPI only: the uneven layout is the one that finds a backend's group bugs.
LAYOUTS = [_layout(2, 1, b, pytest.mark.fast) for b in BACKENDS] + [_layout(4, 2, "mpi")] + \
    [_layout(5, 2, b) for b in BACKENDS]


@pytest.mark.mpi
@pytest.mark.parametrize("np_,rpn,backend", LAYOUTS)
def test_parallel_bodies_under_mpirun(np_, rpn, backend):
    proc = run_mpi(np_, [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                         *FILES],
                   timeout=300, env={"LSGD_TEST_RPN": str(rpn), "LSGD_TEST_BACKEND": backend})
    # every rank's pytest reports its own pass line, and nothing failed
    assert proc.stdout.count(" passed") >= np_, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert " failed" not in proc.stdout


@pytest.mark.mpi
@pytest.mark.fast
def test_one_rank_failure_ends_the_job_with_its_message():
    """A body failing on one rank ends the whole job at once (tests/parallel/conftest.py),
    with that rank's assertion, instead of the other ranks hanging in the next body."""
    import time
    t0 = time.monotonic()
    proc = run_mpi(2, [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                       str(REPO / "tests" / "parallel" / "failing_body.py")], timeout=120,
                   check=False)
    elapsed = time.monotonic() - t0
    assert proc.returncode not in (0, None), proc.stdout[-2000:]
    assert "deliberate failure on the last rank" in proc.stderr, proc.stderr[-3000:]
    assert elapsed < 60, f"the job took {elapsed:.0f} s to end"
