"""``lsgd_hpc.init``: the world communicator, its node groups and this rank's device.

    comm = lsgd_hpc.init(backend="mpi")     # under mpirun / srun --mpi=pmix
    comm.rank, comm.size, comm.local_rank, comm.node_index, comm.n_nodes, comm.device

The object it returns is what every method and run-time helper of the library takes. Ranks
are grouped into nodes by host name (``ranks_per_node=K`` groups K consecutive ranks instead,
to try a multi-node layout on one machine).
"""

from __future__ import annotations

import sys
import traceback
from typing import Optional

__all__ = ["Comm", "init"]

_BACKENDS = ("mpi", "horovod", "torch")


class Comm:
    """The world, its node groups and this rank's device (what :func:`init` returns).

    ``world`` is the package's communication interface (``lsgd_hpc.comm.Communicator``),
    ``groups`` the node hierarchy (``NodeGroups``: world, node, node roots). Collective
    helpers here (``barrier``, ``allgather_object``, ``any_true``) are not counted as the
    methods' traffic.
    """

    def __init__(self, world, groups, device, backend: str):
        self.world, self.groups, self.device, self.backend = world, groups, device, backend

    @property
    def rank(self) -> int:
        return self.world.rank

    @property
    def size(self) -> int:
        return self.world.size

    @property
    def local_rank(self) -> int:
        return self.groups.local_rank

    @property
    def local_size(self) -> int:
        return self.groups.local_size

    @property
    def node_index(self) -> int:
        return self.groups.node_index

    @property
    def n_nodes(self) -> int:
        return self.groups.n_nodes

    @property
    def stats(self):
        """Cumulative bytes and seconds of this rank's communication (``CommStats``)."""
        return self.world.stats

    def barrier(self) -> None:
        from lsgd_hpc.comm import uncounted
        with uncounted(self.world):
            self.world.barrier()

    def allgather_object(self, obj) -> list:
        return self.world.allgather_object(obj)

    def any_true(self, flag: bool) -> bool:
        from lsgd_hpc.comm import uncounted
        with uncounted(self.world):
            return self.world.any_true(flag)

    def agree(self, error: Optional[str]) -> Optional[str]:
        """Collective: the first rank's error message (saying on how many ranks it was
        seen), or None when no rank had one. Use it before raising a check's error so that
        every rank raises the same one instead of some waiting in a collective."""
        errors = self.world.allgather_object(error)
        bad = [r for r, e in enumerate(errors) if e]
        if not bad:
            return None
        msg = errors[bad[0]]
        if len(bad) < len(errors):
            msg += f" (on {len(bad)} of {len(errors)} ranks, first rank {bad[0]})"
        return msg

    def abort(self, code: int = 1) -> None:
        self.world.abort(code)

    def __repr__(self) -> str:
        return (f"Comm(backend={self.backend!r}, rank={self.rank}, size={self.size}, "
                f"node={self.node_index}/{self.n_nodes}, device={self.device})")


def _pick_device(device, local_rank: int):
    import torch
    if isinstance(device, torch.device):
        return device
    if device in (None, "auto"):
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        return torch.device("cpu")
    if device == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("device: 'cuda' asked for, but torch sees no GPU on this node")
        dev = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(dev)
        return dev
    raise ValueError(f"device must be 'auto', 'cpu', 'cuda' or a torch.device, got {device!r}")


def _install_abort_hook(world) -> None:
    """An exception that escapes the user's script on one rank ends every rank now (as
    ``python -m mpi4py`` does): otherwise the others wait in their next collective forever."""
    previous = sys.excepthook

    def hook(exc_type, exc, tb):
        try:
            print(f"[lsgd_hpc] rank {world.rank}: uncaught {exc_type.__name__}: {exc}; "
                  "aborting every rank", file=sys.stderr, flush=True)
            traceback.print_exception(exc_type, exc, tb, file=sys.stderr)
            sys.stderr.flush()
        finally:
            if world.size > 1 and not issubclass(exc_type, KeyboardInterrupt):
                world.abort(1)
            previous(exc_type, exc, tb)

    sys.excepthook = hook


def init(backend: str = "mpi", ranks_per_node: Optional[int] = None, device="auto",
         abort_on_exception: bool = True) -> Comm:
    """Join the job's world (collective: every rank calls it once, first).

    ``backend``: ``"mpi"`` (mpi4py; mpirun, srun --mpi=pmix), ``"horovod"``, or ``"torch"``
    (torch.distributed) where this build has it. ``ranks_per_node``: group K consecutive
    ranks as one node (default: by host name, or ``LSGD_HPC_RANKS_PER_NODE``). ``device``:
    ``"auto"`` (this rank's GPU by node-local rank when torch sees one, else the CPU),
    ``"cpu"``, ``"cuda"`` or a torch.device. ``abort_on_exception``: an uncaught exception
    on one rank aborts the whole job (the default), instead of leaving the others hanging.
    """
    if backend not in _BACKENDS:
        hint = ""
        if str(backend).lower() in ("nccl", "gloo"):
            hint = (f"; {backend} is reached through backend=\"torch\" (torch.distributed: "
                    "NCCL for GPU tensors, gloo for CPU ones)")
        raise ValueError(f"backend must be one of {', '.join(_BACKENDS)}, got {backend!r}{hint}")
    if ranks_per_node is not None and (not isinstance(ranks_per_node, int) or ranks_per_node < 1):
        raise ValueError(f"ranks_per_node must be a positive integer, got {ranks_per_node!r}")
    from lsgd_hpc.comm import NodeGroups, launcher, make_world
    local = launcher.local_rank()
    # the device first: NCCL binds the process group to this rank's GPU
    dev = _pick_device(device, local if local is not None else launcher.env_rank())
    world = make_world(backend, device=dev) if backend == "torch" else make_world(backend)
    if abort_on_exception:
        _install_abort_hook(world)
    groups = NodeGroups.build(world, ranks_per_node)
    return Comm(world, groups, dev, backend)
