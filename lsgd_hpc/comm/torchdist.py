"""The communication interface over torch.distributed: gloo for CPU tensors, NCCL for CUDA ones.

Same semantics, checks and byte counts as :class:`~lsgd_hpc.comm.mpi.MPICommunicator`, so that
both backends give the same results and the same traffic figures:

* The world is one default process group created with the backend string
  ``"cpu:gloo,cuda:nccl"`` (``"gloo"`` where CUDA or NCCL is missing): torch dispatches every
  collective by the tensor's device, so CPU tensors (and the small control tensors of the
  agreement checks and elections, always on the CPU) go through gloo and CUDA tensors through
  NCCL. Rendezvous (rank, size, MASTER_ADDR/PORT) comes from :mod:`lsgd_hpc.comm.launcher`:
  torchrun, srun without MPI, or mpirun.
* ``op='mean'`` is a SUM finished as sum / size, as on the other backends (bit-identical).
  Half precision (float16, bfloat16) can be summed here (gloo and NCCL add them), which the
  MPI backend refuses.
* Elections: one all-gather of (score, rank) as float64 pairs, the MINLOC worked out on every
  member from the same list: non-finite scores are +inf (never beat a finite one), ties go to
  the lowest rank. Counted as the 16 bytes of MPI's DOUBLE_INT, like the MPI backend.
* ``split``/``dup`` create process groups with ``new_group(use_local_synchronization=True)``:
  only the members of a group take part in creating it, so a split of a sub-communicator
  (only its members call it) needs nothing from the rest of the world. torch names such a
  group after its ranks and a per-process counter of groups created; the members must see the
  same counter, so every split first agrees on it (the largest among the parent's members,
  in the same object all-gather that collects the colours and keys), then creates the groups
  in colour order.
* ``alltoall``/``allgather`` (the two phases of the int8/fp8 allreduce, on byte buffers):
  ``all_to_all_single`` and ``all_gather_single``, which gloo (torch 2.14) and NCCL both have.
* ``neighbor_allgather``: point-to-point (``batch_isend_irecv``), never a collective over
  the group; neighbours compare buffer signatures first, so gossip stays neighbour-only.
* ``abort``: ends this process at once (``os._exit``); the launcher (torchrun, mpirun,
  ``srun --kill-on-bad-exit``) ends the others, whose gloo peers see the connection close.
"""

from __future__ import annotations

import atexit
import datetime
import os
import sys
from typing import Dict, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from lsgd_hpc.comm.launcher import RENDEZVOUS
from lsgd_hpc.envvars import COMM_VALIDATE
from lsgd_hpc.comm.monitor import MONITOR
from lsgd_hpc.comm.base import (CommError, CommStats, Communicator, Election, Pending, Request,
                                SUPPORTED_DTYPES, check_tensor, sanitize_score)

__all__ = ["TorchCommunicator", "C10dCalls", "init_torch_world", "REDUCIBLE_DTYPES_TORCH"]

#: what an allreduce adds on this backend: the MPI backend's dtypes and half precision
REDUCIBLE_DTYPES_TORCH = (torch.float32, torch.float64, torch.int32, torch.int64,
                          torch.float16, torch.bfloat16)
_DTYPE_CODE = {dt: i + 1 for i, dt in enumerate(SUPPORTED_DTYPES)}
#: the payload of one election as the MPI backend counts it (MPI.DOUBLE_INT, padded)
ELECT_BYTES = 16
#: an allgather into one flat tensor (gloo and NCCL have it; all_gather_single is its newer
#: name, all_gather_into_tensor the older one that torch 2.14 deprecates)
_ALLGATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class C10dCalls:
    """The collectives a :class:`TorchCommunicator` issues, over one process group that
    torch.distributed knows (``group`` None: the default group): torch.distributed's own
    functions. lsgd_hpc.comm.replicas has the same calls over a torchft process group, which
    torch.distributed does not know (its groups are reconfigured between quorums)."""

    def __init__(self, group=None):
        self.group = group

    def all_reduce(self, tensor, op, async_op: bool = False):
        return dist.all_reduce(tensor, op, group=self.group, async_op=async_op)

    def broadcast(self, tensor, root: int, async_op: bool = False):
        return dist.broadcast(tensor, group=self.group, group_src=root, async_op=async_op)

    def all_gather(self, outs: list, send, async_op: bool = False):
        return dist.all_gather(outs, send, group=self.group, async_op=async_op)

    def all_gather_single(self, out, send, async_op: bool = False):
        return _ALLGATHER(out, send, group=self.group, async_op=async_op)

    def all_to_all_single(self, out, send, async_op: bool = False):
        return dist.all_to_all_single(out, send, group=self.group, async_op=async_op)

    def all_gather_object(self, out: list, obj) -> None:
        dist.all_gather_object(out, obj, group=self.group)

    def exchange(self, send, receives, destinations) -> None:
        """Point-to-point: ``send`` to every rank of ``destinations``; each ``(buffer, rank)``
        of ``receives`` filled from that rank."""
        ops = [dist.P2POp(dist.irecv, buf, group=self.group, group_peer=j)
               for buf, j in receives]
        ops += [dist.P2POp(dist.isend, send, group=self.group, group_peer=j)
                for j in destinations]
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()


