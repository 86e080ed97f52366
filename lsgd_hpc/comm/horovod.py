"""The communication interface over Horovod (MPI build): allreduce and broadcast through
``horovod.torch``, node groups as Horovod process sets.

Same semantics as :class:`~lsgd_hpc.comm.mpi.MPICommunicator` (in place, same checks, same
byte counts). What Horovod has no collective for (MINLOC elections, neighbour exchanges,
object gathers, barriers) goes through an ``MPICommunicator`` over the same ranks that shares
this communicator's stats, so it is counted exactly as in the MPI backend.

Horovod specifics handled here:

* ``hvd.init(comm=MPI.COMM_WORLD, process_sets="dynamic")``: process sets are added after
  initialisation, which Horovod only allows with ``HOROVOD_DYNAMIC_PROCESS_SETS=1``
  (set before ``hvd.init``).
* ``hvd.add_process_set`` is collective over the whole world (Horovod's background threads
  agree on the table of sets), so :meth:`HorovodCommunicator.split` works on the world
  communicator only: every rank learns every group's ranks (an allgather of colors) and adds
  every group's process set in the same order. A set of the same ranks is added once and
  reused (Horovod refuses duplicates); the whole world is ``hvd.global_process_set``; a
  one-rank group needs none (size-1 communicators return at once).
* Horovod matches the ranks' requests by operation name, and its automatic names count per
  process, so ranks whose earlier traffic differs (node groups) would wait on each other
  forever. Every operation gets an explicit name that is the same on every member.
* ``op="mean"`` is a Horovod Sum then a division by the group size, exactly as in the MPI
  backend, so that both backends give bit-identical results (``hvd.Average`` multiplies by
  1/size and differs in the last bit).
* ``broadcast_``'s root is a world rank in Horovod, also on a process set.
* Horovod has no bfloat16 and no half-precision broadcast path of its own here: 2-byte
  types are broadcast as int16 words (as the MPI backend moves them as 16-bit words).
* Horovod 0.28.1's allreduce has no bfloat16 sum (``hvd.allreduce_`` raises "Tensor type
  torch.BFloat16Tensor is not supported"). A bfloat16 allreduce here is a reduce-scatter and
  an allgather of int16 words: with c = ceil(n / p), chunk j (c elements, zero padded) of
  every member goes to member j (``hvd.alltoall``), member j sums its p chunks in rank order,
  s <- bf16(s + x_i) for i = 1..p-1 (each addition widened to float32, exact, and rounded to
  nearest even, as the MPI backend's bfloat16 sum rounds after every addition), and
  ``hvd.allgather`` gives every member every summed chunk: the same bits on every member,
  2 (p - 1) c bytes each way in all (a ring allreduce's), counted as the MPI backend's
  allreduce (n * 2 bytes each way). The rank order may differ from the order in which MPI
  combines; past 2 members the two backends' bfloat16 sums may differ in the last bit.
* The compressed allreduce's byte buffers (lsgd_hpc.comm.quantized, lsgd_hpc.comm.sparse)
  go through ``hvd.alltoall`` (equal splits) and ``hvd.allgather``: :meth:`alltoall`,
  :meth:`allgather`, blocking (``ialltoall``/``iallgather`` are the base class's).
"""

from __future__ import annotations

import os
from typing import Dict, Optional, Sequence, Tuple

import torch

from lsgd_hpc.comm.base import CommError, CommStats, Communicator, Election, Request, check_tensor
from lsgd_hpc.comm.mpi import MPICommunicator  # mpi4py first: it puts libmpi in the process

__all__ = ["HorovodCommunicator", "horovod_available", "NOT_INSTALLED"]

NOT_INSTALLED = ("--backend horovod: Horovod is not installed in this environment; run "
                 "`make horovod` (builds Horovod 0.28.1 against this torch, about 5 minutes)")

_hvd = None
#: non-blocking allreduce names cycle through this many slots (see _start_iallreduce)
NAME_CYCLE = 256
#: world ranks (sorted) -> the Horovod process set of those ranks, added once per process
_PROCESS_SETS: Dict[Tuple[int, ...], object] = {}


