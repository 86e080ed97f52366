"""The communication-interface and update-rule tests, for real under mpirun, on each backend.

tests/parallel/*.py hold test bodies that hold at any world size; the cases of a layout share
one `mpirun -np N` job (ranks grouped K per node) that runs them on each of its backends in
turn, under a timeout so that a hang fails instead of stalling the suite. The same bodies
run at size 1 in the plain pytest run.
"""

import fcntl
import json
import os
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


#: 2 ranks and 5 ranks as nodes of 2, 2 and 1 on every backend; 4 ranks as two even nodes on
#: MPI only: the uneven layout is the one that finds a backend's group bugs. The fast set is
#: 2 ranks on mpi and torch (make test's 2-rank job runs Horovod's bodies too, in the same job).
LAYOUTS = [_layout(2, 1, b, *([] if b is BACKENDS[1] else [pytest.mark.fast]))
           for b in BACKENDS] + [_layout(4, 2, "mpi")] + [_layout(5, 2, b) for b in BACKENDS]


#: One job per layout runs the bodies for each of its backends in turn (a rank's python, torch
#: and MPI start-up costs seconds; the suite's time): pytest on FILES once per backend, in
#: the same ranks; each rank writes, per backend, its pytest exit status and how many bodies
#: passed and failed. A failure on one rank still ends the whole job at once
#: (tests/parallel/conftest.py).
RUNNER = """
import json, os, sys
import pytest
from lsgd_hpc.comm.launcher import env_rank
out, backends, files = sys.argv[1], sys.argv[2].split(","), sys.argv[3:]


class Count:
    def __init__(self):
        self.passed = self.failed = 0

    def pytest_runtest_logreport(self, report):
        self.passed += report.passed and report.when == "call"
        self.failed += report.failed


here = os.path.dirname(os.path.abspath(files[0]))
for backend in backends:
    os.environ["LSGD_TEST_BACKEND"] = backend
    # the bodies read the backend at import (module constants such as BACKEND): each
    # backend's pytest imports them afresh
    for name, mod in list(sys.modules.items()):
        if os.path.dirname(os.path.abspath(getattr(mod, "__file__", None) or "/")) == here:
            del sys.modules[name]
    count = Count()
    status = int(pytest.main(["-q", "-x", "-p", "no:cacheprovider", *files], plugins=[count]))
    with open(os.path.join(out, f"{backend}.rank{env_rank()}.json"), "w") as f:
        json.dump({"status": status, "passed": count.passed, "failed": count.failed}, f)
    if status != 0:
        sys.exit(status)
"""


def _selected_backends(session, np_, rpn) -> list:
    """The backends of layout (np_, rpn) this session runs (Horovod only where installed)."""
    names = []
    for item in session.items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if getattr(item, "originalname", None) == "test_parallel_bodies_under_mpirun" and \
                (params.get("np_"), params.get("rpn")) == (np_, rpn) and \
                params["backend"] not in names:
            names.append(params["backend"])
    return [b for b in names if b != "horovod" or horovod_available()]


@pytest.fixture(scope="module")
def layout_jobs(request, tmp_path_factory):
    """The job of a layout, started by its first test: (its folder, the job's returncode,
    stdout and stderr). Once a session, whichever pytest-xdist worker asks first (a lock
    in the session's temporary folder; make test-fast spreads these tests over workers)."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent                      # the folder the workers share
    jobs = {}

    def job(np_, rpn):
        if (np_, rpn) not in jobs:
            out = root / f"parallel-bodies-{np_}-{rpn}"
            with open(root / f"parallel-bodies-{np_}-{rpn}.lock", "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                done = out / "job.json"
                if not done.exists():
                    out.mkdir(exist_ok=True)
                    backends = _selected_backends(request.session, np_, rpn)
                    proc = run_mpi(np_, [sys.executable, "-c", RUNNER, str(out),
                                         ",".join(backends), *FILES],
                                   timeout=60 + 240 * len(backends),
                                   env={"LSGD_TEST_RPN": str(rpn)}, check=False)
                    done.write_text(json.dumps({"returncode": proc.returncode,
                                                "stdout": proc.stdout, "stderr": proc.stderr}))
            jobs[(np_, rpn)] = (out, json.loads(done.read_text()))
        return jobs[(np_, rpn)]
    return job


@pytest.mark.mpi
@pytest.mark.parametrize("np_,rpn,backend", LAYOUTS)
def test_parallel_bodies_under_mpirun(np_, rpn, backend, layout_jobs):
    out, proc = layout_jobs(np_, rpn)
    log = proc["stdout"][-3000:] + proc["stderr"][-3000:]
    # every rank's pytest ran the bodies on this backend, and nothing failed
    for rank in range(np_):
        result = out / f"{backend}.rank{rank}.json"
        assert result.exists(), (f"rank {rank} did not finish the {backend} bodies (exit "
                                 f"{proc['returncode']})\n{log}")
        got = json.loads(result.read_text())
        assert got["status"] == 0 and got["failed"] == 0 and got["passed"] > 0, \
            (rank, got, log)
    assert " failed" not in proc["stdout"]


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