def _buffer_key(t: torch.Tensor) -> tuple:
    return (t.device.type, t.data_ptr(), t.numel(), t.dtype)


def init_torch_world(env: Optional[dict] = None, timeout_s: Optional[float] = None,
                     device: Optional[torch.device] = None) -> None:
    """Create the default process group once (collective over every rank the launcher
    started); nothing when it exists. Raises CommError when the launcher says too little.

    ``device``: this rank's GPU, bound to the group (``device_id``: NCCL then sets up its
    communicator for that GPU at once instead of guessing at the first CUDA collective)."""
    if dist.is_initialized():
        return
    if not dist.is_available():
        raise CommError("--backend torch: this torch was built without torch.distributed")
    from lsgd_hpc.comm import launcher
    env = os.environ if env is None else env
    info = launcher.detect(env)
    cuda = torch.cuda.is_available() and dist.is_nccl_available()
    backend = "cpu:gloo,cuda:nccl" if cuda else "gloo"
    kwargs = {}
    if timeout_s:
        kwargs["timeout"] = datetime.timedelta(seconds=timeout_s)
    if cuda and device is not None and torch.device(device).type == "cuda":
        kwargs["device_id"] = torch.device(device)
    if info.size is None or info.size == 1 and info.launcher is None:
        # alone: a world of one needs no peer, but a store all the same
        store = dist.HashStore()
        dist.init_process_group(backend, store=store, rank=0, world_size=1, **kwargs)
        RENDEZVOUS.update(launcher=info.launcher or "", host="", port=0)
        return
    store = launcher.torch_store(info, env)
    if store is None:
        kwargs["init_method"] = "env://"
        host, port = info.master_addr or "", int(info.master_port or 0)
    else:
        kwargs["store"] = store
        host = str(getattr(store, "host", info.master_addr or ""))
        port = int(getattr(store, "port", info.master_port or 0))
    RENDEZVOUS.update(launcher=info.launcher or "", host=host, port=port)
    dist.init_process_group(backend, rank=info.rank, world_size=info.size, **kwargs)
    _LEAVING["store"] = store
    atexit.register(_leave_world)


#: how long the barrier of :func:`_leave_world` waits for the other ranks
LEAVE_TIMEOUT_S = 60.0
#: how long rank 0, which serves the TCP store, waits for the others to have left
LEAVE_LAST_S = 10.0
#: the TCP store this process joined through (None under torchrun's env://)
_LEAVING: Dict[str, object] = {}


def _leave_world() -> None:
    """At interpreter exit (a library user's script that ends without tearing down): leave
    the default group together -- a barrier, then destroy it. Without it, a rank whose gloo
    threads are still joinable when the interpreter ends aborts ("terminate called without
    an active exception", SIGABRT) and srun --kill-on-bad-exit then kills the others. The
    barrier waits at most LEAVE_TIMEOUT_S (a peer that failed is not waited for). Rank 0
    serves the TCP store the others joined through: it leaves last (each other rank counts
    itself out in the store once its group is gone; rank 0 waits at most LEAVE_LAST_S), and
    the store is released here, not in the interpreter's final teardown."""
    store = _LEAVING.pop("store", None)
    if not dist.is_available() or not dist.is_initialized():
        return
    rank, size = dist.get_rank(), dist.get_world_size()
    try:
        if size > 1:
            work = dist.all_reduce(torch.zeros(1), async_op=True)
            work.wait(datetime.timedelta(seconds=LEAVE_TIMEOUT_S))
    except Exception:       # a peer gone or late: leave all the same
        pass
    try:
        dist.destroy_process_group()
    except Exception:
        pass
    if store is None or size == 1:
        return
    try:
        if rank != 0:
            store.add("lsgd_hpc/left", 1)
        else:
            import time
            deadline = time.monotonic() + LEAVE_LAST_S
            while store.add("lsgd_hpc/left", 0) < size - 1 and time.monotonic() < deadline:
                time.sleep(0.02)
    except Exception:
        pass
    del store


