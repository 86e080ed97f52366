"""The MPI communicators this process created, freed before MPI_Finalize after a heal.

Open MPI 5's MPI_Finalize disconnects this process from every process of another job (a
spawned replacement, or the job that spawned this one) that shares a live communicator with
it. The disconnect is a collective of those processes: when one of them died after the
connection was made (a replacement whose job then lost another rank, a replacement that died
while joining), it waits for the dead one forever, and the job never ends. A healed job's
processes therefore free, at exit, every communicator they created (the worlds of every
generation, their node groups and duplicates, the spawn's and the merge's), so that
MPI_Finalize has no connection left to take down.

``track(comm)`` records a communicator as it is made; ``arm()`` (a spawn, a merge, a join)
makes the exit free them all. The exit hook is registered when this module is first imported
(by lsgd_hpc.comm.mpi, before any session registers its own exit barrier), so it runs after
every other exit function of the package (``atexit`` runs them last-registered first) and
before mpi4py's MPI_Finalize (a C-level exit function, after all of them).
"""

from __future__ import annotations

import atexit
from typing import List

_CREATED: List = []
#: the record's length at which freed communicators are dropped from it
_PRUNE_AT = 64
_ARMED = False


def track(comm):
    """Record ``comm`` (an mpi4py communicator; MPI_COMM_NULL is left out); returns it."""
    from mpi4py import MPI
    if comm is not None and comm != MPI.COMM_NULL:
        if len(_CREATED) >= _PRUNE_AT:
            # communicators freed since (a rebuilt graph, a disconnect) are COMM_NULL now:
            # dropped, so the record holds the live ones only, however long the run
            _CREATED[:] = [c for c in _CREATED if c != MPI.COMM_NULL]
        _CREATED.append(comm)
    return comm


def arm() -> None:
    """This process is connected to another job's processes: free everything at exit."""
    global _ARMED
    _ARMED = True


def free_all() -> int:
    """Free every tracked communicator, newest first (errors ignored: a revoked one, or
    one already freed); how many were freed."""
    from mpi4py import MPI
    if MPI.Is_finalized():
        return 0
    freed = 0
    while _CREATED:
        comm = _CREATED.pop()
        try:
            if comm != MPI.COMM_NULL:
                comm.Free()
                freed += 1
        except MPI.Exception:
            pass
    return freed


@atexit.register
def _at_exit() -> None:
    if _ARMED:
        free_all()
