"""Local SGD's automatic T (its averaging period, ``local_steps="auto"``): fit the local decay
law between averagings, then the seed's T*.

The estimator in four steps (the maths is in docs/algorithms.md, "Automatic T"):

1. Evidence. A *segment* is the run of local steps one rank takes between two averagings.
   Within a segment the loss decays by local progress alone; an averaging round moves every
   model, so the loss jumps between segments. Both laws are fitted with one intercept per
   segment and a common slope, numbering steps by the absolute step s:

       geometric   log L = a_seg + s     log rho      (x = s)
       power       log L = a_seg - beta  log s        (x = log s)

   Only within-segment deviations enter (x - mean_seg x, y - mean_seg y), so jumps across
   averagings never bias the slope. The fit needs five sums per law, pooled over segments:
   n, #segments, Syy, Sxx, Sxy (:class:`DecayStatistics`), which add across ranks.
2. Agreement. Every rank contributes its sums and its measured step/round seconds to one
   sum-allreduce of a float64 vector; every rank then runs the same deterministic
   :func:`decide` on the same numbers, so every rank ends on the same T without unanimity.
3. Goodness of fit. The better law (smaller residual sum of squares) is accepted only if it
   decays (slope < 0), explains at least ``min_r2`` of the within-segment variance, and
   its slope is significant (t-statistic >= ``min_t``). If the other law fits about as well
   (the F-statistic of the difference is below ``min_f``), the data cannot tell the laws apart
   (a short window late in training is nearly straight in both s and log s); the geometric
   law of over-parameterised models is then assumed and recorded as such.
4. T* (seed: Distributed Optimization for Over-Parameterized Learning), with c the cost of one
   averaging round in local steps (round seconds / step seconds):

       geometric  T* = log c / log(1/rho)        power  T* = c^(1/beta) = exp(log c / beta)

   both computed in logs, rounded up and clipped to [1, t_max]; c <= 1 (a round no dearer
   than a step) gives T* = 1 under either law.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, List, Optional, Sequence, Tuple

import numpy as np

__all__ = ["LAW_FIXED", "LAW_NONE", "LAW_GEOMETRIC", "LAW_POWER", "LAW_GEOMETRIC_ASSUMED",
           "LAW_NAMES", "DecayStatistics", "Decision", "decay_statistics", "decide",
           "choose_local_steps", "EVIDENCE_LENGTH"]

#: /train/local_law codes (also written as the HDF5 attribute ``local_law_codes``)
LAW_FIXED = -1               # T given by the user (--local-steps N): no estimate
LAW_NONE = 0                 # auto, no accepted fit yet: T unchanged
LAW_GEOMETRIC = 1            # local loss decays geometrically, rho^s
LAW_POWER = 2                # local loss decays like s^-beta
LAW_GEOMETRIC_ASSUMED = 3    # both laws fit equally well: geometric assumed
LAW_NAMES = {LAW_FIXED: "fixed", LAW_NONE: "none", LAW_GEOMETRIC: "geometric",
             LAW_POWER: "power", LAW_GEOMETRIC_ASSUMED: "geometric (assumed)"}

_TINY_LOSS = 1e-300          # log of a zero loss: a huge negative, not -inf


@dataclass
class DecayStatistics:
    """Pooled within-segment sums of both fits. ``sxx``/``sxy`` are (geometric, power)."""

    n: float = 0.0               # points in segments of >= 2 points
    segments: float = 0.0        # such segments
    syy: float = 0.0
    sxx: Tuple[float, float] = (0.0, 0.0)
    sxy: Tuple[float, float] = (0.0, 0.0)

    def as_vector(self) -> List[float]:
        return [self.n, self.segments, self.syy, *self.sxx, *self.sxy]

    @classmethod
    def from_vector(cls, v: Sequence[float]) -> "DecayStatistics":
        return cls(float(v[0]), float(v[1]), float(v[2]), (float(v[3]), float(v[4])),
                   (float(v[5]), float(v[6])))


#: length of DecayStatistics.as_vector()
EVIDENCE_LENGTH = 7


def decay_statistics(segments: Iterable[Sequence[Tuple[int, float]]]) -> DecayStatistics:
    """Within-segment sums of squares and products of y = log L against x = s and x = log s.

    ``segments``: each a sequence of (absolute step s >= 1, loss) taken between two averagings.
    Points with a non-finite loss are dropped; a zero or negative loss counts as 1e-300.
    Segments left with fewer than two points carry no slope information and are skipped.
    """
    n = segs = syy = 0.0
    sxx, sxy = [0.0, 0.0], [0.0, 0.0]
    for seg in segments:
        pts = [(s, l) for s, l in seg if math.isfinite(l) and s >= 1]
        if len(pts) < 2:
            continue
        s = np.array([p[0] for p in pts], dtype=np.float64)
        y = np.log(np.maximum(np.array([p[1] for p in pts], dtype=np.float64), _TINY_LOSS))
        dy = y - y.mean()
        syy += float(dy @ dy)
        for k, x in enumerate((s, np.log(s))):
            dx = x - x.mean()
            sxx[k] += float(dx @ dx)
            sxy[k] += float(dx @ dy)
        n += len(pts)
        segs += 1
    return DecayStatistics(n, segs, syy, (sxx[0], sxx[1]), (sxy[0], sxy[1]))


@dataclass
class Decision:
    """What the estimator concluded: the law code, its rate, the fit quality, the cost ratio,
    and the T it implies (None: keep the current T)."""

    law: int
    rate: float = math.nan       # rho (geometric) or beta (power)
    r2: float = math.nan
    cost_ratio: float = math.nan
    T: Optional[int] = None
    reason: str = ""


def choose_local_steps(law: int, rate: float, cost_ratio: float, t_max: int) -> Optional[int]:
    """T* of the seed's laws, in logs so that no input overflows, rounded up, in [1, t_max].

    ``cost_ratio`` c = seconds of one averaging round / seconds of one local step.
      geometric (rate = rho in (0, 1)):  T* = log c / log(1/rho)
      power     (rate = beta > 0):       T* = c^(1/beta),  log T* = log c / beta
    c <= 1 gives 1 under either law. None when the law or the numbers give no T.
    """
    t_max = max(1, int(t_max))
    if not (math.isfinite(rate) and math.isfinite(cost_ratio)) or cost_ratio <= 0:
        return None
    if law in (LAW_GEOMETRIC, LAW_GEOMETRIC_ASSUMED):
        if not 0.0 < rate < 1.0:
            return None
        if cost_ratio <= 1.0:
            return 1
        log_t = math.log(math.log(cost_ratio)) - math.log(-math.log(rate))
    elif law == LAW_POWER:
        if not rate > 0.0:
            return None
        if cost_ratio <= 1.0:
            return 1
        log_t = math.log(cost_ratio) / rate
    else:
        return None
    if log_t >= math.log(t_max):
        return t_max
    # ceil with a little slack, so that a T* of exactly 100 computed as 100.00000000001 is 100
    return int(min(max(1, math.ceil(math.exp(log_t) * (1.0 - 1e-12))), t_max))


def decide(stats: DecayStatistics, cost_ratio: float, t_max: int, min_r2: float = 0.1,
           min_t: float = 3.0, min_f: float = 4.0, min_dof: int = 8) -> Decision:
    """The deterministic decision from pooled evidence (same numbers in, same T out).

    Fit per law: slope b = Sxy/Sxx, residual SSE = Syy - Sxy^2/Sxx, R^2 = 1 - SSE/Syy (within
    segments), dof = n - segments - 1, t = -b / sqrt(SSE / (dof Sxx)). The law with the smaller
    SSE is taken if b < 0, R^2 >= min_r2 and t >= min_t; it is *identified* if the other law's
    excess residual is significant, F = (SSE_other - SSE_best) / (SSE_best / dof) >= min_f,
    otherwise the geometric law is assumed (LAW_GEOMETRIC_ASSUMED). Never raises.
    """
    ratio_ok = math.isfinite(cost_ratio) and cost_ratio > 0
    dof = stats.n - stats.segments - 1
    if dof < min_dof or not stats.syy > 0 or not all(v > 0 for v in stats.sxx):
        return _fallback(LAW_NONE, cost_ratio, ratio_ok, f"too little evidence (dof {dof:g})")
    fits = []
    for k in range(2):
        b = stats.sxy[k] / stats.sxx[k]
        sse = max(stats.syy - stats.sxy[k] ** 2 / stats.sxx[k], 0.0)
        fits.append((sse, b))
    best = 0 if fits[0][0] <= fits[1][0] else 1
    sse, b = fits[best]
    r2 = 1.0 - sse / stats.syy
    se = math.sqrt(sse / (dof * stats.sxx[best]))
    t_stat = math.inf if se == 0 else -b / se
    if not b < 0:
        return _fallback(LAW_NONE, cost_ratio, ratio_ok, "the loss does not decay", r2)
    if r2 < min_r2 or t_stat < min_t:
        return _fallback(LAW_NONE, cost_ratio, ratio_ok,
                         f"fit rejected (R^2 {r2:.3g} < {min_r2} or t {t_stat:.3g} < {min_t})",
                         r2)
    sse_other = fits[1 - best][0]
    f_stat = math.inf if sse == 0 else (sse_other - sse) / (sse / dof)
    if f_stat >= min_f:
        law = LAW_GEOMETRIC if best == 0 else LAW_POWER
        reason = f"identified (F {f_stat:.3g})"
    else:
        law, best = LAW_GEOMETRIC_ASSUMED, 0
        b = fits[0][1]
        r2 = 1.0 - fits[0][0] / stats.syy
        reason = f"laws indistinguishable (F {f_stat:.3g} < {min_f}): geometric assumed"
    rate = math.exp(b) if best == 0 else -b
    if not ratio_ok:
        return Decision(law, rate, r2, cost_ratio, None, reason + "; no cost ratio")
    return Decision(law, rate, r2, cost_ratio,
                    choose_local_steps(law, rate, cost_ratio, t_max), reason)


def _fallback(law: int, cost_ratio: float, ratio_ok: bool, reason: str,
              r2: float = math.nan) -> Decision:
    # Without a law, T is kept -- except when a round is no dearer than a step: then every law
    # of the seed gives T* = 1.
    t = 1 if ratio_ok and cost_ratio <= 1.0 else None
    return Decision(law, math.nan, r2, cost_ratio, t, reason)
