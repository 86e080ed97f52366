"""The communication interface over mpi4py: zero-copy for CPU tensors, CUDA-aware buffers for GPU."""

from __future__ import annotations

import socket
from typing import Dict, Optional, Sequence, Tuple

import numpy as np
import torch
from mpi4py import MPI

from lsgd_hpc.comm.lifetime import track
from lsgd_hpc.envvars import COMM_VALIDATE
from lsgd_hpc.comm.monitor import MONITOR, _Inside
from lsgd_hpc.comm.base import (CommError, CommStats, Communicator, Election, Pending, Request,
                                check_tensor, sanitize_score)

__all__ = ["MPICommunicator", "mpi_library"]

_MPI_TYPES = {
    torch.float32: MPI.FLOAT,
    torch.float64: MPI.DOUBLE,
    torch.int32: MPI.INT32_T,
    torch.int64: MPI.INT64_T,
    torch.uint8: MPI.UINT8_T,
    # No portable MPI type for half precision: moved as raw 2-byte words. Sum/mean are
    # refused for them below instead of silently adding bit patterns.
    torch.float16: MPI.UINT16_T,
    torch.bfloat16: MPI.UINT16_T,
}
_DTYPE_CODE = {dt: i + 1 for i, dt in enumerate(_MPI_TYPES)}

#: Non-blocking allreduces of at least this many bytes run out of place from a copy (see
#: MPICommunicator._start_iallreduce); below, in place (latency-bound, and Open MPI takes the
#: same algorithm either way under 64 KiB).
NB_SEND_COPY_MIN_BYTES = 64 * 1024

# MPI.DOUBLE_INT is C's struct {double; int;}: 8 + 4 bytes padded to 16.
_DOUBLE_INT = np.dtype([("score", np.float64), ("rank", np.int32)], align=True)


def _bf16_sum(inbuf, inoutbuf, datatype) -> None:
    """MPI has no bfloat16: a user-defined sum over raw 16-bit words. Each pair is widened to
    float32 (exact), added, and rounded back to bfloat16 to nearest, ties to even (as torch
    rounds), so every rank's result is the same bits."""
    a = np.frombuffer(inbuf, dtype=np.uint16)
    b = np.frombuffer(inoutbuf, dtype=np.uint16)
    s = (a.astype(np.uint32) << 16).view(np.float32) + (b.astype(np.uint32) << 16).view(np.float32)
    u = s.view(np.uint32)
    nan = np.isnan(s)
    r = ((u + np.uint32(0x7FFF) + ((u >> 16) & np.uint32(1))) >> 16).astype(np.uint16)
    r[nan] = 0x7FC0
    b[:] = r


_BF16_SUM = None


def _sum_op(tensor: torch.Tensor):
    """MPI.SUM, or the bfloat16 sum for bfloat16 tensors (created once, on first use)."""
    global _BF16_SUM
    if tensor.dtype != torch.bfloat16:
        return MPI.SUM
    if _BF16_SUM is None:
        _BF16_SUM = MPI.Op.Create(_bf16_sum, commute=True)
    return _BF16_SUM


def mpi_library() -> str:
    """First line of the MPI library's own version string (which MPI is really used)."""
    return MPI.Get_library_version().replace("\x00", "").strip().splitlines()[0]


def _world_on_one_host(size: int) -> Optional[bool]:
    """Whether all ``size`` ranks of COMM_WORLD run on this host (see lsgd_hpc.comm.launcher)."""
    from lsgd_hpc.comm.launcher import world_on_one_host
    return world_on_one_host(size)


def _buffer(t: torch.Tensor, count: Optional[int] = None):
    """An MPI buffer spec over the tensor's own memory (no copy); ``count`` elements per peer
    (default: the whole tensor).

    CPU tensors go through numpy (shares storage). CUDA tensors are handed to mpi4py as
    they are: torch exposes __cuda_array_interface__, which a CUDA-aware MPI reads directly.
    """
    mpitype = _MPI_TYPES[t.dtype]
    count = t.numel() if count is None else count
    if t.is_cuda:
        # Kernels writing this buffer run on a stream; MPI reads device memory now.
        torch.cuda.current_stream(t.device).synchronize()
        return [t.detach(), count, mpitype]
    if t.dtype in (torch.float16, torch.bfloat16):
        arr = t.detach().view(torch.int16).numpy()
    else:
        arr = t.detach().numpy()
    return [arr, count, mpitype]


