"""Gossip topologies as pure graphs: who sends to whom, with which mixing weights (no MPI).

TOPOLOGIES is the registry of names; build_topology(name, n) makes one."""

from __future__ import annotations

import math
from collections import deque
from typing import Dict, Iterable, List, Optional, Sequence, Tuple, Union

import numpy as np

from .spectra import (_mean_variance_from_spectrum, _mean_variance_periodic, _periodic_slem,
                      _slem_from_spectrum)

__all__ = ["TOPOLOGIES", "Topology", "build_topology"]

TOPOLOGIES = ("complete", "ring", "torus", "hypercube", "star", "chain", "tree", "exponential",
              "exponential-undirected", "one-peer-exponential", "hierarchical")

#: What ``spectral_gap`` and ``analyse(...)["spectral_gap"]`` report, in words.
SPECTRAL_GAP_DEFINITION = ("1 - ||W - 11^T/n||_2 (one-step contraction of the consensus error); "
                           "time-varying: 1 - ||W_{P-1}...W_0 - 11^T/n||_2^(1/P)")

#: Gamma grid of the effective number of neighbours when the caller gives none.
DEFAULT_GAMMAS = (0.5, 0.9, 0.99, 0.999)

_TOL = 1e-12        # row/column sums and symmetry are checked to this absolute tolerance
_TINY = 1e-300      # stands in for an exactly zero pivot in Sturm counts (LDL^T bisection)

Matrix = Union[np.ndarray, Sequence[Sequence[float]]]


# --------------------------------------------------------------------------------------------
# Topologies
# --------------------------------------------------------------------------------------------

