"""``lsgd_hpc.init``: the world communicator, its node groups and this rank's device.

    comm = lsgd_hpc.init(backend="mpi")     # under mpirun / srun --mpi=pmix
    comm.rank, comm.size, comm.local_rank, comm.node_index, comm.n_nodes, comm.device

The object it returns is what every method and run-time helper of the library takes. Ranks
are grouped into nodes by host name (``ranks_per_node=K`` groups K consecutive ranks instead,
to try a multi-node layout on one machine).

``on_failure="shrink"`` (MPI backend under ``mpirun --with-ft ulfm``): the survivors of a
rank failure go on in a smaller world (lsgd_hpc/comm/faults.py); ``comm.rank``, ``size``,
``local_rank``, ``node_index`` and ``n_nodes`` are then the new world's, and
``comm.on_failure(callback)`` hears of every recovery.
"""

from __future__ import annotations

import os
import sys
import traceback
from typing import Optional

__all__ = ["Comm", "init", "ON_FAILURE", "exit_as_interpreter"]

_BACKENDS = ("mpi", "horovod", "torch")
#: the values of ``init(on_failure=...)``: "abort" (the first dead rank ends the job),
#: "shrink" (the survivors go on; needs ULFM) or "heal" (the survivors go on, and lost ranks
#: are replaced while the job runs: lsgd_hpc/comm/heal.py)
ON_FAILURE = ("abort", "shrink", "heal")


