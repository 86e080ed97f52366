"""Healing: lost ranks replaced while the job runs (``on_failure="heal"``, MPI under ULFM).

The survivors of a failure first recover exactly as with ``shrink`` (lsgd_hpc/comm/faults.py)
and go on training in the smaller world. Then:

1. **Spawn.** Collective over the survivors: ``MPI_Comm_spawn`` of one replacement per lost
   rank, running the same program with the same arguments (through
   ``python -m lsgd_hpc.comm.replacement``, which restores the job's environment and working
   folder first), on the lost ranks' hosts while they still hold a survivor, else where the
   MPI library finds free slots. The call returns once the replacements have started MPI
   (about a second here); it does not wait for them to import torch or build their model.
2. **Ready.** A replacement does its start-up (Python, torch, data) while the survivors
   train, then says it is ready with one message to the survivors' rank 0. At each step
   boundary the survivors agree whether it has come (:meth:`Healer.ready`: one small
   allreduce per step, and only while a replacement is on its way).
3. **Join.** The survivors and the replacements merge their intercommunicator and reorder
   it so that every replacement takes a lost rank's number (the lowest lost rank to the
   first replacement, and so on): the healed world has the job's initial size and
   numbering again. A replacement that dies before it joins makes the survivors spawn again
   (at most :data:`MAX_SPAWNS` times per failure), else they go on shrunk.

What the joined ranks then take from the survivors is the library user's loop's business (the
trainer: the survivors save a checkpoint, every rank builds its objects over the healed world
and resumes from it; the replacements take their state from a live peer as the rejoining
ranks of a full-size resume do). The replacement side is :func:`join`.
"""

from __future__ import annotations

import base64
import json
import os
import sys
import time
from typing import List, Optional

from lsgd_hpc.comm.lifetime import arm, track
from lsgd_hpc.envvars import HEAL_BLOCKING, HEAL_JOIN_TIMEOUT, HEAL_TIMEOUT

__all__ = ["Healer", "HealEvent", "Spares", "SPARES", "wait_as_spare", "join",
           "is_replacement", "payload", "MAX_SPAWNS",
           "BLOCKING_ENV", "TIMEOUT_ENV", "JOIN_TIMEOUT_ENV", "EXIT_JOIN_FAILED"]

#: spawns tried for one failure when replacements die before they join
MAX_SPAWNS = 3
#: environment variables a replacement must not inherit from the survivor that spawned it:
#: the MPI launcher's own (the replacement's MPI sets its own) and SLURM's per-task ones
_LAUNCHER_PREFIXES = ("OMPI_COMM_WORLD", "OMPI_UNIVERSE", "OMPI_FIRST_RANKS", "OMPI_APP_CTX",
                      "OMPI_NUM_APP_CTX", "OMPI_FILE_LOCATION", "OMPI_MCA_orte_",
                      "OMPI_MCA_prte_", "OMPI_MCA_ess", "OMPI_MCA_pmix", "PMIX_", "PRTE_",
                      "OMPI_LOCAL", "OMPI_ARGV", "OMPI_COMMAND", "OMPI_MCA_initial_wdir",
                      "SLURM_PROCID", "SLURM_LOCALID", "SLURM_TASK_PID", "SLURM_NODEID",
                      "SLURM_GTIDS", "PMI_", "MPI_LOCAL")
_READY_TAG = 7101
_VERDICT_TAG = 7102
_WAKE_TAG = 7103
_BRIDGE_TAG = 7104
#: set to 1 to make the survivors wait for their replacements at the first step boundary
#: after a spawn instead of training on (tests; a machine with no core to spare for the
#: replacement's start-up)
BLOCKING_ENV = HEAL_BLOCKING.name
#: seconds a replacement may take from its spawn to "ready" before the survivors take it for
#: dead and spawn another (the environment variable overrides the default)
TIMEOUT_ENV = HEAL_TIMEOUT.name
#: seconds the join itself (merge, split, first messages) may take before every process in
#: it ends itself (the environment variable overrides the default)
JOIN_TIMEOUT_ENV = HEAL_JOIN_TIMEOUT.name
#: exit status of a process that ended itself because the join did not end
EXIT_JOIN_FAILED = 3


def ready_timeout() -> float:
    return HEAL_TIMEOUT.read()


def join_timeout() -> float:
    return HEAL_JOIN_TIMEOUT.read()


