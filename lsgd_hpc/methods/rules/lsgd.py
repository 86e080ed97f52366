"""Leader SGD: each worker is pulled toward the best worker, its node's and the global one."""

from __future__ import annotations

import math
from collections import deque
from typing import Callable, Dict, Optional

import torch

from lsgd_hpc.comm import Election, FlatParams, NodeGroups
from lsgd_hpc.comm.failures import is_process_failure
from lsgd_hpc.comm.injection import injection_point
from lsgd_hpc.comm.hierarchy import HierarchicalBroadcast
from lsgd_hpc.comm.delta import (BookedBroadcast, BookedRequest, apply_delta, delta_layout,
                                 encode_delta, message_buffer)
from lsgd_hpc.methods.registry import LSGD_BN_POLICIES
from lsgd_hpc.methods.rules.base import MetricsSink, Rule
from lsgd_hpc.methods.rules.state import broadcast_copy, take_parameters

__all__ = ["LeaderRule", "BN_POLICIES", "window_score", "to_the_leader"]

GLOBAL, LOCAL = 0, 1


def window_score(losses) -> float:
    """A worker's score: the mean of its last K minibatch losses (+inf before any)."""
    return sum(losses) / len(losses) if losses else math.inf


#: BatchNorm policies of a pull: statistics kept local, copied from the leader, or pulled like
#: parameters (the spec's list)
BN_POLICIES = LSGD_BN_POLICIES