class Comm:
    """The world, its node groups and this rank's device (what :func:`init` returns).

    ``world`` is the package's communication interface (``lsgd_hpc.comm.Communicator``),
    ``groups`` the node hierarchy (``NodeGroups``: world, node, node roots). Collective
    helpers here (``barrier``, ``allgather_object``, ``any_true``) are not counted as the
    methods' traffic.
    """

    def __init__(self, world, groups, device, backend: str):
        self.world, self.groups, self.device, self.backend = world, groups, device, backend
        #: the recovery machinery when on_failure="shrink" (``lsgd_hpc.comm.faults
        #: .FaultTolerance``), else None: what a participant registers with
        #: (``comm.fault_tolerance.register(obj)``; see that class for the protocol); a user's
        #: loop asks ``comm.failure_policy == "shrink"``
        self.fault_tolerance = None
        #: under on_failure="heal", in a rank that joined a running job (a replacement):
        #: what the survivors sent it (``{"replacing": [...], "history": {...}}``); else None
        self.joined = None

    # -- failures (on_failure="shrink") ------------------------------------------------------
    @property
    def failure_policy(self) -> str:
        """``"abort"``, ``"shrink"`` or ``"heal"`` (``init(on_failure=...)``)."""
        return "abort" if self.fault_tolerance is None else self.fault_tolerance.policy

    @property
    def initial_rank(self) -> int:
        """This rank's rank at the start of the job (``rank`` is the current world's)."""
        return self.rank if self.fault_tolerance is None else self.fault_tolerance.initial_ranks[self.rank]

    @property
    def initial_size(self) -> int:
        return self.size if self.fault_tolerance is None else self.fault_tolerance.initial_size

    @property
    def initial_ranks(self) -> tuple:
        """The initial rank of every current world rank."""
        return tuple(range(self.size)) if self.fault_tolerance is None else tuple(self.fault_tolerance.initial_ranks)

    @property
    def lost_ranks(self) -> tuple:
        """Initial ranks lost so far (on_failure="shrink")."""
        return () if self.fault_tolerance is None else tuple(sorted(self.fault_tolerance.lost))

    @property
    def generation(self) -> int:
        """How many recoveries this world has been through."""
        return 0 if self.fault_tolerance is None else self.fault_tolerance.generation

    @property
    def failures(self) -> list:
        """The FailureEvents so far, oldest first."""
        return [] if self.fault_tolerance is None else list(self.fault_tolerance.events)

    def on_failure(self, callback):
        """Call ``callback(event)`` (a ``lsgd_hpc.comm.failures.FailureEvent``) on every
        survivor after each recovery, once the methods have restored their state (e.g. to
        reshard your data: ``comm.rank`` and ``comm.size`` are the new world's). Returns the
        callback (usable as a decorator). Needs ``init(on_failure="shrink")``."""
        if self.fault_tolerance is None:
            raise ValueError("comm.on_failure: the job runs with on_failure='abort' (a dead "
                             "rank ends it); pass on_failure='shrink' to lsgd_hpc.init")
        self.fault_tolerance.callbacks.append(callback)
        return callback

    def recover(self, exc: Optional[BaseException] = None):
        """Collective over the survivors, after a ``ProcessFailure`` raised by a collective of
        your own on ``comm.world``: shrink the world, rebuild the node groups, restore the
        methods; returns the FailureEvent. The methods and this object's helpers call it
        themselves."""
        if self.fault_tolerance is None:
            raise ValueError("comm.recover: the job runs with on_failure='abort'")
        return self.fault_tolerance.recover(exc)

    # -- healing (on_failure="heal") ----------------------------------------------------------
    @property
    def heal_pending(self) -> bool:
        """Local: replacements for lost ranks are on their way (call :meth:`heal_ready` at
        your step boundaries while this is True)."""
        ft = self.fault_tolerance
        return ft is not None and ft.healer is not None and ft.healer.pending

    def heal_ready(self) -> bool:
        """Collective (every rank, at a step boundary): True on every rank once the
        replacements are ready to join; then save what they must take (a checkpoint) and call
        :meth:`heal`. False at once, without a collective, when none is on its way."""
        if not self.heal_pending:
            return False
        return self._resilient(self.fault_tolerance.healer.ready)

    def heal(self, **app) -> "Comm":
        """Collective with the replacements, after :meth:`heal_ready` said True: the healed
        world as a new ``Comm`` (the job's initial size and numbering; build your method,
        metrics and checkpointer over it and resume from the checkpoint you just saved).
        ``app``: what the replacements find in ``comm.joined["history"]["app"]`` (the
        trainer sends its run folder). Returns this object when a replacement died during the
        join (then it is spawned again: keep training and ask :meth:`heal_ready` again), or
        when a rank of this world died during it (the world is shrunk as for any failure and
        replacements for every lost rank are spawned: the same)."""
        ft = self.fault_tolerance
        if ft is None or ft.healer is None:
            raise ValueError("comm.heal: the job does not run with on_failure='heal'")
        try:
            history = ft.history(app)
            healed = ft.healer.join(history)
        except Exception as exc:                  # noqa: BLE001
            from lsgd_hpc.comm.failures import is_process_failure
            if not is_process_failure(exc):
                raise
            ft.recover(exc)                # a survivor died: shrink; replacements for all
            return self
        if healed is None:
            return self
        ft.retired = True                  # the old world's exit barrier is not needed
        if getattr(ft, "manager", None) is not None:     # torchft: the world healed in place
            return _replica_session(healed, ft.manager, ft.replica_id, self.device,
                                    ft.min_ranks, ft.ranks_per_node, ft.policy,
                                    healed.healed_history, joined=None)
        return _session_over(healed, self.backend, self.device, ft.min_ranks,
                             ft.ranks_per_node, ft.policy, history, joined=None)

    def _resilient(self, fn):
        return fn() if self.fault_tolerance is None else self.fault_tolerance.resilient(fn)

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

        def run():
            with uncounted(self.world):
                self.world.barrier()
        self._resilient(run)

    def allgather_object(self, obj) -> list:
        return self._resilient(lambda: self.world.allgather_object(obj))

    def any_true(self, flag: bool) -> bool:
        from lsgd_hpc.comm import uncounted

        def run():
            with uncounted(self.world):
                return self.world.any_true(flag)
        return self._resilient(run)

    def agree(self, error: Optional[str]) -> Optional[str]:
        """Collective: the first rank's error message (saying on how many ranks it was
        seen), or None when no rank had one. Use it before raising a check's error so that
        every rank raises the same one instead of some waiting in a collective."""
        errors = self.allgather_object(error)
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
        from lsgd_hpc.comm.failures import UnrecoverableFailure
        if issubclass(exc_type, UnrecoverableFailure):
            _end_survivor(exc)                  # every survivor got it: no abort, no race
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