def _buffer_key(t: torch.Tensor) -> tuple:
    """What identifies a buffer whose shape was agreed on: its memory, length and type."""
    return (t.device.type, t.data_ptr(), t.numel(), t.dtype)


def _failure_of(exc: BaseException, comm=None):
    """The ProcessFailure an mpi4py error stands for (a dead rank, a revoked communicator:
    lsgd_hpc.comm.failures), or None."""
    from lsgd_hpc.comm.failures import mpi_failure
    return mpi_failure(exc, comm)


class _Watched(_Inside):
    """A blocking collective, numbered for the watchdog; an MPI error of a dead rank or a
    revoked communicator leaves it as ProcessFailure (lsgd_hpc.comm.failures)."""

    __slots__ = ("mpi_comm",)

    def __init__(self, mon, key, members, name, seq, mpi_comm=None):
        _Inside.__init__(self, mon, key, members, name, seq)
        self.mpi_comm = mpi_comm

    def __exit__(self, exc_type, exc, tb) -> bool:
        _Inside.__exit__(self, exc_type, exc, tb)
        if exc_type is not None and issubclass(exc_type, MPI.Exception):
            failure = _failure_of(exc, self.mpi_comm)
            if failure is not None:
                raise failure from exc
        return False


def _translated(call, comm=None):
    """``call`` (a request's Wait/Test, a non-blocking start) with failures as ProcessFailure."""
    def run(*args, **kwargs):
        try:
            return call(*args, **kwargs)
        except MPI.Exception as exc:
            failure = _failure_of(exc, comm)
            if failure is None:
                raise
            raise failure from exc
    return run


