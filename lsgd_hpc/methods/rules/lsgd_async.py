"""Asynchronous multi-leader LSGD: rounds counted in total work, communication overlapped.

Synchronous LSGD couples every rank at every tau-th step: one slow rank slows all. Here a
worker never waits for another one's step. Each level (the world, and each node when there
are several nodes of several ranks) runs a small state machine on a communicator of its own
(a dup, so its non-blocking collectives never interleave with the trainer's blocking ones),
advanced by ``test`` calls between local steps:

  probe   two non-blocking reductions posted together: a sum of
          (local steps since this worker's last round, steps done, stop wanted, step budget,
          draining) and a MINLOC election of the scores (mean of the last K losses).
          Every member sees the same sums, so every member takes the same decision:
  round   when the group's steps since the last round reach n * tau (total work, as in the
          reference implementation: a faster worker contributes more local steps), the
          paired election names the leader, which copies its parameters aside into the
          level's buffer (its live parameters keep training) and every member posts a
          non-blocking broadcast of that snapshot;
  pull    when the broadcast completes on a worker it applies x <- x - c (x - x_L)
          (c = c_L for a node, c_G for the world; none on the leader).
  bound   a worker that has taken ``max_staleness`` (S) steps since it posted a probe or a
          broadcast that has not completed waits for it: no worker runs more than S steps
          ahead of the slowest member's communication (and a stalled member is noticed by
          the collective watchdog instead of being trained around forever).
  control (world level only) when the steps done reach the sum of the step budgets, or a
          member asked to stop (SIGTERM/SIGUSR1), or the steps done cross a multiple of
          n * checkpoint_every, every member stops stepping and drains: the node levels keep
          probing with the draining flag set until every member of the node drains, so no
          request is left in flight; then the trainer ends, stops or checkpoints, and the
          schedule resumes from exactly the counters in the checkpoint.

Otherwise a probe is re-posted as soon as the previous one completes, so decisions follow the
slowest member's progress while faster members keep stepping. Every member posts the same
collectives in the same order on each level's communicator. The staleness of a pull is the
number of this worker's own steps between posting the broadcast and applying it.
"""

from __future__ import annotations

import math
import time
from collections import deque
from typing import List, Optional

import torch

from lsgd_hpc.comm import Communicator, FlatParams, NodeGroups, Request
from lsgd_hpc.comm.monitor import MONITOR
from lsgd_hpc.methods.rules.base import Rule, MetricsSink
from lsgd_hpc.methods.rules.lsgd import GLOBAL, LOCAL, to_the_leader, window_score
from lsgd_hpc.methods.rules.state import broadcast_copy

__all__ = ["AsyncLeaderRule", "ACTIONS"]

#: what the world level can decide besides a round, in order of precedence
ACTIONS = ("stop", "end", "checkpoint")

# fields of a probe's sum
_ROUND, _DONE, _STOP, _BUDGET, _DRAINING = range(5)
#: seconds between tests while a worker must wait (short: the others are still stepping)
_POLL_S = 2e-4