class Topology:
    """A graph over ranks 0..n-1 and its mixing matrix W (one W_t per step t if time-varying).

    Gossip step of rank i at step t:  x_i <- w_ii x_i + sum_{j in in(i, t)} w_ij x_j,
    i.e. x <- W_t x with row i of W_t equal to ``weights(i, t)``. Every W_t is doubly stochastic
    and nonnegative, W_t[i, j] > 0 only for j = i or j in ``in_neighbors(i, t)``, and rank i sends
    to ``out_neighbors(i, t)``: j in out(i, t) iff i in in(j, t). Static graphs (period 1) are
    undirected (in = out, W symmetric) except ``exponential``, which is directed (in != out, W
    circulant). Every W this module builds is normal (symmetric or circulant), so its singular
    values are the moduli of its eigenvalues.

    Build with :func:`build_topology`; the subclasses are private.
    """

    time_varying: bool = False
    period: int = 1
    #: whether distances from rank 0 are the distances from every rank (circulant, torus, ...)
    _vertex_transitive: bool = False

    def __init__(self, name: str, n: int, layout: str):
        self.name = name
        self.n = n
        #: a short human description of the layout, e.g. "64 x 64 torus"
        self.layout = layout
        self._spectrum_cache: Optional[np.ndarray] = None

    def __repr__(self) -> str:
        return f"<Topology {self.name} n={self.n}: {self.layout}>"

    # -- the interface the gossip algorithms use ------------------------------------------------

    def in_neighbors(self, i: int, step: int = 0) -> List[int]:
        """Ranks whose parameters rank i mixes in at this step: sorted, distinct, without i."""
        raise NotImplementedError

    def out_neighbors(self, i: int, step: int = 0) -> List[int]:
        """Ranks that mix in rank i's parameters at this step: sorted, distinct, without i."""
        return self.in_neighbors(i, step)

    def weights(self, i: int, step: int = 0) -> Tuple[float, Dict[int, float]]:
        """Row i of W at this step: (w_ii, {j: w_ij for j in in_neighbors(i, step)}).

        O(degree) work; the n x n matrix is never built.
        """
        raise NotImplementedError

    def degree(self) -> Dict[str, float]:
        """Min, max and mean number of in-neighbours over ranks (and over the steps of a period)."""
        d = np.asarray(self._degrees(), dtype=float)
        return {"min": int(d.min()), "max": int(d.max()), "mean": float(d.mean())}

    def mixing_matrix(self, step: int = 0) -> np.ndarray:
        """Dense n x n W at this step (for analysis and tests; O(n^2) memory)."""
        W = np.zeros((self.n, self.n))
        for i in range(self.n):
            w_ii, row = self.weights(i, step)
            W[i, i] = w_ii
            if row:
                W[i, list(row)] = list(row.values())
        return W

    # -- hooks of the analysis functions; subclasses replace them where structure helps -------

    def _check_rank(self, i: int) -> None:
        if not 0 <= i < self.n:
            raise ValueError(f"rank {i} out of range for the {self.name} topology of n={self.n}")

    def _degrees(self) -> List[int]:
        return [len(self.in_neighbors(i, t)) for t in range(self.period) for i in range(self.n)]

    def _spectrum(self) -> np.ndarray:
        """Eigenvalues of the (static, symmetric) W, ascending. Default: dense eigvalsh."""
        if self._spectrum_cache is None:
            if self.n == 1:
                self._spectrum_cache = np.ones(1)
            else:
                self._spectrum_cache = self._structured_spectrum()
            if self._spectrum_cache is None:
                self._spectrum_cache = np.linalg.eigvalsh(self.mixing_matrix())
        return self._spectrum_cache

    def _structured_spectrum(self) -> Optional[np.ndarray]:
        return None

    def _slem(self) -> float:
        if self.time_varying:
            return _periodic_slem([self.mixing_matrix(t) for t in range(self.period)])
        return _slem_from_spectrum(self._spectrum())

    def _mean_variance(self, gammas: Sequence[float]) -> np.ndarray:
        if self.time_varying:
            return _mean_variance_periodic([self.mixing_matrix(t) for t in range(self.period)],
                                           gammas)
        return _mean_variance_from_spectrum(self._spectrum(), gammas)

    def _diameter(self) -> Optional[int]:
        sources = [0] if self._vertex_transitive else range(self.n)
        worst = 0
        for s in sources:
            dist = _bfs(self, s)
            if min(dist) < 0:
                return None
            worst = max(worst, max(dist))
        return worst

    def _verify(self) -> Tuple[bool, bool]:
        """(every W_t symmetric, every W_t doubly stochastic and nonnegative), from the rows."""
        symmetric, stochastic = True, True
        for t in range(self.period):
            rows, cols, vals = [], [], []
            for i in range(self.n):
                w_ii, row = self.weights(i, t)
                rows.append(i)
                cols.append(i)
                vals.append(w_ii)
                rows.extend([i] * len(row))
                cols.extend(row)
                vals.extend(row.values())
            import scipy.sparse            # scipy on use: a run's start-up skips it
            W = scipy.sparse.csr_matrix((vals, (rows, cols)), shape=(self.n, self.n))
            symmetric &= bool(abs(W - W.T).max() <= _TOL) if self.n > 1 else True
            stochastic &= (min(vals) >= 0.0
                           and np.allclose(W.sum(axis=1), 1.0, rtol=0, atol=_TOL)
                           and np.allclose(W.sum(axis=0), 1.0, rtol=0, atol=_TOL))
        return symmetric, bool(stochastic)


class _MaxDegreeGraph(Topology):
    """Static undirected graph with the max-degree weights (the package default):

        w_ij = 1 / (max(deg_i, deg_j) + 1)  for neighbours j of i,   w_ii = 1 - sum_j w_ij.

    W is symmetric (w_ij depends on the unordered pair), nonnegative (w_ii >= 1 - deg_i/(deg_i+1)
    > 0) and doubly stochastic. Subclasses give the sorted neighbour list and the degrees.
    """

    def __init__(self, name: str, n: int, layout: str, degrees: Sequence[int]):
        super().__init__(name, n, layout)
        self._deg = [int(d) for d in degrees]

    def _neighbors(self, i: int) -> List[int]:
        raise NotImplementedError

    def in_neighbors(self, i: int, step: int = 0) -> List[int]:
        self._check_rank(i)
        return self._neighbors(i)

    out_neighbors = in_neighbors

    def weights(self, i: int, step: int = 0) -> Tuple[float, Dict[int, float]]:
        nbrs = self.in_neighbors(i)
        deg = self._deg
        d_i = deg[i]
        row = {j: 1.0 / (max(d_i, deg[j]) + 1) for j in nbrs}
        return 1.0 - math.fsum(row.values()), row

    def _degrees(self) -> List[int]:
        return self._deg

    def _row0(self) -> np.ndarray:
        w_00, row = self.weights(0)
        c = np.zeros(self.n)
        c[0] = w_00
        c[list(row)] = list(row.values())
        return c