class LeaderRule(Rule):
    """Multi-leader LSGD (Teng et al.), synchronous.

    Every ``tau_local`` steps, inside each node:   x_i <- x_i - c_L (x_i - x_l(node))
    Every ``tau_global`` steps, over all workers:   x_i <- x_i - c_G (x_i - x_L)
    where a leader is the member with the lowest score (mean of its last K minibatch
    losses), elected with one MINLOC reduction; the leader's own pull is zero. When both
    fall on one step the local pull comes first. With one node, or one rank per node, the
    local level is the global one and only the global pull runs (single-leader LSGD).
    The global leader's parameters cross node boundaries once per node
    (NodeGroups.broadcast_from_). Momentum buffers are the worker's own and are not pulled.

    ``pull_every_step`` (the reference implementation's proximal term): at every step on
    which a level does not communicate, each worker is also pulled toward the copy of that
    level's leader it received last, with the strength spread over the period,
        x_i <- x_i - (c_L / tau_L)(x_i - x~_l) - (c_G / tau_G)(x_i - x~_L),
    (the last leader included: its copy is its own past self, a proximal anchor).

    ``bn`` says what a pull does to the floating-point buffers (BatchNorm running
    statistics), which the flat buffer holds after the parameters:
      keep  pull the parameters only; each worker keeps its own statistics (the reference;
            only the parameters are broadcast)
      copy  pull the parameters and take the leader's statistics as they are
      pull  pull the statistics like parameters (a convex mix of two workers' statistics)

    ``score_fn`` (--leader-score heldout): when given, a worker's score at an election is
    ``score_fn()`` (its loss on a held-out slice of the training set, the same slice on
    every rank) instead of the window mean; it is called once per step that has an
    election, and its value is the score elected on and logged in /leader.

    ``pull_delay`` d > 0 puts the leader's broadcast behind d steps of compute. At a period
    boundary s the election runs as above (blocking: one 16-byte MINLOC, latency-bound),
    the leader snapshots its parameters x_L(s) and their broadcast starts without blocking
    (an ibroadcast on a node communicator of the level's own; the global one stage by stage
    through the node hierarchy, still crossing node boundaries once per node:
    lsgd_hpc.comm.hierarchy), progressed at every step; at step s + d it is completed and

        x_i <- x_i - c (x_i - x_L(s))        on the worker's current x_i, the leader's too

    (the leader's pull is toward its own step-s self, zero only when d = 0). d < tau_local
    (the spec), so at most one pull per level is in flight, and a pull never lands on a
    boundary step; on step s + d the local pull comes first. With ``pull_every_step`` a
    level's proximal term runs at every step on which its pull does not land, toward the
    last copy that landed. ``state_dict`` completes a broadcast in flight and keeps the
    leader's copy and the step to pull at. d = 0 is the rule above, through the same code.

    Compressed global pull (the communicators send top-k: ``--topk F`` < 1; docs/algorithms.md,
    "Compressed leader pull"): every rank keeps a reference r of the global leader (the
    global copy x~_L; the same bits on every rank, the common x_0 at the first step). At a
    global pull the leader sends d = C(x_L - r), the top-k records of each chunk with values
    as comm_dtype (lsgd_hpc.comm.delta), through the node hierarchy; every rank (the leader
    too) sets r <- r + d, and the others pull toward r:  x_i <- x_i - c_G (x_i - r). The
    leader is not pulled (its pull is zero in LSGD; what r lacks of x_L is sent at later
    pulls). r is shared state (checkpoints, recoveries, rejoins). The local pull inside a
    node stays the dense broadcast of comm_dtype. With ``pull_delay`` d the leader encodes
    d(s) = C(x_L(s) - r) at the boundary s and the message goes as a non-blocking broadcast
    of its bytes (progressed at every step, booked as the blocking one); at s + d every rank
    sets r <- r + d(s) and pulls toward r, the leader too (as the delayed dense pull);
    ``state_dict`` keeps the message and the step it lands at. The recovery of lost ranks
    drops a message in flight on every survivor (r stays the source's shared r:
    :meth:`_drop_compressed_delayed`).
    """

    name = "lsgd"

    def __init__(self, groups: NodeGroups, flat: FlatParams, tau_local: int, tau_global: int,
                 pull_local: float, pull_global: float, window: int,
                 log: Optional[MetricsSink] = None, pull_every_step: bool = False,
                 bn: str = "keep", score_fn: Optional[Callable[[], float]] = None,
                 pull_delay: int = 0):
        super().__init__(groups, flat, log)
        self.tau_local, self.tau_global = tau_local, tau_global
        self.pull_local, self.pull_global = pull_local, pull_global
        self.pull_every_step, self.bn = pull_every_step, bn
        self.losses: deque = deque(maxlen=window)
        n = flat.n_params
        # what crosses the wire (the statistics only when a pull uses them) and what is pulled
        self.sent = flat.params if bn == "keep" else flat.flat
        self.pulled = flat.flat if bn == "pull" else flat.params
        # the last received copy of each level's leader (x~_l, x~_L)
        self.copies = {LOCAL: torch.empty_like(self.sent), GLOBAL: torch.empty_like(self.sent)}
        self.world.agree_buffers(*self.copies.values())
        self.have_copy = {LOCAL: False, GLOBAL: False}
        self.n_params = n
        self.multi_level = 1 < groups.n_nodes < groups.world.size
        self.last_global: Optional[Election] = None
        self.score_fn = score_fn
        # fault recovery (suspend/resume): the pull whose broadcast is in flight, as
        # (level, is_leader), and how many pulls of each level this rank completed
        self.pull_in_flight = None
        self.pulls_done = {LOCAL: 0, GLOBAL: 0}
        self.pull_delay = int(pull_delay)
        # the compressed global pull (topk < 1 on the communicators): the reference r is the
        # global copy; ``msg`` the last message (records) sent or received
        self.topk = float(getattr(self.world, "topk", 1.0))
        self.compressed = self.topk < 1
        if self.pull_delay:
            # what a broadcast in flight writes into (the copies stay readable meanwhile; the
            # compressed global pull's: its message)
            self.incoming = {level: torch.empty_like(self.sent)
                             for level in ((LOCAL,) if self.compressed else (LOCAL, GLOBAL))}
            #: level -> [step to pull at, request or None (completed), is the leader]
            self.delayed: Dict[int, list] = {}
            #: a rank failure that progress() met in a gradient hook (raised in the next step)
            self.progress_failure: Optional[BaseException] = None
            # communicators of the delayed broadcasts' own (every rank creates them in this
            # order: node, node, roots), so that they never interleave with other collectives
            self.delay_node = {GLOBAL: groups.node.dup()}
            if self.multi_level:
                self.delay_node[LOCAL] = groups.node.dup()
            self.delay_roots = groups.roots.dup() if groups.roots is not None else None
        if self.compressed:
            self.delta_lay = delta_layout(self.sent.numel(), self.topk, self.world.kind)
            self.msg = message_buffer(self.delta_lay, self.sent.device)
            self.world.agree_buffers(self.msg)
            self.reference = self.copies[GLOBAL]
            self.reference_ready = False          # set to the common x_0 at the first step
            self.shared_state = ("reference", "reference_ready")

    def before_step(self, step: int) -> None:
        if self.compressed and not self.reference_ready:
            # the parameters before the first optimizer step: the common x_0 on every rank
            self.reference.copy_(self.sent)
            self.reference_ready = True

    def score(self) -> float:
        return window_score(self.losses)

    def _due(self, step: int):
        """(local election now, global election now, this rank's score for them)."""
        local_now = self.multi_level and step % self.tau_local == 0
        global_now = step % self.tau_global == 0
        if self.score_fn is not None:
            score = float(self.score_fn()) if (local_now or global_now) else math.nan
        else:
            score = self.score()
        return local_now, global_now, score

    def after_step(self, step: int, loss: float) -> None:
        if self.pull_delay:
            self._after_step_delayed(step, loss)
            return
        self.losses.append(float(loss))
        local_now, global_now, score = self._due(step)
        if local_now:
            el = self.groups.node.elect(score)
            self._log(step, LOCAL, el, score)
            self._pull(LOCAL, el.world_rank, self.pull_local,
                       lambda t: self.groups.node.broadcast_(t, el.rank))
        if global_now:
            el = self.groups.world.elect(score)
            self.last_global = el
            self._log(step, GLOBAL, el, score)
            injection_point("elected", step, leader=el.world_rank == self.world.world_rank)
            self.track(step, **{"leader/score": el.score})
            if self.compressed:
                self._pull_compressed(el.world_rank, self.pull_global)
            else:
                self._pull(GLOBAL, el.world_rank, self.pull_global,
                           lambda t: self.groups.broadcast_from_(t, el.world_rank))
        if self.pull_every_step:
            if self.multi_level and not local_now:
                self._proximal(LOCAL, self.pull_local / self.tau_local)
            if not global_now:
                self._proximal(GLOBAL, self.pull_global / self.tau_global)

    def _pull(self, level: int, leader: int, c: float, broadcast) -> None:
        x, xl = self.sent, self.copies[level]
        is_leader = self.world.world_rank == leader
        if is_leader:
            xl.copy_(x)
        self.pull_in_flight = (level, is_leader)
        broadcast(xl)
        self.pull_in_flight = None
        self.pulls_done[level] += 1
        self.have_copy[level] = True
        if not is_leader:
            self.apply_pull(level, c)

    def _pull_compressed(self, leader: int, c: float) -> None:
        """The global pull, compressed: the leader's d = C(x_L - r) to every rank (records,
        through the node hierarchy), r <- r + d everywhere, then x <- x - c (x - r) on the
        others. r changes only once the whole message is here (a recovery relies on it)."""
        is_leader = self.world.world_rank == leader
        if is_leader:
            encode_delta(self.sent, self.reference, self.delta_lay, self.msg)
        self.pull_in_flight = (GLOBAL, is_leader)
        with BookedBroadcast(self.world.stats, self.delta_lay):
            self.groups.broadcast_from_(self.msg, leader)
        self.pull_in_flight = None
        apply_delta(self.reference, self.msg, self.delta_lay)
        self.pulls_done[GLOBAL] += 1
        self.have_copy[GLOBAL] = True
        if not is_leader:
            self.apply_pull(GLOBAL, c)

    def apply_pull(self, level: int, c: float) -> None:
        """Pull toward the copy of ``level``'s leader just received: x <- x - c (x - x_L)."""
        xl = self.copies[level]
        n = self.pulled.numel()
        if c > 0:
            self.pulled.sub_(self.pulled - xl[:n], alpha=c)      # x <- x - c (x - x_L)
        if self.bn == "copy":
            self.flat.flat[self.n_params:].copy_(xl[self.n_params:])

    # -- pull_delay > 0 ------------------------------------------------------------------
    @property
    def overlaps(self) -> bool:
        return bool(self.pull_delay)

    def progress(self) -> None:
        try:
            for pending in (self.delayed.values() if self.pull_delay else ()):
                if pending is not None and pending[1] is not None:
                    pending[1].test()
        except Exception as exc:                  # noqa: BLE001
            # (from a gradient hook, outside the method's step: a rank failure found here
            # is raised again inside the next step, where the recovery runs)
            if not is_process_failure(exc):
                raise
            self.progress_failure = exc

    def _after_step_delayed(self, step: int, loss: float) -> None:
        self.losses.append(float(loss))
        if self.progress_failure is not None:
            exc, self.progress_failure = self.progress_failure, None
            raise exc
        landed = set()
        for level in (LOCAL, GLOBAL):
            pending = self.delayed.get(level)
            if pending is None:
                continue
            if pending[0] == step:
                self._land(level)
                landed.add(level)
            elif pending[1] is not None:
                pending[1].test()                        # progress it behind compute
        local_now, global_now, score = self._due(step)
        if local_now:
            el = self.groups.node.elect(score)
            self._log(step, LOCAL, el, score)
            self._start(LOCAL, step, el, lambda t: self.delay_node[LOCAL].ibroadcast_(t, el.rank))
        if global_now:
            el = self.groups.world.elect(score)
            self.last_global = el
            self._log(step, GLOBAL, el, score)
            injection_point("elected", step, leader=el.world_rank == self.world.world_rank)
            self._start(GLOBAL, step, el, lambda t: self._post_global(t, el.world_rank))
        if self.pull_every_step:
            if self.multi_level and LOCAL not in landed:
                self._proximal(LOCAL, self.pull_local / self.tau_local)
            if GLOBAL not in landed:
                self._proximal(GLOBAL, self.pull_global / self.tau_global)

    def _post_global(self, t: torch.Tensor, leader: int):
        """The global broadcast of ``t`` from ``leader``, non-blocking, through the node
        hierarchy; the compressed pull's message booked as the blocking one's."""
        def post():
            return HierarchicalBroadcast(self.delay_node[GLOBAL], self.delay_roots,
                                         self.groups.node_of, t, leader,
                                         self.groups.world.world_ranks)
        return BookedRequest(self.world.stats, self.delta_lay, post) if self.compressed \
            else post()

    def _incoming(self, level: int) -> torch.Tensor:
        """What a delayed broadcast of ``level`` writes into: the leader's copy, or the
        compressed pull's message (the global level with topk < 1)."""
        return self.msg if self.compressed and level == GLOBAL else self.incoming[level]

    def _saved_as(self, level: int) -> str:
        return "message" if self.compressed and level == GLOBAL else "copy"

    def _start(self, level: int, step: int, el: Election, post) -> None:
        """The leader's x of this step (compressed: its message d = C(x - r)) into the level's
        incoming buffer, its broadcast posted.
        ``delayed[level]``: [step to pull at, request (None: completed), is the leader]."""
        is_leader = self.world.world_rank == el.world_rank
        buf = self._incoming(level)
        if is_leader and self.compressed and level == GLOBAL:
            encode_delta(self.sent, self.reference, self.delta_lay, buf)
        elif is_leader:
            buf.copy_(self.sent)
        self.delayed[level] = [step + self.pull_delay, None, is_leader]
        self.delayed[level][1] = post(buf)

    def _land(self, level: int) -> None:
        """The pull of a delayed broadcast: x <- x - c (x - x_L(s)), on every worker; the
        compressed one's r <- r + d(s) first, then x <- x - c (x - r), the leader's too."""
        pending = self.delayed[level]
        if pending[1] is not None:
            pending[1].wait()
            pending[1] = None
        del self.delayed[level]                  # (kept until complete: a failure may cut it)
        self.pulls_done[level] += 1
        if self.compressed and level == GLOBAL:
            apply_delta(self.reference, self.msg, self.delta_lay)
        else:
            # the copy that landed is the level's copy now (proximal pulls, checkpoints)
            self.copies[level], self.incoming[level] = self.incoming[level], self.copies[level]
        self.have_copy[level] = True
        self.apply_pull(level, self.pull_local if level == LOCAL else self.pull_global)

    def drain(self) -> None:
        """Complete the broadcasts in flight (their pulls still land at their steps)."""
        if self.pull_delay:
            for pending in self.delayed.values():
                if pending[1] is not None:
                    pending[1].wait()
                    pending[1] = None

    def _proximal(self, level: int, strength: float) -> None:
        if not self.have_copy[level] or strength <= 0:
            return
        n = self.pulled.numel()
        self.pulled.sub_(self.pulled - self.copies[level][:n], alpha=strength)

    def _log(self, step: int, scope: int, el: Election, score: float) -> None:
        self.log("leader", step=step, scope=scope, leader_rank=el.world_rank, score=score)

    def state_dict(self) -> dict:
        state = {"losses": list(self.losses)}
        if self.pull_every_step:      # the copies the next steps pull toward
            for level, name in ((LOCAL, "local"), (GLOBAL, "global")):
                if self.have_copy[level] and not (self.compressed and level == GLOBAL):
                    state[f"{name}_copy"] = self.copies[level].clone()
        if self.compressed:           # the reference (shared), which is the global copy
            state["reference"] = self.reference.clone()
            state["reference_ready"] = bool(self.reference_ready)
            state["pulled_global"] = bool(self.have_copy[GLOBAL])
        if self.pull_delay:           # a leader copy received, to pull toward at its step
            self.drain()
            for level, name in ((LOCAL, "local"), (GLOBAL, "global")):
                if level in self.delayed:     # (compressed: the message; r + d lands)
                    state[f"{name}_delayed"] = {"pull_step": self.delayed[level][0],
                                                self._saved_as(level):
                                                    self._incoming(level).clone()}
        return state

    def load_state_dict(self, state: dict) -> None:
        self.losses.clear()
        self.losses.extend(float(v) for v in state["losses"])
        if self.compressed:
            if "reference" not in state:
                raise ValueError("lsgd: this state was saved without the compressed pull's "
                                 "reference (topk 1); resume with the topk it was saved with")
            self.reference.copy_(state["reference"])
            self.reference_ready = bool(state["reference_ready"])
            self.have_copy[GLOBAL] = bool(state["pulled_global"])
        for level, name in ((LOCAL, "local"), (GLOBAL, "global")):
            if f"{name}_copy" in state:
                self.copies[level].copy_(state[f"{name}_copy"])
                self.have_copy[level] = True
            if self.pull_delay:
                self.delayed.pop(level, None)
                got = state.get(f"{name}_delayed")
                if got is not None:
                    self._incoming(level).copy_(got[self._saved_as(level)])
                    self.delayed[level] = [int(got["pull_step"]), None, False]

    # -- ranks lost (on_failure="shrink") ------------------------------------------------------
    # A pull cut off by the failure is finished on every survivor of its group or on none:
    # the survivors report whether they hold a complete copy of the leader (they finished
    # its broadcast, or are that leader); if one does, it is re-broadcast from the lowest
    # such rank and the others pull; if none does (the leader died before anyone had its
    # copy), nobody pulled. With pull_delay the broadcasts in flight are treated alike, but
    # for the compressed global pull's, which is dropped on every survivor
    # (_drop_compressed_delayed). A dead rank is never elected again: the new world does not
    # hold it.
    def suspend(self, complete: bool, recovery) -> dict:
        node = recovery.node_key
        pending = None
        if self.pull_in_flight is not None:
            level, is_leader = self.pull_in_flight
            pending = (int(level), int(self.pulls_done[level]),
                       str(node) if level == LOCAL else "", bool(is_leader))
        self.pull_in_flight = None
        last = self.last_global
        self._last_global_initial = None if last is None else \
            (recovery.ctx.initial_of(last.world_rank), last.score)
        # pull_delay: the broadcasts in flight, as (level, pulls landed before it, node,
        # pull step, this rank holds the whole copy: the broadcast completed or it is the
        # leader); whether one completed is not asked of the broken communicators
        delayed = []
        if self.pull_delay:
            self.progress_failure = None        # (the failure this recovery is about)
            for level, (pull_step, request, is_leader) in sorted(self.delayed.items()):
                delayed.append((int(level), int(self.pulls_done[level]),
                                str(node) if level == LOCAL else "", int(pull_step),
                                bool(request is None or is_leader)))
        return {"pending": pending, "done": {int(k): int(v) for k, v in self.pulls_done.items()},
                "node": str(node), "delayed": delayed}

    def resume(self, recovery) -> None:
        world, reports, mine = recovery.world, recovery.reports, recovery.mine
        pulls: Dict[tuple, list] = {}
        for r, rep in enumerate(reports):
            if rep["pending"] is not None:
                pulls.setdefault(rep["pending"][:3], []).append(r)
        for key in sorted(pulls):
            level, count, node = key
            if self.compressed and level == GLOBAL:
                self._resume_compressed(recovery, count)
                continue
            holders = [r for r, rep in enumerate(reports)
                       if (level != LOCAL or rep["node"] == node)
                       and (rep["done"].get(level, 0) == count + 1
                            or (rep["pending"] is not None and rep["pending"][:3] == key
                                and rep["pending"][3]))]
            in_it = mine["pending"] is not None and mine["pending"][:3] == key
            if holders:
                broadcast_copy(world, self.copies[level], min(holders),
                               self.copies[level] if in_it else None)
                if in_it:
                    if not mine["pending"][3]:
                        self.apply_pull(level, self.pull_local if level == LOCAL
                                        else self.pull_global)
                    self.pulls_done[level] = count + 1
                    self.have_copy[level] = True
            elif in_it:
                self.have_copy[level] = False              # its copy is half a broadcast
            if in_it:
                mine["pending"] = None                       # done, should the resume rerun
                if holders:
                    mine["done"][level] = count + 1
        if self.pull_delay:
            self._resume_delayed(recovery)
        last, self.last_global = self._last_global_initial, None
        if last is not None:
            now = recovery.ctx.now_of_initial(last[0])
            if now is not None:                  # a dead leader is never reported again
                self.last_global = Election(now, now, last[1])
        groups = self.groups
        self.multi_level = 1 < groups.n_nodes < groups.world.size
        if self.pull_delay:           # the delayed broadcasts' own communicators, rebuilt
            self.delay_node = {GLOBAL: groups.node.dup()}
            if self.multi_level:
                self.delay_node[LOCAL] = groups.node.dup()
            self.delay_roots = groups.roots.dup() if groups.roots is not None else None

    def _resume_compressed(self, recovery, count: int) -> None:
        """A compressed global pull cut off: the reference r is shared state, so every
        survivor already holds the source's r, which has the message d in it iff the source
        finished the pull (r changes only once the whole message is there). If a survivor
        holds the message (it finished, or it is the leader: its ``msg``), it is broadcast
        from the lowest such, every survivor that lacks it in r adds it (the same bits), and
        the survivors that were in it pull; else nobody has it and nobody pulls."""
        world, reports, mine = recovery.world, recovery.reports, recovery.mine
        key = (GLOBAL, count, "")
        holders = [r for r, rep in enumerate(reports)
                   if rep["done"].get(GLOBAL, 0) == count + 1
                   or (rep["pending"] is not None and rep["pending"][:3] == key
                       and rep["pending"][3])]
        in_it = mine["pending"] is not None and mine["pending"][:3] == key
        if holders:
            broadcast_copy(world, self.msg, min(holders), self.msg)
            if reports[recovery.source]["done"].get(GLOBAL, 0) != count + 1:
                apply_delta(self.reference, self.msg, self.delta_lay)
            if in_it and not mine["pending"][3]:
                self.apply_pull(GLOBAL, self.pull_global)
            self.pulls_done[GLOBAL] = count + 1
            self.have_copy[GLOBAL] = True
            mine["done"][GLOBAL] = count + 1
        if in_it:
            mine["pending"] = None                   # done, should the resume rerun

    def _resume_delayed(self, recovery) -> None:
        """pull_delay: each broadcast in flight is completed on every survivor of its group
        (re-broadcast from the lowest that holds the whole copy: it completed, it is the
        leader, or it already pulled it) or dropped on all (nobody holds it: nobody pulls).
        A completed one lands now when its pull step is behind the agreed step, else at it."""
        world, reports, mine = recovery.world, recovery.reports, recovery.mine
        if self.compressed:
            self._drop_compressed_delayed(recovery)
        for key in sorted({d[:4] for rep in reports for d in rep["delayed"]}):
            level, count, node, pull_step = key
            if self.compressed and level == GLOBAL:
                continue
            holders, started, landed, group = [], 0, False, 0
            for r, rep in enumerate(reports):
                if level == LOCAL and rep["node"] != node:
                    continue
                group += 1
                mine_r = [d for d in rep["delayed"] if d[:4] == key]
                landed_r = rep["done"].get(level, 0) == count + 1
                started += bool(mine_r) or landed_r
                landed = landed or landed_r
                if landed_r or (mine_r and mine_r[0][4]):
                    holders.append(r)
            if started < group and not landed:
                # a member whose election of it failed never started it: nobody pulls
                holders = []
            in_it = any(d[:4] == key for d in mine["delayed"])
            if holders:
                # the root's whole copy: the one in flight, or the one it pulled already
                source = self.incoming[level] if in_it else self.copies[level]
                broadcast_copy(world, source, min(holders),
                               self.incoming[level] if in_it else None)
            if in_it:
                mine["delayed"] = [d for d in mine["delayed"] if d[:4] != key]
                if not holders:
                    self.delayed.pop(level, None)          # nobody holds it: nobody pulls
                    continue
                self.delayed[level] = [pull_step, None, False]
                if pull_step <= recovery.steps:              # its step is behind: land now
                    self._land(level)
                mine["done"][level] = self.pulls_done[level]

    def _drop_compressed_delayed(self, recovery) -> None:
        """pull_delay with the compressed global pull: the one in flight is dropped on every
        survivor alike (its request died with the old world; nobody pulls toward it). The
        reference r is shared state, already the source's on every survivor (taken before
        ``resume``), and r changes only when a pull lands (r <- r + d at its step), so r has
        d(s) in it iff the source had landed it: the same r everywhere either way, and the
        next message d = C(x_L - r) is taken against it. A survivor that landed it already
        pulled its own x toward its r + d (x is its own); one that had not does not pull.
        Every survivor counts the source's landed global pulls."""
        mine = recovery.mine
        self.delayed.pop(GLOBAL, None)
        mine["delayed"] = [d for d in mine["delayed"] if d[0] != GLOBAL]
        done = int(recovery.reports[recovery.source]["done"].get(GLOBAL, 0))
        self.pulls_done[GLOBAL] = mine["done"][GLOBAL] = done
        self.have_copy[GLOBAL] = self.have_copy[GLOBAL] or done > 0

    def rejoin(self, world, joined: bool, source: int) -> str:
        """The rejoining ranks take the global leader's parameters (the survivor with the best
        score: the window mean of its last losses, restored from its checkpoint; theirs is
        +inf), which is also their copy of the global leader."""
        leader = to_the_leader(self, world, joined, source)
        if joined:
            if not self.compressed:   # compressed: the reference is shared state, the source's
                self.copies[GLOBAL].copy_(self.flat.flat[:self.copies[GLOBAL].numel()])
                self.have_copy[GLOBAL] = True
            self.have_copy[LOCAL] = False
            if self.pull_delay:           # a local leader's copy in the survivor's state is
                self.delayed.pop(LOCAL, None)     # its node's: not necessarily this rank's
        return f"the global leader's parameters (rank {leader}) and a fresh optimizer state"


def to_the_leader(rule, world, joined: bool, source: int) -> int:
    """Leader rules at a rejoin: elect the survivor with the best score (the window mean of
    its last losses; a rejoining rank has none), give the rejoining ranks its parameters and
    remember it as the last global leader. Returns its rank: the lowest survivor when no
    score is finite."""
    if joined:
        rule.losses.clear()
    el = world.elect(rule.score())
    leader = el.world_rank if math.isfinite(el.score) else source
    take_parameters(world, rule.flat, leader, joined)
    rule.last_global = Election(leader, leader, el.score)
    return leader
