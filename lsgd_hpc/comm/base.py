"""The narrow communication interface every algorithm uses, and its shared bookkeeping."""

from __future__ import annotations

import abc
import math
import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from lsgd_hpc.comm.monitor import MONITOR

__all__ = ["CommStats", "Election", "Communicator", "CommError", "Pending", "Request",
           "check_tensor", "sanitize_score"]

#: dtypes the backends can move (mapped to MPI datatypes by the MPI backend).
SUPPORTED_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16,
                    torch.int32, torch.int64, torch.uint8)
#: dtypes an allreduce adds (bfloat16 through a sum of the backend's own: MPI has none;
#: float16 is refused)
REDUCIBLE_DTYPES = (torch.float32, torch.float64, torch.int32, torch.int64, torch.bfloat16)


class CommError(ValueError):
    """A caller handed the communication layer something it cannot move safely."""


@dataclass
class CommStats:
    """Cumulative traffic of this rank: payload bytes it sent and received, and seconds spent.

    Conventions (logical payload, independent of the MPI library's algorithm):
    allreduce of n bytes: sent n, received n.  broadcast: the root sends n, every other rank
    receives n.  neighbour exchange: n per out-neighbour sent, n per in-neighbour received.
    alltoall of n bytes (n/p per member): the (p - 1) n/p that leave sent, as many received.
    allgather of n bytes from each member: n per other member, sent and received.
    A quantized allreduce (lsgd_hpc.comm.quantized) counts as an allreduce of its payload.
    Sub-communicators share their parent's stats, so the totals are per rank.
    """

    bytes_sent: int = 0
    bytes_recv: int = 0
    seconds: float = 0.0
    calls: int = 0
    #: seconds of control traffic (the stop-flag agreement), kept out of both the method's
    #: communication and the compute time; still part of the training time
    overhead_seconds: float = 0.0
    #: seconds of measurement traffic (consensus probes): left out of the training time
    probe_seconds: float = 0.0

    def snapshot(self) -> "CommStats":
        return CommStats(**self.state_dict())

    def reset(self) -> None:
        """Back to zero (a second run in the same job starts its counters afresh)."""
        self.load_state_dict(CommStats().state_dict())

    def state_dict(self) -> dict:
        return {"bytes_sent": self.bytes_sent, "bytes_recv": self.bytes_recv,
                "seconds": self.seconds, "calls": self.calls,
                "overhead_seconds": self.overhead_seconds, "probe_seconds": self.probe_seconds}

    def load_state_dict(self, state: dict) -> None:
        self.bytes_sent = int(state["bytes_sent"])
        self.bytes_recv = int(state["bytes_recv"])
        self.seconds = float(state["seconds"])
        self.calls = int(state["calls"])
        self.overhead_seconds = float(state.get("overhead_seconds", 0.0))
        self.probe_seconds = float(state.get("probe_seconds", 0.0))


@dataclass(frozen=True)
class Election:
    """Result of a leader election over one communicator."""

    rank: int          # leader's rank in the communicator the election ran on
    world_rank: int    # the same leader's rank in the world communicator
    score: float       # leader's score (+inf when no member had a finite score)


def sanitize_score(score: float) -> float:
    """Map a score to what an election compares: any non-finite value becomes +inf.

    +inf never beats a finite score under MINLOC, and among all-non-finite members the
    tie-break (lowest rank) still gives every member the same answer.
    """
    score = float(score)
    return score if math.isfinite(score) else math.inf


def check_tensor(t, name: str = "tensor") -> torch.Tensor:
    """Refuse what would corrupt memory or hang: non-tensors, non-contiguous views, odd dtypes."""
    if not isinstance(t, torch.Tensor):
        raise CommError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if not t.is_contiguous():
        raise CommError(f"{name} must be contiguous (got strides {tuple(t.stride())}); "
                        "call .contiguous() or use a FlatParams buffer")
    if t.dtype not in SUPPORTED_DTYPES:
        raise CommError(f"{name} has unsupported dtype {t.dtype}")
    return t


class _Counted:
    """The context of Communicator._counted (a class: it is on the path of every collective,
    and cheaper than a generator-based context manager)."""

    __slots__ = ("stats", "sent", "recv", "t0")

    def __init__(self, stats: "CommStats", sent: int, recv: int):
        self.stats, self.sent, self.recv = stats, sent, recv

    def __enter__(self) -> None:
        self.t0 = time.perf_counter()

    def __exit__(self, *exc) -> bool:
        st = self.stats
        st.seconds += time.perf_counter() - self.t0
        st.bytes_sent += int(self.sent)
        st.bytes_recv += int(self.recv)
        st.calls += 1
        return False