def _end_survivor(exc) -> None:
    """An uncaught UnrecoverableFailure: every survivor raised it alike (agreed), so each
    prints the same one line and ends with EXIT_UNRECOVERABLE after the exit handlers
    (metrics closed) and MPI_Finalize. An MPI_Abort from three survivors at once, under
    ``--with-ft ulfm``, let mpirun exit 0 now and then."""
    from lsgd_hpc.comm.failures import EXIT_UNRECOVERABLE
    print(str(exc), file=sys.stderr, flush=True)
    exit_as_interpreter(EXIT_UNRECOVERABLE)


def exit_as_interpreter(code: int) -> None:
    """End this process with ``code`` now, as the interpreter's own exit would: the exit
    handlers (metrics closed, the session's own), MPI_Finalize, flushed output."""
    import atexit
    try:
        atexit._run_exitfuncs()
        mpi = sys.modules.get("mpi4py.MPI")
        if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
            mpi.Finalize()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def init(backend: str = "mpi", ranks_per_node: Optional[int] = None, device="auto",
         abort_on_exception: bool = True, on_failure: str = "abort",
         min_ranks: int = 1, spares: int = 0,
         failure_timeout: Optional[float] = None) -> Comm:
    """Join the job's world (collective: every rank calls it once, first).

    ``backend``: ``"mpi"`` (mpi4py; mpirun, srun --mpi=pmix), ``"horovod"``, or ``"torch"``
    (torch.distributed) where this build has it. ``ranks_per_node``: group K consecutive
    ranks as one node (default: by host name, or ``LSGD_HPC_RANKS_PER_NODE``). ``device``:
    ``"auto"`` (this rank's GPU by node-local rank when torch sees one, else the CPU),
    ``"cpu"``, ``"cuda"`` or a torch.device. ``abort_on_exception``: an uncaught exception
    on one rank aborts the whole job (the default), instead of leaving the others hanging.
    ``on_failure``: ``"abort"`` (the default: the first dead rank ends the job) or
    ``"shrink"`` (the survivors go on in a smaller world: the MPI backend under a
    fault-tolerant MPI, ``mpirun --with-ft ulfm``; or the torch backend with every worker a
    torchft replica group, lsgd_hpc/comm/replicas.py; ValueError on every rank otherwise).
    ``failure_timeout``: torch backend with ``"shrink"``, the seconds after which a silent
    worker counts as lost (default 10); every other timeout of torchft follows from it.
    ``min_ranks``: with ``"shrink"``, fewer survivors than this end the job
    (``lsgd_hpc.comm.failures.UnrecoverableFailure`` on every survivor). ``spares``: with
    ``"heal"``, the job's last ``spares`` ranks train nothing and wait to replace lost ranks
    (their ``init`` returns only when one is needed, as a replacement's does; at the end of
    the job the ones never needed exit with status 0 inside ``init``).
    """
    _check_init_args(backend, ranks_per_node, on_failure, min_ranks, spares, failure_timeout)
    from lsgd_hpc.comm import NodeGroups, launcher, make_world
    tolerant = on_failure in ("shrink", "heal")
    if tolerant and backend == "torch":
        comm = _join_replicas(device, ranks_per_node, min_ranks, on_failure, failure_timeout)
        if abort_on_exception:
            _install_abort_hook(comm.world)
        return comm
    if tolerant and backend != "mpi":
        from lsgd_hpc.comm.ulfm import ulfm_problem
        raise ValueError(ulfm_problem(backend).replace("'shrink'", repr(on_failure)))
    if tolerant:
        from lsgd_hpc.comm.ulfm import prepare_mpi_environment
        prepare_mpi_environment()
    if on_failure == "heal":
        from lsgd_hpc.comm.heal import is_replacement
        if is_replacement():                  # spawned by a heal: join the running job
            comm = _join_as_replacement(device, ranks_per_node, min_ranks)
            if abort_on_exception:
                _install_abort_hook(comm.world)
            return comm
    local = launcher.local_rank()
    # the device first: NCCL binds the process group to this rank's GPU
    dev = _pick_device(device, local if local is not None else launcher.env_rank())
    world = make_world(backend, device=dev) if backend == "torch" else make_world(backend)
    if on_failure == "heal":
        world = _set_spares_aside(world, spares, device, ranks_per_node, min_ranks)
        if isinstance(world, Comm):            # a spare that replaced a lost rank
            if abort_on_exception:
                _install_abort_hook(world.world)
            return world
    if abort_on_exception:
        _install_abort_hook(world)
    if tolerant:
        _check_fault_tolerance(world, min_ranks, on_failure)
    from lsgd_hpc.envvars import RANKS_PER_NODE
    if ranks_per_node is None:
        ranks_per_node = RANKS_PER_NODE.read()
    groups = NodeGroups.build(world, ranks_per_node)
    comm = Comm(world, groups, dev, backend)
    if tolerant:
        _enable_fault_tolerance(comm, min_ranks, ranks_per_node, on_failure)
    return comm