class _Level:
    """One level's round machine over its own communicator (see the module docstring)."""

    def __init__(self, comm: Communicator, scope: int, tau: int, pull: float, flat: FlatParams):
        self.comm, self.scope, self.tau, self.pull, self.flat = comm, scope, tau, pull, flat
        self.buf = torch.empty_like(flat.flat)       # the leader's snapshot / what arrives
        self.sums = torch.zeros(5, dtype=torch.float64)
        self.probe: Optional[List[Request]] = None   # [sum, election] in flight
        self.bcast: Optional[Request] = None
        self.posted_round = 0        # steps since the last round, as posted in the probe
        self.round_steps = 0         # this worker's steps since the last round
        self.rounds = 0              # rounds completed on this level (same on every member)
        self.idle = True             # nothing posted (drained, or not started)
        self.leader = None
        self.my_score = math.inf
        self.bcast_at_step = 0
        self.posted_at = 0           # this worker's step when it posted what is in flight
        self.last_staleness = 0
        self.last_round_steps = 0

    @property
    def busy(self) -> bool:
        return self.probe is not None or self.bcast is not None

    def post_probe(self, algo: "AsyncLeaderRule") -> None:
        self.posted_round = self.round_steps
        s = self.sums
        s.zero_()
        s[_ROUND] = self.round_steps
        s[_DRAINING] = float(algo.draining)
        if self.scope == GLOBAL:
            s[_DONE], s[_STOP], s[_BUDGET] = algo.steps, float(algo.stop_wanted), algo.budget
        self.my_score = algo.score()
        self.posted_at = algo.steps
        # agreed: the same 5 float64 on every member, no blocking agreement check per probe
        self.probe = [self.comm.iallreduce_(s, "sum", agreed=True),
                      self.comm.ielect(self.my_score)]
        self.idle = False

    def progress(self, algo: "AsyncLeaderRule") -> None:
        """Advance without blocking: complete what has arrived, post what comes next."""
        if self.bcast is not None and self.bcast.test():
            self._apply(algo)
        if self.probe is not None and all(r.test() for r in self.probe):
            sums, election = self.sums.clone(), self.probe[1].result
            self.probe = None
            self._decide(algo, sums, election)
        if not self.busy and not self.idle:
            self.post_probe(algo)

    def _decide(self, algo: "AsyncLeaderRule", s: torch.Tensor, election) -> None:
        n = self.comm.size
        if self.scope == GLOBAL:
            action = algo.decide(s)
            if action is not None:             # this level stops posting; the others drain
                algo.action, self.idle = action, True
                return
        elif s[_DRAINING] >= n:                 # every member drains: nothing left in flight
            self.idle = True
            return
        if s[_ROUND] >= n * self.tau:
            self._start_round(algo, election)
        # otherwise progress() posts the next probe

    def _start_round(self, algo: "AsyncLeaderRule", election) -> None:
        self.leader = election
        self.last_round_steps = self.posted_round
        self.round_steps -= self.posted_round    # steps taken since the probe count next time
        if election.rank == self.comm.rank:
            self.buf.copy_(self.flat.flat)        # the snapshot; live parameters keep training
        self.bcast_at_step = self.posted_at = algo.steps
        self.bcast = self.comm.ibroadcast_(self.buf, election.rank)

    def _apply(self, algo: "AsyncLeaderRule") -> None:
        self.bcast = None
        self.rounds += 1
        x = self.flat.flat
        if self.leader.rank != self.comm.rank and self.pull > 0:
            x.sub_(x - self.buf, alpha=self.pull)         # x <- x - c (x - x_L)
        self.last_staleness = algo.steps - self.bcast_at_step
        algo.log("leader", step=algo.steps, scope=self.scope,
                 leader_rank=self.leader.world_rank, score=self.my_score, round=self.rounds,
                 staleness=self.last_staleness, round_steps=self.last_round_steps)
        if self.scope == GLOBAL:
            algo.last_global = self.leader

    def state_dict(self) -> dict:
        return {"round_steps": self.round_steps, "rounds": self.rounds}

    def load_state_dict(self, state: dict) -> None:
        self.round_steps, self.rounds = int(state["round_steps"]), int(state["rounds"])