class _CyclicRows:
    """A circulant W: every row, and every column, is a cyclic shift of row 0 (``_row0``),
    so row 0 gives the matrix and decides symmetry and stochasticity."""

    def mixing_matrix(self, step: int = 0) -> np.ndarray:
        idx = np.arange(self.n)
        return self._row0()[(idx[None, :] - idx[:, None]) % self.n]

    def _verify(self) -> Tuple[bool, bool]:
        c = self._row0()
        symmetric = bool(np.allclose(c, np.roll(c[::-1], 1), rtol=0, atol=_TOL))
        stochastic = bool(c.min() >= 0 and abs(c.sum() - 1.0) <= _TOL)
        return symmetric, stochastic


class _Circulant(_CyclicRows, _MaxDegreeGraph):
    """Neighbours of i: (i + o) mod n for a set of offsets closed under negation. Every rank has
    the same degree d, so w_ij = 1/(d+1) and w_ii = 1/(d+1): W is circulant, W_ij = c[(j-i) mod n],
    and its eigenvalues are the DFT of the first row c (real, because c[o] = c[-o])."""

    _vertex_transitive = True

    def __init__(self, name: str, n: int, layout: str, offsets: Iterable[int]):
        offs = sorted({o % n for o in offsets} - {0})
        self._offsets = offs
        super().__init__(name, n, layout, [len(offs)] * n)

    def _neighbors(self, i: int) -> List[int]:
        n = self.n
        return sorted((i + o) % n for o in self._offsets)

    def _structured_spectrum(self) -> np.ndarray:
        return np.sort(np.fft.fft(self._row0()).real)

    def _diameter(self) -> Optional[int]:
        if len(self._offsets) == self.n - 1:        # complete: skip the O(n^2) BFS
            return min(1, self.n - 1)
        return super()._diameter()


class _Torus(_MaxDegreeGraph):
    """r x c torus, rank i at (row, col) = divmod(i, c), neighbours (row, col +- 1 mod c) and
    (row +- 1 mod r, col), deduplicated when a dimension is 1 or 2. All degrees are equal, so W is
    block-circulant with circulant blocks: its eigenvalues are the 2-D DFT of row 0 reshaped r x c
    (equivalently w_ii + w (a_p + b_q), a Kronecker sum of the two cycles' spectra)."""

    _vertex_transitive = True

    def __init__(self, n: int):
        r = max(d for d in range(1, math.isqrt(n) + 1) if n % d == 0)
        c = n // r
        self.rows, self.cols = r, c
        d = len({1 % c, -1 % c} - {0}) + len({1 % r, -1 % r} - {0})
        note = " (n prime: a 1 x n torus is a ring)" if r == 1 and n > 1 else ""
        super().__init__("torus", n, f"{r} x {c} torus{note}", [d] * n)

    def _neighbors(self, i: int) -> List[int]:
        r, c = self.rows, self.cols
        row, col = divmod(i, c)
        nbrs = {row * c + (col + 1) % c, row * c + (col - 1) % c,
                ((row + 1) % r) * c + col, ((row - 1) % r) * c + col}
        nbrs.discard(i)
        return sorted(nbrs)

    def _structured_spectrum(self) -> np.ndarray:
        return np.sort(np.fft.fft2(self._row0().reshape(self.rows, self.cols)).real.ravel())


class _Hypercube(_MaxDegreeGraph):
    """log2(n)-dimensional hypercube: neighbours i XOR 2^b. W_ij = c[i XOR j], so W is
    diagonalised by the Walsh-Hadamard basis: eigenvalues = Walsh-Hadamard transform of row 0
    (analytically 1 - 2k/(d+1) with multiplicity C(d, k))."""

    _vertex_transitive = True

    def __init__(self, n: int):
        if n & (n - 1):
            raise ValueError(f"hypercube needs n to be a power of two, got n={n}")
        self.dim = n.bit_length() - 1
        super().__init__("hypercube", n, f"hypercube of dimension {self.dim}", [self.dim] * n)

    def _neighbors(self, i: int) -> List[int]:
        return sorted(i ^ (1 << b) for b in range(self.dim))

    def _structured_spectrum(self) -> np.ndarray:
        v = self._row0()
        h = 1
        while h < self.n:
            v = v.reshape(-1, 2, h)
            v = np.stack([v[:, 0] + v[:, 1], v[:, 0] - v[:, 1]], axis=1).reshape(-1)
            h *= 2
        return np.sort(v)