def _align_group_counter(members_max: int) -> None:
    """Set torch's per-process count of created groups to ``members_max`` (see the module
    docstring): the salt of the names of groups created with local synchronisation."""
    world = getattr(dist.distributed_c10d, "_world", None)
    if world is not None and hasattr(world, "group_count") and world.group_count < members_max:
        world.group_count = members_max


def _group_counter() -> int:
    world = getattr(dist.distributed_c10d, "_world", None)
    return int(getattr(world, "group_count", 0))


class TorchCommunicator(Communicator):
    """A torch.distributed process group behind the lsgd_hpc interface.

    ``group`` None is the world (the default group); ``world_ranks`` maps this group's
    ranks to the default group's ranks, which torch.distributed also calls global ranks.
    """

    def __init__(self, group=None, stats: Optional[CommStats] = None,
                 world_ranks: Optional[Sequence[int]] = None, key: str = "world",
                 env: Optional[dict] = None, device: Optional[torch.device] = None):
        if group is None and world_ranks is None:
            init_torch_world(env, device=device)
        if world_ranks is None:
            world_ranks = range(dist.get_world_size())
        ranks = tuple(int(r) for r in world_ranks)
        self._setup(group, C10dCalls(group), stats, ranks, ranks.index(dist.get_rank()), key)
        if group is None:
            from lsgd_hpc.comm import launcher
            self.one_host = launcher.world_on_one_host(self._size)

    def _setup(self, group, c10d, stats: Optional[CommStats], world_ranks: Sequence[int],
               rank: int, key: str) -> None:
        """The state of a communicator over ``group``, whose collectives ``c10d`` issues."""
        self.group = group
        self._c10d = c10d
        self.stats = stats if stats is not None else CommStats()
        self.world_ranks = tuple(int(r) for r in world_ranks)
        self._size = len(self.world_ranks)
        self._rank = int(rank)
        self.key = key
        self._n_derived = 0
        self._children: list = []
        self.validate = COMM_VALIDATE.read()   # the agreement check before every collective
        self._agreed: Dict[tuple, torch.Tensor] = {}
        # (key, edges) -> (src, dst, serial): graphs whose edges were checked, see _graph
        self._graphs: Dict[tuple, Tuple[tuple, tuple, int]] = {}
        self._serial = 0
        self._nccl_p2p_ready = False
        self.one_host: Optional[bool] = None

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self._size

    # -- helpers -------------------------------------------------------------------------
    def _watch(self, name: str):
        return MONITOR.blocking(self.key, self.world_ranks, name)

    def _agree(self, what: str, tensor: torch.Tensor, root: int = 0) -> None:
        """Raise the same CommError on every member when members disagree on (numel, dtype,
        root): a collective would otherwise fail on some ranks only, or wait forever."""
        if not self.validate or _buffer_key(tensor) in self._agreed:
            return
        sig = [tensor.numel(), _DTYPE_CODE[tensor.dtype], root]
        both = torch.tensor(sig + [-s for s in sig], dtype=torch.int64)
        with self._watch(f"{what} agreement check"):
            self._c10d.all_reduce(both, dist.ReduceOp.MAX)
        hi, lo = both[:3].tolist(), [-v for v in both[3:].tolist()]
        if hi != lo:
            raise CommError(f"{what}: ranks disagree on the buffer (numel {lo[0]}..{hi[0]}, "
                            f"dtype code {lo[1]}..{hi[1]}, root {lo[2]}..{hi[2]})")

    def agree_buffers(self, *tensors: torch.Tensor) -> None:
        """Collective: check these fixed buffers once (see MPICommunicator.agree_buffers);
        later collectives on exactly them skip the per-call check, here and in every split
        or duplicate of this communicator."""
        for t in tensors:
            check_tensor(t)
            if self._size > 1:
                self._agree("agree_buffers", t)
            self._agreed[_buffer_key(t)] = t       # holds the memory: the key never goes stale

    def _check_allreduce(self, tensor: torch.Tensor, op: str) -> None:
        check_tensor(tensor)
        if op not in ("sum", "mean"):
            raise CommError(f"op must be 'sum' or 'mean', got {op!r}")
        if tensor.dtype not in REDUCIBLE_DTYPES_TORCH:
            raise CommError(f"allreduce of {tensor.dtype} is not supported; use "
                            "float32/float64 (or float16/bfloat16 on this backend)")

    # -- collectives ---------------------------------------------------------------------
    def allreduce_(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        self._check_allreduce(tensor, op)
        if self._size == 1:
            return tensor
        self._agree("allreduce_", tensor)
        nbytes = tensor.numel() * tensor.element_size()
        with self._counted(nbytes, nbytes), self._watch("allreduce_"):
            self._c10d.all_reduce(tensor, dist.ReduceOp.SUM)
        return self._finish_mean(tensor, op)

    def _start_iallreduce(self, tensor: torch.Tensor, agreed: bool):
        if not agreed:
            self._agree("iallreduce_", tensor)
        work = self._c10d.all_reduce(tensor, dist.ReduceOp.SUM, async_op=True)
        return work.wait, work.is_completed

    def broadcast_(self, tensor: torch.Tensor, root: int) -> torch.Tensor:
        check_tensor(tensor)
        self._check_root(root)
        if self._size == 1:
            return tensor
        self._agree("broadcast_", tensor, root)
        nbytes = tensor.numel() * tensor.element_size()
        is_root = self._rank == root
        with self._counted(nbytes if is_root else 0, 0 if is_root else nbytes), \
                self._watch("broadcast_"):
            self._c10d.broadcast(tensor, root)
        return tensor

    def _election(self, gathered: torch.Tensor) -> Election:
        pairs = gathered.view(-1, 2).tolist()
        score, leader = min((s, int(r)) for s, r in pairs)
        return Election(leader, self.world_ranks[leader], float(score))

    def elect(self, score: float) -> Election:
        mine = sanitize_score(score)
        if self._size == 1:
            return Election(0, self.world_ranks[0], mine)
        send = torch.tensor([mine, float(self._rank)], dtype=torch.float64)
        out = torch.empty(self._size, 2, dtype=torch.float64)
        with self._counted(ELECT_BYTES, ELECT_BYTES), self._watch("elect"):
            self._c10d.all_gather(list(out.unbind(0)), send)
        return self._election(out)

    def ielect(self, score: float) -> Request:
        mine = sanitize_score(score)
        send = torch.tensor([mine, float(self._rank)], dtype=torch.float64)
        out = torch.empty(self._size, 2, dtype=torch.float64)
        if self._size == 1:
            out.copy_(send.view(1, 2))
            return Pending(self, out, "sum", lambda: None, lambda: True, name="ielect",
                           finish=lambda: self._election(out))
        with self._counted(ELECT_BYTES, ELECT_BYTES):
            work = self._c10d.all_gather(list(out.unbind(0)), send, async_op=True)

        def finish(_send=send) -> Election:       # the send buffer lives until completion
            return self._election(out)
        return Pending(self, out, "sum", work.wait, work.is_completed, name="ielect",
                       finish=finish)

    def ibroadcast_(self, tensor: torch.Tensor, root: int) -> Request:
        check_tensor(tensor)
        self._check_root(root)
        if self._size == 1:
            return Pending(self, tensor, "sum", lambda: None, lambda: True,
                           name="ibroadcast_", finish=lambda: tensor)
        nbytes = tensor.numel() * tensor.element_size()
        is_root = self._rank == root
        with self._counted(nbytes if is_root else 0, 0 if is_root else nbytes):
            work = self._c10d.broadcast(tensor, root, async_op=True)
        return Pending(self, tensor, "sum", work.wait, work.is_completed, name="ibroadcast_",
                       finish=lambda: tensor)

    # -- neighbour exchange --------------------------------------------------------------
    def _exchange(self, send: torch.Tensor, src: tuple, dst: tuple, out: torch.Tensor) -> None:
        """Point-to-point: ``send`` to every rank of ``dst``, row k of ``out`` from ``src[k]``."""
        for k, j in enumerate(src):              # an edge to itself needs no message
            if j == self._rank:
                out[k].copy_(send)
        self._c10d.exchange(send, [(out[k], j) for k, j in enumerate(src) if j != self._rank],
                            [j for j in dst if j != self._rank])

    def neighbor_allgather(self, tensor: torch.Tensor, sources: Sequence[int],
                           destinations: Sequence[int], out: Optional[torch.Tensor] = None,
                           graph_key=None) -> torch.Tensor:
        src, dst, out = self._neighbor_args(tensor, sources, destinations, out)
        self._graph(src, dst, graph_key)
        if self.validate:
            self._agree_neighbours(tensor, src, dst)
        if tensor.is_cuda and not self._nccl_p2p_ready and self._size > 1:
            # NCCL: the first batch_isend_irecv on a group must involve every member, and a
            # rank without neighbours posts nothing; one tiny collective sets the group up
            with self._watch("neighbor_allgather set-up"):
                self._c10d.all_reduce(torch.zeros(1, device=tensor.device), dist.ReduceOp.SUM)
            self._nccl_p2p_ready = True
        nbytes = tensor.numel() * tensor.element_size()
        with self._counted(nbytes * len(dst), nbytes * len(src)), \
                self._watch("neighbor_allgather"):
            self._exchange(tensor, src, dst, out)
        return out

    def _agree_neighbours(self, tensor: torch.Tensor, src: tuple, dst: tuple) -> None:
        """Neighbours compare (numel, dtype): a neighbour that disagrees makes both raise."""
        sig = torch.tensor([tensor.numel(), _DTYPE_CODE[tensor.dtype]], dtype=torch.int64)
        theirs = torch.empty(len(src), 2, dtype=torch.int64)
        with self._watch("neighbor_allgather agreement check"):
            self._exchange(sig, src, dst, theirs)
        mismatch = torch.tensor([int(bool((theirs != sig).any()))], dtype=torch.int64)
        flags = torch.empty(len(src), 1, dtype=torch.int64)
        with self._watch("neighbor_allgather agreement check"):
            self._exchange(mismatch, src, dst, flags)
        if mismatch.item() or flags.any():
            both = torch.vstack([theirs, sig.view(1, 2)])
            lo, hi = both.min(0).values.tolist(), both.max(0).values.tolist()
            raise CommError(f"neighbor_allgather: ranks disagree on the buffer (numel "
                            f"{lo[0]}..{hi[0]}, dtype code {lo[1]}..{hi[1]})")

    def _graph(self, src: tuple, dst: tuple, graph_key=None) -> None:
        """Check a graph's edges once (every edge declared at both ends, or the exchange waits
        forever), as the MPI backend does when it creates its graph communicator: with a
        ``graph_key`` naming the whole graph the cache is keyed on it; without one the
        members agree on a hit with one tiny reduction (a rank's own edges do not identify
        the graph)."""
        if graph_key is not None:
            key = ("key", graph_key)
            entry = self._graphs.get(key)
            if entry is not None and entry[:2] != (src, dst):
                raise CommError(f"graph_key {graph_key!r} was used before with other neighbours")
        else:
            key = ("edges", src, dst)
            entry = self._graphs.get(key)
            serial = -1 if entry is None else entry[2]
            agree = torch.tensor([serial, -serial], dtype=torch.int64)
            if self._size > 1:
                with self._watch("graph cache check"):
                    self._c10d.all_reduce(agree, dist.ReduceOp.MAX)
            if not (agree[0].item() == -agree[1].item() == serial >= 0):
                entry = None
        if entry is None:
            if self.validate:
                self._check_graph_consistent(src, dst)
            self._serial += 1
            self._graphs[key] = (src, dst, self._serial)

    # -- groups --------------------------------------------------------------------------
    def split(self, color: int, key: Optional[int] = None) -> Optional["TorchCommunicator"]:
        key = self._rank if key is None else key
        self._n_derived += 1
        color = -1 if color < 0 else int(color)
        with self._watch("split"):
            table = self.allgather_object((color, int(key), _group_counter()))
        _align_group_counter(max(c for _, _, c in table))
        mine = None
        for c in sorted({c for c, _, _ in table if c >= 0}):
            members = sorted((k, r) for r, (cc, k, _) in enumerate(table) if cc == c)
            world = [self.world_ranks[r] for _, r in members]
            pg = self._new_group(world) if self._rank in [r for _, r in members] else None
            if c == color:
                mine = (pg, world)
        if mine is None:
            return None
        return self._adopt(mine[0], mine[1], f"{self.key}/split{self._n_derived}:{color}")

    def dup(self) -> "TorchCommunicator":
        self._n_derived += 1
        with self._watch("dup"):
            counters = self.allgather_object(_group_counter())
        _align_group_counter(max(counters))
        return self._adopt(self._new_group(list(self.world_ranks)), list(self.world_ranks),
                           f"{self.key}/dup{self._n_derived}")

    def _new_group(self, world_ranks: list):
        """A process group of these world ranks (in this order), made by its members only;
        a one-rank group needs none (its communicator returns at once)."""
        if len(world_ranks) == 1:
            return None
        with MONITOR.blocking(self.key, (), "new_group"):
            return dist.new_group(world_ranks, use_local_synchronization=True, sort_ranks=False)

    def _adopt(self, pg, world_ranks: list, key: str) -> "TorchCommunicator":
        return self._register_child(TorchCommunicator(pg, self.stats, world_ranks, key=key))

    def _register_child(self, child: "TorchCommunicator") -> "TorchCommunicator":
        """Collective over ``child``'s members: a group split from this one learns whether
        it is on one host, shares the buffers agreed on here, and is freed with this one."""
        if child.size > 1:
            hosts = child.allgather_object(_hostname())
            child.one_host = len(set(hosts)) == 1
        else:
            child.one_host = True
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
            self._c10d.all_to_all_single(out, send)
        return out

    def allgather(self, send: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        per = self._exchange_args("allgather", send, out)
        if self._size == 1:
            return out.copy_(send)
        self._agree("allgather", send)
        nbytes = per * send.element_size() * (self._size - 1)
        with self._counted(nbytes, nbytes), self._watch("allgather"):
            self._c10d.all_gather_single(out, send)
        return out

    def ialltoall(self, send: torch.Tensor, out: torch.Tensor, *,
                  agreed: bool = False) -> Request:
        per = self._exchange_args("alltoall", send, out)
        if self._size == 1:
            out.copy_(send)
            return Pending(self, out, "sum", lambda: None, lambda: True, name="ialltoall",
                           finish=lambda: out)
        if not agreed:
            self._agree("ialltoall", send)
        nbytes = per * send.element_size() * (self._size - 1)
        with self._counted(nbytes, nbytes):
            work = self._c10d.all_to_all_single(out, send, async_op=True)

        def finish(_send=send) -> torch.Tensor:       # the send buffer lives until completion
            return out
        return Pending(self, out, "sum", work.wait, work.is_completed, name="ialltoall",
                       finish=finish)

    def iallgather(self, send: torch.Tensor, out: torch.Tensor, *,
                   agreed: bool = False) -> Request:
        per = self._exchange_args("allgather", send, out)
        if self._size == 1:
            out.copy_(send)
            return Pending(self, out, "sum", lambda: None, lambda: True, name="iallgather",
                           finish=lambda: out)
        if not agreed:
            self._agree("iallgather", send)
        nbytes = per * send.element_size() * (self._size - 1)
        with self._counted(nbytes, nbytes):
            work = self._c10d.all_gather_single(out, send, async_op=True)

        def finish(_send=send) -> torch.Tensor:       # the send buffer lives until completion
            return out
        return Pending(self, out, "sum", work.wait, work.is_completed, name="iallgather",
                       finish=finish)

    def allgather_object(self, obj) -> list:
        if self._size == 1:
            return [obj]
        out: list = [None] * self._size
        with self._watch("allgather_object"):
            self._c10d.all_gather_object(out, obj)
        return out

    def barrier(self) -> None:
        if self._size == 1:
            return
        with self._watch("barrier"):
            # a one-element all-reduce on the CPU: gloo's barrier, without NCCL's device guess
            self._c10d.all_reduce(torch.zeros(1, dtype=torch.int32), dist.ReduceOp.SUM)

    def free(self) -> None:
        for child in self._children:
            child.free()
            if child.group is not None:
                try:
                    dist.destroy_process_group(child.group)
                except (RuntimeError, ValueError):
                    pass
        self._children.clear()
        self._graphs.clear()

    def abort(self, code: int = 1) -> None:
        """End this process now, without waiting on anything; the launcher (torchrun, mpirun,
        srun --kill-on-bad-exit) ends the others, and their gloo connections to this one close.
        Under mpirun with MPI initialised, MPI_Abort ends the whole job at once."""
        sys.stdout.flush()
        sys.stderr.flush()
        mpi = sys.modules.get("mpi4py.MPI")
        if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
            mpi.COMM_WORLD.Abort(code)
        os._exit(code)


def _hostname() -> str:
    import socket
    return socket.gethostname()
