"""Local SGD (periodic averaging) with a fixed T, or T chosen at run time (see auto_period)."""

from __future__ import annotations

import math
import time
from collections import deque
from typing import Deque, List, Optional, Tuple

import numpy as np
import torch

from lsgd_hpc.comm import FlatParams, NodeGroups
from lsgd_hpc.comm.accounting import uncounted
from lsgd_hpc.methods.rules.base import Rule
from lsgd_hpc.methods.rules.auto_period import (EVIDENCE_LENGTH, LAW_FIXED, LAW_NAMES, LAW_NONE,
                                                DecayStatistics, Decision, choose_local_steps,
                                                decay_statistics, decide)

__all__ = ["LocalSGDRule", "FlatAverage", "choose_local_steps"]


class FlatAverage:
    """x <- (1/p) sum_j x_j over ``world``, x the flat vector (parameters and buffers): the
    averaging round of local SGD and SlowMo.

    Dense (the world's ``topk`` 1): the weights themselves, copied into a scratch buffer,
    allreduced (``mean``) and copied back; nothing else is kept. Top-k (``topk`` < 1: the
    allreduce sends each chunk's top-k, lsgd_hpc.comm.sparse): through a reference r, the
    common x after the last round (x_0 before the first: taken just before the first
    optimizer step, after the initial broadcast; rank 0's, see :meth:`anchor`), the same bits
    on every rank:

        d_i = r - x_i;   dbar = (1/p) sum_j C(d_j (+ e_j));   x <- r - dbar;   r <- x

    (C and the residuals e_j: the wire layer's, with ``error_feedback``). Every rank adds the
    same records in the same order, so x and r end with the same bits everywhere. r is the
    rule's shared state ``reference`` (:meth:`shared`, :meth:`save`, :meth:`load`).
    """

    def __init__(self, world, flat: FlatParams):
        self.world, self.flat = world, flat
        self.scratch = torch.empty_like(flat.flat)
        world.agree_buffers(self.scratch)
        sparse = float(getattr(world, "topk", 1.0)) < 1
        #: r (None: dense, no reference)
        self.reference = flat.flat.detach().clone() if sparse else None
        self.anchor_pending = sparse

    def shared(self, keys: Tuple[str, ...]) -> Tuple[str, ...]:
        """A rule's ``shared_state`` keys, with the reference when there is one."""
        return keys if self.reference is None else keys + ("reference",)

    def anchor(self) -> None:
        """Before a step: at the first one, r <- rank 0's x, broadcast exactly and uncounted
        (set-up, as the initial broadcast): the parameters are the common x_0 there, but the
        first forward pass has already moved each rank's BatchNorm statistics its own way."""
        if self.anchor_pending:
            world = getattr(self.world, "inner", self.world)     # exact, whatever comm_dtype
            self.reference.copy_(self.flat.flat)
            with uncounted(world):
                world.broadcast_(self.reference, 0)
            self.anchor_pending = False

    def average(self) -> None:
        x, buf, r = self.flat.flat, self.scratch, self.reference
        if r is None:
            buf.copy_(x)
            self.world.allreduce_(buf, "mean")
            x.copy_(buf)
            return
        self.anchor_pending = False
        torch.sub(r, x, out=buf)                          # d_i = r - x_i
        self.world.allreduce_(buf, "mean")                # dbar (top-k records)
        torch.sub(r, buf, out=x)                          # x <- r - dbar
        r.copy_(x)

    def settle(self) -> None:
        """r <- x, after a change that every rank makes alike (SlowMo's slow step)."""
        if self.reference is not None:
            self.reference.copy_(self.flat.flat)

    def save(self, state: dict) -> dict:
        """``state`` with the reference added (before the first step: the x it will take)."""
        if self.reference is not None:
            r = self.flat.flat if self.anchor_pending else self.reference
            state["reference"] = r.detach().clone()
        return state

    def load(self, state: dict, who: str) -> None:
        if self.reference is None:
            return
        if "reference" not in state:
            raise ValueError(f"{who}: this state was saved without the reference of top-k "
                             "averaging (topk 1); resume with the topk it was saved with")
        self.reference.copy_(state["reference"])
        self.anchor_pending = False


