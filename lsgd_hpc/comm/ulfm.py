"""How the MPI library's fault tolerance (ULFM) is detected, prepared and driven.

:func:`ulfm_problem` says why ``on_failure="shrink"`` cannot work in this process (no ULFM,
an mpi4py without Revoke/Shrink/Agree, a backend that cannot shrink);
:func:`prepare_mpi_environment` sets what a fault-tolerant run needs before MPI starts
(FINALIZE_ENV); :func:`settle_failures` lets the notices of a failure settle before the
survivors shrink (the quiet period: :func:`settle_seconds`, ``$LSGD_HPC_FT_SETTLE_SECONDS``).

The recovery protocol that uses them is lsgd_hpc/comm/faults.py.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Optional

from lsgd_hpc.envvars import FT_SETTLE_SECONDS, ULFM

__all__ = ["ulfm_problem", "ULFM_ENV", "FINALIZE_ENV", "prepare_mpi_environment",
           "settle_failures", "settle_seconds", "SETTLE_ENV", "RECOVERABLE_SPAWNS"]

#: Open MPI 5's mpirun options that make the jobs a heal spawns (its replacements) recoverable
#: as ``--with-ft ulfm`` makes the first one: without them the runtime ends every process a
#: spawn started when one of them dies (replacements that joined die with it), and mpirun
#: exits with the dead process's status even when the job completes. The trainer's
#: documented heal command line and slurm/lsgd_cifar.sbatch pass them.
RECOVERABLE_SPAWNS = ("--prtemca", "state_base_recoverable", "1")

#: set to 1 to assert that an MPI other than Open MPI has ULFM active (MPICH:
#: ``mpiexec -disable-auto-cleanup``); Open MPI is checked by its own setting
ULFM_ENV = ULFM.name


# -- is fault tolerance there? ---------------------------------------------------------------
def ulfm_problem(backend: str) -> Optional[str]:
    """Why ``on_failure="shrink"`` cannot work in this process (one line), or None."""
    if backend == "horovod":
        return ("on_failure='shrink' is not supported with backend='horovod' (Horovod cannot "
                "shrink its world); use backend='mpi' under mpirun --with-ft ulfm")
    if backend == "torch":                # (the torch backend shrinks with torchft instead)
        return ("on_failure='shrink' with backend='torch' runs over torchft, not ULFM "
                "(lsgd_hpc/comm/replicas.py)")
    from mpi4py import MPI
    if not all(hasattr(MPI.Comm, n) for n in ("Revoke", "Shrink", "Agree")):
        return ("on_failure='shrink' needs mpi4py >= 4 (Comm.Revoke/Shrink/Agree); this "
                f"mpi4py is {getattr(sys.modules.get('mpi4py'), '__version__', '?')}")
    if ULFM.read():
        return None
    lib = MPI.Get_library_version()
    if "Open MPI" in lib:
        if os.environ.get("OMPI_MCA_mpi_ft_enable", "").strip().lower() in ("1", "true", "yes",
                                                                             "on", "enabled"):
            return None
        return ("on_failure='shrink' needs a fault-tolerant MPI, and this Open MPI runs without "
                "ULFM: start the job with mpirun --with-ft ulfm")
    first = lib.replace("\x00", "").strip().splitlines()[0] if lib.strip() else "this MPI"
    return (f"on_failure='shrink' needs ULFM, and {first} is not known to have it active; "
            f"with Open MPI start the job with mpirun --with-ft ulfm (another MPI with ULFM "
            f"enabled: set {ULFM_ENV}=1)")


#: Open MPI: MPI_Finalize's PMIx fence can wait forever once ranks have died (seen here about
#: once in three runs that lost a whole node); the library's own fault-tolerant barrier at
#: exit (FaultTolerance.final_barrier) takes its place. Read at MPI_Init.
FINALIZE_ENV = {"OMPI_MCA_async_mpi_finalize": "1"}


def prepare_mpi_environment() -> bool:
    """Before MPI starts (mpi4py.MPI not imported yet): the settings a fault-tolerant run
    needs (FINALIZE_ENV), unless set already. False when MPI was already started, too late
    (then set them in the job's environment: ``mpirun -x OMPI_MCA_async_mpi_finalize=1``)."""
    if "mpi4py.MPI" in sys.modules:
        return all(os.environ.get(k) == v for k, v in FINALIZE_ENV.items())
    for k, v in FINALIZE_ENV.items():
        os.environ.setdefault(k, v)
    return True


#: seconds of quiet (no new failure noticed) that a recovery waits for before it shrinks;
#: the environment variable overrides the default (0 turns the wait off)
SETTLE_ENV = FT_SETTLE_SECONDS.name
#: the longest a recovery waits for failure notices to settle (ranks that keep dying)
SETTLE_LIMIT_SECONDS = 10.0


def settle_seconds() -> float:
    """The quiet period of :func:`settle_failures`: ``$LSGD_HPC_FT_SETTLE_SECONDS`` or 0.5."""
    return FT_SETTLE_SECONDS.read()


def _failed_count(comm) -> int:
    try:
        group = comm.Get_failed()
        n = group.Get_size()
        group.Free()
        return n
    except Exception:                                               # noqa: BLE001
        return -1


def settle_failures(comm, quiet: float, limit: float = SETTLE_LIMIT_SECONDS) -> int:
    """Let failure knowledge settle on the revoked ``comm`` before a communicator is built.

    Open MPI 5.0's ULFM marks every communicator that holds a newly failed process as failed
    (``ompi_comm_set_rank_failed`` -> ``ompi_comm_revoke_local``) from inside the progress
    engine; when that happens while ``MPI_Comm_shrink`` activates its new communicator, whose
    collective modules are not selected yet, the rank crashes (SIGSEGV at address 0x450).
    A node that goes down dies process by process, and on a busy node the notices of those
    deaths reach a survivor over hundreds of milliseconds: a survivor that shrinks at the
    first notice builds its communicator while the others arrive. So: drive the progress
    engine until this rank has noticed no new failed member of ``comm`` for ``quiet``
    seconds (at most ``limit``), acknowledge the failures, then meet the other survivors in
    one fault-tolerant agreement (what one survivor saw dead, the agreement makes known to
    all) before the shrink. Every survivor runs the same calls whatever it saw, so no
    survivor is left in a different collective. Returns the failed members seen."""
    MPI = _mpi()
    if quiet <= 0:
        return _failed_count(comm)
    t0 = time.monotonic()
    seen, since = _failed_count(comm), t0
    while time.monotonic() - since < quiet and time.monotonic() - t0 < limit:
        try:
            MPI.COMM_SELF.Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG)   # runs the progress engine
        except MPI.Exception:
            pass
        time.sleep(0.005)
        now = _failed_count(comm)
        if now != seen:
            seen, since = now, time.monotonic()
    for call in (comm.Ack_failed, lambda: comm.Agree(1)):
        try:
            call()
        except MPI.Exception:                # a new failure: the shrink's agreement sees it
            pass
    return seen


def _mpi():
    from mpi4py import MPI
    return MPI
