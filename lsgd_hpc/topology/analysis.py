"""Spectral analysis of a topology's mixing matrix: spectral gap, second eigenvalue and
singular value, effective number of neighbours, diameter, and ``analyse`` (all of them)."""

from __future__ import annotations

from typing import Optional, Sequence, Union

import numpy as np

from .graphs import Matrix, Topology, build_topology
from .spectra import (_as_square, _check_gamma, _is_symmetric, _mean_variance_from_spectrum,
                      _mean_variance_periodic, _slem_from_spectrum)

__all__ = ["DEFAULT_GAMMAS", "SPECTRAL_GAP_DEFINITION", "spectral_gap", "second_eigenvalue_modulus",
           "second_singular_value", "effective_neighbors", "diameter", "analyse"]

#: What ``spectral_gap`` and ``analyse(...)["spectral_gap"]`` report, in words.
SPECTRAL_GAP_DEFINITION = ("1 - ||W - 11^T/n||_2 (one-step contraction of the consensus error); "
                           "time-varying: 1 - ||W_{P-1}...W_0 - 11^T/n||_2^(1/P)")

#: Gamma grid of the effective number of neighbours when the caller gives none.
DEFAULT_GAMMAS = (0.5, 0.9, 0.99, 0.999)


# --------------------------------------------------------------------------------------------
# Analysis
# --------------------------------------------------------------------------------------------

def second_eigenvalue_modulus(topology_or_W: Union[Topology, Matrix]) -> float:
    """|lambda_2(W)|: the second largest eigenvalue modulus (0 when n = 1), the asymptotic
    per-step rate at which W^t x approaches the average.

    For a time-varying topology: the per-step rate |lambda_2(W_{P-1} ... W_0)|^(1/P) of the
    product over one period (0 for the one-peer exponential graph with n a power of two).
    """
    if isinstance(topology_or_W, Topology):
        return topology_or_W._slem()
    W = _as_square(topology_or_W)
    if len(W) == 1:
        return 0.0
    eig = np.linalg.eigvalsh(W) if _is_symmetric(W) else np.linalg.eigvals(W)
    return _slem_from_spectrum(eig)


def second_singular_value(topology_or_W: Union[Topology, Matrix, Sequence[Matrix]]) -> float:
    """sigma_2(W) = ||W - 11^T/n||_2 for a doubly stochastic W (0 when n = 1): the largest
    factor by which one mixing step can shrink the consensus error, ||W x - xbar|| <=
    sigma_2 ||x - xbar|| for every x (xbar the average, which W keeps).

    For a normal W (symmetric, or circulant like every graph built here) sigma_2 = |lambda_2|.
    For a non-normal W, |lambda_2| only gives the rate after many steps and can be far below
    sigma_2. A sequence W_0..W_{P-1} (or a time-varying topology) is taken as one period:
    ||W_{P-1}...W_0 - 11^T/n||_2^(1/P), a per-step rate.
    """
    if isinstance(topology_or_W, Topology):
        return topology_or_W._slem()               # normal W: sigma_2 = |lambda_2|
    arr = np.asarray(topology_or_W, dtype=float)
    Ws = [_as_square(W) for W in arr] if arr.ndim == 3 else [_as_square(arr)]
    n = len(Ws[0])
    if n == 1:
        return 0.0
    Phi = np.eye(n)
    for W in Ws:
        Phi = W @ Phi
    return float(np.linalg.norm(Phi - np.full((n, n), 1.0 / n), 2) ** (1.0 / len(Ws)))


def spectral_gap(topology_or_W: Union[Topology, Matrix, Sequence[Matrix]]) -> float:
    """1 - sigma_2(W) = 1 - ||W - 11^T/n||_2 (see second_singular_value): the guaranteed
    one-step shrink of the consensus error, the quantity decentralized-SGD rates are stated in.
    It equals 1 - |lambda_2(W)| for symmetric W and for every (normal) graph built here; for a
    non-normal matrix given directly the two differ and this one is the honest bound.
    Complete graph: 1; ring with max-degree weights: 1 - |1/3 + 2/3 cos(2 pi / n)|; static
    exponential graph, n a power of two: 2 / (log2 n + 1). Uses the topology's structure when
    given one."""
    return 1.0 - second_singular_value(topology_or_W)