def _check_init_args(backend, ranks_per_node, on_failure, min_ranks, spares,
                     failure_timeout) -> None:
    """``init``'s arguments, before anything starts (ValueError, one line)."""
    if backend not in _BACKENDS:
        hint = ""
        if str(backend).lower() in ("nccl", "gloo"):
            hint = (f"; {backend} is reached through backend=\"torch\" (torch.distributed: "
                    "NCCL for GPU tensors, gloo for CPU ones)")
        raise ValueError(f"backend must be one of {', '.join(_BACKENDS)}, got {backend!r}{hint}")
    if ranks_per_node is not None and (not isinstance(ranks_per_node, int) or ranks_per_node < 1):
        raise ValueError(f"ranks_per_node must be a positive integer, got {ranks_per_node!r}")
    if on_failure not in ON_FAILURE:
        raise ValueError(f"on_failure must be one of {', '.join(ON_FAILURE)}, got {on_failure!r}")
    if isinstance(min_ranks, bool) or not isinstance(min_ranks, int) or min_ranks < 1:
        raise ValueError(f"min_ranks must be an integer >= 1, got {min_ranks!r}")
    if isinstance(spares, bool) or not isinstance(spares, int) or spares < 0:
        raise ValueError(f"spares must be an integer >= 0, got {spares!r}")
    if spares and on_failure != "heal":
        raise ValueError("spares need on_failure='heal' (spares replace lost ranks)")
    if spares and backend == "torch":
        raise ValueError("spares are for backend='mpi': on the torch backend a lost worker's "
                         "launcher starts it again (torchrun --max-restarts) and it joins")
    if failure_timeout is not None and not (on_failure != "abort" and backend == "torch"):
        raise ValueError("failure_timeout is for backend='torch' with on_failure='shrink' or "
                         "'heal' (torchft's timeouts); ULFM detects failures itself")


def _join_replicas(device, ranks_per_node, min_ranks: int, policy: str,
                   failure_timeout) -> Comm:
    """The torch backend with on_failure="shrink" or "heal": the world of workers that
    torchft's first quorum gives (or, for a restarted worker under heal, the running job's:
    lsgd_hpc/comm/replicas.py), its node groups, the fault tolerance."""
    from lsgd_hpc.comm import launcher
    from lsgd_hpc.comm.replicas import join_replicas
    dev = _pick_device(device, launcher.local_rank() or 0)
    world, manager, rid, history = join_replicas(dev, ranks_per_node, min_ranks, policy,
                                                 failure_timeout)
    return _replica_session(world, manager, rid, dev, min_ranks, ranks_per_node, policy,
                            history, joined=None if history is None else {"history": history})


def _replica_session(world, manager, rid: int, dev, min_ranks: int, ranks_per_node,
                     policy: str, history, joined) -> Comm:
    """Collective over a world of torchft replica groups (at the start, or healed: the
    survivors and the restarted workers, the same calls): node groups, fault tolerance."""
    import atexit
    from lsgd_hpc.comm import NodeGroups
    from lsgd_hpc.comm.replicas import ReplicaFaultTolerance, replica_env
    comm = Comm(world, NodeGroups.build(world, ranks_per_node), dev, "torch")
    comm.joined = joined
    n = replica_env()[1]
    comm.fault_tolerance = ReplicaFaultTolerance(comm, manager, rid, min_ranks, ranks_per_node,
                                                 policy, initial_size=n)
    if history is not None:
        comm.fault_tolerance.take_history(history)
    ft = comm.fault_tolerance
    comm.groups.node_key = ft.initial_nodes[ft.initial_ranks[comm.rank]]
    atexit.register(comm.fault_tolerance.final_barrier)
    return comm