class HealEvent:
    """One heal: the initial ranks replaced, the world size after, the survivors' pause for
    the join (seconds), the wall-clock time (``time.time()``) the ranks were lost, and the
    step the job went on from."""

    def __init__(self, replaced: List[int], size_after: int, lost_at: float, step: int = -1):
        self.replaced, self.size_after, self.lost_at = list(replaced), int(size_after), lost_at
        self.step, self.pause_seconds = int(step), 0.0
        self.logged = False
        #: the nodes the replacements run on (host names; "node K" when the layout is
        #: emulated), set once the healed world knows them
        self.nodes: List[str] = []


def payload(extra_env: Optional[dict] = None) -> str:
    """What a replacement needs to start as this process did: its program (module or
    script), arguments, working folder and environment (less the launcher's per-process
    variables, plus ``extra_env``), base64-encoded JSON."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    target = ({"module": spec.name} if spec is not None and spec.name
              else {"script": os.path.abspath(sys.argv[0])})
    env = {k: v for k, v in os.environ.items() if not k.startswith(_LAUNCHER_PREFIXES)}
    env.update(extra_env or {})
    data = dict(target, argv=list(sys.argv[1:]), cwd=os.getcwd(), env=env)
    return base64.b64encode(json.dumps(data).encode()).decode()


def is_replacement() -> bool:
    """True in a process that a heal spawned (it has a parent intercommunicator)."""
    from mpi4py import MPI
    return MPI.Comm.Get_parent() != MPI.COMM_NULL


class Healer:
    """The survivors' side of healing, held by ``FaultTolerance`` under ``on_failure="heal"``."""

    def __init__(self, ft):
        self.ft = ft
        self.inter = None                 # the intercommunicator to the replacements
        self.replacing: List[int] = []    # the initial ranks they will take, in order
        self.lost_at = 0.0
        self.request = None               # rank 0: the first replacement's "ready"
        self.spawns = 0
        self.spawned_at = 0.0
        #: the healed world built with woken spares (they are ready at once)
        self.from_spares = None
        self.problem: Optional[str] = None

    @property
    def pending(self) -> bool:
        """A replacement is on its way (spawned or woken, not joined yet)."""
        return self.inter is not None or self.from_spares is not None

    # -- 1. spawn ----------------------------------------------------------------------------
    def spawn(self, lost: List[int]) -> bool:
        """Collective over the survivors' world: start one replacement per initial rank of
        ``lost`` (added to any on their way already). False when the MPI library refused
        (no slot anywhere): the job goes on shrunk, and says so."""
        from mpi4py import MPI
        self.abandon()
        self.replacing = sorted(set(self.replacing) | set(lost))
        if not self.lost_at:
            self.lost_at = time.time()
        world = self.ft.comm.world.comm
        if SPARES.ranks and len(SPARES.ranks) >= len(self.replacing):   # hot spares first
            mine = self.ft.initial_ranks[world.Get_rank()]
            self.from_spares = SPARES.wake(world, self.replacing, mine)
            return True
        info = MPI.Info.Create()
        hosts = self._hosts()
        if hosts:
            info.Set("host", ",".join(hosts))
        from lsgd_hpc.comm.injection import replacement_env
        # the testing hook: the first spawn for a loss may be told to die (a no-op in training)
        lost_step = self.ft.events[-1].step if self.ft.events else -1
        args = ["-m", "lsgd_hpc.comm.replacement",
                payload(replacement_env(self.replacing, lost_step, self.spawns))]
        self.spawns += 1
        try:
            inter = track(world.Spawn(sys.executable, args, maxprocs=len(self.replacing),
                                      info=info, root=0))
            arm()
        except MPI.Exception as exc:
            self.problem = f"cannot spawn {len(self.replacing)} replacement(s): {exc}"
            self._forget()
            return False
        finally:
            info.Free()
        inter.Set_errhandler(MPI.ERRORS_RETURN)
        self.inter, self.spawned_at = inter, time.monotonic()
        if world.Get_rank() == 0:
            self.request = inter.irecv(source=0, tag=_READY_TAG)
        return True

    def _hosts(self) -> List[str]:
        """The lost ranks' hosts, when each still holds a survivor (else none: the MPI
        library places the replacements)."""
        ft = self.ft
        alive = {ft.initial_hosts[r] for r in ft.initial_ranks}
        hosts = [ft.initial_hosts[r] for r in self.replacing]
        return hosts if all(h in alive for h in hosts) and len(alive) > 1 else []

    # -- 2. ready? -----------------------------------------------------------------------------
    def ready(self) -> bool:
        """Collective over the survivors' world (call it at a step boundary, on every rank):
        True on every survivor once the replacements are ready to join. A replacement that
        died on its way is spawned again (or given up after MAX_SPAWNS)."""
        from mpi4py import MPI
        if self.from_spares is not None:
            return True                    # spares: ready at once, on every survivor alike
        if self.inter is None:
            return False
        state = 0
        if self.request is not None:
            blocking = HEAL_BLOCKING.read()
            try:
                done, _ = self.request.test()
                while blocking and not done and not self._late():
                    time.sleep(0.01)
                    done, _ = self.request.test()
                # a replacement that died before it said ready is seen by the timeout: MPI
                # does not report the death of a spawned process to its parents reliably
                state = 1 if done else 2 if self._late() else 0
            except MPI.Exception:
                state = 2                  # the replacement died before it said ready
        world = self.ft.comm.world
        state = int(world.comm.allreduce(state, op=MPI.MAX))
        if state == 2:
            self._respawn_or_give_up()
            return False
        return state == 1

    def _late(self) -> bool:
        return time.monotonic() - self.spawned_at > ready_timeout()

    def _respawn_or_give_up(self) -> None:
        from lsgd_hpc.ranklists import format_ranks
        lost, tries = list(self.replacing), self.spawns
        first = self.ft.comm.world.rank == 0
        if tries >= MAX_SPAWNS:
            self.problem = f"replacements died {tries} times before joining; giving up"
            if first:
                print(f"[lsgd_hpc] heal: {self.problem}; going on with "
                      f"{self.ft.comm.world.size} ranks", file=sys.stderr, flush=True)
            self.abandon()
            self._forget()
            return
        if first:
            print(f"[lsgd_hpc] heal: the replacement(s) for rank(s) {format_ranks(lost)} died "
                  f"before joining; spawning again (try {tries + 1} of {MAX_SPAWNS})",
                  file=sys.stderr, flush=True)
        self.spawn(lost)

    # -- 3. join -------------------------------------------------------------------------------
    def join(self, history: dict):
        """Collective with the replacements: the healed MPI communicator (initial
        numbering), or None when a replacement died during the join (every survivor alike:
        a uniform agreement decides; the replacements are spawned again). Raises
        ProcessFailure on every survivor when one of them died during the join."""
        from mpi4py import MPI
        world = self.ft.comm.world.comm
        if self.from_spares is not None:
            healed = self.from_spares
            healed.bcast({"replacing": self.replacing, "history": history}, root=0)
            self._forget()
            return _connected(healed)
        ok, merged = 1, None
        joined = _join_deadline("this survivor")
        try:
            if world.Get_rank() == 0:
                for child in range(self.inter.Get_remote_size()):
                    self.inter.send("join", dest=child, tag=_VERDICT_TAG)
            from lsgd_hpc.comm.injection import injection_point
            # the testing hook: a survivor that dies here (after a loss at the plan's step)
            injection_point("merge", self.ft.events[-1].step if self.ft.events else -1)
            merged = track(self.inter.Merge(False))
            merged.Set_errhandler(MPI.ERRORS_RETURN)
            merged.bcast({"replacing": self.replacing, "history": history}, root=0)
            mine = self.ft.initial_ranks[world.Get_rank()]
            healed = _connected(track(merged.Split(0, mine)))
        except MPI.Exception:
            ok, healed = 0, None
        try:
            agreed = world.Agree(ok)
            joined.set()
        except MPI.Exception as exc:
            joined.set()
            # A survivor died during the join (the agreement reports it on every survivor):
            # a failure like any other. The caller recovers (shrink); the replacements for
            # every lost rank, these included, are then spawned anew.
            self.abandon()
            self.spawns = 0
            from lsgd_hpc.comm.failures import ProcessFailure
            raise ProcessFailure(f"a rank died during the join ({exc.Get_error_string()})") \
                from exc
        if not agreed:
            self._respawn_or_give_up()
            return None
        self._forget()
        return healed

    # -- bookkeeping ---------------------------------------------------------------------------
    def abandon(self) -> None:
        """Drop a spawn whose replacements died or were taken for dead (their
        intercommunicator is forgotten, not revoked: revoking one whose other side died
        waits forever in Open MPI 5)."""
        if self.request is not None:
            try:
                self.request.Cancel()
            except Exception:                                   # noqa: BLE001
                pass
        self.request = None
        self.inter = None

    def release(self) -> None:
        """Collective over the survivors, at the end of the job: replacements on their way
        are told to leave (waiting for their "ready" at most until the spawn's timeout) and
        the spawn's connection is closed, so that every process can finish."""
        from mpi4py import MPI
        world = self.ft.comm.world.comm
        SPARES.release(world)
        if self.inter is None:
            return
        alive = 1
        if self.request is not None:
            try:
                done, _ = self.request.test()
                while not done and not self._late():
                    time.sleep(0.01)
                    done, _ = self.request.test()
                alive = int(done)
            except MPI.Exception:
                alive = 0
        alive = int(world.bcast(alive, root=0))
        if alive:
            try:
                if world.Get_rank() == 0:
                    for child in range(self.inter.Get_remote_size()):
                        self.inter.send("leave", dest=child, tag=_VERDICT_TAG)
                self.inter.Disconnect()
            except MPI.Exception:
                pass
        self.abandon()
        self._forget()

    def _forget(self) -> None:
        self.inter, self.request, self.replacing = None, None, []
        self.from_spares = None
        self.lost_at, self.spawns = 0.0, 0