class AsyncLeaderRule(Rule):
    """Multi-leader LSGD without per-step coupling (module docstring has the schedule).

    The trainer calls ``set_schedule`` once, ``after_step`` after each optimizer step and
    then ``control(stop_raised)``, which returns None to go on, or an agreed action from
    ACTIONS once every level has drained. It ends training itself (``owns_schedule``).
    """

    name = "lsgd-async"
    owns_schedule = True
    extra_columns = {"leader": {"round": "i8", "staleness": "i8", "round_steps": "i8"},
                     "train": {"pull_staleness": "i8", "round_steps": "i8"}}

    def __init__(self, groups: NodeGroups, flat: FlatParams, tau_local: int, tau_global: int,
                 pull_local: float, pull_global: float, window: int, max_staleness: int,
                 log: Optional[MetricsSink] = None):
        super().__init__(groups, flat, log)
        self.max_staleness = max_staleness
        self.losses: deque = deque(maxlen=window)
        multi_level = 1 < groups.n_nodes < groups.world.size
        self.levels: List[_Level] = []
        if multi_level and groups.node.size > 1:    # (a dup is collective over the node only)
            self.levels.append(_Level(groups.node.dup(), LOCAL, tau_local, pull_local, flat))
        self.world_level = _Level(groups.world.dup(), GLOBAL, tau_global, pull_global, flat)
        self.levels.append(self.world_level)
        self.steps = 0
        self.budget = 0
        self.checkpoint_every = 0
        self.checkpoints_done = 0
        self.stop_wanted = False
        self.draining = False
        self.action: Optional[str] = None
        self.last_global = None

    # -- the trainer's side -------------------------------------------------------------------
    def set_schedule(self, steps_per_rank: int, checkpoint_every: int) -> None:
        """Training ends when the steps of all ranks together reach the sum of every rank's
        ``steps_per_rank`` (faster ranks take more); checkpoints every n * checkpoint_every
        steps of all ranks together (0: none)."""
        self.budget, self.checkpoint_every = int(steps_per_rank), int(checkpoint_every)

    def score(self) -> float:
        return window_score(self.losses)

    def after_step(self, step: int, loss: float) -> None:
        self.losses.append(float(loss))
        self.steps = step
        for lv in self.levels:
            lv.round_steps += 1
        self._progress()
        for lv in self.levels:   # bounded staleness: wait for a request S steps old
            if lv.busy and self.steps - lv.posted_at >= self.max_staleness:
                reqs = [lv.bcast] if lv.bcast is not None else list(lv.probe)
                self._wait_until(lambda reqs=reqs: all(r.done for r in reqs), "max staleness")

    def before_step(self, step: int) -> None:
        self._progress()          # one more test per step: the backward pass was long

    def control(self, stop_raised: bool) -> Optional[str]:
        """None to take another step, or the agreed action once nothing is in flight."""
        self.stop_wanted = self.stop_wanted or bool(stop_raised)
        if self.action is None:
            return None
        self.draining = True
        self._wait_until(lambda: all(lv.idle and not lv.busy for lv in self.levels),
                         "drain before " + self.action)
        action, self.action, self.draining = self.action, None, False
        if self.consensus_every:                # every rank is here: a consistent moment
            self.measure_consensus(self.steps)
        return action

    def decide(self, s: torch.Tensor) -> Optional[str]:
        """The world level's decision on a completed probe (the same sums on every rank)."""
        if s[_STOP] > 0:
            return "stop"
        if s[_DONE] >= s[_BUDGET]:
            return "end"
        if self.checkpoint_every:
            k = int(s[_DONE]) // (self.world.size * self.checkpoint_every)
            if k > self.checkpoints_done:
                self.checkpoints_done = k
                return "checkpoint"
        return None

    # -- progress ------------------------------------------------------------------------------
    def _progress(self) -> None:
        for lv in self.levels:
            if lv.idle and not lv.busy and not (self.draining or self.action):
                lv.idle = False                      # (re)start after a drain or at start
            lv.progress(self)

    def _pending(self) -> Optional[Request]:
        for lv in self.levels:
            for req in ([lv.bcast] if lv.bcast is not None else []) + (lv.probe or []):
                if not req.done:
                    return req
        return None

    def _wait_until(self, ready, what: str) -> None:
        """Test every level until ``ready()``. Blocking on one request could deadlock with a
        member blocked on another level's, so nothing here blocks; the watchdog sees the
        request waited on as the collective this rank is in."""
        while True:
            self._progress()
            if ready():
                return
            req = self._pending()
            if req is None:
                continue
            with MONITOR.inside(req.comm.key, req.comm.world_ranks, req.seq,
                                f"{req.name} ({what})"):
                while not req.done:
                    time.sleep(_POLL_S)
                    self._progress()

    # -- metrics and checkpoints ---------------------------------------------------------------
    def train_columns(self) -> dict:
        return {"pull_staleness": max(lv.last_staleness for lv in self.levels),
                "round_steps": self.world_level.last_round_steps}

    def state_dict(self) -> dict:
        assert not any(lv.busy for lv in self.levels), "checkpoint with requests in flight"
        return {"losses": list(self.losses), "checkpoints_done": self.checkpoints_done,
                "levels": {int(lv.scope): lv.state_dict() for lv in self.levels}}

    def load_state_dict(self, state: dict) -> None:
        self.losses.clear()
        self.losses.extend(float(v) for v in state["losses"])
        self.checkpoints_done = int(state["checkpoints_done"])
        levels = state["levels"]
        if isinstance(levels, list):     # (written before levels were saved by scope)
            levels = {lv.scope: st for lv, st in zip(self.levels, levels)}
        for lv in self.levels:
            # a level the checkpoint lacks (a node level its writer no longer had after lost
            # ranks) starts a fresh round count
            lv.load_state_dict(levels.get(lv.scope, {"round_steps": 0, "rounds": 0}))

    # -- ranks lost (on_failure="shrink") ------------------------------------------------------
    # Nothing is shared but the rounds. Every request in flight died with the old
    # communicators: probes are dropped (fresh ones decide again, from the survivors' sums:
    # their steps done against their budgets), and the newest round of each level's group --
    # its broadcast cut off, or its probe completed on some members only -- is completed on
    # every survivor of the group or on none, like LeaderSGD's pull (re-broadcast from the
    # lowest survivor holding the leader's snapshot: the leader itself, or a member that
    # pulled it and has nothing newer in flight). A level's communicator is rebuilt over the
    # survivors; a node level with one rank left, or with one node left, ends. An action
    # decided on some ranks only (a checkpoint, the end) is decided again.
    def suspend(self, complete: bool, recovery) -> dict:
        levels = {}
        for lv in self.levels:
            flight = None
            if lv.bcast is not None:
                flight = (lv.rounds + 1, bool(lv.leader.rank == lv.comm.rank))
            levels[int(lv.scope)] = {"rounds": int(lv.rounds), "flight": flight}
            lv.probe = lv.bcast = None              # their requests died with the old world
        self.action, self.draining = None, False
        return {"node": str(recovery.node_key), "levels": levels,
                "checkpoints_done": int(self.checkpoints_done)}

    def resume(self, recovery) -> None:
        world, reports, mine = recovery.world, recovery.reports, recovery.mine
        by_scope = {lv.scope: lv for lv in self.levels}
        # each level's groups: the world, and each node's ranks that have a node level
        groups_of = sorted({(scope, rep["node"] if scope == LOCAL else "")
                            for rep in reports for scope in rep["levels"]})
        for scope, node in groups_of:
            members = [(r, rep["levels"][scope]) for r, rep in enumerate(reports)
                       if scope in rep["levels"] and (scope == GLOBAL or rep["node"] == node)]
            # a round's probe completes only once every member has finished the round before
            # it, so members are at most one round apart: T is the newest round any reached
            T = max(lvr["rounds"] + (lvr["flight"] is not None) for _, lvr in members)
            behind = [r for r, lvr in members if lvr["rounds"] < T]
            if not behind:
                continue
            holders = [r for r, lvr in members
                       if (lvr["rounds"] == T and lvr["flight"] is None)
                       or lvr["flight"] == (T, True)]
            mylv = mine["levels"].get(scope)
            me_in = world.rank in behind and (scope == GLOBAL or mine["node"] == node)
            lv = by_scope.get(scope)
            if holders:
                broadcast_copy(world, lv.buf if lv is not None else self.world_level.buf,
                               min(holders), lv.buf if me_in else None)
            if me_in:
                leads = mylv["flight"] == (T, True)
                mylv["flight"] = None                    # done, should the resume rerun
                if holders:
                    if not leads and lv.pull > 0:
                        x = lv.flat.flat
                        x.sub_(x - lv.buf, alpha=lv.pull)     # x <- x - c (x - x_L)
                    lv.rounds = mylv["rounds"] = T
        self.checkpoints_done = max(rep["checkpoints_done"] for rep in reports)
        self.last_global = None
        self._rebuild_levels(by_scope.get(LOCAL))

    def _rebuild_levels(self, node_level) -> None:
        """The levels over the rebuilt groups (each a communicator of its own, as at the
        start); the next step posts a fresh probe on each."""
        groups = self.groups
        multi_level = 1 < groups.n_nodes < groups.world.size
        self.levels = []
        if node_level is not None and multi_level and groups.node.size > 1:
            node_level.comm = groups.node.dup()
            self.levels.append(node_level)
        self.world_level.comm = groups.world.dup()
        self.levels.append(self.world_level)
        for lv in self.levels:
            lv.idle = True

    def rejoin(self, world, joined: bool, source: int) -> str:
        """As LeaderSGD's: the global leader's parameters (best window score)."""
        leader = to_the_leader(self, world, joined, source)
        return f"the global leader's parameters (rank {leader}) and a fresh optimizer state"