def _set_spares_aside(world, spares: int, device, ranks_per_node, min_ranks: int):
    """Under heal: the job's duplicate for reaching spares, and with ``spares`` K the
    training world of the first size - K ranks (returned); a spare waits here and returns
    the Comm of the healed world it joined (or exits at the end of the job)."""
    from mpi4py import MPI
    from lsgd_hpc.comm.heal import SPARES, wait_as_spare
    from lsgd_hpc.comm.mpi import MPICommunicator
    from lsgd_hpc.comm.lifetime import track
    job = track(MPI.COMM_WORLD.Dup())
    job.Set_errhandler(MPI.ERRORS_RETURN)
    size = job.Get_size()
    if spares >= size:
        raise ValueError(f"spares={spares} leaves no rank to train in a job of {size}")
    n = size - spares
    SPARES.job, SPARES.ranks = job, list(range(n, size))
    if not spares:
        return world
    me = job.Get_rank()
    part = track(job.Split(0 if me < n else 1, me))
    if me >= n:                                 # a spare
        import torch  # noqa: F401 - the slow import while waiting, not in the join
        healed, sent = wait_as_spare(part)
        return _session_over(healed, "mpi", device, min_ranks, ranks_per_node, "heal",
                             sent["history"], joined=sent)
    return MPICommunicator(part, world_ranks=range(n), key="world")


def _join_as_replacement(device, ranks_per_node, min_ranks: int) -> Comm:
    """A replacement's ``init``: its start-up is done (torch imported), so join the
    survivors now (lsgd_hpc.comm.heal.join) and build the session over the healed world."""
    import time
    import torch  # noqa: F401 - the slow import before the join, not during it
    from lsgd_hpc.comm.heal import join
    from lsgd_hpc.envvars import REPLACEMENT_STARTED
    started = REPLACEMENT_STARTED.read()
    started = time.time() if started is None else started
    healed, sent = join(started)
    return _session_over(healed, "mpi", device, min_ranks, ranks_per_node, "heal",
                         sent["history"], joined=sent)


def _session_over(mpi_comm, backend: str, device, min_ranks: int, ranks_per_node, policy: str,
                  history: dict, joined) -> Comm:
    """Collective over a healed world (survivors and replacements alike, the same calls):
    the world, its node groups, the device, the fault tolerance with the job's history."""
    from lsgd_hpc.comm import NodeGroups
    from lsgd_hpc.comm.mpi import MPICommunicator
    world = MPICommunicator(mpi_comm, world_ranks=range(mpi_comm.Get_size()),
                            key=f"world+{history['generation']}")
    groups = NodeGroups.build(world, ranks_per_node)
    dev = device if not isinstance(device, str) else _pick_device(device, groups.local_rank)
    comm = Comm(world, groups, dev, backend)
    comm.joined = joined
    _enable_fault_tolerance(comm, min_ranks, ranks_per_node, policy)
    comm.fault_tolerance.take_history(history)
    return comm


def _check_fault_tolerance(world, min_ranks: int, policy: str = "shrink") -> None:
    """The same ValueError on every rank when ULFM is not active here (or min_ranks is more
    than the world): shrink would otherwise run as an ordinary MPI (Shrink a Dup)."""
    from lsgd_hpc.comm.ulfm import ulfm_problem
    problem = ulfm_problem("mpi")
    if problem is not None:
        problem = problem.replace("'shrink'", repr(policy))
    if problem is None and min_ranks > world.size:
        problem = f"min_ranks={min_ranks} is more than the {world.size} ranks of the job"
    problems = world.allgather_object(problem)
    bad = [p for p in problems if p]
    if bad:
        raise ValueError(bad[0])


def _enable_fault_tolerance(comm: Comm, min_ranks: int, ranks_per_node,
                            policy: str = "shrink") -> None:
    import atexit
    from lsgd_hpc.comm.faults import FaultTolerance
    comm.fault_tolerance = FaultTolerance(comm, min_ranks, ranks_per_node, policy)
    comm.groups.node_key = comm.fault_tolerance.initial_nodes[comm.rank]
    # a survivor that finished its loop waits here for one whose last step was cut off
    # (registered after mpi4py's own exit handler, so it runs before MPI_Finalize)
    atexit.register(comm.fault_tolerance.final_barrier)
