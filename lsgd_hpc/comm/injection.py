"""A testing hook: ranks that kill themselves at chosen points, so that the tests and the
soak benchmark (benchmarks/ft_soak.py) can lose ranks where they want (a step, the moment
after LSGD's global election, the middle of a checkpoint's save). Not a feature for training:
a training loop has no use for it.

:func:`inject_failures` ("RANK:STEP[:POINT],...") installs a plan for this process (the
trainer exposes it as ``--inject-failure``; :func:`failure_plan` checks its SPEC); the
methods and the Checkpointer call :func:`injection_point` at their points, where the ranks of
the plan SIGKILL themselves (:class:`FailureInjector`). Without a plan installed, a no-op.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from typing import Optional, Sequence, Tuple

from lsgd_hpc.envvars import TEST_REPLACEMENT_DIES

__all__ = ["inject_failures", "failure_plan", "injection_point", "FailureInjector",
           "replacement_env", "replacement_dies_here"]


class FailureInjector:
    """Which ranks SIGKILL themselves where (testing only; :func:`inject_failures`).

    ``plan``: (rank, step, point) triples. ``rank`` is a rank as numbered at the start of the
    job, or ``"leader"``: the rank elected global leader at that step (LeaderSGD), which dies
    between its election and its broadcast. ``point``: ``"step"`` (the start of that step,
    before any of its communication), ``"elected"`` (LeaderSGD, after the global election)
    or ``"save"`` (Checkpointer.save of the set labelled that step, once this rank's file is
    written under its temporary name and before it is renamed: the set is never committed).
    ``"join"`` (under heal) is not a point of this rank's: the first replacement spawned for
    that rank after a loss at that step or later kills itself as it joins, before it says
    it is ready (:func:`replacement_env`, asked by the survivors as they spawn it).
    ``"merge"`` (under heal): this survivor dies in the first join with replacements after a
    loss at that step or later, once the survivors told the replacements to join and before
    the merge. ``"resume"`` (under heal), like ``"join"``: the first replacement that takes
    that rank after a loss at that step or later kills itself after the join, in the healed
    world's restore (before its first step), once."""

    def __init__(self, plan: Sequence[Tuple[object, int, str]]):
        self.plan = list(plan)
        self.initial_rank: Optional[int] = None

    def at(self, point: str, step: int, rank: Optional[int] = None,
           leader: bool = False) -> None:
        if self.initial_rank is None and rank is None:
            try:             # MPI_COMM_WORLD keeps the initial numbering whatever was lost
                from mpi4py import MPI
                self.initial_rank = MPI.COMM_WORLD.Get_rank()
            except ImportError:                                     # pragma: no cover
                pass
        me = self.initial_rank if self.initial_rank is not None else rank
        for who, s, p in self.plan:
            # "merge": the step is the loss's; the join comes some steps after it
            if p != point or (s > step if point == "merge" else s != step):
                continue
            if who == "leader" and leader or who == me:
                print(f"[lsgd_hpc] inject_failures: rank {me} kills itself at step {step} "
                      f"({point})", file=sys.stderr, flush=True)
                sys.stderr.flush()
                os.kill(os.getpid(), signal.SIGKILL)
                time.sleep(60)                    # pragma: no cover - the signal is on its way


_INJECTOR: Optional[FailureInjector] = None
#: the points of a plan (FailureInjector)
POINTS = ("step", "elected", "save", "join", "merge", "resume")


def inject_failures(spec: str, comm=None) -> FailureInjector:
    """Testing only: ``"1:5,2:9"`` makes rank 1 SIGKILL itself at the start of step 5 and
    rank 2 at step 9 (ranks as numbered at the start of the job; steps as counted by the
    methods, 1 = the first). ``"leader:8"``: the rank elected global leader at step 8 dies
    between its election and its broadcast (LeaderSGD). ``"1:5:elected"`` names the point
    explicitly; ``"2:8:save"`` kills rank 2 in the middle of saving the checkpoint of step 8;
    ``"1:8:join"`` kills the first replacement of rank 1 while it joins (heal);
    ``"2:8:merge"`` kills rank 2 in the first join after a loss at step 8 or later (heal);
    ``"2:8:resume"`` kills rank 2's replacement in the restore after its join (heal).
    Installs the plan for this process (the methods call :func:`injection_point` each step)
    and returns it; ``comm`` (the session's) pins this rank's initial number."""
    global _INJECTOR
    _INJECTOR = FailureInjector(failure_plan(spec))
    if comm is not None:
        _INJECTOR.initial_rank = getattr(comm, "initial_rank", comm.rank)
    return _INJECTOR


