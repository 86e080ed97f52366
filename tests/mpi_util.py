"""Start real MPI jobs from the test suite: mpirun under a timeout, so a hang fails the test.

The helpers live in the package (lsgd_hpc/testing.py, which benchmarks/ and results/ use too);
the tests import them from here by their old names. Horovod's probe is the tests' own."""

from __future__ import annotations

import re
from pathlib import Path

from lsgd_hpc.testing import (kill_session, mpi_env, mpirun_cmd, mpirun_path, run_group,
                              run_mpi, session_pids)

__all__ = ["REPO", "mpirun_path", "mpi_env", "mpirun_cmd", "run_group", "session_pids",
           "kill_session", "run_mpi", "horovod_available", "fault_time"]

REPO = Path(__file__).resolve().parents[1]


def fault_time(stderr: str) -> float:
    """The wall time tests/parallel/train_driver.py printed as ``FAULT_AT <seconds>`` when it
    injected its fault. Read by pattern: mpirun forwards a rank's stderr in pieces, and its
    own abort banner may land on the same line, right after the number."""
    found = re.search(r"FAULT_AT (\d+\.\d{3})", stderr)
    assert found, "no FAULT_AT line in the job's stderr:\n" + stderr[-3000:]
    return float(found.group(1))


def horovod_available() -> bool:
    """True when ``horovod.torch`` imports; False only when Horovod is not installed.

    mpi4py is imported first, as the Horovod backend does (Horovod must initialise over the
    MPI that mpi4py set up). Any other failure -- a broken build, an import-order problem, a
    missing symbol -- is raised, so that it fails loudly instead of skipping the backend's tests.
    """
    from mpi4py import MPI  # noqa: F401
    try:
        import horovod.torch  # noqa: F401
    except ModuleNotFoundError as exc:
        if exc.name in ("horovod", "horovod.torch"):
            return False
        raise
    return True