class LocalSGDRule(Rule):
    """Every T local steps:  x_i <- (1/p) sum_j x_j   (one allreduce over the fused buffer).

    T = 1 is parameter-averaged SGD. ``auto``: start at ``t_initial``; keep this rank's recent
    losses as segments (the steps between two averagings) and the seconds of its local steps
    and averaging rounds. At the first averaging round at least ``reestimate_steps`` after the
    last estimate, every rank adds its decay statistics and its median step and round seconds
    (or takes the given ``cost_ratio``) into one float64 sum-allreduce, and every rank runs the same :func:`auto_period.decide`
    on the sums: the same T everywhere, without asking the ranks to agree on a law. The T in
    use is logged in /train/local_steps and the law behind it in /train/local_law (codes in
    auto_period.LAW_NAMES; -1 for a fixed T); /train/local_rate (rho or beta) and
    /train/local_cost_ratio (c) are those of the last estimate (NaN before one). Timing-based, so an ``auto`` run is not
    bit-reproducible; a fixed T is. With ``topk`` < 1 on the world the average goes through
    the shared reference ``reference`` (:class:`FlatAverage`).
    """

    name = "local-sgd"
    #: the period state; the decay samples (segments, current) are the rank's own
    shared_state = ("T", "law", "since_avg", "last_estimate", "decision")
    extra_columns = {"train": {"local_steps": "i8", "local_law": "i1", "local_rate": "f8",
                               "local_cost_ratio": "f8"}}
    file_attrs = {"local_law_codes": ", ".join(f"{k}={v}" for k, v in LAW_NAMES.items())}

    def __init__(self, groups: NodeGroups, flat: FlatParams, local_steps, t_max: int = 1024,
                 t_initial: int = 4, reestimate_steps: int = 50, history: int = 200,
                 cost_ratio: Optional[float] = None, log=None):
        super().__init__(groups, flat, log)
        self.auto = local_steps == "auto"
        self.T = min(t_initial, t_max) if self.auto else int(local_steps)
        self.law = LAW_NONE if self.auto else LAW_FIXED
        self.t_max = t_max
        self.reestimate_steps = reestimate_steps
        #: the round/step cost ratio to assume; None: measure it
        self.fixed_cost_ratio = cost_ratio
        self.history = history
        self.since_avg = 0
        self.last_estimate = 0
        #: finished segments [(step, loss), ...], newest last, about ``history`` points in all
        self.segments: Deque[List[Tuple[int, float]]] = deque()
        self.current: List[Tuple[int, float]] = []
        self.step_seconds: Deque[float] = deque(maxlen=history)
        self.round_seconds: Deque[float] = deque(maxlen=16)
        self.last_decision: Decision = Decision(self.law)
        self._t_last = None
        self.averaging = FlatAverage(self.world, flat)
        self.shared_state = self.averaging.shared(type(self).shared_state)

    def before_step(self, step: int) -> None:
        self.averaging.anchor()

    def after_step(self, step: int, loss: float) -> None:
        now = time.perf_counter()
        if self._t_last is not None:
            self.step_seconds.append(now - self._t_last)
        if self.auto:
            self.current.append((int(step), float(loss)))
        self.since_avg += 1
        if self.since_avg >= self.T:
            t0 = time.perf_counter()
            self.average(step)
            self.round_seconds.append(time.perf_counter() - t0)
            self.since_avg = 0
            if self.auto:
                self._close_segment()
                if step - self.last_estimate >= self.reestimate_steps:
                    self.reestimate(step)
        self._t_last = time.perf_counter()

    def average(self, step: int) -> None:
        self.averaging.average()

    def _close_segment(self) -> None:
        self.segments.append(self.current)
        self.current = []
        while sum(len(seg) for seg in self.segments) - len(self.segments[0]) >= self.history:
            self.segments.popleft()

    def evidence(self) -> List[float]:
        """This rank's share of the one allreduce: decay sums, then (median step seconds,
        median round seconds, 1) if it has timings, else zeros (it then does not count)."""
        stats = decay_statistics(self.segments).as_vector()
        step_s = float(np.median(self.step_seconds)) if self.step_seconds else math.nan
        round_s = float(np.median(self.round_seconds)) if self.round_seconds else math.nan
        timed = [step_s, round_s, 1.0]
        if not (all(math.isfinite(v) for v in timed) and step_s > 0):
            timed = [0.0, 0.0, 0.0]
        return stats + timed

    def reestimate(self, step: int) -> None:
        v = torch.tensor(self.evidence(), dtype=torch.float64)
        self.world.allreduce_(v, "sum")
        total = v.tolist()
        stats = DecayStatistics.from_vector(total[:EVIDENCE_LENGTH])
        step_s, round_s, timed = total[EVIDENCE_LENGTH:]
        ratio = round_s / step_s if timed > 0 and step_s > 0 else math.nan
        if self.fixed_cost_ratio is not None:
            ratio = self.fixed_cost_ratio
        decision = decide(stats, ratio, self.t_max)
        self.last_estimate = step
        self.last_decision = decision
        if decision.T is not None:
            self.T = decision.T
            self.law = decision.law

    def train_columns(self):
        d = self.last_decision
        return {"local_steps": self.T, "local_law": self.law, "local_rate": d.rate,
                "local_cost_ratio": d.cost_ratio}

    def state_dict(self) -> dict:
        state = {"T": self.T, "law": self.law, "since_avg": self.since_avg,
                 "last_estimate": self.last_estimate,
                 "segments": [list(map(list, seg)) for seg in self.segments],
                 "current": [list(p) for p in self.current],
                 "decision": [self.last_decision.law, self.last_decision.rate,
                              self.last_decision.r2, self.last_decision.cost_ratio,
                              self.last_decision.T, self.last_decision.reason]}
        return self.averaging.save(state)

    def load_state_dict(self, state: dict) -> None:
        self.T = int(state["T"])
        self.law = int(state.get("law", LAW_NONE if self.auto else LAW_FIXED))
        self.since_avg = int(state["since_avg"])
        self.last_estimate = int(state["last_estimate"])
        self.segments.clear()
        self.segments.extend([(int(s), float(l)) for s, l in seg]
                             for seg in state.get("segments", []))
        self.current = [(int(s), float(l)) for s, l in state.get("current", [])]
        if "decision" in state:
            law, rate, r2, ratio, *rest = state["decision"]   # (older checkpoints: 4)
            self.last_decision = Decision(int(law), float(rate), float(r2), float(ratio),
                                          *rest)
        self.averaging.load(state, "local-sgd")

    def suspend(self, complete: bool, recovery) -> None:
        if not complete and self.since_avg >= self.T:
            self.since_avg = 0          # the averaging that was cut off is skipped
        return None
