"""Surviving lost ranks: ``lsgd_hpc.init(on_failure="shrink")`` over a fault-tolerant MPI (ULFM).

With ``on_failure="abort"`` (the default) the first dead rank ends the job: without ULFM mpirun
kills every rank; under ``mpirun --with-ft ulfm`` the survivors' next collective raises and the
library's uncaught-exception hook aborts the job. With ``on_failure="shrink"`` the survivors go
on without the dead ranks:

1. **Noticing.** A collective that involves a dead rank fails on some or all survivors with
   ``MPI_ERR_PROC_FAILED`` (or ``MPI_ERR_REVOKED`` once another survivor has revoked the
   communicator); the MPI backend raises :class:`ProcessFailure`. Blocking calls, and the
   ``wait``/``test`` of the non-blocking ones (``Pending``), return with that error within
   about a second here (Open MPI's failure detector), never wait forever.
2. **Revoke.** The survivor that caught it revokes every communicator it holds (the world,
   the node groups, duplicates, graph communicators), so that every survivor blocked in any of
   them, or entering one later, fails too and joins the recovery.
3. **Let the failures settle.** A node dies process by process, and the notices of those deaths
   reach a busy survivor over hundreds of milliseconds; Open MPI 5.0 crashes a rank that
   notices one while ``MPI_Comm_shrink`` builds its communicator. So each survivor first waits
   until it has noticed no new failure for ``LSGD_HPC_FT_SETTLE_SECONDS`` (0.5 s), then all
   meet in one agreement (:func:`settle_failures`); a shrink that still meets a failure is
   retried.
   **Agree on who is gone.** ``MPI_Comm_shrink`` of the world: a fault-tolerant agreement
   that gives every survivor the same smaller communicator; the lost ranks are the old
   world's group less the new one's (the same set on every survivor, checked by an
   allgather). Fewer than ``min_ranks`` left: :class:`UnrecoverableFailure` on every survivor.
4. **Rebuild.** The world communicator object is rewired in place onto the shrunk one (every
   method, sampler and helper holding it sees the new rank and size), and the node groups
   are rebuilt by host name (or ``initial rank // ranks_per_node``): a node with no rank left
   is gone, a node whose root died gets its lowest survivor as root.
5. **Restore.** Every method built on the communicator (in the order they were built, the
   same on every survivor) restores its invariants over the new world
   (lsgd_hpc/methods/recovery.py: one broadcast from the lowest survivor that finished the
   most advanced step; LSGD finishes a cut-off pull everywhere or nowhere).
6. **Agree on the outcome.** ``MPI_Comm_agree`` (uniform: every survivor gets the same answer
   even if another rank dies meanwhile). A failure during steps 4-5 makes some survivor vote
   no: the survivors shrink again and redo 4-5 (at most ``MAX_ATTEMPTS`` times), else
   :class:`UnrecoverableFailure` on every survivor.
7. **Report.** A :class:`FailureEvent` goes to the metrics writer (its ``/faults`` row) and
   then to every callback registered with ``comm.on_failure(callback)``.

Testing hook (not for training loops): :func:`inject_failures` ("RANK:STEP,...") makes a rank
SIGKILL itself at a step; the trainer exposes it as ``--inject-failure``.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

__all__ = ["ON_FAILURE", "ProcessFailure", "UnrecoverableFailure", "FailureEvent",
           "FaultTolerance", "ulfm_problem", "is_process_failure", "format_ranks",
           "parse_ranks", "inject_failures", "failure_plan", "injection_point", "FailureInjector",
           "MAX_ATTEMPTS", "EXIT_UNRECOVERABLE", "ULFM_ENV", "FINALIZE_ENV",
           "prepare_mpi_environment", "settle_failures", "settle_seconds", "SETTLE_ENV"]

#: the values of ``lsgd_hpc.init(on_failure=...)`` (and of the trainer's ``--on-failure``)
ON_FAILURE = ("abort", "shrink")
#: recoveries tried for one failure before giving up (a rank dying during the recovery)
MAX_ATTEMPTS = 3
#: exit status suggested for a job that ended with UnrecoverableFailure
EXIT_UNRECOVERABLE = 3
#: set to 1 to assert that an MPI other than Open MPI has ULFM active (MPICH:
#: ``mpiexec -disable-auto-cleanup``); Open MPI is checked by its own setting
ULFM_ENV = "LSGD_HPC_ULFM"


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


def format_ranks(ranks: Sequence[int]) -> str:
    """'1,3,8-11': sorted ranks with runs of three or more as ranges (the /faults column)."""
    out, rs = [], sorted({int(r) for r in ranks})
    i = 0
    while i < len(rs):
        j = i
        while j + 1 < len(rs) and rs[j + 1] == rs[j] + 1:
            j += 1
        if j - i >= 2:
            out.append(f"{rs[i]}-{rs[j]}")
        else:
            out.extend(str(r) for r in rs[i:j + 1])
        i = j + 1
    return ",".join(out)


def parse_ranks(text) -> List[int]:
    """The inverse of :func:`format_ranks` (bytes accepted, as HDF5 gives them back)."""
    if isinstance(text, bytes):
        text = text.decode("ascii", "replace")
    out: List[int] = []
    for part in str(text).split(","):
        part = part.strip()
        if not part:
            continue
        if "-" in part:
            lo, hi = part.split("-", 1)
            out.extend(range(int(lo), int(hi) + 1))
        else:
            out.append(int(part))
    return out


# -- is fault tolerance there? ---------------------------------------------------------------
def ulfm_problem(backend: str) -> Optional[str]:
    """Why ``on_failure="shrink"`` cannot work in this process (one line), or None."""
    if backend == "horovod":
        return ("on_failure='shrink' is not supported with backend='horovod' (Horovod cannot "
                "shrink its world); use backend='mpi' under mpirun --with-ft ulfm")
    if backend == "torch":
        return ("on_failure='shrink' is not supported with backend='torch': torch.distributed "
                "can shrink only NCCL groups (gloo has no shrink_group support); use "
                "backend='mpi' under mpirun --with-ft ulfm, or torchrun restarts")
    from mpi4py import MPI
    if not all(hasattr(MPI.Comm, n) for n in ("Revoke", "Shrink", "Agree")):
        return ("on_failure='shrink' needs mpi4py >= 4 (Comm.Revoke/Shrink/Agree); this "
                f"mpi4py is {getattr(sys.modules.get('mpi4py'), '__version__', '?')}")
    if os.environ.get(ULFM_ENV, "").strip() == "1":
        return None
    lib = MPI.Get_library_version()
    if "Open MPI" in lib:
        if os.environ.get("OMPI_MCA_mpi_ft_enable", "").strip().lower() in ("1", "true", "yes",
                                                                             "on", "enabled"):
            return None
        return ("on_failure='shrink' needs a fault-tolerant MPI, and this Open MPI runs without "
                "ULFM: start the job with mpirun --with-ft ulfm")
    first = lib.replace("\x00", "").strip().splitlines()[0] if lib.strip() else "this MPI"
    return (f"on_failure='shrink' needs ULFM, and {first} is not known to have it active; "
            f"with Open MPI start the job with mpirun --with-ft ulfm (another MPI with ULFM "
            f"enabled: set {ULFM_ENV}=1)")


#: Open MPI: MPI_Finalize's PMIx fence can wait forever once ranks have died (seen here about
#: once in three runs that lost a whole node); the library's own fault-tolerant barrier at
#: exit (FaultTolerance.final_barrier) takes its place. Read at MPI_Init.
FINALIZE_ENV = {"OMPI_MCA_async_mpi_finalize": "1"}


def prepare_mpi_environment() -> bool:
    """Before MPI starts (mpi4py.MPI not imported yet): the settings a fault-tolerant run
    needs (FINALIZE_ENV), unless set already. False when MPI was already started, too late
    (then set them in the job's environment: ``mpirun -x OMPI_MCA_async_mpi_finalize=1``)."""
    if "mpi4py.MPI" in sys.modules:
        return all(os.environ.get(k) == v for k, v in FINALIZE_ENV.items())
    for k, v in FINALIZE_ENV.items():
        os.environ.setdefault(k, v)
    return True


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


# -- the recovery ----------------------------------------------------------------------------
class FaultTolerance:
    """The recovery machinery of one ``Comm`` (``comm._ft``; see the module docstring)."""

    def __init__(self, comm, min_ranks: int, ranks_per_node: Optional[int]):
        self.comm, self.min_ranks, self.ranks_per_node = comm, int(min_ranks), ranks_per_node
        self.initial_size = comm.world.size
        #: initial world rank of each current world rank
        self.initial_ranks: List[int] = list(range(comm.world.size))
        self.generation = 0
        self.events: List[FailureEvent] = []
        self.participants: list = []            # methods, in the order they were built
        self.listeners: List[Callable] = []      # the metrics writers (before user callbacks)
        self.callbacks: List[Callable] = []
        self.recovering = False
        self.in_transaction = False
        #: set once UnrecoverableFailure was raised: the world is not to be used again
        self.broken = False
        self.lost: List[int] = []
        #: seconds without a new failure notice before a recovery shrinks (settle_failures)
        self.settle_seconds = settle_seconds()
        self._ids = 0
        world = comm.world
        world.comm.Set_errhandler(_mpi().ERRORS_RETURN)
        import socket
        #: the host of every initial rank, and its node: the host name, or "node K" when the
        #: layout is emulated (``ranks_per_node``); the node groups are rebuilt from these
        self.initial_hosts: List[str] = world.allgather_object(socket.gethostname())
        self.initial_nodes: List[str] = [
            f"node {r // ranks_per_node}" if ranks_per_node else host
            for r, host in enumerate(self.initial_hosts)]

    # -- registration ------------------------------------------------------------------------
    def register(self, participant) -> None:
        self._ids += 1
        participant._ft_id = self._ids
        self.participants.append(participant)

    def unregister(self, participant) -> None:
        self.participants = [p for p in self.participants if p is not participant]

    # -- the recovery --------------------------------------------------------------------------
    def recover(self, exc: Optional[BaseException] = None, _voted: bool = False) -> FailureEvent:
        """Collective over the survivors (see the module docstring); returns the event."""
        if self.recovering:
            raise exc if exc is not None else ProcessFailure("failure during recovery")
        t0 = time.perf_counter()
        self.recovering = True
        try:
            if not _voted:
                # A survivor that was finishing a transaction (a checkpoint) waits in its
                # closing agreement on this world: meet it there (its answer is then "no",
                # and it recovers too) before anyone shrinks.
                self.comm.world.revoke_all()
                try:
                    self.comm.world.comm.Agree(0)
                except _mpi().Exception:
                    pass
            event = self._recover(t0, exc)
        except UnrecoverableFailure:
            self.broken = True
            raise
        finally:
            self.recovering = False
        from lsgd_hpc.comm.monitor import MONITOR
        MONITOR.rank_map = tuple(self.initial_ranks)
        self.events.append(event)
        if self.comm.world.rank == 0:
            nodes = f" and node(s) {', '.join(event.lost_nodes)}" if event.lost_nodes else ""
            print(f"[lsgd_hpc] lost rank(s) {format_ranks(event.lost_ranks)} (initial "
                  f"numbering){nodes}; {event.world_size_after} of {self.initial_size} ranks go on "
                  f"from step {event.step} after {event.recovery_seconds:.2f} s of recovery",
                  file=sys.stderr, flush=True)
        for fn in list(self.listeners) + list(self.callbacks):
            fn(event)
        return event

    def _recover(self, t0: float, exc: Optional[BaseException]) -> FailureEvent:
        MPI = _mpi()
        from lsgd_hpc.comm.accounting import uncounted
        comm, world = self.comm, self.comm.world
        before = world.size
        lost_here: List[int] = []
        ctx = RecoveryContext(comm, self)
        for p in self.participants:
            p._ft_prepare(ctx)                  # local: where each method was cut off
        for attempt in range(MAX_ATTEMPTS):
            world.revoke_all()
            old = world.comm
            # No communicator is built while failures are still being noticed (see
            # settle_failures): Open MPI crashes a rank that notices one during MPI_Comm_shrink.
            settle_failures(old, self.settle_seconds)
            try:
                new = old.Shrink()              # the survivors agree on who is gone
            except MPI.Exception as e:
                if attempt + 1 < MAX_ATTEMPTS:  # a failure met inside the shrink: again
                    continue
                raise UnrecoverableFailure(f"lsgd_hpc: MPI_Comm_shrink failed ({e}); cannot "
                                           "recover") from exc
            new.Set_errhandler(MPI.ERRORS_RETURN)
            kept = MPI.Group.Translate_ranks(new.Get_group(), list(range(new.Get_size())),
                                             old.Get_group())
            gone = sorted(set(range(old.Get_size())) - set(kept))
            lost_here += [self.initial_ranks[r] for r in gone]
            self.initial_ranks = [self.initial_ranks[r] for r in kept]
            self.generation += 1
            world.adopt_shrunk(new, key=f"world~{self.generation}")
            if new.Get_size() < self.min_ranks:     # the same size on every survivor
                raise UnrecoverableFailure(
                    f"lsgd_hpc: {new.Get_size()} rank(s) left after losing rank(s) "
                    f"{format_ranks(self.lost + lost_here)} (initial numbering), fewer than "
                    f"min_ranks={self.min_ranks}; ending the job")
            ok, problem = 1, None
            try:
                with uncounted(world):
                    seen = world.allgather_object(tuple(sorted(lost_here)))
                    if len(set(seen)) != 1:
                        raise RuntimeError(f"survivors disagree on the lost ranks {set(seen)}")
                    _rebuild_groups(comm, self)
                    ctx.begin_attempt(sorted(lost_here))
                    for p in self.participants:
                        p._ft_restore(ctx)
            except Exception as e:              # noqa: BLE001 - every survivor must vote
                ok = 0
                if not is_process_failure(e):
                    problem = f"{type(e).__name__}: {e}"
                world.revoke_all()              # release survivors blocked in the restore
            try:
                agreed = world.comm.Agree(ok)   # uniform, even if a rank dies meanwhile
            except MPI.Exception:
                agreed = 0                      # another rank died: shrink again
            if agreed:
                break
            if problem is not None:             # a bug, not a failure: all voted and end alike
                raise UnrecoverableFailure(f"lsgd_hpc: recovery failed: {problem}")
        else:
            raise UnrecoverableFailure(f"lsgd_hpc: recovery failed {MAX_ATTEMPTS} times "
                                       "(ranks kept dying); ending the job")
        self.lost += lost_here
        alive = {self.initial_nodes[r] for r in self.initial_ranks}
        lost_nodes = tuple(dict.fromkeys(self.initial_nodes[r] for r in sorted(lost_here)
                                         if self.initial_nodes[r] not in alive))
        return FailureEvent(lost_ranks=tuple(sorted(lost_here)), lost_now=tuple(sorted(self.lost)),
                            world_size_before=before, world_size_after=world.size,
                            step=ctx.step, recovery_seconds=time.perf_counter() - t0,
                            rank=world.rank, initial_rank=self.initial_ranks[world.rank],
                            generation=self.generation, lost_nodes=lost_nodes)

    def resilient(self, fn: Callable):
        """``fn()``; after a rank failure: recover, then ``fn()`` again on the new world."""
        while True:
            try:
                return fn()
            except Exception as exc:              # noqa: BLE001
                if self.recovering or self.in_transaction or not is_process_failure(exc):
                    raise
                self.recover(exc)

    def transaction(self, fn: Callable):
        """``fn()`` (collectives over the world) with an outcome every survivor shares: a
        uniform agreement (MPI_Comm_agree) follows it, and when a rank died on the way (on
        any survivor, even one whose collectives completed) every survivor recovers and runs
        ``fn()`` again. For blocks that end in a decision, such as a checkpoint's commit."""
        MPI = _mpi()
        while True:
            ok, error = 1, None
            self.in_transaction = True
            try:
                result = fn()
            except Exception as exc:              # noqa: BLE001 - every survivor must vote
                ok = 0
                if not is_process_failure(exc):
                    error = exc
                self.comm.world.revoke_all()
            finally:
                self.in_transaction = False
            try:
                agreed = self.comm.world.comm.Agree(ok)
            except MPI.Exception:
                agreed = 0
            if error is not None:
                raise error
            if agreed:
                return result
            self.recover(_voted=True)

    def final_barrier(self) -> None:
        """At exit: meet the other survivors once more, so that a survivor that finished is
        still there for the recovery of one whose last step was cut off."""
        if self.broken:
            return
        try:
            self.resilient(self.comm.world.barrier)
        except UnrecoverableFailure as exc:
            print(str(exc), file=sys.stderr, flush=True)
            sys.stderr.flush()
            os._exit(EXIT_UNRECOVERABLE)
        except Exception:                         # noqa: BLE001 - exiting anyway
            pass


#: seconds of quiet (no new failure noticed) that a recovery waits for before it shrinks;
#: the environment variable overrides the default (0 turns the wait off)
SETTLE_ENV = "LSGD_HPC_FT_SETTLE_SECONDS"
SETTLE_SECONDS = 0.5
#: the longest a recovery waits for failure notices to settle (ranks that keep dying)
SETTLE_LIMIT_SECONDS = 10.0


def settle_seconds() -> float:
    """The quiet period of :func:`settle_failures`: ``$LSGD_HPC_FT_SETTLE_SECONDS`` or 0.5."""
    raw = os.environ.get(SETTLE_ENV, "").strip()
    try:
        return max(0.0, float(raw)) if raw else SETTLE_SECONDS
    except ValueError:
        return SETTLE_SECONDS


def _failed_count(comm) -> int:
    try:
        group = comm.Get_failed()
        n = group.Get_size()
        group.Free()
        return n
    except Exception:                                               # noqa: BLE001
        return -1


def settle_failures(comm, quiet: float, limit: float = SETTLE_LIMIT_SECONDS) -> int:
    """Let failure knowledge settle on the revoked ``comm`` before a communicator is built.

    Open MPI 5.0's ULFM marks every communicator that holds a newly failed process as failed
    (``ompi_comm_set_rank_failed`` -> ``ompi_comm_revoke_local``) from inside the progress
    engine; when that happens while ``MPI_Comm_shrink`` activates its new communicator, whose
    collective modules are not selected yet, the rank crashes (SIGSEGV at address 0x450).
    A node that goes down dies process by process, and on a busy node the notices of those
    deaths reach a survivor over hundreds of milliseconds: a survivor that shrinks at the
    first notice builds its communicator while the others arrive. So: drive the progress
    engine until this rank has noticed no new failed member of ``comm`` for ``quiet``
    seconds (at most ``limit``), acknowledge the failures, then meet the other survivors in
    one fault-tolerant agreement (what one survivor saw dead, the agreement makes known to
    all) before the shrink. Every survivor runs the same calls whatever it saw, so no
    survivor is left in a different collective. Returns the failed members seen."""
    MPI = _mpi()
    if quiet <= 0:
        return _failed_count(comm)
    t0 = time.monotonic()
    seen, since = _failed_count(comm), t0
    while time.monotonic() - since < quiet and time.monotonic() - t0 < limit:
        try:
            MPI.COMM_SELF.Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG)   # runs the progress engine
        except MPI.Exception:
            pass
        time.sleep(0.005)
        now = _failed_count(comm)
        if now != seen:
            seen, since = now, time.monotonic()
    for call in (comm.Ack_failed, lambda: comm.Agree(1)):
        try:
            call()
        except MPI.Exception:                # a new failure: the shrink's agreement sees it
            pass
    return seen


