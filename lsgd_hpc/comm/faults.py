"""Surviving lost ranks: ``lsgd_hpc.init(on_failure="shrink")`` over a fault-tolerant MPI (ULFM).

With ``on_failure="abort"`` (the default) the first dead rank ends the job: without ULFM mpirun
kills every rank; under ``mpirun --with-ft ulfm`` the survivors' next collective raises and the
library's uncaught-exception hook aborts the job. With ``on_failure="shrink"`` the survivors go
on without the dead ranks:

1. **Noticing.** A collective that involves a dead rank fails on some or all survivors with
   ``MPI_ERR_PROC_FAILED`` (or ``MPI_ERR_REVOKED`` once another survivor has revoked the
   communicator); the MPI backend raises :class:`ProcessFailure` (lsgd_hpc/comm/failures.py).
   Blocking calls, and the ``wait``/``test`` of the non-blocking ones (``Pending``), return
   with that error within about a second here (Open MPI's failure detector), never wait
   forever.
2. **Revoke.** The survivor that caught it revokes every communicator it holds (the world,
   the node groups, duplicates, graph communicators), so that every survivor blocked in any of
   them, or entering one later, fails too and joins the recovery.
3. **Let the failures settle.** A node dies process by process, and the notices of those deaths
   reach a busy survivor over hundreds of milliseconds; Open MPI 5.0 crashes a rank that
   notices one while ``MPI_Comm_shrink`` builds its communicator. So each survivor first waits
   until it has noticed no new failure for ``LSGD_HPC_FT_SETTLE_SECONDS`` (0.5 s), then all
   meet in one agreement (:func:`lsgd_hpc.comm.ulfm.settle_failures`); a shrink that still
   meets a failure is retried.
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

This module holds the protocol (:class:`FaultTolerance`, :class:`RecoveryContext`); what a
failure is and how it is recognised (ProcessFailure, UnrecoverableFailure, FailureEvent,
is_process_failure) is lsgd_hpc/comm/failures.py; ULFM's detection, set-up and the settling
of step 3 (ulfm_problem, prepare_mpi_environment, settle_failures), lsgd_hpc/comm/ulfm.py;
the lost ranks as text (format_ranks), lsgd_hpc/ranklists.py.
Testing hook (not for training loops): lsgd_hpc/comm/injection.py makes ranks SIGKILL
themselves at chosen steps (``inject_failures``; the trainer's ``--inject-failure``).
"""

from __future__ import annotations

import os
import sys
import time
from typing import Callable, Dict, List, Optional, Protocol

from lsgd_hpc.comm.failures import (EXIT_UNRECOVERABLE, FailureEvent, ProcessFailure,
                                    UnrecoverableFailure, is_process_failure)
from lsgd_hpc.comm.lifetime import track
from lsgd_hpc.comm.ulfm import _mpi, settle_failures, settle_seconds
from lsgd_hpc.ranklists import format_ranks

__all__ = ["ON_FAILURE", "FaultTolerance", "Participant", "RecoveryContext", "MAX_ATTEMPTS"]

#: the values of ``lsgd_hpc.init(on_failure=...)`` (and of the trainer's ``--on-failure``)
ON_FAILURE = ("abort", "shrink", "heal")
#: recoveries tried for one failure before giving up (a rank dying during the recovery)
MAX_ATTEMPTS = 3


# -- the recovery ----------------------------------------------------------------------------
class Participant(Protocol):
    """What takes part in a recovery (``FaultTolerance.register``; every method does): after
    ranks died, every survivor calls each participant's ``recovery_prepare(ctx)`` (local,
    before the world is shrunk: note where this rank was cut off, forget requests in flight)
    and, once the world and node groups are rebuilt, ``recovery_restore(ctx)`` (collective
    over the survivors; called again from the start if another rank dies during it).
    ``ctx`` is the recovery's :class:`RecoveryContext`."""

    def recovery_prepare(self, ctx: "RecoveryContext") -> None: ...

    def recovery_restore(self, ctx: "RecoveryContext") -> None: ...