class Pending:
    """A non-blocking collective in flight; :meth:`wait` completes it, :meth:`test` progresses it.

    Its buffers must not be read or written until it has completed (MPI or Horovod may be
    reading and writing them). ``test`` lets the library progress the operation (Open MPI's
    non-blocking collectives advance only inside MPI calls) and says whether it is done;
    once done, ``result`` is what the collective produced (the tensor for an allreduce or a
    broadcast, the Election for ``ielect``). ``wait`` books its blocking time in the
    communicator's ``stats.seconds`` (the time that communication was not hidden behind
    computation) and is the collective the watchdog sees this rank blocked in. Every posted
    collective is numbered on its communicator (``seq``) for the watchdog's report.
    """

    def __init__(self, comm: "Communicator", tensor: torch.Tensor, op: str,
                 wait: Callable[[], None], test: Callable[[], bool], *,
                 name: str = "iallreduce_", finish: Optional[Callable[[], object]] = None):
        self.comm, self.tensor, self.op, self.name = comm, tensor, op, name
        self._wait, self._test = wait, test
        # default: an allreduce, whose mean is finished on this side
        self._finish = finish or (lambda: self.comm._finish_mean(self.tensor, self.op))
        self._result = None
        self.done = False
        self.seq = MONITOR.post(comm.key, name)

    def test(self) -> bool:
        """Progress the operation; True once it has completed (``wait`` is then immediate)."""
        if not self.done and self._test():
            self.wait()           # completes the bookkeeping (Horovod: frees the handle)
        return self.done

    def wait(self):
        """Block until complete; returns ``result``."""
        if not self.done:
            t0 = time.perf_counter()
            try:
                with MONITOR.inside(self.comm.key, self.comm.world_ranks, self.seq, self.name):
                    self._wait()
            finally:
                self.comm.stats.seconds += time.perf_counter() - t0
            self.done = True
            self._result = self._finish()
        return self._result

    @property
    def result(self):
        if not self.done:
            raise CommError(f"{self.name}: result read before the collective completed")
        return self._result


#: what the asynchronous methods hold: a posted collective (one class on every backend)
Request = Pending


def _no_wait() -> None:
    pass