class Spares:
    """Hot spares (``init(on_failure="heal", spares=K)``): the last K ranks of the job train
    nothing and wait; a heal takes them before it spawns anything. ``job`` is a duplicate of
    the job's MPI_COMM_WORLD (the survivors reach the spares through it), ``ranks`` the
    spares still waiting (their ranks in it)."""

    def __init__(self):
        self.job = None
        self.ranks: List[int] = []
        self.waiting = False              # this process is a spare that waits

    def wake(self, world, replacing: List[int], mine: int):
        """Collective over the survivors' ``world`` and every waiting spare: the first
        len(``replacing``) spares take those initial ranks. The job's communicator is shrunk
        (survivors and spares: the live processes) and split: the healed world, numbered by
        initial rank (``mine`` is this survivor's), is returned; the other spares wait on."""
        from mpi4py import MPI
        if world.Get_rank() == 0:
            self.job.send({"replacing": list(replacing)}, dest=self.ranks[0], tag=_WAKE_TAG)
        healed, self.job = _split_job(self.job, 0, mine)
        self.ranks = _spare_ranks(self.job)
        return healed

    def release(self, world) -> None:
        """Collective over the survivors at the end of the job: the spares still waiting
        leave."""
        if self.ranks and world.Get_rank() == 0:
            self.job.send({"exit": True}, dest=self.ranks[0], tag=_WAKE_TAG)
        self.ranks = []


