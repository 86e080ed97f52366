"""What a rank failure is and how it is recognised: the errors of a job that lost ranks
(:class:`ProcessFailure`, :class:`UnrecoverableFailure`), the record of one recovery
(:class:`FailureEvent`), and the test that tells an mpi4py error of a dead rank or a revoked
communicator from any other (:func:`mpi_failure`, :func:`is_process_failure`).

The recovery itself is lsgd_hpc/comm/faults.py; ULFM's set-up, lsgd_hpc/comm/ulfm.py.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional, Tuple

__all__ = ["ProcessFailure", "UnrecoverableFailure", "FailureEvent", "is_process_failure",
           "EXIT_UNRECOVERABLE"]

#: exit status suggested for a job that ended with UnrecoverableFailure
EXIT_UNRECOVERABLE = 3


class ProcessFailure(RuntimeError):
    """A collective failed because a rank of the job died (or because a survivor revoked the
    communicator after such a failure). With ``on_failure="shrink"`` the methods and the
    ``Comm`` helpers recover from it themselves; a collective of your own on ``comm.world``
    raises it: call ``comm.recover()`` (every survivor does) and retry."""

    def __init__(self, message: str, error_class: int = 0):
        super().__init__(message)
        self.error_class = error_class


class UnrecoverableFailure(RuntimeError):
    """``on_failure="shrink"`` could not go on: fewer than ``min_ranks`` ranks left, or the
    recovery itself failed. Raised on every survivor; uncaught (with the session's
    ``abort_on_exception``), each survivor prints its one line and exits with
    EXIT_UNRECOVERABLE (3); catch it to end otherwise."""


@dataclass(frozen=True)
class FailureEvent:
    """One recovery, as every survivor saw it (the same values on every survivor but ``rank``).

    ``lost_ranks``: the ranks lost, numbered as at the start of the job (initial world
    ranks); ``lost_now``: all ranks lost so far; ``world_size_before``/``after``;
    ``step``: the step count of the methods after the recovery (the last method's; -1
    without a method); ``recovery_seconds``: from noticing to restored, on this rank;
    ``rank``: this rank's new rank (``comm.rank``); ``initial_rank``: its rank at the start;
    ``wall_time``: ``time.time()`` at the end of the recovery; ``lost_nodes``: the nodes
    left without any rank by this failure (host names, or "node K" when the layout is
    emulated with ``ranks_per_node``)."""

    lost_ranks: Tuple[int, ...]
    lost_now: Tuple[int, ...]
    world_size_before: int
    world_size_after: int
    step: int
    recovery_seconds: float
    rank: int
    initial_rank: int
    generation: int
    wall_time: float = field(default_factory=time.time)
    lost_nodes: Tuple[str, ...] = ()


_FAILURE_CLASSES: Optional[frozenset] = None


def _failure_classes() -> frozenset:
    global _FAILURE_CLASSES
    if _FAILURE_CLASSES is None:
        try:
            from mpi4py import MPI
            _FAILURE_CLASSES = frozenset(getattr(MPI, n) for n in (
                "ERR_PROC_FAILED", "ERR_PROC_FAILED_PENDING", "ERR_REVOKED") if hasattr(MPI, n))
        except ImportError:                                         # pragma: no cover
            _FAILURE_CLASSES = frozenset()
    return _FAILURE_CLASSES


def _knows_failure(comm) -> bool:
    """Whether this mpi4py communicator is revoked or knows of a failed member (local)."""
    try:
        return bool(comm.Is_revoked()) or comm.Get_failed().Get_size() > 0
    except Exception:                                               # noqa: BLE001
        return False


def mpi_failure(exc: BaseException, comm=None) -> Optional[ProcessFailure]:
    """The ProcessFailure an mpi4py exception stands for, or None (another MPI error).

    ``comm`` (the mpi4py communicator of the call): Open MPI's neighbourhood collectives
    report a dead neighbour as MPI_ERR_OTHER; that error counts as a failure when the
    communicator knows of a failed member or was revoked."""
    get = getattr(exc, "Get_error_class", None)
    if get is None:
        return None
    try:
        cls = int(get())
    except Exception:                                               # pragma: no cover
        return None
    if cls not in _failure_classes():
        if comm is not None and _knows_failure(comm):
            return ProcessFailure(f"collective failed after a rank died ({str(exc).strip()})",
                                  cls)
        return None
    what = "a rank of the job died" if cls != max(_failure_classes(), default=-1) \
        else "the communicator was revoked after a rank died"
    return ProcessFailure(f"collective failed: {what} ({str(exc).strip()})", cls)


def is_process_failure(exc: BaseException) -> bool:
    """True for a ProcessFailure or an mpi4py error of a dead rank or a revoked communicator."""
    return isinstance(exc, ProcessFailure) or mpi_failure(exc) is not None
