"""Rank correlation of two samples (Spearman's rho, Kendall's tau-b) for the aggregator."""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np
import scipy.stats

__all__ = ["RANK_CORRELATION_METHODS", "rank_correlation"]

RANK_CORRELATION_METHODS = ("spearman", "kendall")


def rank_correlation(x: Sequence[float], y: Sequence[float], method: str = "spearman") -> float:
    """Rank correlation of paired samples ``x`` and ``y``: +1 when they order the items the same
    way, -1 when in opposite ways, about 0 when unrelated. Only the ordering matters, so a
    predictor on any scale (spectral gap, neighbours, seconds) can be compared with a measured
    quantity (time to target, consensus distance).

    Pairs where either value is NaN or infinite are left out first.

    ``spearman`` (Spearman's rho, with average ranks for ties): replace each sample by its
    ranks 1..n, tied values sharing the mean of the ranks they span (``[10, 20, 20, 30]`` ->
    ``[1, 2.5, 2.5, 4]``), and take Pearson's correlation of the ranks::

        rho = sum_i (a_i - abar)(b_i - bbar) / sqrt(sum_i (a_i - abar)^2 * sum_i (b_i - bbar)^2)

    where a, b are the ranks of x, y. Without ties this is ``1 - 6 sum_i (a_i - b_i)^2 /
    (n (n^2 - 1))``.

    ``kendall`` (Kendall's tau-b): over all n(n-1)/2 pairs i < j, with
    ``s_ij = sign(x_i - x_j) * sign(y_i - y_j)``::

        tau_b = sum_{i<j} s_ij / sqrt((n0 - n1) (n0 - n2))

    n0 = n(n-1)/2, n1 = sum over groups of tied x values of t(t-1)/2 (t the group's size), n2
    the same for y: the numerator is concordant minus discordant pairs, the denominator the
    geometric mean of the pairs not tied in x and not tied in y.

    Returns NaN when fewer than 2 pairs remain or either sample is constant (the correlation is
    undefined: nothing to order). Computed with scipy.stats (spearmanr, kendalltau variant b).
    Raises ValueError for samples of different lengths or an unknown method.
    """
    if method not in RANK_CORRELATION_METHODS:
        raise ValueError(f"method must be one of {', '.join(RANK_CORRELATION_METHODS)}, "
                         f"not {method!r}")
    xa = np.asarray(x, dtype=float).ravel()
    ya = np.asarray(y, dtype=float).ravel()
    if len(xa) != len(ya):
        raise ValueError(f"x and y differ in length ({len(xa)} and {len(ya)})")
    keep = np.isfinite(xa) & np.isfinite(ya)
    xa, ya = xa[keep], ya[keep]
    # checked here rather than left to scipy, which would warn (ConstantInputWarning) as well
    if len(xa) < 2 or np.all(xa == xa[0]) or np.all(ya == ya[0]):
        return math.nan
    if method == "spearman":
        return float(scipy.stats.spearmanr(xa, ya).statistic)
    return float(scipy.stats.kendalltau(xa, ya, variant="b").statistic)