class Communicator(abc.ABC):
    """One group of ranks. Every method is collective over the group unless stated.

    In-place methods end in ``_`` like torch's. A size-1 communicator returns at once.
    """

    stats: CommStats
    #: world rank of each member, indexed by rank in this communicator
    world_ranks: Sequence[int]
    #: the communicator's name, the same on every member ("world", "world/split1:0", ...):
    #: the collective watchdog numbers collectives per name
    key: str = "world"

    @property
    @abc.abstractmethod
    def rank(self) -> int: ...

    @property
    @abc.abstractmethod
    def size(self) -> int: ...

    @property
    def world_rank(self) -> int:
        return self.world_ranks[self.rank]

    # -- collectives ---------------------------------------------------------------------
    def agree_buffers(self, *tensors: torch.Tensor) -> None:
        """Collective, at set-up: agree once on these fixed buffers' shapes, so that later
        collectives on them skip the per-call agreement check (backends that have one)."""

    @abc.abstractmethod
    def allreduce_(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """In place: tensor <- sum (op='sum') or mean (op='mean') over the group."""

    def iallreduce_(self, tensor: torch.Tensor, op: str = "sum", *,
                    agreed: bool = False) -> Pending:
        """Start ``allreduce_(tensor, op)`` without waiting; complete it with ``.wait()``.

        Every member must start the group's non-blocking collectives in the same order.
        Bytes and the call are counted when it starts, the seconds spent starting and
        waiting as communication time. ``agreed=True``: the caller has already made sure
        that every member passes the same numel and dtype (a bucket plan checked once),
        so the per-call agreement check is skipped.
        """
        self._check_allreduce(tensor, op)
        if self.size == 1:
            return Pending(self, tensor, "sum", _no_wait, lambda: True)
        nbytes = tensor.numel() * tensor.element_size()
        with self._counted(nbytes, nbytes):
            wait, test = self._start_iallreduce(tensor, agreed)
        return Pending(self, tensor, op, wait, test)

    def _start_iallreduce(self, tensor: torch.Tensor, agreed: bool):
        """Backend part of :meth:`iallreduce_`: start an in-place sum, return (wait, test)."""
        raise NotImplementedError(f"{type(self).__name__} has no non-blocking allreduce")

    @abc.abstractmethod
    def broadcast_(self, tensor: torch.Tensor, root: int) -> torch.Tensor:
        """In place: every member's tensor <- root's tensor (root is a rank in this group)."""

    @abc.abstractmethod
    def elect(self, score: float) -> Election:
        """Leader = argmin of score over the group, ties to the lowest rank, one MINLOC reduction.

        A non-finite score never wins while a finite one exists.
        """

    # -- more non-blocking collectives -----------------------------------------------------
    # Every member posts the same non-blocking collectives in the same order; a method that
    # keeps them in flight across steps posts them on a communicator of its own (dup()), so
    # that they never interleave with the blocking ones of the trainer.
    @abc.abstractmethod
    def ibroadcast_(self, tensor: torch.Tensor, root: int) -> Request:
        """Post broadcast_ without waiting; the root must not write ``tensor`` until completed."""

    @abc.abstractmethod
    def ielect(self, score: float) -> Request:
        """Post elect without waiting (one MINLOC reduction); ``result`` is the Election."""

    @abc.abstractmethod
    def dup(self) -> "Communicator":
        """The same members in a communicator of their own (collective); shares the stats."""

    @abc.abstractmethod
    def neighbor_allgather(self, tensor: torch.Tensor, sources: Sequence[int],
                           destinations: Sequence[int], out: Optional[torch.Tensor] = None,
                           graph_key=None) -> torch.Tensor:
        """Send ``tensor`` to every rank in ``destinations``; receive one tensor from every rank
        in ``sources``. Returns ``out`` of shape (len(sources), *tensor.shape), row k holding
        the tensor of ``sources[k]``. Collective over the group: every member calls it with
        its own lists, and the lists must be consistent (j in destinations of i iff i in
        sources of j). The graph communicator is created once per distinct graph and cached;
        ``graph_key``, the same on every member, names the whole graph (for instance
        (topology name, step % period)) and saves the agreement on cache hits.
        """

    @abc.abstractmethod
    def split(self, color: int, key: Optional[int] = None) -> Optional["Communicator"]:
        """Sub-communicator of the members with the same color (color < 0: none, returns None).

        The result shares this communicator's stats.
        """

    # -- personalised exchange and gather (the two phases of a quantized allreduce) -----------
    def alltoall(self, send: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Chunk j of ``send`` (``send.numel() // size`` elements) goes to rank j; chunk i of
        ``out`` (same numel and dtype as ``send``) comes from rank i. Returns ``out``."""
        raise NotImplementedError(f"{type(self).__name__} has no alltoall")

    def allgather(self, send: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Chunk i of ``out`` (``size * send.numel()`` elements of send's dtype) <- rank i's
        ``send``. Returns ``out``."""
        raise NotImplementedError(f"{type(self).__name__} has no allgather")

    def ialltoall(self, send: torch.Tensor, out: torch.Tensor, *,
                  agreed: bool = False) -> Request:
        """Post :meth:`alltoall` without waiting (``send`` and ``out`` untouched until it
        completes); ``result`` is ``out``. Counted as the blocking one (bytes and the call
        when posted, the seconds as it is waited for). ``agreed=True``: the caller has made
        sure every member passes the same numel and dtype (no per-call agreement check).
        Default (a backend without one): the blocking alltoall, a completed request."""
        self.alltoall(send, out)
        return Pending(self, out, "sum", _no_wait, lambda: True, name="ialltoall",
                       finish=lambda: out)

    def iallgather(self, send: torch.Tensor, out: torch.Tensor, *,
                   agreed: bool = False) -> Request:
        """Post :meth:`allgather` without waiting; as :meth:`ialltoall` otherwise."""
        self.allgather(send, out)
        return Pending(self, out, "sum", _no_wait, lambda: True, name="iallgather",
                       finish=lambda: out)

    def _exchange_args(self, what: str, send: torch.Tensor, out: torch.Tensor) -> int:
        """Check the buffers of an alltoall or allgather; the elements per member's chunk."""
        check_tensor(send, "send")
        check_tensor(out, "out")
        per = send.numel() // self.size if what == "alltoall" else send.numel()
        want = send.numel() if what == "alltoall" else send.numel() * self.size
        if what == "alltoall" and send.numel() % self.size:
            raise CommError(f"alltoall: send has {send.numel()} elements, not a multiple of "
                            f"the group size {self.size}")
        if out.numel() != want or out.dtype != send.dtype or out.device != send.device:
            raise CommError(f"{what}: out must hold {want} elements of {send.dtype} on "
                            f"{send.device}, got {out.numel()} of {out.dtype} on {out.device}")
        return per

    @abc.abstractmethod
    def allgather_object(self, obj) -> list:
        """Small Python objects (host names, configuration checks); not counted as traffic."""

    @abc.abstractmethod
    def barrier(self) -> None: ...

    def any_true(self, flag: bool) -> bool:
        """True on every member when any member passed True (one tiny allreduce)."""
        if self.size == 1:
            return bool(flag)
        buf = torch.tensor([1 if flag else 0], dtype=torch.int32)
        self.allreduce_(buf, "sum")
        return bool(buf.item() > 0)

    def free(self) -> None:
        """Release backend resources (sub-communicators, graph communicators)."""

    # -- bookkeeping shared by backends --------------------------------------------------
    def _counted(self, sent: int, recv: int) -> "_Counted":
        """Count one call's bytes and its seconds in ``stats`` (a context)."""
        return _Counted(self.stats, sent, recv)

    @staticmethod
    def _check_allreduce(tensor: torch.Tensor, op: str) -> None:
        check_tensor(tensor)
        if op not in ("sum", "mean"):
            raise CommError(f"op must be 'sum' or 'mean', got {op!r}")
        if tensor.dtype not in REDUCIBLE_DTYPES:
            raise CommError(f"allreduce of {tensor.dtype} is not supported; use float32/float64 "
                            "(or bfloat16)")

    def _finish_mean(self, tensor: torch.Tensor, op: str) -> torch.Tensor:
        """op='mean' is the sum divided by the group size on every backend (Horovod's Average
        multiplies by 1/size, which differs in the last bit)."""
        if op == "mean":
            if tensor.is_floating_point():
                tensor.div_(self.size)
            else:
                tensor.floor_divide_(self.size)
        return tensor

    def _check_root(self, root: int) -> int:
        if not isinstance(root, int) or not 0 <= root < self.size:
            raise CommError(f"root must be a rank in [0, {self.size}), got {root!r}")
        return root

    def _check_graph_consistent(self, src: tuple, dst: tuple) -> None:
        """Every edge must be declared at both ends, or the neighbour collective waits forever."""
        graphs = self.allgather_object((src, dst))
        me = self.rank
        bad = sorted({j for j in src if me not in graphs[j][1]}
                     | {j for j in dst if me not in graphs[j][0]})
        all_bad = self.allgather_object(bad)
        if any(all_bad):
            r = next(i for i, b in enumerate(all_bad) if b)
            raise CommError(f"neighbor_allgather: rank {r} and ranks {all_bad[r]} disagree on "
                            "the edges between them (each edge needs both ends declared)")

    def _neighbor_args(self, tensor: torch.Tensor, sources: Sequence[int],
                       destinations: Sequence[int], out: Optional[torch.Tensor]) -> tuple:
        """``(sources, destinations, out)`` of a neighbour allgather, checked; ``out`` made
        when not given (shape (len(sources), *tensor.shape), the tensor's dtype)."""
        check_tensor(tensor)
        src, dst = self._check_graph(sources, destinations)
        shape = (len(src),) + tuple(tensor.shape)
        if out is None:
            out = torch.empty(shape, dtype=tensor.dtype, device=tensor.device)
        else:
            check_tensor(out, "out")
            if tuple(out.shape) != shape or out.dtype != tensor.dtype:
                raise CommError(f"out must have shape {shape} and dtype {tensor.dtype}, "
                                f"got {tuple(out.shape)} {out.dtype}")
        return src, dst, out

    def _check_graph(self, sources: Sequence[int], destinations: Sequence[int]) -> tuple:
        src, dst = tuple(int(s) for s in sources), tuple(int(d) for d in destinations)
        for name, lst in (("sources", src), ("destinations", dst)):
            bad = [r for r in lst if not 0 <= r < self.size]
            if bad:
                raise CommError(f"{name} holds ranks outside [0, {self.size}): {bad}")
            if len(set(lst)) != len(lst):
                raise CommError(f"{name} holds a rank twice: {list(lst)}")
        return src, dst
