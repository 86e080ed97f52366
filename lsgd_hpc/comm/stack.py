"""A method's communicators, composed in one place from its options.

Three layers over one communicator protocol (:class:`~lsgd_hpc.comm.base.Communicator`),
each unaware of the others:

- **who forms a worker**: a rank, K consecutive ranks of a node, or a node
  (:mod:`lsgd_hpc.comm.workers`): the method runs between workers, over the world of
  workers and its node hierarchy;
- **what the wire carries**: fp32, bf16 (:mod:`lsgd_hpc.comm.lowprec`), int8/fp8/int4/int2
  with or without error feedback (:mod:`lsgd_hpc.comm.quantized`), the top-k entries of
  each chunk (:mod:`lsgd_hpc.comm.sparse`), wrapped around the communicators the method
  runs on;
- **what happens when a rank dies**: the session's policy (``lsgd_hpc.init(on_failure=)``):
  abort, or shrink (:mod:`lsgd_hpc.comm.faults`), under all of them.

:func:`compose` assembles them; :meth:`Stack.refresh` points the wire's wrappers at the
node communicators that a recovery rebuilt.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Optional

__all__ = ["Stack", "compose", "QUANTIZED", "LOW_PRECISION"]

#: the wire formats of one byte (int8, fp8), half a byte (int4) or a quarter of a byte (int2)
#: per element plus per-block scales (comm/quantized.py)
QUANTIZED = ("int8", "fp8", "int4", "int2")
#: the wire formats that round to a lower-precision float (comm/lowprec.py)
LOW_PRECISION = ("bf16",)

#: the workers built on a job's world, per (node layout, worker_ranks): every method on that
#: world with that grouping shares them (as methods share the world and its counters)
_WORKERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


@dataclass
class Stack:
    """What a method communicates over: ``world`` and ``groups`` (the method's, after every
    layer), ``workers`` (this rank's worker; None when every rank is one), ``wire`` (the
    quantized or low-precision groups holding the error-feedback residuals; None otherwise)
    and ``base``, the session's node groups under them."""

    world: Any
    groups: Any
    base: Any
    workers: Optional[Any] = None
    wire: Optional[Any] = None

    def refresh(self, comm, generation: int) -> None:
        """Collective over the survivors, after a recovery shrank ``comm.world`` and rebuilt
        its node groups (``generation``: the recovery's world): the workers go on with the
        ranks they have left, and the wire's wrappers point at the rebuilt communicators (in
        place, so a rule's references stay valid)."""
        if self.workers is not None:
            self.workers.rebuild(comm.world, comm.groups, comm.initial_ranks, generation)
        groups, base = self.groups, self.base
        if groups is base:
            return
        wrap = getattr(groups.node, "inner", None) is not None

        def like(template, inner):
            if inner is None or not wrap:
                return inner
            w = object.__new__(type(template))        # (a wrapper may forward __getattr__)
            w.__dict__.update({k: (dict(v) if isinstance(v, dict) else v)
                               for k, v in vars(template).items()})
            w.inner = inner
            return w
        groups.node = like(groups.node, base.node)
        groups.roots = like(groups.node, base.roots)
        groups.node_of = base.node_of


def _workers_of(comm, layout, worker_ranks):
    """The workers of ``layout`` (the method's, ``worker_layout(comm.groups.node_of,
    worker_ranks)``): collective over ``comm.world`` the first time (every rank builds a
    method alike)."""
    from lsgd_hpc.comm.workers import build_workers
    per_world = _WORKERS.setdefault(comm.world, {})
    # (a world that torchft reconfigured in place has a new key: its old workers are gone)
    key = (getattr(comm.world, "key", None), tuple(comm.groups.node_of), worker_ranks)
    if key not in per_world:
        workers = build_workers(comm.world, comm.groups, worker_ranks, layout=layout)
        initial = getattr(comm, "initial_ranks", range(comm.world.size))
        workers.initial_worker_of = {i: workers.layout.worker_of[r]
                                     for r, i in enumerate(initial)}
        workers.generation = getattr(comm, "generation", 0)
        per_world[key] = workers
    return per_world[key]


def compose(comm, *, layout=None, worker_ranks=1, comm_dtype: str = "fp32",
            error_feedback: bool = False, topk: float = 1.0,
            error_feedback_decay: float = 1.0) -> Stack:
    """The stack of a method on the session ``comm``: between the workers of ``layout``
    (a :class:`~lsgd_hpc.comm.workers.WorkerLayout` of ``worker_ranks`` ranks each, as the
    method computed it from ``comm.groups.node_of``; None: every rank a worker), sending
    ``comm_dtype`` (with ``topk`` < 1: each allreduce's top-k entries, values as
    ``comm_dtype``, bf16 too; with ``error_feedback``, bf16 alone included, residuals decayed
    by ``error_feedback_decay`` before each use). Collective over ``comm.world`` the first time a
    grouping is used (every rank composes alike); options arrive checked."""
    stack = Stack(comm.world, comm.groups, comm.groups)
    ft = getattr(comm, "fault_tolerance", None)
    problem = ft.workers_problem(worker_ranks) if ft is not None and layout is not None \
        else None
    if problem:
        raise ValueError(problem)
    if layout is not None:
        stack.workers = _workers_of(comm, layout, worker_ranks)
        stack.groups = stack.base = stack.workers.groups
    if comm_dtype in QUANTIZED or topk < 1:
        from lsgd_hpc.comm.quantized import quantized_groups
        stack.groups = stack.wire = quantized_groups(stack.groups, comm_dtype, error_feedback,
                                                     topk=topk, decay=error_feedback_decay)
    elif comm_dtype in LOW_PRECISION:
        from lsgd_hpc.comm.lowprec import WIRE_DTYPES, low_precision_groups
        stack.groups = low_precision_groups(stack.groups, WIRE_DTYPES[comm_dtype],
                                            error_feedback, error_feedback_decay)
        if error_feedback:              # the residuals' holder, as the quantized groups
            stack.wire = stack.groups
    stack.world = stack.groups.world
    return stack