class RecoveryContext:
    """What the participants of one recovery share: the session ``Comm``, the numbering at
    the start of the recovery, and (per attempt) the lost ranks. ``step`` is set by the
    methods (the agreed step count)."""

    def __init__(self, comm, ft: FaultTolerance):
        self.comm, self.ft = comm, ft
        #: initial rank of each world rank as numbered when the failure was noticed
        self.initial_before = list(ft.initial_ranks)
        self.lost: List[int] = []
        self.step = -1
        self.first_attempt = True
        self._attempts = 0

    def begin_attempt(self, lost: List[int]) -> None:
        self._attempts += 1
        self.first_attempt = self._attempts == 1
        self.lost = list(lost)

    def initial_of(self, rank_before: int) -> int:
        """The initial rank of a world rank numbered as before the recovery."""
        return self.initial_before[rank_before]

    def now_of_initial(self, initial: int) -> Optional[int]:
        """The current world rank of an initial rank (None when it is gone)."""
        try:
            return self.ft.initial_ranks.index(initial)
        except ValueError:
            return None


def _mpi():
    from mpi4py import MPI
    return MPI


def _rebuild_groups(comm, ft: FaultTolerance) -> None:
    """Node groups of the new world, in place (objects holding ``comm.groups`` see them): by
    host name, or by ``initial rank // ranks_per_node`` when the layout was emulated (the
    nodes recorded at the start, so no collective is needed for them)."""
    groups, world = comm.groups, comm.world
    world.one_host = len({ft.initial_hosts[r] for r in ft.initial_ranks}) == 1
    keys = [ft.initial_nodes[r] for r in ft.initial_ranks]
    index: Dict = {}
    node_of = [index.setdefault(key, len(index)) for key in keys]
    me = world.rank
    node = world.split(node_of[me], key=me)
    roots = world.split(0 if node.rank == 0 else -1, key=me)
    groups.node, groups.roots, groups.node_of = node, roots, node_of
    groups.node_key = keys[me]