class _Star(_MaxDegreeGraph):
    """Rank 0 is the centre, every other rank a leaf. Every edge has weight w = 1/n, so
    W = I - w L with L the star Laplacian (eigenvalues 0, 1 (n-2 times), n): the spectrum of W is
    1, 1 - w (n-2 times), 1 - n w."""

    def __init__(self, n: int):
        super().__init__("star", n, "star centred on rank 0", [n - 1] + [1] * (n - 1))

    def _neighbors(self, i: int) -> List[int]:
        return list(range(1, self.n)) if i == 0 else [0]

    def _structured_spectrum(self) -> np.ndarray:
        w = self.weights(1)[1][0]
        return np.sort(np.concatenate([[1.0, 1.0 - self.n * w], np.full(self.n - 2, 1.0 - w)]))

    def _diameter(self) -> int:
        return min(self.n - 1, 2)


class _Chain(_MaxDegreeGraph):
    """Path 0 - 1 - ... - n-1. W is tridiagonal: eigenvalues by LAPACK's tridiagonal solver."""

    def __init__(self, n: int):
        degrees = [min(i, 1) + min(n - 1 - i, 1) for i in range(n)]
        super().__init__("chain", n, "path 0 - 1 - ... - n-1", degrees)

    def _neighbors(self, i: int) -> List[int]:
        return [j for j in (i - 1, i + 1) if 0 <= j < self.n]

    def _structured_spectrum(self) -> np.ndarray:
        rows = [self.weights(i) for i in range(self.n)]
        diag = np.array([w_ii for w_ii, _ in rows])
        off = np.array([rows[i][1][i + 1] for i in range(self.n - 1)])
        import scipy.linalg
        return np.sort(scipy.linalg.eigvalsh_tridiagonal(diag, off, lapack_driver="sterf"))

    def _diameter(self) -> int:
        return self.n - 1


