"""Local SGD (periodic averaging) with a fixed T, or T chosen at run time from measured costs."""

from __future__ import annotations

import math
import time
from collections import deque
from typing import Optional, Tuple

import numpy as np
import torch

from ..comm import FlatParams, NodeGroups
from .base import Algorithm

__all__ = ["LocalSGD", "choose_local_steps", "fit_decay"]


def fit_decay(losses) -> Tuple[str, float, float]:
    """Fit the local decay of the loss over steps t = 1..n, both ways, by least squares on
    log-loss: geometric  L_t = a rho^t   and  power  L_t = a t^(-beta).
    Returns (law, rate, r2) for the better fit: law 'geometric' with rate rho, or 'power'
    with rate beta; ('none', nan, nan) when the loss does not decay.
    """
    y = np.log(np.maximum(np.asarray(losses, dtype=np.float64), 1e-12))
    n = len(y)
    if n < 4 or not np.all(np.isfinite(y)):
        return "none", math.nan, math.nan
    t = np.arange(1, n + 1, dtype=np.float64)
    best = ("none", math.nan, -math.inf)
    for law, xs in (("geometric", t), ("power", np.log(t))):
        slope, icpt = np.polyfit(xs, y, 1)
        resid = y - (slope * xs + icpt)
        ss = float(((y - y.mean()) ** 2).sum())
        r2 = 1.0 - float((resid ** 2).sum()) / ss if ss > 0 else 0.0
        if slope < 0 and r2 > best[2]:
            best = (law, math.exp(slope) if law == "geometric" else -slope, r2)
    return best if best[0] != "none" else ("none", math.nan, math.nan)


def choose_local_steps(law: str, rate: float, cost_ratio: float, t_max: int) -> Optional[int]:
    """T* from the laws of the over-parameterized-learning seed.

    ``cost_ratio`` = (seconds of one averaging round) / (seconds of one local step), as
    measured. The seed writes its laws with r = 1 / cost_ratio (a local step's cost in
    units of a communication), so that cheap steps and dear communication mean small r:
      geometric local progress (L ~ rho^t):   T* = log(1/r) / log(1/rho)   (grows like log(1/r))
      power-law local decay  (L ~ t^-beta):   T* = r^(-1/beta)
    rounded up and clipped to [1, t_max]. None when no law applies (keep the current T).
    """
    if law == "none" or not math.isfinite(rate) or cost_ratio <= 0:
        return None
    inv_r = max(cost_ratio, 1.0 + 1e-9)   # r >= 1: a step dearer than a round -> T = 1
    if law == "geometric":
        if not 0 < rate < 1:
            return None
        t = math.log(inv_r) / math.log(1.0 / rate)
    else:
        if rate <= 0:
            return None
        t = inv_r ** (1.0 / rate)
    return int(min(max(1, math.ceil(t)), t_max))


class LocalSGD(Algorithm):
    """Every T local steps:  x_i <- (1/p) sum_j x_j   (one allreduce over the fused buffer).

    T = 1 is parameter-averaged SGD. ``auto``: start at ``t_initial``; at every averaging
    round at least ``reestimate_steps`` after the last estimate, measure the cost ratio
    (round seconds / local-step seconds) and fit the local decay of the recent training loss
    (fit_decay), average those over ranks (one 4-number allreduce, so every rank picks the
    same T) and set T = choose_local_steps(...). The T in use is logged in /train/local_steps.
    Timing-based, so an ``auto`` run is not bit-reproducible; a fixed T is.
    """

    name = "local-sgd"
    extra_columns = {"train": {"local_steps": "i8"}}

    def __init__(self, groups: NodeGroups, flat: FlatParams, local_steps, t_max: int = 1024,
                 t_initial: int = 4, reestimate_steps: int = 50, history: int = 200, log=None):
        super().__init__(groups, flat, log)
        self.auto = local_steps == "auto"
        self.T = t_initial if self.auto else int(local_steps)
        self.t_max = t_max
        self.reestimate_steps = reestimate_steps
        self.since_avg = 0
        self.last_estimate = 0
        self.losses: deque = deque(maxlen=history)
        self.step_seconds: deque = deque(maxlen=history)
        self.round_seconds: deque = deque(maxlen=16)
        self._t_last: Optional[float] = None
        self.scratch = torch.empty_like(flat.flat)

    def after_step(self, step: int, loss: float) -> None:
        now = time.perf_counter()
        if self._t_last is not None:
            self.step_seconds.append(now - self._t_last)
        self.losses.append(float(loss))
        self.since_avg += 1
        if self.since_avg >= self.T:
            t0 = time.perf_counter()
            self.average(step)
            self.round_seconds.append(time.perf_counter() - t0)
            self.since_avg = 0
            if self.auto and step - self.last_estimate >= self.reestimate_steps:
                self.reestimate(step)
        self._t_last = time.perf_counter()

    def average(self, step: int) -> None:
        x, mean = self.flat.flat, self.scratch
        mean.copy_(x)
        self.world.allreduce_(mean, "mean")
        self.log_consensus(step, x - mean)
        x.copy_(mean)

    def reestimate(self, step: int) -> None:
        law, rate, _ = fit_decay(self.losses)
        step_s = float(np.median(self.step_seconds)) if self.step_seconds else math.nan
        round_s = float(np.median(self.round_seconds)) if self.round_seconds else math.nan
        geometric = law == "geometric"
        # Average the evidence over ranks so that every rank chooses the same T.
        v = torch.tensor([round_s / step_s if step_s > 0 else math.nan,
                          1.0 if geometric else 0.0,
                          math.log(rate) if geometric else (rate if law == "power" else math.nan),
                          1.0 if law != "none" else 0.0], dtype=torch.float64)
        if not torch.isfinite(v).all():
            v.zero_()                       # this rank has no usable evidence (counts 0)
        self.world.allreduce_(v, "sum")
        n_valid = v[3].item()
        self.last_estimate = step
        if n_valid < self.world.size:      # some rank saw no decay yet: keep T
            return
        ratio, geo_votes, rate_mean = (v[0] / n_valid).item(), v[1].item(), (v[2] / n_valid).item()
        if 0 < geo_votes < n_valid:
            return                          # ranks disagree on the law: keep T
        law = "geometric" if geo_votes else "power"
        rate = math.exp(rate_mean) if law == "geometric" else rate_mean
        new_t = choose_local_steps(law, rate, ratio, self.t_max)
        if new_t is not None:
            self.T = new_t

    def train_columns(self):
        return {"local_steps": self.T}

    def state_dict(self) -> dict:
        return {"T": self.T, "since_avg": self.since_avg, "last_estimate": self.last_estimate,
                "losses": list(self.losses)}

    def load_state_dict(self, state: dict) -> None:
        self.T = int(state["T"])
        self.since_avg = int(state["since_avg"])
        self.last_estimate = int(state["last_estimate"])
        self.losses.clear()
        self.losses.extend(float(v) for v in state["losses"])
