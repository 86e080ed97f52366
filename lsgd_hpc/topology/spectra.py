"""Spectral kernels shared by the graphs (their structured spectra) and the analysis: the
second largest eigenvalue modulus and the stationary variance of the noisy walk, from a
spectrum or from one period of a time-varying W."""

from __future__ import annotations

from typing import Sequence

import numpy as np

_TOL = 1e-12        # row/column sums and symmetry are checked to this absolute tolerance

Matrix = "np.ndarray | Sequence[Sequence[float]]"

def _as_square(W: Matrix) -> np.ndarray:
    W = np.asarray(W, dtype=float)
    if W.ndim != 2 or W.shape[0] != W.shape[1] or W.shape[0] < 1:
        raise ValueError(f"expected a square matrix, got shape {W.shape}")
    return W


def _is_symmetric(W: np.ndarray) -> bool:
    return bool(np.allclose(W, W.T, rtol=0, atol=_TOL))


def _check_gamma(gamma: float) -> float:
    try:
        g = float(gamma)
    except (TypeError, ValueError):
        raise ValueError(f"gamma must be a number in [0, 1), got {gamma!r}") from None
    if not 0.0 <= g < 1.0:
        raise ValueError(f"gamma must be in [0, 1), got {gamma!r}")
    return g


def _slem_from_spectrum(eigenvalues: np.ndarray) -> float:
    if len(eigenvalues) < 2:
        return 0.0
    return float(np.sort(np.abs(eigenvalues))[-2])


def _periodic_slem(Ws: Sequence[np.ndarray]) -> float:
    Phi = np.eye(len(Ws[0]))
    for W in Ws:
        Phi = W @ Phi
    if len(Phi) < 2:
        return 0.0
    mods = np.sort(np.abs(np.linalg.eigvals(Phi)))
    return float(mods[-2] ** (1.0 / len(Ws)))


def _mean_variance_from_spectrum(eigenvalues: np.ndarray, gammas: Sequence[float]) -> np.ndarray:
    l2 = np.asarray(eigenvalues, dtype=float) ** 2
    return np.array([np.mean(l2 / (1.0 - g * l2)) for g in gammas])


def _mean_variance_periodic(Ws: Sequence[np.ndarray], gammas: Sequence[float]) -> np.ndarray:
    """mean_i Var(x_i), averaged over the phases of one period, of the random walk
        x_{t+1} = W_t (sqrt(g) x_t + xi_t),   xi_t ~ N(0, I),   W_{t+P} = W_t.
    Covariance at phase k: Sigma_{k+1} = W_k (g Sigma_k + I) W_k^T. Over a period,
    Sigma_0 = g^P Phi Sigma_0 Phi^T + Q with Phi = W_{P-1} ... W_0 and Q the P maps applied to 0:
    a discrete Lyapunov equation (A = g^(P/2) Phi), solved by Schur (dense, O(n^3)). For P = 1 and
    symmetric W it reduces to Sigma = W^2 (I - g W^2)^{-1}, the formula of the static case.
    """
    n, P = len(Ws[0]), len(Ws)
    Phi = np.eye(n)
    for W in Ws:
        Phi = W @ Phi
    out = np.empty(len(gammas))
    for idx, g in enumerate(gammas):
        Q = np.zeros((n, n))
        for W in Ws:
            Q = W @ (g * Q + np.eye(n)) @ W.T
        import scipy.linalg
        Sigma = scipy.linalg.solve_discrete_lyapunov(g ** (P / 2) * Phi, Q)
        total = 0.0
        for W in Ws:
            total += np.trace(Sigma) / n
            Sigma = W @ (g * Sigma + np.eye(n)) @ W.T
        out[idx] = total / P
    return out