class FaultTolerance:
    """The recovery machinery of one ``Comm`` (``comm.fault_tolerance``; see the module docstring)."""

    def __init__(self, comm, min_ranks: int, ranks_per_node: Optional[int],
                 policy: str = "shrink"):
        self.comm, self.min_ranks, self.ranks_per_node = comm, int(min_ranks), ranks_per_node
        #: "shrink", or "heal": lost ranks are also replaced (lsgd_hpc/comm/heal.py)
        self.policy = policy
        from lsgd_hpc.comm.heal import Healer
        self.healer = Healer(self) if policy == "heal" else None
        #: the heal this world came from (lsgd_hpc.comm.heal.HealEvent), or None
        self.heal_event = None
        #: set on the survivors' old world once a heal replaced it (its exit barrier is moot)
        self.retired = False
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
        world = comm.world
        self._prepare_world(world)
        import socket
        #: the host of every initial rank, and its node: the host name, or "node K" when the
        #: layout is emulated (``ranks_per_node``); the node groups are rebuilt from these
        self.initial_hosts: List[str] = world.allgather_object(socket.gethostname())
        self.initial_nodes: List[str] = [
            f"node {r // ranks_per_node}" if ranks_per_node else host
            for r, host in enumerate(self.initial_hosts)]

    # -- what the engine does (ULFM here; torchft in lsgd_hpc/comm/replicas.py) ----------------
    def _prepare_world(self, world) -> None:
        """Make the world's collectives report a lost rank instead of aborting."""
        world.comm.Set_errhandler(_mpi().ERRORS_RETURN)

    def _alert_others(self) -> None:
        """Make every survivor blocked in a collective with this one fail too (revoke)."""
        self.comm.world.revoke_all()

    def _agree(self, ok: int) -> int:
        """A uniform agreement of the survivors on ``ok`` (0 when a rank died meanwhile)."""
        try:
            return self.comm.world.comm.Agree(ok)
        except _mpi().Exception:
            return 0

    def _meet_survivors(self) -> None:
        """Before a recovery: meet a survivor waiting in a transaction's closing agreement."""
        self.comm.world.revoke_all()
        try:
            self.comm.world.comm.Agree(0)
        except _mpi().Exception:
            pass

    def _shrink_world(self, attempt: int, exc: Optional[BaseException]) -> Optional[List[int]]:
        """The survivors agree on who is gone and the world adopts the smaller group: the
        initial ranks of the new world's ranks, or None to try again (a failure met inside)."""
        MPI = _mpi()
        world = self.comm.world
        world.revoke_all()
        old = world.comm
        # No communicator is built while failures are still being noticed (see
        # settle_failures): Open MPI crashes a rank that notices one during MPI_Comm_shrink.
        settle_failures(old, self.settle_seconds)
        try:
            new = track(old.Shrink())           # the survivors agree on who is gone
        except MPI.Exception as e:
            if attempt + 1 < MAX_ATTEMPTS:      # a failure met inside the shrink: again
                return None
            raise UnrecoverableFailure(f"lsgd_hpc: MPI_Comm_shrink failed ({e}); cannot "
                                       "recover") from exc
        new.Set_errhandler(MPI.ERRORS_RETURN)
        kept = MPI.Group.Translate_ranks(new.Get_group(), list(range(new.Get_size())),
                                         old.Get_group())
        world.adopt_shrunk(new, key=f"world~{self.generation + 1}")
        return [self.initial_ranks[r] for r in kept]

    def workers_problem(self, worker_ranks) -> Optional[str]:
        """Why a method cannot run between workers of ``worker_ranks`` ranks under this
        engine (one line), or None: ULFM's recovery handles every worker shape."""
        return None

    # -- registration ------------------------------------------------------------------------
    def register(self, participant: "Participant") -> None:
        """Restore ``participant`` at every recovery, after the ones registered before it
        (the methods register themselves when built)."""
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
                self._meet_survivors()
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
            what = (f"lost rank(s) {format_ranks(event.lost_ranks)} (initial numbering){nodes}"
                    if event.lost_ranks else "a collective failed but no rank was lost (one "
                    "was slower than the failure timeout)")
            print(f"[lsgd_hpc] {what}; {event.world_size_after} of {self.initial_size} ranks "
                  f"go on from step {event.step} after {event.recovery_seconds:.2f} s of "
                  "recovery", file=sys.stderr, flush=True)
        for fn in list(self.listeners) + list(self.callbacks):
            fn(event)
        if self.healer is not None:
            self._spawn_replacements(event)
        return event

    # -- healing ---------------------------------------------------------------------------------
    def _spawn_replacements(self, event: FailureEvent) -> None:
        """Under heal, after a recovery: replacements for every lost rank (collective over
        the survivors; the job goes on shrunk if the MPI library cannot start them)."""
        from lsgd_hpc.comm.heal import SPARES
        spares = len(SPARES.ranks)
        started = self.healer.spawn(list(self.lost))
        if self.comm.world.rank != 0:
            return
        if not started:
            print(f"[lsgd_hpc] heal: {self.healer.problem}; going on with "
                  f"{self.comm.world.size} ranks", file=sys.stderr, flush=True)
        elif self.healer.from_spares is not None:
            print(f"[lsgd_hpc] heal: hot spare(s) take rank(s) "
                  f"{format_ranks(self.healer.replacing)} ({len(SPARES.ranks)} of {spares} "
                  "spare(s) left)", file=sys.stderr, flush=True)
        else:
            print(f"[lsgd_hpc] heal: spawning replacement(s) for rank(s) "
                  f"{format_ranks(self.healer.replacing)}", file=sys.stderr, flush=True)

    def history(self, app: dict) -> dict:
        """What a healed world carries over (every survivor the same; rank 0's clocks)."""
        from lsgd_hpc.comm.heal import SPARES
        healer = self.healer
        return self.comm.world.comm.bcast(
            {"generation": self.generation + 1, "replaced": list(healer.replacing),
             "lost_at": healer.lost_at, "decided_at": time.time(), "app": dict(app),
             "spares": list(SPARES.ranks),
             "step": int(getattr(self, "last_step", -1))}, root=0)

    def take_history(self, history: dict) -> None:
        """A healed world's: its generation, and the heal it came from."""
        from lsgd_hpc.comm.heal import HealEvent
        from lsgd_hpc.comm.monitor import MONITOR
        from lsgd_hpc.comm.heal import SPARES
        SPARES.ranks = list(history.get("spares", []))
        self.generation = int(history["generation"])
        self.heal_event = HealEvent(history["replaced"], self.comm.world.size,
                                    history["lost_at"], history.get("step", -1))
        self.heal_event.decided_at = history["decided_at"]
        self.heal_event.nodes = list(dict.fromkeys(self.initial_nodes[r]
                                                   for r in history["replaced"]))
        MONITOR.rank_map = tuple(self.initial_ranks)
        if self.comm.world.rank == 0:
            print(f"[lsgd_hpc] heal: rank(s) {format_ranks(history['replaced'])} joined on "
                  f"node(s) {', '.join(self.heal_event.nodes)}; {self.comm.world.size} ranks "
                  f"on {len(set(self.initial_nodes))} node(s)", file=sys.stderr, flush=True)

    def _recover(self, t0: float, exc: Optional[BaseException]) -> FailureEvent:
        from lsgd_hpc.comm.accounting import uncounted
        comm, world = self.comm, self.comm.world
        before = world.size
        lost_here: List[int] = []
        ctx = RecoveryContext(comm, self)
        for p in self.participants:
            p.recovery_prepare(ctx)                  # local: where each method was cut off
        for attempt in range(MAX_ATTEMPTS):
            kept = self._shrink_world(attempt, exc)
            if kept is None:
                continue
            lost_here += [r for r in self.initial_ranks if r not in set(kept)]
            self.initial_ranks = list(kept)
            self.generation += 1
            if world.size < self.min_ranks:         # the same size on every survivor
                raise UnrecoverableFailure(
                    f"lsgd_hpc: {world.size} rank(s) left after losing rank(s) "
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
                        p.recovery_restore(ctx)
            except Exception as e:              # noqa: BLE001 - every survivor must vote
                ok = 0
                if not is_process_failure(e):
                    problem = f"{type(e).__name__}: {e}"
                self._alert_others()            # release survivors blocked in the restore
            agreed = self._agree(ok)   # uniform, even if a rank dies meanwhile (0: again)
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
        while True:
            ok, error = 1, None
            self.in_transaction = True
            try:
                result = fn()
            except Exception as exc:              # noqa: BLE001 - every survivor must vote
                ok = 0
                if not is_process_failure(exc):
                    error = exc
                self._alert_others()
            finally:
                self.in_transaction = False
            agreed = self._agree(ok)
            if error is not None:
                raise error
            if agreed:
                return result
            self.recover(_voted=True)

    def final_barrier(self) -> None:
        """At exit: meet the other survivors once more, so that a survivor that finished is
        still there for the recovery of one whose last step was cut off."""
        if self.broken or self.retired:
            return
        from lsgd_hpc.comm.heal import SPARES
        if self.healer is not None and (self.healer.pending or SPARES.ranks):
            try:                        # the job ended before its replacements joined
                self.resilient(self.healer.release)
            except Exception:                                       # noqa: BLE001
                pass
        try:
            self.resilient(self.comm.world.barrier)
        except UnrecoverableFailure as exc:
            print(str(exc), file=sys.stderr, flush=True)
            sys.stderr.flush()
            os._exit(EXIT_UNRECOVERABLE)
        except Exception:                         # noqa: BLE001 - exiting anyway
            pass


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