def _import_horovod():
    """``horovod.torch``, initialised over MPI.COMM_WORLD with dynamic process sets."""
    global _hvd
    if _hvd is not None:
        return _hvd
    try:
        import horovod.torch as hvd
    except ModuleNotFoundError as e:
        if e.name and e.name.split(".")[0] == "horovod":
            raise CommError(NOT_INSTALLED) from None
        raise CommError(f"--backend horovod: `import horovod.torch` fails ({e}); "
                        "run `make horovod` to reinstall it") from e
    except ImportError as e:
        raise CommError(f"--backend horovod: `import horovod.torch` fails "
                        f"({str(e).splitlines()[0] if str(e) else type(e).__name__}); "
                        "run `make horovod` to reinstall it") from e
    from mpi4py import MPI
    if not hvd.is_initialized():
        # Process sets are added after init (split); Horovod allows that only with this set.
        os.environ["HOROVOD_DYNAMIC_PROCESS_SETS"] = "1"
        hvd.init(comm=MPI.COMM_WORLD, process_sets="dynamic")  # registers hvd.shutdown atexit
    elif os.environ.get("HOROVOD_DYNAMIC_PROCESS_SETS") != "1":
        raise CommError("Horovod was initialised before HorovodCommunicator without "
                        "HOROVOD_DYNAMIC_PROCESS_SETS=1; node groups need dynamic process sets")
    if hvd.size() != MPI.COMM_WORLD.Get_size():
        raise CommError(f"Horovod runs over {hvd.size()} ranks, MPI.COMM_WORLD has "
                        f"{MPI.COMM_WORLD.Get_size()}")
    _hvd = hvd
    return hvd


def horovod_available() -> bool:
    """True when ``horovod.torch`` imports (does not initialise Horovod). mpi4py is imported
    first, as the backend does, so an import-order problem is not mistaken for a missing
    Horovod; only a missing ``horovod`` package gives False."""
    from mpi4py import MPI  # noqa: F401
    try:
        import horovod.torch  # noqa: F401
    except ModuleNotFoundError as exc:
        if exc.name and exc.name.split(".")[0] == "horovod":
            return False
        raise
    return True


def _process_set(hvd, ranks: Tuple[int, ...], world_size: int):
    """The process set of these world ranks; collective over the world when it is new."""
    if len(ranks) == world_size:
        return hvd.global_process_set
    ps = _PROCESS_SETS.get(ranks)
    if ps is None:
        ps = hvd.add_process_set(list(ranks))
        _PROCESS_SETS[ranks] = ps
    return ps