def effective_neighbors(topology_or_W: Union[Topology, Matrix, Sequence[Matrix]],
                        gamma: float) -> float:
    """Effective number of neighbours ENN(gamma) (seed: Beyond spectral gap).

    Model: x <- W (sqrt(gamma) x + xi), xi ~ N(0, I). For symmetric W = Q diag(l) Q^T the
    stationary covariance is Q diag(l^2 / (1 - gamma l^2)) Q^T, and, by trace invariance,

        ENN(gamma) = 1 / ((1 - gamma) * mean_k l_k^2 / (1 - gamma l_k^2)),

    so W = I gives 1 and W = 11^T/n gives n. For a non-symmetric W, or a time-varying topology
    (or a sequence of matrices W_0..W_{P-1} taken as one period), mean_i Var(x_i) comes from the
    discrete Lyapunov equation over one period, averaged over the P phases (see
    _mean_variance_periodic). gamma must be in [0, 1).
    """
    g = _check_gamma(gamma)
    if isinstance(topology_or_W, Topology):
        var = topology_or_W._mean_variance([g])[0]
    else:
        arr = np.asarray(topology_or_W, dtype=float)
        if arr.ndim == 3:
            var = _mean_variance_periodic([_as_square(W) for W in arr], [g])[0]
        else:
            W = _as_square(arr)
            if _is_symmetric(W):
                var = _mean_variance_from_spectrum(np.linalg.eigvalsh(W), [g])[0]
            else:
                var = _mean_variance_periodic([W], [g])[0]
    return float(1.0 / ((1.0 - g) * var))


def diameter(topology: Topology) -> Optional[int]:
    """Largest hop distance between two ranks (over the union of one period's graphs, along
    edge directions, for a time-varying topology); None if some rank cannot reach another."""
    return topology._diameter()


def analyse(name: str, n: int, gammas: Sequence[float] = DEFAULT_GAMMAS,
            node_of: Optional[Sequence[int]] = None) -> dict:
    """Everything the comparison tables need about one topology, JSON-ready.

    Keys: topology, n, layout, time_varying, directed, period, degree {min, max, mean}
    (in-neighbours per step), diameter, symmetric and doubly_stochastic (checked on the weights,
    every step of a period), second_eigenvalue_modulus (|lambda_2|), second_singular_value
    (||W - 11^T/n||_2), spectral_gap (1 - second_singular_value; per-step rates of the period
    product for a time-varying topology), spectral_gap_definition (that sentence), and
    effective_neighbors {str(gamma): ENN(gamma)} (discrete Lyapunov equation for a non-symmetric
    or time-varying W, evaluated through the Fourier modes where W is circulant).
    """
    gammas = [_check_gamma(g) for g in gammas]
    top = build_topology(name, n, node_of)
    symmetric, stochastic = top._verify()
    slem = second_eigenvalue_modulus(top)
    sigma2 = second_singular_value(top)
    enn = 1.0 / ((1.0 - np.array(gammas)) * top._mean_variance(gammas)) if gammas else []
    return {
        "topology": top.name,
        "n": top.n,
        "layout": top.layout,
        "time_varying": top.time_varying,
        "directed": any(top.in_neighbors(i, t) != top.out_neighbors(i, t)
                        for t in range(top.period) for i in range(top.n)),
        "period": top.period,
        "degree": top.degree(),
        "diameter": diameter(top),
        "symmetric": symmetric,
        "doubly_stochastic": stochastic,
        "second_eigenvalue_modulus": slem,
        "second_singular_value": sigma2,
        "spectral_gap": 1.0 - sigma2,
        "spectral_gap_definition": SPECTRAL_GAP_DEFINITION,
        "effective_neighbors": {str(g): float(v) for g, v in zip(gammas, enn)},
    }