def _split_job(job, color: int, key: int):
    """Collective over the job's live processes: shrink ``job`` (ULFM: the dead left out),
    then split it; ``(this process's part, the shrunk job)``."""
    from mpi4py import MPI
    shrunk = track(job.Shrink())
    shrunk.Set_errhandler(MPI.ERRORS_RETURN)
    part = track(shrunk.Split(color, key))
    part.Set_errhandler(MPI.ERRORS_RETURN)
    return part, shrunk


def _spare_ranks(job) -> List[int]:
    """The ranks in ``job`` of the processes that still wait as spares (collective)."""
    flags = job.allgather(bool(SPARES.waiting))
    return [r for r, f in enumerate(flags) if f]


#: this process's view of the job's hot spares (set by ``lsgd_hpc.init``)
SPARES = Spares()


def wait_as_spare(spare_comm):
    """A spare's ``init``: wait (training nothing) until the survivors wake some of the
    spares; a woken one returns ``(healed MPI communicator, what the survivors sent)`` once
    the survivors join it at a step boundary, the others wait on; at the end of the job
    every spare still waiting leaves (``sys.exit(0)``)."""
    from mpi4py import MPI
    SPARES.waiting = True
    while True:
        msg = None
        if spare_comm.Get_rank() == 0:
            msg = _receive(SPARES.job)
        msg = spare_comm.bcast(msg, root=0)
        if msg.get("exit"):
            sys.exit(0)
        me = spare_comm.Get_rank()
        woken = me < len(msg["replacing"])
        if woken:
            SPARES.waiting = False
        healed, SPARES.job = _split_job(SPARES.job, 0 if woken else 1,
                                        msg["replacing"][me] if woken else me)
        SPARES.ranks = _spare_ranks(SPARES.job)
        if woken:
            sent = healed.bcast(None, root=0)
            return _connected(healed), sent
        spare_comm = healed


