"""A method's side of fault tolerance: the survivors' recovery after lost ranks
(``on_failure="shrink"``) and the rejoin of lost ranks at a full-size resume.

It knows no rule: it works from each rule's declared state (``shared_state``,
lsgd_hpc/methods/rules/state.py) and the rule's two hooks for what is in flight
(``suspend``, ``resume``). The communication layer has shrunk the world and rebuilt the node
groups (lsgd_hpc/comm/faults.py); every survivor then runs, for every method built on the
communicator (in the order they were built), ``recovery_prepare`` (local: where this rank's
step was cut off) and ``recovery_restore`` (collective over the new world):

1. **Where was each survivor?** One allgather of (completed steps, whether that step's
   communication completed, stop flag, the rule's report of what it had in flight). A
   survivor cut off in the gradient exchange of step s had completed s - 1 (nothing of s is
   applied); one cut off in the rule's communication after its optimizer step has taken s
   steps, incompletely. Survivors may be a few steps apart: a collective can complete on
   some survivors and fail on others (ULFM reports failures non-uniformly), and those go on
   to their next collective.
2. **The agreed step** K is the most advanced survivor's step count; the *source* is the
   lowest rank among those at K whose communication completed (else the lowest at K).
   Every survivor ends the recovery with ``method.steps == K``: the call that was cut off
   returns, and a survivor that was behind skips the local steps it did not take (its
   minibatches are lost; schedules stay in step on every rank).
3. **The rule's state.** The shared state (``shared_state``: AllreduceSGD the replica with
   its optimizer state, EASGD the centre, DiLoCo x_prev and the outer optimizer, SlowMo
   x_old and u, local SGD its period state) is broadcast from the source and taken by the
   others; the rule's ``resume`` then completes or drops what was in flight alike on every
   survivor (LeaderSGD's pull, a delayed broadcast, Streaming DiLoCo's fragment allreduce,
   the asynchronous rounds) and rebuilds communicators of its own (GossipSGD its
   topology). The shared state is then checked to be bit-identical (a digest allgather).
4. **Control.** A stop already agreed on one survivor is taken on all; a stop agreement in
   flight is dropped (flags raised since are posted again); ``done`` and
   ``checkpoint_due`` follow K. A rule that owns its schedule (AsyncLeaderSGD, whose ranks
   take uneven steps) keeps each rank's own count and decides the end and the
   checkpoints again.

AllreduceSGD and a failure during the gradient averaging of step s: if any survivor finished
step s, every survivor takes that survivor's replica (the step counts); otherwise the step
is dropped on every survivor (its minibatch lost, the count stays s - 1, the next call is
step s again). Its averaging over the survivors is not redone: a survivor's own gradient is
gone by then (the in-place allreduce overwrote it).
"""

from __future__ import annotations

from lsgd_hpc.comm.monitor import MONITOR
from lsgd_hpc.methods.rules.state import (Recovery, broadcast_object, check_agreed, shared_of,
                                          take_shared)

__all__ = ["Recoverable"]