class HorovodCommunicator(Communicator):
    """Horovod (MPI build) behind the lsgd_hpc interface.

    ``HorovodCommunicator()`` is the world; sub-communicators come from :meth:`split`.
    """

    def __init__(self, stats: Optional[CommStats] = None, *, _mpi: Optional[MPICommunicator] = None,
                 _process_set=None):
        self._hvd = _import_horovod()
        if _mpi is None:                       # the world
            _mpi = MPICommunicator(stats=stats)
            _process_set = self._hvd.global_process_set
        self._mpi = _mpi
        self.stats = _mpi.stats
        self.world_ranks = _mpi.world_ranks
        self._ps = _process_set               # None for a one-rank communicator
        self._is_world = _process_set is self._hvd.global_process_set
        # Process-set ids agree on every rank: every rank adds the same sets in the same order.
        self._tag = "-" if _process_set is None else str(_process_set.process_set_id)
        self._started = 0                     # non-blocking operations started (names)

    @property
    def rank(self) -> int:
        return self._mpi.rank

    @property
    def key(self) -> str:
        return self._mpi.key

    @property
    def size(self) -> int:
        return self._mpi.size

    @property
    def validate(self) -> bool:
        """The MPI backend's agreement check before every collective (LSGD_HPC_COMM_VALIDATE)."""
        return self._mpi.validate

    @validate.setter
    def validate(self, on: bool) -> None:
        self._mpi.validate = bool(on)

    @property
    def process_set(self):
        """The Horovod process set of this group (None for a one-rank group)."""
        return self._ps

    # -- collectives ---------------------------------------------------------------------
    def _name(self, kind: str, tensor: torch.Tensor) -> str:
        # Same on every member, whatever else each member has done before (see module doc).
        dtype = str(tensor.dtype).replace("torch.", "")
        return f"lsgd.{self._tag}.{kind}.{dtype}.{tensor.numel()}"

    def allreduce_(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        self._check_allreduce(tensor, op)
        if self.size == 1:
            return tensor
        # Same CommError as the MPI backend on every member when members disagree on the
        # buffer (also: names carry numel and dtype, so Horovod would wait, not fail).
        self._mpi._agree("allreduce_", tensor)
        nbytes = tensor.numel() * tensor.element_size()
        with self._counted(nbytes, nbytes), self._mpi._watch("allreduce_ (horovod)"):
            if tensor.dtype == torch.bfloat16:
                self._bf16_sum_(tensor)
            elif tensor.numel() > 0:
                # detach(): same storage, and Horovod never sees autograd state.
                self._hvd.allreduce_(tensor.detach(), op=self._hvd.Sum,
                                     name=self._name("sum", tensor), process_set=self._ps)
        # Mean as sum / size, not hvd.Average, so both backends agree to the last bit.
        return self._finish_mean(tensor, op)

    def _start_iallreduce(self, tensor: torch.Tensor, agreed: bool):
        if not agreed:
            self._mpi._agree("iallreduce_", tensor)
        if tensor.numel() == 0:
            return (lambda: None), (lambda: True)
        if tensor.dtype == torch.bfloat16:        # no non-blocking form: done at the start
            self._bf16_sum_(tensor)
            return (lambda: None), (lambda: True)
        # Names must be unique among operations in flight and the same on every member.
        # Members start these in the same order, but they see them complete at different
        # times (test() polls), so a name may depend only on the start count: the count
        # modulo NAME_CYCLE. Names then repeat (Horovod's response cache keeps working), and
        # two in flight at once could share one only with NAME_CYCLE operations in between.
        slot = self._started % NAME_CYCLE
        self._started += 1
        handle = self._hvd.allreduce_async_(tensor.detach(), op=self._hvd.Sum,
                                            name=f"{self._name('isum', tensor)}.{slot}",
                                            process_set=self._ps)
        return (lambda: self._hvd.synchronize(handle)), (lambda: self._hvd.poll(handle))

    def broadcast_(self, tensor: torch.Tensor, root: int) -> torch.Tensor:
        check_tensor(tensor)
        self._check_root(root)
        if self.size == 1:
            return tensor
        self._mpi._agree("broadcast_", tensor, root)
        nbytes = tensor.numel() * tensor.element_size()
        is_root = self.rank == root
        buf = tensor.detach()
        if buf.dtype in (torch.float16, torch.bfloat16):
            buf = buf.view(torch.int16)
        with self._counted(nbytes if is_root else 0, 0 if is_root else nbytes), \
                self._mpi._watch("broadcast_ (horovod)"):
            if tensor.numel() > 0:
                # Horovod's root_rank is a world rank, also on a process set.
                self._hvd.broadcast_(buf, root_rank=self.world_ranks[root],
                                     name=self._name("bcast", buf), process_set=self._ps)
        return tensor

    def _bf16_sum_(self, tensor: torch.Tensor) -> None:
        """In place: the bfloat16 sum over the group, as a reduce-scatter (alltoall of
        chunks) with the rank-order sum and an allgather (module doc). Not counted here."""
        n, p = tensor.numel(), self.size
        if n == 0:
            return
        c = -(-n // p)
        words = torch.zeros(p * c, dtype=torch.int16)
        words[:n].copy_(tensor.detach().reshape(-1).view(torch.int16))
        splits = torch.full((p,), c, dtype=torch.int32)
        got = self._hvd.alltoall(words, splits=splits, name=self._name("bf16rs", words),
                                 process_set=self._ps)
        parts = (got[0] if isinstance(got, tuple) else got).view(torch.bfloat16).view(p, c)
        acc = parts[0].clone()
        for i in range(1, p):                      # rank order, rounded after every addition
            acc = (acc.to(torch.float32) + parts[i].to(torch.float32)).to(torch.bfloat16)
        acc = acc.view(torch.int16)
        every = self._hvd.allgather(acc, name=self._name("bf16ag", acc), process_set=self._ps)
        tensor.detach().reshape(-1).view(torch.int16).copy_(every[:n])

    # Byte buffers of the compressed allreduce (lsgd_hpc.comm.quantized: alltoall then
    # allgather of quantized records; top-k: allgather of index/value records). Horovod's
    # alltoall takes the per-member splits and returns a new tensor, its allgather
    # concatenates along dim 0; both are copied into ``out``. Checked, agreed and counted
    # exactly as MPICommunicator's (per-member chunk bytes times size - 1, each way).
    @staticmethod
    def _wire(t: torch.Tensor) -> torch.Tensor:
        """``t`` (flat) as a dtype Horovod moves: 2-byte floats as int16 words."""
        t = t.detach().reshape(-1)
        return t.view(torch.int16) if t.dtype in (torch.float16, torch.bfloat16) else t

    def alltoall(self, send: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        per = self._exchange_args("alltoall", send, out)
        if self.size == 1:
            return out.copy_(send)
        self._mpi._agree("alltoall", send)
        nbytes = per * send.element_size() * (self.size - 1)
        with self._counted(nbytes, nbytes), self._mpi._watch("alltoall (horovod)"):
            if send.numel() > 0:
                buf = self._wire(send)
                splits = torch.full((self.size,), per, dtype=torch.int32)
                got = self._hvd.alltoall(buf, splits=splits, name=self._name("a2a", buf),
                                         process_set=self._ps)
                got = got[0] if isinstance(got, tuple) else got   # (output, received splits)
                self._wire(out).copy_(got)
        return out

    def allgather(self, send: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        per = self._exchange_args("allgather", send, out)
        if self.size == 1:
            return out.copy_(send)
        self._mpi._agree("allgather", send)
        nbytes = per * send.element_size() * (self.size - 1)
        with self._counted(nbytes, nbytes), self._mpi._watch("allgather (horovod)"):
            if send.numel() > 0:
                buf = self._wire(send)
                got = self._hvd.allgather(buf, name=self._name("gather", buf),
                                          process_set=self._ps)
                self._wire(out).copy_(got)
        return out

    def elect(self, score: float) -> Election:
        return self._mpi.elect(score)

    # No MINLOC in Horovod, and a broadcast kept in flight across steps must not share
    # Horovod's name space with the blocking ones: these go through the same ranks' mpi4py
    # communicator, as elect and neighbor_allgather do.
    def ibroadcast_(self, tensor: torch.Tensor, root: int) -> Request:
        return self._mpi.ibroadcast_(tensor, root)

    def ielect(self, score: float) -> Request:
        return self._mpi.ielect(score)

    def agree_buffers(self, *tensors: torch.Tensor) -> None:
        self._mpi.agree_buffers(*tensors)

    def dup(self) -> MPICommunicator:
        """The mpi4py side's duplicate: what a method keeps in flight across steps stays out of
        Horovod's negotiation with the trainer's blocking collectives."""
        return self._mpi.dup()

    def neighbor_allgather(self, tensor: torch.Tensor, sources: Sequence[int],
                           destinations: Sequence[int], out: Optional[torch.Tensor] = None,
                           graph_key=None) -> torch.Tensor:
        return self._mpi.neighbor_allgather(tensor, sources, destinations, out, graph_key)

    def split(self, color: int, key: Optional[int] = None) -> Optional["HorovodCommunicator"]:
        if not self._is_world:
            raise CommError("HorovodCommunicator.split works on the world communicator only: "
                            "Horovod process sets are added by every rank of the world")
        color = -1 if color < 0 else int(color)
        key = self.rank if key is None else key
        sub = self._mpi.split(color, key)              # the mpi4py side, same ranks and order
        colors = self._mpi.allgather_object(color)     # rank here -> color
        groups: Dict[int, list] = {}
        for rank, c in enumerate(colors):
            if c >= 0:
                groups.setdefault(c, []).append(self.world_ranks[rank])
        mine = None
        # Every rank adds every group's set, in the same order (sorted colors).
        for c in sorted(groups):
            ranks = tuple(sorted(groups[c]))
            ps = _process_set(self._hvd, ranks, self.size) if len(ranks) > 1 else None
            if c == color:
                mine = ps
        if sub is None:
            return None
        return HorovodCommunicator(_mpi=sub, _process_set=mine)

    def allgather_object(self, obj) -> list:
        return self._mpi.allgather_object(obj)

    def barrier(self) -> None:
        self._mpi.barrier()

    def free(self) -> None:
        # Process sets stay registered (removing one is collective over the world, and a
        # later split of the same ranks reuses it); the mpi4py side is freed.
        self._mpi.free()

    def abort(self, code: int = 1) -> None:
        """End every rank of the job now (fail fast instead of hanging in the next collective)."""
        self._mpi.abort(code)