# -- testing: ranks that kill themselves ------------------------------------------------------
class FailureInjector:
    """Which ranks SIGKILL themselves where (testing only; :func:`inject_failures`).

    ``plan``: (rank, step, point) triples. ``rank`` is a rank as numbered at the start of the
    job, or ``"leader"``: the rank elected global leader at that step (LeaderSGD), which dies
    between its election and its broadcast. ``point``: ``"step"`` (the start of that step,
    before any of its communication), ``"elected"`` (LeaderSGD, after the global election)
    or ``"save"`` (Checkpointer.save of the set labelled that step, once this rank's file is
    written and before the set is committed)."""

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
            if s != step or p != point:
                continue
            if who == "leader" and leader or who == me:
                print(f"[lsgd_hpc] inject_failures: rank {me} kills itself at step {step} "
                      f"({point})", file=sys.stderr, flush=True)
                sys.stderr.flush()
                os.kill(os.getpid(), signal.SIGKILL)
                time.sleep(60)                    # pragma: no cover - the signal is on its way


_INJECTOR: Optional[FailureInjector] = None


def inject_failures(spec: str, comm=None) -> FailureInjector:
    """Testing only: ``"1:5,2:9"`` makes rank 1 SIGKILL itself at the start of step 5 and
    rank 2 at step 9 (ranks as numbered at the start of the job; steps as counted by the
    methods, 1 = the first). ``"leader:8"``: the rank elected global leader at step 8 dies
    between its election and its broadcast (LeaderSGD). ``"1:5:elected"`` names the point
    explicitly; ``"2:8:save"`` kills rank 2 in the middle of saving the checkpoint of step 8. Installs the plan for this process (the methods call :func:`injection_point`
    each step) and returns it; ``comm`` (the session's) pins this rank's initial number."""
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
        if point not in ("step", "elected", "save"):
            raise ValueError(f"inject_failures: point {point!r} is not 'step', 'elected' or "
                             "'save'")
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