class _BinaryTree(_MaxDegreeGraph):
    """Heap-ordered binary tree: parent of i is (i-1)//2, children 2i+1 and 2i+2.

    No closed-form spectrum, and a dense eigendecomposition is O(n^3). A symmetric matrix on a
    tree factors as L D L^T without fill when leaves are eliminated first, so (:class:`_TreeSolver`)
    Sturm counts give the second eigenvalues by bisection and the diagonal of (W - s I)^{-1} gives
    the traces the effective number of neighbours needs, both in O(n) per shift.
    """

    def __init__(self, n: int):
        degrees = [min(i, 1) + len([c for c in (2 * i + 1, 2 * i + 2) if c < n]) for i in range(n)]
        depth = max(n.bit_length() - 1, 0)
        super().__init__("tree", n, f"binary tree of depth {depth}, parent of i is (i-1)//2",
                         degrees)
        self._solver: Optional[_TreeSolver] = None

    def _neighbors(self, i: int) -> List[int]:
        nbrs = [(i - 1) // 2] if i > 0 else []
        return nbrs + [c for c in (2 * i + 1, 2 * i + 2) if c < self.n]

    def _tree(self) -> "_TreeSolver":
        if self._solver is None:
            parent = (np.arange(self.n) - 1) // 2
            rows = [self.weights(i) for i in range(self.n)]
            diag = np.array([w_ii for w_ii, _ in rows])
            off = np.array([0.0] + [rows[i][1][(i - 1) // 2] for i in range(1, self.n)])
            self._solver = _TreeSolver(parent, diag, off)
        return self._solver

    def _slem(self) -> float:
        if self.n == 1:
            return 0.0
        lam_min, lam_2 = self._tree().eigenvalues_by_index([1, self.n - 1])
        return float(max(abs(lam_min), abs(lam_2)))

    def _mean_variance(self, gammas: Sequence[float]) -> np.ndarray:
        # mean_k l^2/(1 - g l^2) = (tr((I - g W^2)^{-1}) - n) / (g n), and with a = sqrt(g),
        # (I - g W^2)^{-1} = ((I - aW)^{-1} + (I + aW)^{-1}) / 2 = (T(-1/a) - T(1/a)) / (2a)
        # where T(s) = tr((W - s I)^{-1}).
        out = np.empty(len(gammas))
        for k, g in enumerate(gammas):
            if g == 0.0:                        # mean_k l_k^2 = ||W||_F^2 / n
                out[k] = sum(w_ii ** 2 + math.fsum(v * v for v in row.values())
                             for w_ii, row in (self.weights(i) for i in range(self.n))) / self.n
                continue
            a = math.sqrt(g)
            t_minus, t_plus = self._tree().inverse_traces([-1.0 / a, 1.0 / a])
            out[k] = ((t_minus - t_plus) / (2 * a) - self.n) / (g * self.n)
        return out

    def _diameter(self) -> int:
        if self.n == 1:
            return 0
        # double sweep: on a tree the farthest rank from any rank is an end of a longest path
        far = int(np.argmax(_bfs(self, 0)))
        return max(_bfs(self, far))


class _Hierarchical(_MaxDegreeGraph):
    """Complete graph inside each node; between nodes a ring of node roots.

    The root of a node is its lowest rank; nodes are ordered by their roots, and root k is joined
    to the roots of nodes k-1 and k+1 (mod the number of nodes m; one edge when m = 2, none when
    m = 1). Only roots cross node boundaries, so inter-node traffic is 2 messages per node per
    step, and the intra-node mixing is exact averaging-like.

    Spectrum: the s-1 non-root ranks of a node are interchangeable, so vectors on them summing
    to zero are eigenvectors (eigenvalue w_aa - w_ab, s-2 times per node); what remains is the
    quotient on {root_v, mean of non-roots of v}: a ring with pendant vertices, banded (bandwidth
    <= 5) after ordering the nodes 0, m-1, 1, m-2, ..., solved by LAPACK's banded eigensolver.
    """

    def __init__(self, n: int, node_of: Optional[Sequence[int]]):
        if node_of is None:
            node_of = list(range(n))
        node_of = list(node_of)
        if len(node_of) != n:
            raise ValueError(f"node_of has {len(node_of)} entries but n={n}")
        members: Dict[int, List[int]] = {}
        for rank, node in enumerate(node_of):
            members.setdefault(node, []).append(rank)
        self._members = sorted(members.values(), key=lambda ranks: ranks[0])  # ordered by root
        m = len(self._members)
        self._node_index = [0] * n
        for v, ranks in enumerate(self._members):
            for rank in ranks:
                self._node_index[rank] = v
        self._ring = [sorted({(v - 1) % m, (v + 1) % m} - {v}) for v in range(m)]
        degrees = [len(self._members[self._node_index[i]]) - 1 for i in range(n)]
        for v, ranks in enumerate(self._members):
            degrees[ranks[0]] += len(self._ring[v])
        sizes = [len(ranks) for ranks in self._members]
        per_node = str(sizes[0]) if min(sizes) == max(sizes) else f"{min(sizes)}-{max(sizes)}"
        super().__init__("hierarchical", n,
                         f"{m} nodes of {per_node} ranks: complete inside a node, "
                         "ring of node roots (lowest rank of each node)", degrees)

    def _neighbors(self, i: int) -> List[int]:
        v = self._node_index[i]
        ranks = self._members[v]
        nbrs = [j for j in ranks if j != i]
        if i == ranks[0]:
            nbrs.extend(self._members[u][0] for u in self._ring[v])
            nbrs.sort()
        return nbrs

    def _structured_spectrum(self) -> np.ndarray:
        m = len(self._members)
        zigzag = [v for k in range((m + 1) // 2)
                  for v in ((k, m - 1 - k) if k != m - 1 - k else (k,))]
        slot_root, slot_mean, N = [0] * m, [None] * m, 0
        for v in zigzag:
            slot_root[v] = N
            N += 1
            if len(self._members[v]) > 1:
                slot_mean[v] = N
                N += 1
        entries: Dict[Tuple[int, int], float] = {}
        extra: List[np.ndarray] = []
        for v, ranks in enumerate(self._members):
            s, root = len(ranks), ranks[0]
            w_rr, row = self.weights(root)
            entries[slot_root[v], slot_root[v]] = w_rr
            for u in self._ring[v]:
                entries[slot_root[v], slot_root[u]] = row[self._members[u][0]]
            if s > 1:
                w_aa, row_a = self.weights(ranks[1])
                w_ab = row_a[ranks[2]] if s > 2 else 0.0
                entries[slot_mean[v], slot_mean[v]] = w_aa + (s - 2) * w_ab
                entries[slot_mean[v], slot_root[v]] = math.sqrt(s - 1) * row_a[root]
                entries[slot_root[v], slot_mean[v]] = math.sqrt(s - 1) * row_a[root]
                extra.append(np.full(s - 2, w_aa - w_ab))
        u = max(abs(i - j) for i, j in entries)
        band = np.zeros((u + 1, N))
        for (i, j), val in entries.items():
            if i >= j:
                band[i - j, j] = val
        import scipy.linalg
        quotient = scipy.linalg.eigvals_banded(band, lower=True)
        return np.sort(np.concatenate([quotient] + extra))

    def _diameter(self) -> int:
        # distance between ranks of different nodes u, v: (to u's root) + ring hops + (from v's
        # root), where a non-root is one hop from its root; inside a node it is 1.
        m = len(self._members)
        e = np.array([len(ranks) > 1 for ranks in self._members], dtype=int)
        best = int(e.max())
        for shift in range(1, m):
            hops = min(shift, m - shift)
            best = max(best, hops + int((e + np.roll(e, -shift)).max()))
        return best


class _OnePeerExponential(Topology):
    """Time-varying directed one-peer exponential graph, period P = ceil(log2 n) (1 when n = 1).

    At step t with k = t mod P, rank i sends to (i + 2^k) mod n and receives from (i - 2^k) mod n:
        x_i <- (x_i + x_{(i - 2^k) mod n}) / 2,    W_t = (I + S^{2^k}) / 2
    with S the cyclic shift. Each W_t is doubly stochastic but not symmetric (except n = 2). The
    W_t are circulant, so the Fourier modes f = 0..n-1 diagonalise all of them, with moduli
    |mu_k(f)| = |cos(pi f 2^k / n)|; when n is a power of two every f != 0 meets a k with
    f 2^k = n/2 mod n, so the product over one period is exactly 11^T / n.
    """

    time_varying = True
    _vertex_transitive = True

    def __init__(self, n: int):
        super().__init__("one-peer-exponential", n,
                         "one peer per step at distance 2^(t mod period), directed")
        self.period = max(1, (n - 1).bit_length())

    def _offset(self, step: int) -> int:
        return 1 << (step % self.period)

    def in_neighbors(self, i: int, step: int = 0) -> List[int]:
        self._check_rank(i)
        return [(i - self._offset(step)) % self.n] if self.n > 1 else []

    def out_neighbors(self, i: int, step: int = 0) -> List[int]:
        self._check_rank(i)
        return [(i + self._offset(step)) % self.n] if self.n > 1 else []

    def weights(self, i: int, step: int = 0) -> Tuple[float, Dict[int, float]]:
        nbrs = self.in_neighbors(i, step)
        return (0.5, {nbrs[0]: 0.5}) if nbrs else (1.0, {})

    def _degrees(self) -> List[int]:
        return [min(self.n - 1, 1)] * self.n

    def _moduli(self) -> np.ndarray:
        """|mu_k(f)| for k = 0..P-1 (rows) and f = 0..n-1 (columns), exact zeros kept exact:
        |cos(pi m / n)| = |sin(pi (n - 2m) / (2n))| with m = f 2^k mod n an integer."""
        n = self.n
        f = np.arange(n, dtype=np.int64)
        m = np.stack([(f << k) % n for k in range(self.period)]) if n > 1 else np.zeros((1, 1))
        return np.abs(np.sin(np.pi * (n - 2 * m) / (2 * n)))

    def _slem(self) -> float:
        # per-step rate of the period product: |lambda_2(W_{P-1} ... W_0)|^(1/P)
        if self.n == 1:
            return 0.0
        rho = np.prod(self._moduli(), axis=0)[1:]
        return float(rho.max() ** (1.0 / self.period))

    def _mean_variance(self, gammas: Sequence[float]) -> np.ndarray:
        # per Fourier mode: s_{k+1} = |mu_k|^2 (g s_k + 1); see _mean_variance_periodic
        g2 = self._moduli() ** 2
        P = self.period
        out = np.empty(len(gammas))
        for idx, g in enumerate(gammas):
            q = np.zeros(self.n)
            for k in range(P):
                q = g2[k] * (g * q + 1.0)
            s = q / (1.0 - g ** P * np.prod(g2, axis=0))
            total = 0.0
            for k in range(P):
                total += s.mean()
                s = g2[k] * (g * s + 1.0)
            out[idx] = total / P
        return out


class _StaticExponential(_CyclicRows, Topology):
    """The static exponential graph of Ying et al. (2021), directed.

    With d = ceil(log2 n) (0 when n = 1), rank i sends to (i + 2^k) mod n and receives from
    (i - 2^k) mod n for k = 0..d-1, and every weight, its own included, is 1/(d + 1):

        x_i <- (x_i + sum_{k<d} x_{(i - 2^k) mod n}) / (d + 1),    W = (I + sum_k S^{2^k}) / (d + 1)

    with S the cyclic shift ((S x)_i = x_{i-1}). The offsets 2^k < n are distinct and nonzero, so
    every rank has exactly d in- and d out-neighbours (3, 4, 6 at n = 8, 16, 64) and W is doubly
    stochastic but not symmetric for n >= 3. W is circulant, hence normal: the Fourier modes
    diagonalise it, mu_f = (1 + sum_k e^{-2 pi i f 2^k / n}) / (d + 1), its singular values are
    |mu_f|, and for n a power of two ||W - 11^T/n||_2 = 1 - 2/(d + 1).
    """

    _vertex_transitive = True

    def __init__(self, n: int):
        super().__init__("exponential", n,
                         "static exponential graph (directed): i sends to i + 2^k mod n")
        self.d = max(n - 1, 0).bit_length()          # ceil(log2 n) for n >= 1
        self._offsets = [1 << k for k in range(self.d)]

    def in_neighbors(self, i: int, step: int = 0) -> List[int]:
        self._check_rank(i)
        return sorted((i - o) % self.n for o in self._offsets)

    def out_neighbors(self, i: int, step: int = 0) -> List[int]:
        self._check_rank(i)
        return sorted((i + o) % self.n for o in self._offsets)

    def weights(self, i: int, step: int = 0) -> Tuple[float, Dict[int, float]]:
        w = 1.0 / (self.d + 1)
        return w, {j: w for j in self.in_neighbors(i)}

    def _degrees(self) -> List[int]:
        return [self.d] * self.n

    def _row0(self) -> np.ndarray:
        c = np.zeros(self.n)
        c[0] = 1.0 / (self.d + 1)
        c[[(-o) % self.n for o in self._offsets]] = 1.0 / (self.d + 1)
        return c

    def _moduli(self) -> np.ndarray:
        """|mu_f|, f = 0..n-1: the eigenvalue moduli and the singular values of W."""
        return np.abs(np.fft.fft(self._row0()))

    def _slem(self) -> float:
        return float(np.sort(self._moduli())[-2]) if self.n > 1 else 0.0

    def _mean_variance(self, gammas: Sequence[float]) -> np.ndarray:
        # W normal: Sigma = sum_k g^k W^(k+1) W^T(k+1) = F diag(|mu|^2 / (1 - g |mu|^2)) F^*
        return _mean_variance_from_spectrum(self._moduli(), gammas)



class _TreeSolver:
    """Symmetric matrix A on a rooted tree (parent[i] < i for i > 0): A_ii = diag[i],
    A_{i,parent(i)} = off[i]. Eliminating children before parents gives A - sI = L D L^T with no
    fill: d_i = A_ii - s - sum_{c child of i} off_c^2 / d_c. Sylvester: #(d_i < 0) = #(eig < s).
    Diagonal of (A - sI)^{-1}, root down: S_root = 1/d_root, S_c = 1/d_c + (off_c/d_c)^2 S_parent.
    Levels of equal depth are processed together, and many shifts s at once."""

    def __init__(self, parent: np.ndarray, diag: np.ndarray, off: np.ndarray):
        n = len(diag)
        depth = np.zeros(n, dtype=np.int64)
        for i in range(1, n):
            depth[i] = depth[parent[i]] + 1
        self.parent, self.diag, self.off = parent, diag, off
        self.levels = [np.flatnonzero(depth == k) for k in range(1, int(depth.max()) + 1)]

    def _pivots(self, shifts: Sequence[float]) -> np.ndarray:
        s = np.asarray(shifts, dtype=float)
        acc = np.zeros((len(self.diag), len(s)))
        d = np.empty_like(acc)
        for idx in reversed(self.levels):
            d_lvl = self.diag[idx, None] - s[None, :] - acc[idx]
            d_lvl[d_lvl == 0.0] = _TINY
            d[idx] = d_lvl
            np.add.at(acc, self.parent[idx], self.off[idx, None] ** 2 / d_lvl)
        d0 = self.diag[0] - s - acc[0]
        d[0] = np.where(d0 == 0.0, _TINY, d0)
        return d

    def eigenvalues_by_index(self, ks: Sequence[int], iters: int = 64) -> np.ndarray:
        """The k-th smallest eigenvalues (1-based) by bisection on Sturm counts, in [-1, 1]."""
        ks = np.asarray(ks)
        bound = float(np.max(np.abs(self.diag)) + 2 * np.max(np.abs(self.off))) + 1.0
        lo, hi = np.full(len(ks), -bound), np.full(len(ks), bound)
        for _ in range(iters):
            mid = 0.5 * (lo + hi)
            below = (self._pivots(mid) < 0).sum(axis=0) >= ks      # lambda_k < mid
            hi, lo = np.where(below, mid, hi), np.where(below, lo, mid)
        return 0.5 * (lo + hi)

    def inverse_traces(self, shifts: Sequence[float]) -> np.ndarray:
        """tr((A - sI)^{-1}) for each shift s (none an eigenvalue)."""
        d = self._pivots(shifts)
        inv = np.empty_like(d)
        inv[0] = 1.0 / d[0]
        for idx in self.levels:
            inv[idx] = 1.0 / d[idx] + (self.off[idx, None] / d[idx]) ** 2 * inv[self.parent[idx]]
        return inv.sum(axis=0)


def _bfs(topology: Topology, source: int) -> List[int]:
    """Hop distances from source along out-edges of any step of one period (-1: unreachable)."""
    dist = [-1] * topology.n
    dist[source] = 0
    queue = deque([source])
    while queue:
        i = queue.popleft()
        for t in range(topology.period):
            for j in topology.out_neighbors(i, t):
                if dist[j] < 0:
                    dist[j] = dist[i] + 1
                    queue.append(j)
    return dist


def _exponential_offsets(n: int) -> List[int]:
    return [s * (1 << k) for k in range(max(n - 1, 0).bit_length()) for s in (1, -1)]


def build_topology(name: str, n: int, node_of: Optional[Sequence[int]] = None) -> Topology:
    """The named topology over n ranks (names in TOPOLOGIES).

    complete; ring; torus (most square r x c = n, true wrap-around; n prime gives 1 x n, a ring);
    hypercube (n a power of two); star (centre 0); chain (path); tree (binary, parent (i-1)//2);
    exponential (the static exponential graph of Ying et al. 2021: directed, i sends to
    i + 2^k mod n, k < ceil(log2 n), all weights 1/(ceil(log2 n) + 1)); exponential-undirected
    (neighbours i +- 2^k mod n, max-degree weights, symmetric); one-peer-exponential
    (time-varying, one peer per step); hierarchical (complete inside a node, ring of node roots; node_of[i] is the node
    of rank i, default every rank its own node, which makes it a ring). node_of is ignored by
    the other topologies. Raises ValueError for an unknown name, n < 1 or an impossible pair.
    """
    if name not in TOPOLOGIES:
        raise ValueError(f"unknown topology {name!r}; choose from: {', '.join(TOPOLOGIES)}")
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
        raise ValueError(f"n must be an integer >= 1, got {n!r}")
    n = int(n)
    if name == "complete":
        return _Circulant(name, n, "complete graph", range(1, n))
    if name == "ring":
        return _Circulant(name, n, "ring i - (i+1) mod n", (1, -1))
    if name == "exponential":
        return _StaticExponential(n)
    if name == "exponential-undirected":
        return _Circulant(name, n, "undirected exponential graph: neighbours i +- 2^k mod n",
                          _exponential_offsets(n))
    if name == "torus":
        return _Torus(n)
    if name == "hypercube":
        return _Hypercube(n)
    if name == "star":
        return _Star(n)
    if name == "chain":
        return _Chain(n)
    if name == "tree":
        return _BinaryTree(n)
    if name == "one-peer-exponential":
        return _OnePeerExponential(n)
    return _Hierarchical(n, node_of)