class MPICommunicator(Communicator):
    """An mpi4py communicator behind the lsgd_hpc interface.

    ``key`` names the communicator the same way on every member ("world", "world/split1:0",
    "world/dup2", ...): the collective watchdog numbers collectives per key.
    """

    def __init__(self, comm: Optional[MPI.Comm] = None, stats: Optional[CommStats] = None,
                 world_ranks: Optional[Sequence[int]] = None, key: str = "world"):
        self.comm = comm if comm is not None else MPI.COMM_WORLD
        self.stats = stats if stats is not None else CommStats()
        if world_ranks is None:
            world_ranks = (range(self.comm.Get_size()) if self.comm == MPI.COMM_WORLD
                           else self.comm.allgather(MPI.COMM_WORLD.Get_rank()))
        self.world_ranks = tuple(world_ranks)
        self._rank = self.comm.Get_rank()
        self._size = self.comm.Get_size()
        self._graphs: Dict[tuple, Tuple[MPI.Distgraphcomm, tuple, tuple, int]] = {}
        self._serial = 0
        self._children: list = []
        self.key = key
        self._n_derived = 0       # children made so far: the same count on every member
        self.validate = COMM_VALIDATE.read()   # the agreement check before every collective
        # fixed buffers agreed on once at set-up (agree_buffers), key -> (the tensor, its MPI
        # buffer or None on GPU): shared with every communicator derived from this one, whose
        # members are a subset of ours
        self._agreed: Dict[tuple, tuple] = {}
        # send copies of fixed buffers for out-of-place non-blocking allreduces, buffer key ->
        # the copy (one per buffer of a checked plan: gradient buckets)
        self._send_copies: Dict[tuple, torch.Tensor] = {}
        #: True when every member runs on this host (shared memory between all of them),
        #: False when not, None when unknown (COMM_WORLD outside a launcher that says).
        self.one_host: Optional[bool] = (_world_on_one_host(self._size)
                                         if self.comm == MPI.COMM_WORLD else None)
        # made once: an election is on the path of every LSGD period
        self._elect_bufs = (np.zeros(1, dtype=_DOUBLE_INT), np.zeros(1, dtype=_DOUBLE_INT))

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self._size

    # -- agreement check -----------------------------------------------------------------
    def _agree(self, what: str, tensor: torch.Tensor, root: int = 0,
               graph: Optional[MPI.Distgraphcomm] = None) -> None:
        """Raise the same CommError on every member when members disagree on (numel, dtype,
        root): MPI would otherwise truncate, overrun a buffer or wait forever.

        Over a graph only the neighbours compare, so gossip stays neighbour-only.
        """
        if not self.validate or (graph is None and _buffer_key(tensor) in self._agreed):
            return
        sig = np.array([tensor.numel(), _DTYPE_CODE[tensor.dtype], root], dtype=np.int64)
        if graph is None:
            both = np.concatenate([sig, -sig])
            with self._watch(f"{what} agreement check"):
                self.comm.Allreduce(MPI.IN_PLACE, both, op=MPI.MAX)
            ok = np.array_equal(both[:3], -both[3:])
            lo, hi = -both[3:], both[:3]
        else:
            indeg = graph.Get_dist_neighbors_count()[0]
            theirs = np.zeros((indeg, 3), dtype=np.int64)
            with self._watch(f"{what} agreement check"):
                graph.Neighbor_allgather(sig, theirs)
            mismatch = int(bool((theirs != sig).any()))
            # A neighbour that disagrees makes both sides raise; nobody waits on it.
            flag = np.zeros(indeg, dtype=np.int64)
            with self._watch(f"{what} agreement check"):
                graph.Neighbor_allgather(np.array([mismatch], dtype=np.int64), flag)
            ok = not mismatch and not flag.any()
            lo, hi = np.vstack([theirs, sig]).min(axis=0), np.vstack([theirs, sig]).max(axis=0)
        if not ok:
            raise CommError(f"{what}: ranks disagree on the buffer (numel {lo[0]}..{hi[0]}, "
                            f"dtype code {lo[1]}..{hi[1]}, root {lo[2]}..{hi[2]})")

    def agree_buffers(self, *tensors: torch.Tensor) -> None:
        """Collective: check once that every member passes the same numel and dtype for each
        of these fixed buffers (one small allreduce each); blocking collectives on exactly
        these buffers (same memory, numel and dtype), on this communicator or any split or
        duplicate of it, then skip the per-call agreement check. A model's flat buffers never
        change shape, so checking them at set-up instead of at every step loses no safety
        against a mismatched configuration and saves a latency-bound allreduce per
        collective. Roots (of broadcasts on these buffers) come from elections, which every
        member computes from the same reduction.
        """
        for t in tensors:
            check_tensor(t)
            if self._size > 1:
                self._agree("agree_buffers", t)
            # The entry holds the tensor, so its memory cannot be freed and handed to another
            # buffer of the same length on some ranks only: entries are added collectively and
            # never go stale, and every member decides alike whether to check.
            # CPU buffers: their MPI buffer (a numpy view of the same memory) made once too.
            self._agreed[_buffer_key(t)] = (t, None if t.is_cuda else _buffer(t))

    def _checked_buffer(self, what: str, tensor: torch.Tensor, root: int = 0):
        """The agreement check (skipped for a buffer agreed on at set-up), then the tensor's
        MPI buffer (made once for an agreed CPU buffer: this is on every collective's path)."""
        entry = self._agreed.get(_buffer_key(tensor))
        if entry is None:
            self._agree(what, tensor, root)
            return _buffer(tensor)
        return entry[1] if entry[1] is not None else _buffer(tensor)

    # -- collectives ---------------------------------------------------------------------
    def allreduce_(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        self._check_allreduce(tensor, op)
        if self._size == 1:
            return tensor
        buf = self._checked_buffer("allreduce_", tensor)
        nbytes = tensor.numel() * tensor.element_size()
        with self._counted(nbytes, nbytes), self._watch("allreduce_"):
            self.comm.Allreduce(MPI.IN_PLACE, buf, op=_sum_op(tensor))
        return self._finish_mean(tensor, op)

    def _start_iallreduce(self, tensor: torch.Tensor, agreed: bool):
        if not agreed:
            self._agree("iallreduce_", tensor)
        if self.one_host or tensor.numel() * tensor.element_size() < NB_SEND_COPY_MIN_BYTES:
            # The memory stays alive while in flight: the Pending holds the tensor that owns it.
            req = _translated(self.comm.Iallreduce, self.comm)(MPI.IN_PLACE, _buffer(tensor),
                                                    op=_sum_op(tensor))
            return _translated(req.Wait, self.comm), _translated(req.Test, self.comm)
        # Out of place from a copy: Open MPI's non-blocking allreduce (coll/libnbc) takes a
        # binomial tree (reduce to one rank, then broadcast: the whole buffer through one
        # rank's link, twice) whenever it is called in place, and reduce-scatter + allgather
        # (bandwidth-optimal) otherwise. For gradient buckets over a network that is 2.5x
        # (benchmarks/nonblocking_allreduce.py); within one host, through shared memory, the
        # copy costs more than it saves, so there it stays in place (one_host). The send
        # copy of a fixed buffer (agreed: a bucket plan checked once) is kept and reused; it
        # is never read by two collectives at once, since its buffer cannot be in flight twice.
        key = _buffer_key(tensor)
        send = self._send_copies.get(key) if agreed else None
        if send is None:
            send = torch.empty_like(tensor, memory_format=torch.contiguous_format)
            if agreed:
                self._send_copies[key] = send
        send.copy_(tensor)
        req = _translated(self.comm.Iallreduce, self.comm)(_buffer(send), _buffer(tensor),
                                                op=_sum_op(tensor))
        wait_, test_ = _translated(req.Wait, self.comm), _translated(req.Test, self.comm)

        def wait(_send=send) -> None:      # the copy stays alive while in flight
            wait_()

        def test(_send=send) -> bool:
            return test_()
        return wait, test

    def broadcast_(self, tensor: torch.Tensor, root: int) -> torch.Tensor:
        check_tensor(tensor)
        self._check_root(root)
        if self._size == 1:
            return tensor
        buf = self._checked_buffer("broadcast_", tensor, root)
        nbytes = tensor.numel() * tensor.element_size()
        is_root = self._rank == root
        with self._counted(nbytes if is_root else 0, 0 if is_root else nbytes), \
                self._watch("broadcast_"):
            self.comm.Bcast(buf, root=root)
        return tensor

    def elect(self, score: float) -> Election:
        mine = sanitize_score(score)
        if self._size == 1:
            return Election(0, self.world_ranks[0], mine)
        send, recv = self._elect_bufs
        send["score"], send["rank"] = mine, self._rank
        with self._counted(_DOUBLE_INT.itemsize, _DOUBLE_INT.itemsize), self._watch("elect"):
            self.comm.Allreduce([send, MPI.DOUBLE_INT], [recv, MPI.DOUBLE_INT], op=MPI.MINLOC)
        leader = int(recv["rank"][0])
        return Election(leader, self.world_ranks[leader], float(recv["score"][0]))

    def neighbor_allgather(self, tensor: torch.Tensor, sources: Sequence[int],
                           destinations: Sequence[int], out: Optional[torch.Tensor] = None,
                           graph_key=None) -> torch.Tensor:
        src, dst, out = self._neighbor_args(tensor, sources, destinations, out)
        graph = self._graph(src, dst, graph_key)
        self._agree("neighbor_allgather", tensor, graph=graph)
        nbytes = tensor.numel() * tensor.element_size()
        with self._counted(nbytes * len(dst), nbytes * len(src)), \
                self._watch("neighbor_allgather"):
            graph.Neighbor_allgather(_buffer(tensor), _buffer(out, tensor.numel()))
        return out

    def _graph(self, src: tuple, dst: tuple, graph_key=None) -> MPI.Distgraphcomm:
        """The distributed-graph communicator of this graph, created once and cached.

        Creating one is collective, so every member must hit or miss the cache together.
        With a ``graph_key`` that names the whole graph (the same on every rank, e.g.
        (topology, step % period)) the cache is keyed on it; without one, this rank's own
        edges do not identify the graph (two graphs can give one rank the same neighbours),
        so the members agree on a hit with one tiny reduction first.
        """
        if graph_key is not None:
            key = ("key", graph_key)
            entry = self._graphs.get(key)
            if entry is not None and entry[1:3] != (src, dst):
                raise CommError(f"graph_key {graph_key!r} was used before with other neighbours")
        else:
            key = ("edges", src, dst)
            entry = self._graphs.get(key)
            # Hit only if every member holds the very same graph communicator: graphs are
            # numbered in creation order, which is the same on every member.
            serial = -1 if entry is None else entry[3]
            agree = np.array([serial, -serial], dtype=np.int64)
            with self._watch("graph cache check"):
                self.comm.Allreduce(MPI.IN_PLACE, agree, op=MPI.MAX)
            if not (agree[0] == -agree[1] == serial >= 0):
                if entry is not None:
                    entry[0].Free()
                entry = None
        if entry is None:
            if self.validate:
                self._check_graph_consistent(src, dst)
            # reorder=False: ranks in the graph stay the ranks of this communicator.
            with self._watch("graph creation"):
                graph = track(self.comm.Create_dist_graph_adjacent(list(src), list(dst),
                                                                   reorder=False))
            self._serial += 1
            entry = self._graphs[key] = (graph, src, dst, self._serial)
        return entry[0]

    def split(self, color: int, key: Optional[int] = None) -> Optional["MPICommunicator"]:
        key = self._rank if key is None else key
        self._n_derived += 1
        with self._watch("split"):
            sub = track(self.comm.Split(MPI.UNDEFINED if color < 0 else int(color), key))
        if sub == MPI.COMM_NULL:
            return None
        return self._adopt(sub, f"{self.key}/split{self._n_derived}:{int(color)}")

    def dup(self) -> "MPICommunicator":
        self._n_derived += 1
        with self._watch("dup"):
            sub = track(self.comm.Dup())
        return self._adopt(sub, f"{self.key}/dup{self._n_derived}")

    def _adopt(self, sub: MPI.Comm, key: str) -> "MPICommunicator":
        with _Watched(MONITOR, key, (), "world ranks", None):
            members = sub.allgather((self.world_rank, socket.gethostname()))
        child = MPICommunicator(sub, self.stats, [r for r, _ in members], key=key)
        child.one_host = len({h for _, h in members}) == 1
        child._agreed = self._agreed
        self._children.append(child)
        return child

    def alltoall(self, send: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        per = self._exchange_args("alltoall", send, out)
        if self._size == 1:
            return out.copy_(send)
        self._agree("alltoall", send)
        nbytes = per * send.element_size() * (self._size - 1)
        with self._counted(nbytes, nbytes), self._watch("alltoall"):
            self.comm.Alltoall(_buffer(send, per), _buffer(out, per))
        return out

    def allgather(self, send: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        per = self._exchange_args("allgather", send, out)
        if self._size == 1:
            return out.copy_(send)
        self._agree("allgather", send)
        nbytes = per * send.element_size() * (self._size - 1)
        with self._counted(nbytes, nbytes), self._watch("allgather"):
            self.comm.Allgather(_buffer(send), _buffer(out, per))
        return out

    def ialltoall(self, send: torch.Tensor, out: torch.Tensor, *,
                  agreed: bool = False) -> Request:
        per = self._exchange_args("alltoall", send, out)
        if self._size == 1:
            out.copy_(send)
        elif not agreed:
            self._agree("ialltoall", send)
        nbytes = per * send.element_size() * (self._size - 1)
        sbuf, rbuf = _buffer(send, per), _buffer(out, per)

        def finish(_alive=(send, sbuf, rbuf)) -> torch.Tensor:   # live until completion
            return out
        return self._post("ialltoall", out, nbytes, nbytes,
                          lambda: self.comm.Ialltoall(sbuf, rbuf), finish=finish)

    def iallgather(self, send: torch.Tensor, out: torch.Tensor, *,
                   agreed: bool = False) -> Request:
        per = self._exchange_args("allgather", send, out)
        if self._size == 1:
            out.copy_(send)
        elif not agreed:
            self._agree("iallgather", send)
        nbytes = per * send.element_size() * (self._size - 1)
        sbuf, rbuf = _buffer(send), _buffer(out, per)

        def finish(_alive=(send, sbuf, rbuf)) -> torch.Tensor:   # live until completion
            return out
        return self._post("iallgather", out, nbytes, nbytes,
                          lambda: self.comm.Iallgather(sbuf, rbuf), finish=finish)

    def allgather_object(self, obj) -> list:
        with self._watch("allgather_object"):
            return self.comm.allgather(obj)

    def barrier(self) -> None:
        with self._watch("barrier"):
            self.comm.Barrier()

    # -- non-blocking collectives ------------------------------------------------------------
    def _post(self, name: str, tensor: torch.Tensor, sent: int, recv: int, start,
              finish) -> Request:
        """Post one non-blocking collective (``start()`` returns the mpi4py request): bytes and
        the call counted now, the seconds as it is waited for."""
        if self._size == 1:
            return Pending(self, tensor, "sum", lambda: None, lambda: True, name=name,
                           finish=finish)
        with self._counted(sent, recv):
            req = _translated(start, self.comm)()
        return Pending(self, tensor, "sum", _translated(req.Wait, self.comm),
                       _translated(req.Test, self.comm), name=name, finish=finish)

    def ibroadcast_(self, tensor: torch.Tensor, root: int) -> Request:
        check_tensor(tensor)
        self._check_root(root)
        nbytes = tensor.numel() * tensor.element_size()
        is_root = self._rank == root
        buf = _buffer(tensor)    # (CUDA: synchronises the stream that wrote the tensor)
        return self._post("ibroadcast_", tensor, nbytes if is_root else 0,
                          0 if is_root else nbytes, lambda: self.comm.Ibcast(buf, root=root),
                          finish=lambda: tensor)

    def ielect(self, score: float) -> Request:
        mine = sanitize_score(score)
        # Buffers of their own: several elections may be in flight on one communicator.
        send, recv = np.zeros(1, dtype=_DOUBLE_INT), np.zeros(1, dtype=_DOUBLE_INT)
        send["score"], send["rank"] = mine, self._rank
        if self._size == 1:
            recv[...] = send

        def finish(_alive=(send, recv)) -> Election:   # both buffers live until completion
            leader = int(recv["rank"][0])
            return Election(leader, self.world_ranks[leader], float(recv["score"][0]))
        n = _DOUBLE_INT.itemsize
        return self._post("ielect", torch.empty(0), n, n, lambda: self.comm.Iallreduce(
            [send, MPI.DOUBLE_INT], [recv, MPI.DOUBLE_INT], op=MPI.MINLOC), finish=finish)

    def _watch(self, name: str):
        """A blocking collective on this communicator, numbered for the watchdog (a context)."""
        return _Watched(MONITOR, self.key, self.world_ranks, name, None, self.comm)

    def free(self) -> None:
        for g, *_ in self._graphs.values():
            g.Free()
        self._graphs.clear()
        for child in self._children:
            child.free()
            child.comm.Free()
        self._children.clear()

    # -- fault tolerance (lsgd_hpc.comm.faults) ------------------------------------------------
    def revoke_all(self) -> None:
        """Revoke this communicator and every one derived from it (children, graph
        communicators), so that every member blocked in any of them, or entering one later,
        fails and joins the recovery (ULFM; errors of revoked or dead communicators ignored)."""
        comms = [self.comm] + [g for g, *_ in self._graphs.values()]
        for c in comms:
            try:
                if not c.Is_revoked():
                    c.Revoke()
            except MPI.Exception:
                pass
        for child in self._children:
            child.revoke_all()

    def adopt_shrunk(self, comm: MPI.Comm, key: str) -> None:
        """Rewire this communicator object, in place, onto ``comm`` (the shrunk world of a
        recovery): rank, size and world ranks are the new world's; graph communicators and
        children of the old one are dropped (revoked; the groups are rebuilt). Buffers agreed
        on stay agreed: the survivors are a subset of the members that agreed."""
        self._graphs.clear()
        self._children.clear()
        self.comm = comm
        self._rank, self._size = comm.Get_rank(), comm.Get_size()
        self.world_ranks = tuple(range(self._size))
        self.key = key
        self._n_derived = 0
        self.one_host = None         # known again once the groups are rebuilt

    def abort(self, code: int = 1) -> None:
        """End every rank of the job now (fail fast instead of hanging in the next collective)."""
        MPI.COMM_WORLD.Abort(code)

