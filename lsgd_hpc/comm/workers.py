"""Workers that span ranks: K consecutive ranks of a node, or a whole node, train one replica.

A *worker* is a group of ranks of one node that trains one model as data parallel SGD (its
gradients averaged over its ranks every step, over the node's fast links); the method runs
between workers, over the slow links. Its first rank is its *representative*.

:func:`worker_layout` says which worker every rank is in (pure; the same on every rank, from
the node layout every rank holds). :func:`build_workers` forms the communicators:

- ``worker``: this rank's worker (its traffic counted apart, in its own ``CommStats``);
- a *world of workers* (:class:`WorkerView`): a communicator whose members are the workers,
  member i being worker i, usable on every rank of the job. A collective on it runs between
  the representatives only (the payload crosses the network once per worker, not once per
  rank) and then spreads the result from each representative to the rest of its worker, so
  that every rank of a worker leaves it holding the same bits. Ranks that are not
  representatives never enter a representative-only collective: they only wait for their
  representative's broadcast inside their worker.
- its node hierarchy, a :class:`~lsgd_hpc.comm.groups.NodeGroups` of views (the workers of
  each node, and the first worker of every node), so that a rule written for ranks runs
  between workers unchanged, on every rank.

Why every rank of a worker can run the rule itself: the ranks of a worker hold the same
parameters and buffers (averaged gradients, identical optimizer steps, buffers broadcast from
the worker's first rank), so a rule's local arithmetic gives the same bits on each of them,
and the only inputs that differ -- what crosses between workers -- arrive from the
representative. Elections average the ranks' scores inside the worker first (a worker's
score is the mean of its ranks'). A view's member ``world_ranks`` are the representatives'
ranks in the job, so an election names a worker by its representative.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Union

import torch

from lsgd_hpc.comm.base import (CommError, CommStats, Communicator, Election, check_tensor,
                                sanitize_score)
from lsgd_hpc.comm.groups import NodeGroups

__all__ = ["WorkerLayout", "worker_layout", "worker_layout_problem", "surviving_layout",
           "WorkerView", "Workers", "build_workers"]

WorkerRanks = Union[int, str]


@dataclass(frozen=True)
class WorkerLayout:
    """Which worker every rank is in: ``worker_of[r]`` (workers numbered by their first rank),
    ``first[i]`` the first rank (representative) of worker i, ``node_of_worker[i]`` its node."""

    worker_of: List[int]
    first: List[int]
    node_of_worker: List[int]

    @property
    def n_workers(self) -> int:
        return len(self.first)

    def members(self, worker: int) -> List[int]:
        return [r for r, w in enumerate(self.worker_of) if w == worker]


def worker_layout_problem(node_of: Sequence[int], worker_ranks: WorkerRanks) -> Optional[str]:
    """Why ``worker_ranks`` cannot group ranks laid out on nodes as ``node_of`` (the node of
    every rank), or None. ``node`` always can; K must divide the ranks of every node (a
    worker never spans two nodes), so also the world size."""
    if worker_ranks == "node" or worker_ranks == 1:
        return None
    sizes = [list(node_of).count(n) for n in sorted(set(node_of))]
    if all(s % worker_ranks == 0 for s in sizes):
        return None
    if len(sizes) == 1:
        return (f"must divide the world size (worker_ranks={worker_ranks}, "
                f"{sizes[0]} ranks)")
    shown = ", ".join(map(str, sizes))
    return (f"must divide the ranks of every node (worker_ranks={worker_ranks}; the nodes "
            f"hold {shown} ranks)")


def worker_layout(node_of: Sequence[int], worker_ranks: WorkerRanks) -> WorkerLayout:
    """The workers of ranks laid out as ``node_of``: the ranks of each node in rank order,
    cut into runs of K (or taken whole, ``node``). ValueError for a K that does not fit."""
    problem = worker_layout_problem(node_of, worker_ranks)
    if problem:
        raise ValueError(f"worker_ranks {problem}")
    seen: Dict[int, int] = {}           # node -> ranks of it met so far
    index: Dict[tuple, int] = {}        # (node, k-th worker of the node) -> worker index
    worker_of, first, node_of_worker = [], [], []
    for r, n in enumerate(node_of):
        k = 0 if worker_ranks == "node" else seen.get(n, 0) // worker_ranks
        seen[n] = seen.get(n, 0) + 1
        if (n, k) not in index:
            index[(n, k)] = len(first)
            first.append(r)
            node_of_worker.append(n)
        worker_of.append(index[(n, k)])
    return WorkerLayout(worker_of, first, node_of_worker)


class _Spread:
    """A between-worker collective in flight (the interface of Pending): completing it
    completes the representative's collective, then spreads its result inside the worker.
    ``test`` progresses the representative's collective but reports completion only once
    ``wait`` has run: a rank that is not a representative cannot see its representative's
    collective progress, and the ranks of a worker must never decide differently on whether
    it is done (the methods wait at an agreed step and only progress in between)."""

    def __init__(self, view: "WorkerView", tensor: torch.Tensor, inner, spread, finish,
                 name: str):
        self.comm, self.tensor, self.name = view, tensor, name
        self.seq = getattr(inner, "seq", 0)
        self._inner, self._spread, self._finish = inner, spread, finish
        self.done = False
        self._result = None

    def wait(self):
        if not self.done:
            if self._inner is not None:
                self._inner.wait()
            if self._spread:
                self.comm.worker.broadcast_(self.tensor, 0)
            self.done = True
            self._result = self._finish()
        return self._result

    def test(self) -> bool:
        if not self.done and self._inner is not None:
            self._inner.test()
        return self.done

    @property
    def result(self):
        if not self.done:
            raise CommError(f"{self.name}: result read before the collective completed")
        return self._result


class WorkerView(Communicator):
    """The workers as the members of one communicator, on every rank of the job (see the
    module docstring). ``between``: the representatives' communicator of these workers (on a
    representative; None elsewhere); ``worker``: this rank's worker. ``rank``/``size``: this
    worker's rank among these workers and their number; ``world_ranks``: their
    representatives' ranks in the job. Traffic between workers is counted in ``stats`` (the
    job's, comm_bytes_*), the spreading inside the worker in the worker's own counters;
    ``counters`` names both (``uncounted`` restores both)."""

    def __init__(self, between: Optional[Communicator], worker: Communicator, rank: int,
                 size: int, world_ranks: Sequence[int], stats: CommStats, key: str):
        self.between, self.worker = between, worker
        self.is_representative = worker.rank == 0
        if self.is_representative != (between is not None):
            raise CommError("WorkerView: a representative needs the between-worker "
                            "communicator, and only a representative has one")
        self._rank, self._size = rank, size
        self.world_ranks = tuple(world_ranks)
        self.stats = stats
        self.counters = (stats, worker.stats)
        self.key = key

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self._size

    def _spread(self, tensor: torch.Tensor) -> None:
        """The representative's tensor to every rank of its worker."""
        self.worker.broadcast_(tensor, 0)

    # -- collectives ---------------------------------------------------------------------
    def agree_buffers(self, *tensors: torch.Tensor) -> None:
        # inside the worker first, on every rank: the backends share one table of agreed
        # buffers among a job's communicators, so a buffer agreed between representatives
        # only would skip the check inside the worker on the representative alone (a hang)
        self.worker.agree_buffers(*tensors)
        if self.between is not None:
            self.between.agree_buffers(*tensors)

    def allreduce_(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        self._check_allreduce(tensor, op)
        if self._size == 1:
            return tensor          # (every rank of the worker holds the same bits already)
        if self.between is not None:
            self.between.allreduce_(tensor, op)
        self._spread(tensor)
        return tensor

    def iallreduce_(self, tensor: torch.Tensor, op: str = "sum", *, agreed: bool = False):
        self._check_allreduce(tensor, op)
        inner = (self.between.iallreduce_(tensor, op, agreed=agreed)
                 if self.between is not None and self._size > 1 else None)
        return _Spread(self, tensor, inner, self._size > 1, lambda: tensor, "iallreduce_")

    def broadcast_(self, tensor: torch.Tensor, root: int) -> torch.Tensor:
        check_tensor(tensor)
        self._check_root(root)
        if self._size == 1:
            return tensor
        if self.between is not None:
            self.between.broadcast_(tensor, root)
        if self._rank != root:     # the root worker's ranks hold it already
            self._spread(tensor)
        return tensor

    def ibroadcast_(self, tensor: torch.Tensor, root: int):
        check_tensor(tensor)
        self._check_root(root)
        inner = (self.between.ibroadcast_(tensor, root)
                 if self.between is not None and self._size > 1 else None)
        return _Spread(self, tensor, inner, self._size > 1 and self._rank != root,
                       lambda: tensor, "ibroadcast_")

    def alltoall(self, send: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Between the representatives, then ``out`` spread inside each worker (every rank of
        a worker passes the same ``send``: the compressed allreduce's byte buffers)."""
        self._exchange_args("alltoall", send, out)
        if self.between is not None:
            self.between.alltoall(send, out)
        self._spread(out)
        return out

    def allgather(self, send: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """As :meth:`alltoall`: between the representatives, spread inside each worker."""
        self._exchange_args("allgather", send, out)
        if self.between is not None:
            self.between.allgather(send, out)
        self._spread(out)
        return out

    def _worker_score(self, score: float) -> float:
        """The worker's score: the mean of its ranks' (a non-finite one makes it +inf)."""
        buf = torch.tensor([sanitize_score(score)], dtype=torch.float64)
        self.worker.allreduce_(buf, "mean")
        return sanitize_score(float(buf.item()))

    def elect(self, score: float) -> Election:
        mine = self._worker_score(score)
        if self._size == 1:
            return Election(0, self.world_ranks[0], mine)
        out = torch.zeros(2, dtype=torch.float64)
        if self.between is not None:
            el = self.between.elect(mine)
            out[0], out[1] = el.rank, el.score
        self._spread(out)
        rank = int(out[0].item())
        return Election(rank, self.world_ranks[rank], float(out[1].item()))

    def ielect(self, score: float):
        raise CommError("non-blocking elections between workers are not supported "
                        "(lsgd-async refuses worker_ranks)")

    def neighbor_allgather(self, tensor: torch.Tensor, sources: Sequence[int],
                           destinations: Sequence[int], out: Optional[torch.Tensor] = None,
                           graph_key=None) -> torch.Tensor:
        src, dst, out = self._neighbor_args(tensor, sources, destinations, out)
        if self.between is not None:
            self.between.neighbor_allgather(tensor, src, dst, out=out, graph_key=graph_key)
        if len(src):
            self._spread(out)
        return out

    def allgather_object(self, obj) -> list:
        got = self.between.allgather_object(obj) if self.between is not None else None
        return self.worker.allgather_object(got)[0]

    def barrier(self) -> None:
        if self.between is not None:
            self.between.barrier()
        self.worker.barrier()

    def dup(self) -> "WorkerView":
        between = self.between.dup() if self.between is not None else None
        return WorkerView(between, self.worker.dup(), self._rank, self._size, self.world_ranks,
                          self.stats, f"{self.key}/dup")

    def split(self, color: int, key: Optional[int] = None):
        raise CommError("a world of workers is not split further; split the job's world")

    def abort(self, code: int = 1) -> None:
        self.worker.abort(code)


def _own_stats(comm: Communicator, stats: CommStats) -> None:
    """Count ``comm``'s traffic (and that of what is derived from it) in ``stats``."""
    comm.stats = stats
    inner = getattr(comm, "_mpi", None)      # Horovod: its mpi4py side counts some calls
    if inner is not None:
        inner.stats = stats


@dataclass
class Workers:
    """This rank's worker and the world of workers it belongs to (``build_workers``)."""

    worker_ranks: WorkerRanks
    layout: WorkerLayout
    index: int                  # this rank's worker
    worker: Communicator        # the ranks of this worker (own stats: ``stats``)
    groups: NodeGroups          # the workers' hierarchy, of WorkerViews
    #: the worker of every initial rank of the job (the identity a worker keeps when it
    #: loses ranks), and the recovery generation the communicators were built for
    initial_worker_of: Dict[int, int] = field(default_factory=dict)
    generation: int = 0

    @property
    def world(self) -> WorkerView:
        return self.groups.world

    @property
    def stats(self) -> CommStats:
        """Traffic inside this rank's worker (gradients, buffers, results spread)."""
        return self.worker.stats

    @property
    def size(self) -> int:
        return self.worker.size

    @property
    def n_workers(self) -> int:
        return self.layout.n_workers

    @property
    def is_representative(self) -> bool:
        return self.worker.rank == 0

    def rebuild(self, world: Communicator, groups: NodeGroups, initial_ranks: Sequence[int],
                generation: int) -> None:
        """Collective over ``world``, the survivors of lost ranks (on_failure="shrink"): each
        worker goes on with the ranks it has left (a worker left with none leaves the world
        of workers), its communicators rebuilt over them, in place: the views and the node
        groups a rule holds stay the same objects. Once per ``generation`` (the recovery's
        world), however many methods share these workers."""
        if generation == self.generation:
            return
        layout = surviving_layout(self.initial_worker_of, initial_ranks, groups.node_of)
        new = build_workers(world, groups, self.worker_ranks, layout, self.worker.stats)
        old_groups, new_groups = self.groups, new.groups
        for name in ("world", "node", "roots"):
            old, fresh = getattr(old_groups, name), getattr(new_groups, name)
            if old is not None and fresh is not None:
                old.__dict__.update(fresh.__dict__)
                setattr(new_groups, name, old)
        old_groups.__dict__.update(new_groups.__dict__)
        self.layout, self.index, self.worker = new.layout, new.index, new.worker
        self.generation = generation


def surviving_layout(initial_worker_of: Dict[int, int], initial_ranks: Sequence[int],
                     node_of: Sequence[int]) -> WorkerLayout:
    """The layout of the workers over the survivors of lost ranks (``initial_ranks``: the
    initial rank of every current rank; ``node_of``: the current node of every rank): each
    rank stays in its worker, the workers keep their order, numbered again from 0, and a
    worker's first surviving rank is its representative."""
    ids = [initial_worker_of[i] for i in initial_ranks]
    order = sorted(set(ids), key=ids.index)
    number = {w: k for k, w in enumerate(order)}
    first = [ids.index(w) for w in order]
    return WorkerLayout([number[w] for w in ids], first, [node_of[f] for f in first])


def build_workers(world: Communicator, groups: NodeGroups, worker_ranks: WorkerRanks,
                  layout: Optional[WorkerLayout] = None,
                  worker_stats: Optional[CommStats] = None) -> Workers:
    """Collective over ``world`` (every rank, once): this rank's worker, and the world of
    workers with its node hierarchy. ``groups``: the job's node groups (``comm.groups``).
    Raises ValueError, the same on every rank before any collective, when ``worker_ranks``
    does not fit the node layout. Every communicator is split from ``world`` (Horovod splits
    its world only). ``layout`` (after lost ranks: ``surviving_layout``) replaces the one
    ``worker_ranks`` gives; ``worker_stats`` goes on counting the traffic inside the
    worker."""
    layout = layout or worker_layout(groups.node_of, worker_ranks)
    me = world.rank
    w = layout.worker_of[me]
    rep = layout.first[w] == me
    node_w = layout.node_of_worker
    my_node = node_w[w]
    first_of_node = [i for i in range(layout.n_workers) if node_w.index(node_w[i]) == i]
    worker = world.split(w, key=me)
    _own_stats(worker, worker_stats or CommStats())
    between_all = world.split(0 if rep else -1, key=me)
    between_node = world.split(my_node if rep else -1, key=me)
    node_root = w in first_of_node
    between_roots = world.split(0 if rep and node_root else -1, key=me)
    stats = world.stats
    reps = layout.first
    all_view = WorkerView(between_all, worker, w, layout.n_workers, reps, stats, "workers")
    mates = [i for i in range(layout.n_workers) if node_w[i] == my_node]
    node_view = WorkerView(between_node, worker, mates.index(w), len(mates),
                           [reps[i] for i in mates], stats, f"workers/node{my_node}")
    roots_view = None
    if node_root:
        roots_view = WorkerView(between_roots, worker, first_of_node.index(w),
                                len(first_of_node), [reps[i] for i in first_of_node], stats,
                                "workers/roots")
    view_groups = NodeGroups(all_view, node_view, roots_view, list(node_w),
                             getattr(groups, "hostname", socket.gethostname()))
    return Workers(worker_ranks, layout, w, worker, view_groups)