class Recoverable:
    """What ``Method`` implements of the fault-tolerance participant protocol
    (``lsgd_hpc.comm.faults.Participant``: ``recovery_prepare``, ``recovery_restore``) and of
    a full-size resume (``rejoin``)."""

    def _guarded(self, call, *args):
        """``call(*args)``; after a rank failure, recover (every method restores) and return
        None: the call that was cut off ends there, with the method's state agreed."""
        from lsgd_hpc.comm.failures import is_process_failure
        try:
            return call(*args)
        except Exception as exc:                      # noqa: BLE001
            ft = self._fault_tolerance
            if ft is None or ft.recovering or not is_process_failure(exc):
                raise
            self.comm.recover(exc)
            return None

    def recovery_prepare(self, ctx) -> None:
        """Local, once per recovery, before anything is shrunk: what this rank has completed
        (its rule forgets the requests that died with the old world)."""
        complete = self._phase != "after"
        if self._phase == "sync":        # the user's synchronize(): drop the step that follows
            self._drop_next = True
        self._phase = None
        self._synced = False
        if self._agreement is not None:
            self._agreement.abandon()                 # its request died with the old world
        self._recovery = Recovery(self.comm.world, self.comm.groups, self.comm.groups.node_key,
                                  ctx)
        self._report = {"steps": int(self.steps), "complete": bool(complete),
                        "stopping": bool(self.stopping),
                        "rule": self.rule.suspend(complete, self._recovery)}

    def recovery_restore(self, ctx) -> None:
        """Collective over the new world (may run again if a rank dies during it)."""
        world = self.comm.world                          # exact, whatever comm_dtype
        self.stack.refresh(self.comm, ctx.ft.generation)  # workers over their survivors
        reports = world.allgather_object(self._report)
        K = max(r["steps"] for r in reports)
        at_k = [i for i, r in enumerate(reports) if r["steps"] == K]
        source = min([i for i in at_k if reports[i]["complete"]] or at_k)
        rec = self._recovery
        rec.world, rec.groups, rec.ctx = world, self.comm.groups, ctx
        rec.reports, rec.mine = [r["rule"] for r in reports], self._report["rule"]
        rec.steps, rec.source = K, source
        self._take_shared_from(world, source)
        self.rule.resume(rec)
        if self.workers is not None:         # every rank of a worker holds the same again
            self._spread_in_worker(0)
        check_agreed(self, world, "after the recovery")
        ctx.step = K
        self.stopping = self.stopping or any(r["stopping"] for r in reports)
        self._report["stopping"] = self.stopping
        self._report["complete"] = True                  # a second attempt starts from here
        if self.rule.owns_schedule:       # each rank keeps its own count; the rule decides
            self.checkpoint_due = False
            return
        self.steps = K
        MONITOR.step = K
        self._report["steps"] = K
        self.done = self.max_steps is not None and K >= self.max_steps
        self.checkpoint_due = bool(self.checkpoint_every and K % self.checkpoint_every == 0)

    def rejoin(self, info) -> str:
        """Collective, at a full-size resume of a survivors' checkpoint (Checkpointer.restore,
        every object already loaded; ``info`` a runtime.checkpoint.Rejoin): the ranks that were
        lost take what their rule gives them (``Rule.rejoin``) and the shared state of the
        lowest survivor, checked equal on every rank. Returns what the rejoining ranks took,
        for the log line."""
        world = self.comm.world
        joined = world.rank in set(info.joined)
        source = min(r for r in range(world.size) if r not in set(info.joined))
        if joined and self.wire is not None:
            self.wire.load_state_dict({})       # error feedback: no residual of its own yet
        how = self.rule.rejoin(world, joined, source)
        self._take_shared_from(world, source)
        if self.workers is not None:      # a rank rejoins its worker: it takes its replica
            mates = self.workers.worker.allgather_object(joined)
            self._spread_in_worker(mates.index(False) if False in mates else 0)
        check_agreed(self, world, "after the lost ranks rejoined")
        return how

    def _take_shared_from(self, world, source: int) -> None:
        """Collective over ``world``: every rank takes ``source``'s declared shared state."""
        if not self.rule.shared_state:
            return
        shared = broadcast_object(world, shared_of(self) if world.rank == source else None,
                                  source)
        if world.rank != source:
            take_shared(self, shared)

    def _spread_in_worker(self, root: int) -> None:
        """Collective inside this rank's worker: its rank ``root``'s replica (parameters,
        buffers, optimizer state) and rule state to its other ranks, so that they hold the
        same bits whatever point each had reached when ranks were lost."""
        worker = self.workers.worker
        if worker.size == 1:
            return
        inner = self.rule.rule                      # (the worker's counters stay each rank's)
        mine = worker.rank == root
        state = broadcast_object(worker, {"flat": self.flat.flat.detach().clone(),
                                          "optimizer": self.optimizer.state_dict(),
                                          "rule": inner.state_dict()} if mine else None, root)
        if not mine:
            self.flat.flat.copy_(state["flat"])
            self.optimizer.load_state_dict(state["optimizer"])
            inner.load_state_dict(state["rule"])