def _receive(job):
    """The next wake-up message from any rank of the job. ULFM reports the failure of
    another rank to a receive from any source (the request stays active): the failure is
    acknowledged and the same request waits on."""
    from mpi4py import MPI
    req = job.irecv(source=MPI.ANY_SOURCE, tag=_WAKE_TAG)
    while True:
        try:
            done, msg = req.test()
            if done:
                return msg
        except MPI.Exception:
            try:
                job.Ack_failed()
            except MPI.Exception:
                pass
        time.sleep(0.05)


def join(started: float, parent=None) -> tuple:
    """The replacement's side (after its start-up): say ready, merge with the survivors,
    take the lost rank's number. Returns ``(healed MPI communicator, what the survivors
    sent: {"replacing", "history"})``. ``started``: time.time() when this process began."""
    from mpi4py import MPI
    parent = track(MPI.Comm.Get_parent() if parent is None else parent)
    arm()
    parent.Set_errhandler(MPI.ERRORS_RETURN)
    from lsgd_hpc.comm.injection import replacement_dies_here
    replacement_dies_here()                  # the testing hook (a no-op in training)
    joined = _leave_unless_joined(2 * ready_timeout())
    try:
        if parent.Get_rank() == 0:
            parent.send(started, dest=0, tag=_READY_TAG)
        verdict = parent.recv(source=0, tag=_VERDICT_TAG)
        if verdict == "leave":
            parent.Disconnect()
            print("[lsgd_hpc] heal: the job ended before this replacement joined; leaving",
                  file=sys.stderr, flush=True)
            sys.exit(0)

        merging = _join_deadline("this replacement")
        merged = track(parent.Merge(True))
        merged.Set_errhandler(MPI.ERRORS_RETURN)
        sent = merged.bcast(None, root=0)
        n_survivors = merged.Get_size() - parent.Get_size()
        mine = sent["replacing"][merged.Get_rank() - n_survivors]
        healed = _connected(track(merged.Split(0, mine)))
        joined.set()
        merging.set()
    except MPI.Exception as exc:
        # the survivors gave this replacement up (the job ended first, or they spawned
        # another after a failure during the join): nothing to do here
        print(f"[lsgd_hpc] heal: this replacement could not join ({exc.Get_error_string()}); "
              "leaving", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(0)
    return healed, sent


def _leave_unless_joined(seconds: float):
    """A replacement whose survivors all died waits in MPI for good (its "ready" looks up
    the address of a dead parent): a watchdog thread ends it after ``seconds`` unless the
    returned event is set (joined). MPI releases the interpreter while it waits."""
    return _deadline(seconds, f"this replacement was not taken in within {seconds:.0f} s "
                     "(its survivors are gone?); leaving", 1)


def _join_deadline(who: str):
    """The join's own deadline (:func:`join_timeout`), on the survivors and the replacements
    alike: a process that dies during MPI_Intercomm_merge leaves the others in it for good
    (Open MPI 5's ULFM does not return from it), so each ends itself instead of hanging, and
    the job ends; it resumes from the checkpoint the survivors saved for the join."""
    seconds = join_timeout()
    return _deadline(seconds, f"the join did not end within {seconds:.0f} s (a process died "
                     f"during it, which MPI_Intercomm_merge does not return from); ending "
                     f"{who} so that the job ends (resume it from the checkpoint saved for "
                     "the join)", EXIT_JOIN_FAILED)


def _deadline(seconds: float, message: str, status: int):
    """A watchdog thread: unless the returned event is set within ``seconds``, print
    ``message`` and end this process with ``status``."""
    import threading
    done = threading.Event()

    def watch():
        if not done.wait(seconds):
            print(f"[lsgd_hpc] heal: {message}", file=sys.stderr, flush=True)
            os._exit(status)
    threading.Thread(target=watch, name="lsgd-heal-join-watchdog", daemon=True).start()
    return done


def _connected(healed):
    """The healed world with every pair of its processes connected now. Open MPI 5's
    MPI_Finalize disconnects the processes of jobs joined by a spawn from each other, after it
    has let go of their addresses: a pair that never exchanged a message crashes it there
    (SIGSEGV in opal_net_get_hostname, seen with two replacements). One small alltoall
    opens every pair's connection while the addresses are known."""
    from mpi4py import MPI
    healed.Set_errhandler(MPI.ERRORS_RETURN)
    healed.alltoall([0] * healed.Get_size())
    return healed