def failure_plan(spec: str) -> list:
    """``inject_failures``' SPEC as [(rank or "leader", step, point)]; ValueError when bad
    (checked by the trainer before anything starts)."""
    plan = []
    for item in [s for s in str(spec).replace(" ", "").split(",") if s]:
        parts = item.split(":")
        if len(parts) not in (2, 3):
            raise ValueError(f"inject_failures: {item!r} is not RANK:STEP[:POINT]")
        who, step = parts[0], parts[1]
        point = parts[2] if len(parts) == 3 else ("elected" if who == "leader" else "step")
        if point not in POINTS:
            raise ValueError(f"inject_failures: point {point!r} is not 'step', 'elected', "
                             "'save', 'join', 'merge' or 'resume'")
        try:
            step_n = int(step)
            rank = who if who == "leader" else int(who)
        except ValueError:
            raise ValueError(f"inject_failures: {item!r} is not RANK:STEP (integers, or "
                             "leader:STEP)") from None
        if step_n < 1 or (rank != "leader" and rank < 0):
            raise ValueError(f"inject_failures: {item!r}: rank >= 0 and step >= 1 are needed")
        plan.append((rank, step_n, point))
    if not plan:
        raise ValueError("inject_failures: no RANK:STEP given")
    return plan


def injection_point(point: str, step: int, comm=None, leader: bool = False) -> None:
    """Called by the methods at their injection points (a no-op unless a plan is installed)."""
    if _INJECTOR is None:
        return
    rank = None
    if comm is not None:
        rank = getattr(comm, "initial_rank", None)
        if rank is None:
            rank = comm.rank
    _INJECTOR.at(point, step, rank, leader)



#: set in a replacement's environment by the survivors' spawn when the plan says it dies
REPLACEMENT_DIES_ENV = TEST_REPLACEMENT_DIES.name


def replacement_env(replacing: Sequence[int], step: int, spawns: int) -> dict:
    """Testing hook, asked by the survivors as they spawn replacements for ``replacing``
    after a loss at ``step``: the environment that makes one of them die (plan point
    ``"join"``: every replacement of this spawn, while it joins; ``"resume"``: the one that
    takes that rank, after the join, in the healed world's restore), for a plan entry of one
    of those ranks at ``step`` or later; the first spawn for the loss only (``spawns`` ==
    0), and each entry once. Else nothing."""
    if _INJECTOR is None or spawns:
        return {}
    for item in list(_INJECTOR.plan):
        who, s, p = item
        if p in ("join", "resume") and who in replacing and step >= s:
            _INJECTOR.plan.remove(item)
            return {REPLACEMENT_DIES_ENV: "join" if p == "join" else f"resume:{who}"}
    return {}


def replacement_dies_here(point: str = "join", rank: Optional[int] = None) -> None:
    """Called by a replacement as it joins (``"join"``, before it says it is ready) and by
    the Checkpointer's restore (``"resume"``, ``rank`` this process's initial rank): SIGKILL
    itself there when the survivors' spawn said so (``replacement_env``); else a no-op."""
    want = TEST_REPLACEMENT_DIES.read()
    if not want or want != (point if point == "join" else f"{point}:{rank}"):
        return
    where = "while joining" if point == "join" else f"in its {point}"
    who = "a replacement" if rank is None else f"a replacement (rank {rank})"
    print(f"[lsgd_hpc] inject_failures: {who} kills itself {where}", file=sys.stderr,
          flush=True)
    os.environ.pop(REPLACEMENT_DIES_ENV, None)
    os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)                                # pragma: no cover - the signal is on its way
