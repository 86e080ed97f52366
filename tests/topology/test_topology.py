"""Single-process tests of lsgd_hpc.topology: graphs, mixing matrices, spectra, ENN, CLI."""

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from scipy.sparse.csgraph import shortest_path

from lsgd_hpc import topology as topo
from lsgd_hpc.topology import (DEFAULT_GAMMAS, SPECTRAL_GAP_DEFINITION, TOPOLOGIES, analyse,
                               build_topology, diameter, effective_neighbors,
                               second_eigenvalue_modulus, second_singular_value, spectral_gap)

ROOT = Path(__file__).resolve().parents[2]
SIZES = (1, 2, 3, 4, 5, 8, 9, 16)
GAMMAS = (0.0, 0.5, 0.9, 0.99)
#: graphs whose in-neighbours differ from their out-neighbours (W not symmetric)
DIRECTED = ("exponential", "one-peer-exponential")


def _sizes(name, sizes=SIZES):
    return [n for n in sizes if name != "hypercube" or n & (n - 1) == 0]


def _node_layouts(n):
    """node_of variants for hierarchical: default, equal nodes, uneven nodes, interleaved."""
    return [None, [r // 4 for r in range(n)], [r // 3 for r in range(n)], [r % 3 for r in range(n)],
            [0] * n]


CASES = [(name, n, None) for name in TOPOLOGIES if name != "hierarchical" for n in _sizes(name)]
CASES += [("hierarchical", n, node_of) for n in SIZES for node_of in _node_layouts(n)]
CASE_IDS = [f"{name}-{n}-{'default' if node_of is None else node_of}" for name, n, node_of in CASES]


def _matrices(top):
    return [top.mixing_matrix(t) for t in range(top.period)]


@pytest.mark.parametrize("name,n,node_of", CASES, ids=CASE_IDS)
def test_mixing_matrix_is_a_valid_gossip_matrix(name, n, node_of):
    top = build_topology(name, n, node_of)
    assert (top.name, top.n) == (name, n)
    assert top.time_varying == (name == "one-peer-exponential")
    for t in range(top.period):
        W = top.mixing_matrix(t)
        assert W.shape == (n, n)
        assert W.min() >= 0.0
        np.testing.assert_allclose(W.sum(axis=1), 1.0, rtol=0, atol=1e-12)
        np.testing.assert_allclose(W.sum(axis=0), 1.0, rtol=0, atol=1e-12)
        if name not in DIRECTED:
            np.testing.assert_array_equal(W, W.T)
        for i in range(n):
            ins, outs = top.in_neighbors(i, t), top.out_neighbors(i, t)
            for nbrs in (ins, outs):
                assert nbrs == sorted(set(nbrs)) and i not in nbrs
                assert all(0 <= j < n for j in nbrs)
            # W_ij > 0 exactly on the in-neighbours (off the diagonal)
            assert set(np.flatnonzero(W[i] > 0)) - {i} == set(ins)
            assert W[i, i] > 0
            # weights() is row i of W
            w_ii, row = top.weights(i, t)
            assert sorted(row) == ins
            assert w_ii == W[i, i]
            assert all(row[j] == W[i, j] for j in ins)
            # j in out(i) iff i in in(j)
            for j in range(n):
                assert (j in outs) == (i in top.in_neighbors(j, t))


@pytest.mark.parametrize("name", TOPOLOGIES)
def test_single_rank_is_the_identity(name):
    top = build_topology(name, 1)
    np.testing.assert_array_equal(top.mixing_matrix(), [[1.0]])
    assert top.in_neighbors(0) == [] and top.out_neighbors(0) == []
    assert top.weights(0) == (1.0, {})
    assert top.degree() == {"min": 0, "max": 0, "mean": 0.0}
    assert spectral_gap(top) == 1.0 and diameter(top) == 0
    assert effective_neighbors(top, 0.9) == pytest.approx(1.0)


@pytest.mark.parametrize("name", [t for t in TOPOLOGIES if t != "star"])
def test_two_ranks_dedupe_neighbours(name):
    top = build_topology(name, 2)
    for step in range(top.period):
        assert top.in_neighbors(0, step) == [1] and top.out_neighbors(1, step) == [0]
    np.testing.assert_allclose(top.mixing_matrix(), 0.5)


def test_small_graphs_have_no_duplicate_edges():
    assert build_topology("torus", 4).in_neighbors(0) == [1, 2]            # 2 x 2
    assert build_topology("torus", 6).in_neighbors(0) == [1, 2, 3]         # 2 x 3
    undirected = "exponential-undirected"
    assert build_topology(undirected, 4).in_neighbors(0) == [1, 2, 3]      # +2 == -2 mod 4
    assert build_topology(undirected, 8).in_neighbors(0) == [1, 2, 4, 6, 7]
    assert build_topology("ring", 3).in_neighbors(1) == [0, 2]


def test_torus_wraps_around_both_dimensions():
    top = build_topology("torus", 16)
    assert (top.rows, top.cols) == (4, 4)
    assert top.in_neighbors(0) == [1, 3, 4, 12]
    assert top.in_neighbors(15) == [3, 11, 12, 14]
    top = build_topology("torus", 12)                                      # 3 x 4
    assert (top.rows, top.cols) == (3, 4)
    assert top.in_neighbors(5) == [1, 4, 6, 9]
    assert top.in_neighbors(0) == [1, 3, 4, 8]
    assert (build_topology("torus", 4096).rows, build_topology("torus", 4096).cols) == (64, 64)
    prime = build_topology("torus", 7)                                     # falls back to a ring
    assert prime.in_neighbors(0) == [1, 6] and "ring" in prime.layout


def test_named_structures():
    assert build_topology("star", 5).in_neighbors(0) == [1, 2, 3, 4]
    assert build_topology("star", 5).in_neighbors(3) == [0]
    assert build_topology("chain", 5).in_neighbors(0) == [1]
    assert build_topology("chain", 5).in_neighbors(2) == [1, 3]
    tree = build_topology("tree", 9)
    assert tree.in_neighbors(0) == [1, 2] and tree.in_neighbors(3) == [1, 7, 8]
    assert tree.in_neighbors(4) == [1]
    assert build_topology("hypercube", 8).in_neighbors(5) == [1, 4, 7]
    assert build_topology("complete", 4).in_neighbors(2) == [0, 1, 3]
    np.testing.assert_allclose(build_topology("complete", 5).mixing_matrix(), 0.2)
    # default weights: 1/(max(deg_i, deg_j) + 1)
    w_ii, row = build_topology("star", 5).weights(2)
    assert row == {0: 0.2} and w_ii == pytest.approx(0.8)


def test_hierarchical_is_complete_in_nodes_and_a_ring_of_roots():
    node_of = [0, 0, 0, 1, 1, 2, 2, 2, 2, 3]
    top = build_topology("hierarchical", 10, node_of)
    assert top.in_neighbors(1) == [0, 2]                # non-root: only its node
    assert top.in_neighbors(0) == [1, 2, 3, 9]          # root: its node + roots 3 and 9
    assert top.in_neighbors(5) == [3, 6, 7, 8, 9]
    assert top.in_neighbors(9) == [0, 5]                # single-rank node is its own root
    assert top.degree() == {"min": 1, "max": 5, "mean": pytest.approx(2.8)}
    # interleaved placement: roots are the lowest ranks, 0 and 1
    top = build_topology("hierarchical", 6, [0, 1, 0, 1, 0, 1])
    assert top.in_neighbors(0) == [1, 2, 4] and top.in_neighbors(2) == [0, 4]
    # default: every rank its own node = a ring; one node = complete
    np.testing.assert_array_equal(build_topology("hierarchical", 7).mixing_matrix(),
                                  build_topology("ring", 7).mixing_matrix())
    np.testing.assert_array_equal(build_topology("hierarchical", 5, [3] * 5).mixing_matrix(),
                                  build_topology("complete", 5).mixing_matrix())


@pytest.mark.parametrize("args,match", [
    (("mesh", 4), "unknown topology"),
    (("ring", 0), "n must be"),
    (("ring", -3), "n must be"),
    (("ring", 2.5), "n must be"),
    (("hypercube", 6), "power of two"),
    (("hypercube", 12), "power of two"),
    (("hierarchical", 4, [0, 0, 1]), "node_of has 3 entries"),
])
def test_build_topology_rejects_bad_input(args, match):
    with pytest.raises(ValueError, match=match):
        build_topology(*args)


def test_rank_out_of_range_is_an_error():
    with pytest.raises(ValueError, match="out of range"):
        build_topology("ring", 4).weights(4)
    with pytest.raises(ValueError, match="out of range"):
        build_topology("one-peer-exponential", 4).in_neighbors(-1)


def test_one_peer_exponential_schedule():
    top = build_topology("one-peer-exponential", 8)
    assert top.period == 3 and top.time_varying
    for step, dist in [(0, 1), (1, 2), (2, 4), (3, 1), (7, 2)]:
        assert top.out_neighbors(3, step) == [(3 + dist) % 8]
        assert top.in_neighbors(3, step) == [(3 - dist) % 8]
        assert top.weights(3, step) == (0.5, {(3 - dist) % 8: 0.5})
    assert [build_topology("one-peer-exponential", n).period
            for n in (1, 2, 3, 4, 5, 8, 9, 4096)] == [1, 1, 2, 2, 3, 3, 4, 12]


@pytest.mark.parametrize("n", [2, 4, 8, 16, 6, 12])
def test_one_peer_exponential_period_product_is_exact_average_for_powers_of_two(n):
    top = build_topology("one-peer-exponential", n)
    product = np.eye(n)
    for W in _matrices(top):
        product = W @ product
    exact = np.allclose(product, np.full((n, n), 1.0 / n), rtol=0, atol=1e-12)
    assert exact == (n & (n - 1) == 0)
    assert (spectral_gap(top) == 1.0) == exact


def _dense_slem(W):
    return np.sort(np.abs(np.linalg.eigvalsh(W)))[-2]


def _dense_sigma2(W):
    """||W - 11^T/n||_2 by a dense SVD."""
    n = len(W)
    return np.linalg.svd(W - np.full((n, n), 1.0 / n), compute_uv=False)[0]


def _dense_mean_variance(Ws, g):
    """mean_i Var(x_i) of x <- W_t (sqrt(g) x + xi), by iterating the covariance to its
    periodic fixed point (no Lyapunov solver), averaged over the phases of one period."""
    n = len(Ws[0])
    sigma = np.zeros((n, n))
    for _ in range(20000):
        before = sigma
        phases = []
        for W in Ws:
            sigma = W @ (g * sigma + np.eye(n)) @ W.T
            phases.append(np.trace(sigma) / n)
        if np.abs(sigma - before).max() < 1e-14:
            break
    return float(np.mean(phases[-1:] + phases[:-1]))


@pytest.mark.parametrize("n,degree", [(8, 3), (16, 4), (64, 6)])
def test_static_exponential_graph_of_ying_et_al(n, degree):
    top = build_topology("exponential", n)
    for i in (0, 5, n - 1):
        assert top.out_neighbors(i) == sorted((i + 2 ** k) % n for k in range(degree))
        assert top.in_neighbors(i) == sorted((i - 2 ** k) % n for k in range(degree))
        assert top.in_neighbors(i) != top.out_neighbors(i)
        w_ii, row = top.weights(i)
        assert w_ii == 1 / (degree + 1) and set(row.values()) == {1 / (degree + 1)}
    W = top.mixing_matrix()
    np.testing.assert_allclose(W.sum(axis=0), 1.0, rtol=0, atol=1e-12)
    np.testing.assert_allclose(W.sum(axis=1), 1.0, rtol=0, atol=1e-12)
    assert not np.allclose(W, W.T)
    assert top.degree() == {"min": degree, "max": degree, "mean": degree}
    result = analyse("exponential", n, gammas=[0.5, 0.9])
    assert result["directed"] and not result["symmetric"] and result["doubly_stochastic"]
    # Ying et al. (2021): ||W - 11^T/n||_2 = 1 - 2 / (log2 n + 1) for n a power of two
    assert result["spectral_gap"] == pytest.approx(2 / (degree + 1), abs=1e-12)
    assert result["spectral_gap"] == pytest.approx(1 - _dense_sigma2(W), abs=1e-12)
    assert result["spectral_gap_definition"] == SPECTRAL_GAP_DEFINITION
    undirected = analyse("exponential-undirected", n, gammas=[])
    assert undirected["degree"]["max"] == 2 * degree - 1 and undirected["symmetric"]


@pytest.mark.parametrize("n", [2, 3, 5, 6, 8, 12, 16, 33, 64])
def test_static_exponential_analysis_matches_dense_computation(n):
    top = build_topology("exponential", n)
    W = top.mixing_matrix()
    eig = np.linalg.eigvals(W)
    assert second_eigenvalue_modulus(top) == pytest.approx(np.sort(np.abs(eig))[-2], abs=1e-12)
    assert second_singular_value(top) == pytest.approx(_dense_sigma2(W), abs=1e-12)
    assert second_singular_value(W) == pytest.approx(_dense_sigma2(W), abs=1e-12)
    assert top.degree()["max"] == math.ceil(math.log2(n))
    for g in GAMMAS:
        # the Fourier shortcut, the Lyapunov solver on the dense W (non-symmetric path) and a
        # plain fixed-point iteration of the covariance agree
        lyapunov = effective_neighbors(W, g)
        assert effective_neighbors(top, g) == pytest.approx(lyapunov, rel=1e-9)
        direct = 1 / ((1 - g) * _dense_mean_variance([W], g))
        assert lyapunov == pytest.approx(direct, rel=1e-9)


def test_spectral_gap_of_a_non_normal_matrix_is_the_singular_value_bound():
    # doubly stochastic, non-normal: |lambda_2| = 0.5 but one step can shrink x - xbar by less
    W = np.array([[0.5, 0.5, 0.0], [0.0, 0.5, 0.5], [0.5, 0.0, 0.5]])
    W = 0.5 * W + 0.5 * np.eye(3)[[0, 2, 1]] @ W        # mixes in a permutation: non-normal
    np.testing.assert_allclose(W.sum(axis=0), 1.0)
    assert not np.allclose(W @ W.T, W.T @ W)
    assert spectral_gap(W) == pytest.approx(1 - _dense_sigma2(W), abs=1e-12)
    assert 1 - spectral_gap(W) > second_eigenvalue_modulus(W) + 1e-3
    assert effective_neighbors(W, 0.9) == pytest.approx(
        1 / (0.1 * _dense_mean_variance([W], 0.9)), rel=1e-9)


@pytest.mark.parametrize("name", [t for t in TOPOLOGIES if t not in DIRECTED])
def test_structured_spectra_match_dense_eigvalsh(name):
    for n in _sizes(name, (2, 3, 4, 5, 7, 8, 9, 12, 16, 30, 32, 49, 60, 64)):
        layouts = [None]
        if name == "hierarchical":
            layouts = _node_layouts(n) + [[r // 5 for r in range(n)]]
        for node_of in layouts:
            top = build_topology(name, n, node_of)
            W = top.mixing_matrix()
            dense = np.linalg.eigvalsh(W)
            if name != "tree":
                structured = top._structured_spectrum()
                assert structured is not None, "fell back to a dense eigendecomposition"
                np.testing.assert_allclose(np.sort(structured), dense, rtol=0, atol=1e-10)
            assert second_eigenvalue_modulus(top) == pytest.approx(_dense_slem(W), abs=1e-10)
            assert spectral_gap(top) == pytest.approx(1 - _dense_sigma2(W), abs=1e-10)
            for g in GAMMAS:
                assert effective_neighbors(top, g) == pytest.approx(effective_neighbors(W, g),
                                                                    rel=1e-9)


@pytest.mark.parametrize("n", [2, 3, 4, 5, 6, 8, 12, 16])
def test_one_peer_exponential_fourier_shortcut_matches_lyapunov(n):
    top = build_topology("one-peer-exponential", n)
    Ws = np.array(_matrices(top))
    for g in GAMMAS:
        assert effective_neighbors(top, g) == pytest.approx(effective_neighbors(Ws, g), rel=1e-9)
        direct = 1 / ((1 - g) * _dense_mean_variance(list(Ws), g))
        assert effective_neighbors(Ws, g) == pytest.approx(direct, rel=1e-8)
    assert spectral_gap(top) == pytest.approx(spectral_gap(Ws), abs=1e-9)
    product = np.linalg.multi_dot(list(Ws[::-1])) if len(Ws) > 1 else Ws[0]
    # compare before the P-th root, which would magnify dense rounding (1e-17 -> 1e-6)
    period_slem = np.sort(np.abs(np.linalg.eigvals(product)))[-2]
    assert second_eigenvalue_modulus(top) ** top.period == pytest.approx(period_slem, abs=1e-12)


@pytest.mark.parametrize("name", ["ring", "torus", "star", "tree"])
def test_lyapunov_model_reduces_to_the_spectral_formula_for_static_w(name):
    W = build_topology(name, 9).mixing_matrix()
    for g in GAMMAS:
        # a one-matrix "period" goes through solve_discrete_lyapunov
        assert effective_neighbors(W[None], g) == pytest.approx(effective_neighbors(W, g), rel=1e-9)


@pytest.mark.parametrize("n", [1, 2, 5, 16])
def test_enn_of_identity_is_one_and_of_exact_average_is_n(n):
    for g in GAMMAS + (0.999,):
        assert effective_neighbors(np.eye(n), g) == pytest.approx(1.0)
        assert effective_neighbors(np.full((n, n), 1.0 / n), g) == pytest.approx(n)
        assert effective_neighbors(build_topology("complete", n), g) == pytest.approx(n)


@pytest.mark.parametrize("name,n,node_of", [c for c in CASES if c[1] >= 2],
                         ids=[i for c, i in zip(CASES, CASE_IDS) if c[1] >= 2])
def test_enn_lies_between_one_and_n(name, n, node_of):
    top = build_topology(name, n, node_of)
    values = [effective_neighbors(top, g) for g in GAMMAS]
    assert all(1.0 - 1e-9 <= v <= n + 1e-9 for v in values)
    if name != "complete" and not (name == "hierarchical" and node_of == [0] * n):
        assert values[-1] > 1.0 + 1e-6             # some mixing happens
    # a longer memory (larger gamma) never lowers the effective number of neighbours
    assert all(b >= a - 1e-9 for a, b in zip(values, values[1:]))


@pytest.mark.parametrize("n", [16, 64])
def test_enn_grows_with_connectivity(n):
    for g in (0.5, 0.9, 0.99):
        enn = [effective_neighbors(build_topology(name, n), g)
               for name in ("chain", "ring", "torus", "exponential-undirected", "complete")]
        assert enn == sorted(enn) and len(set(enn)) == len(enn), (g, enn)


@pytest.mark.parametrize("n", [2, 3, 4, 5, 16, 64, 4096])
def test_spectral_gap_closed_forms(n):
    assert spectral_gap(build_topology("complete", n)) == pytest.approx(1.0, abs=1e-12)
    if n >= 3:
        expected = 1 - abs(1 / 3 + 2 / 3 * math.cos(2 * math.pi / n))
        assert spectral_gap(build_topology("ring", n)) == pytest.approx(expected, abs=1e-12)
        assert spectral_gap(build_topology("star", n)) == pytest.approx(1 / n, abs=1e-12)
    if n & (n - 1) == 0:
        d = n.bit_length() - 1
        assert spectral_gap(build_topology("hypercube", n)) == pytest.approx(2 / (d + 1))
    if 1 < n <= 64:                                 # dense path: W = I does not mix at all
        assert spectral_gap(np.eye(n)) == pytest.approx(0.0, abs=1e-12)


def _reference_diameter(top):
    adj = np.ascontiguousarray(sum((W.T > 0).astype(float) for W in _matrices(top)))  # i -> j
    np.fill_diagonal(adj, 0)
    return int(shortest_path(adj, unweighted=True).max())


@pytest.mark.parametrize("name,n,node_of", CASES, ids=CASE_IDS)
def test_diameter_matches_all_pairs_shortest_paths(name, n, node_of):
    top = build_topology(name, n, node_of)
    assert diameter(top) == _reference_diameter(top)


def test_known_diameters():
    known = {("ring", 16): 8, ("torus", 16): 4, ("hypercube", 16): 4, ("chain", 9): 8,
             ("star", 9): 2, ("complete", 9): 1, ("tree", 16): 7, ("exponential-undirected", 16): 2,
             ("exponential", 16): 4,
             ("one-peer-exponential", 16): 4, ("hierarchical", 4096): 2048}
    for (name, n), d in known.items():
        assert diameter(build_topology(name, n)) == d, name


@pytest.mark.parametrize("name", TOPOLOGIES)
def test_weights_do_not_build_the_matrix(name, monkeypatch):
    n = 1 << 16                             # a dense W would take 32 GiB
    top = build_topology(name, n)
    monkeypatch.setattr(type(top), "mixing_matrix", lambda *a, **k: pytest.fail("dense W built"))
    for i in (0, 1, 12345, n - 1):
        w_ii, row = top.weights(i, step=5)
        assert math.fsum(row.values()) + w_ii == pytest.approx(1.0)
        assert sorted(row) == top.in_neighbors(i, step=5)


def test_analyse_reports_everything():
    result = analyse("torus", 16)
    assert set(result) == {"topology", "n", "layout", "time_varying", "directed", "period",
                           "degree", "diameter", "symmetric", "doubly_stochastic",
                           "second_eigenvalue_modulus", "second_singular_value", "spectral_gap",
                           "spectral_gap_definition", "effective_neighbors"}
    assert not result["directed"]
    assert result["degree"] == {"min": 4, "max": 4, "mean": 4.0}
    assert result["diameter"] == 4 and result["symmetric"] and result["doubly_stochastic"]
    assert result["spectral_gap"] == pytest.approx(0.4)            # 1 - (1 + 2 cos(pi/2)*2)/5
    assert list(result["effective_neighbors"]) == [str(g) for g in DEFAULT_GAMMAS]
    one_peer = analyse("one-peer-exponential", 8, gammas=[0.9])
    assert one_peer["time_varying"] and one_peer["period"] == 3
    assert not one_peer["symmetric"] and one_peer["doubly_stochastic"]
    assert one_peer["spectral_gap"] == 1.0
    assert analyse("hierarchical", 8, node_of=[0, 0, 0, 0, 1, 1, 1, 1])["diameter"] == 3
    with pytest.raises(ValueError, match=r"gamma must be in \[0, 1\)"):
        analyse("ring", 8, gammas=[0.5, 1.0])


@pytest.mark.parametrize("gamma", [1.0, -0.1, float("nan"), 2])
def test_effective_neighbors_rejects_bad_gamma(gamma):
    with pytest.raises(ValueError, match="gamma"):
        effective_neighbors(np.eye(3), gamma)


@pytest.mark.parametrize("name", ["tree", "hierarchical", "one-peer-exponential", "torus",
                                  "exponential", "exponential-undirected"])
def test_analysis_at_4096_uses_the_structure_not_a_dense_matrix(name, monkeypatch):
    # how much faster that is lives in benchmarks/topology_speed.py, not in a timed assertion
    monkeypatch.setattr(np.linalg, "eigvalsh", lambda *a, **k: pytest.fail("dense eigvalsh"))
    monkeypatch.setattr(np.linalg, "eigvals", lambda *a, **k: pytest.fail("dense eigvals"))
    top = build_topology(name, 4096)
    monkeypatch.setattr(type(top), "mixing_matrix", lambda *a, **k: pytest.fail("dense W built"))
    result = analyse(name, 4096, gammas=[0.9])
    assert 0.0 < result["spectral_gap"] <= 1.0 and result["doubly_stochastic"]
    assert 1.0 < result["effective_neighbors"]["0.9"] <= 4096


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "lsgd_hpc.topology", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)


def test_cli_json():
    proc = _cli("hierarchical", "-n", "16", "--ranks-per-node", "4", "--gamma", "0.5", "0.9",
                "--json")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["topology"] == "hierarchical" and result["n"] == 16
    assert result["degree"] == {"min": 3, "max": 5, "mean": 3.5}
    assert set(result["effective_neighbors"]) == {"0.5", "0.9"}
    assert result["doubly_stochastic"] is True and result["symmetric"] is True
    assert result == json.loads(json.dumps(analyse("hierarchical", 16, [0.5, 0.9],
                                                   [r // 4 for r in range(16)])))


def test_cli_table():
    proc = _cli("ring", "-n", "8")
    assert proc.returncode == 0, proc.stderr
    assert "spectral gap" in proc.stdout and "effective neighbours @ 0.999" in proc.stdout
    proc = _cli("exponential", "-n", "16")
    assert proc.returncode == 0, proc.stderr
    table = dict(line.rsplit(None, 1) for line in proc.stdout.splitlines() if "@" not in line
                 and "/" not in line)
    assert table["directed"] == "True" and table["symmetric"] == "False"
    assert float(table["spectral gap (1 - sigma_2)"]) == pytest.approx(0.4)
    with pytest.raises(json.JSONDecodeError):
        json.loads(proc.stdout)


@pytest.mark.parametrize("args", [
    ["mesh", "-n", "8"],
    ["ring", "-n", "0"],
    ["ring", "-n", "eight"],
    ["ring"],
    ["hypercube", "-n", "6"],
    ["ring", "-n", "8", "--gamma", "1"],
    ["ring", "-n", "8", "--gamma", "-0.5"],
    ["hierarchical", "-n", "8", "--ranks-per-node", "0"],
])
def test_cli_bad_input_is_one_line_and_exit_2(args):
    proc = _cli(*args)
    assert proc.returncode == 2
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("lsgd_hpc.topology: error: "), proc.stderr
    assert "Traceback" not in proc.stderr


def test_main_returns_exit_status_in_process(capsys):
    assert topo.main(["complete", "-n", "4", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["spectral_gap"] == pytest.approx(1.0)
    assert topo.main(["hypercube", "-n", "3"]) == 2
    assert capsys.readouterr().err.startswith("lsgd_hpc.topology: error: hypercube")


@pytest.mark.mpi
def test_gossip_trains_on_the_directed_exponential_graph(tmp_path):
    """4 ranks, d = 2: every step a rank sends its model to i+1 and i+2 and receives from i-1
    and i-2 (different ranks), and the loss falls."""
    import h5py
    from mpi_util import run_mpi
    run_mpi(4, [sys.executable, "-m", "lsgd_hpc.train", "--algorithm", "gossip",
                "--topology", "exponential", "--max-steps", "30", "--eval-every", "1000",
                "--consensus-every", "10", "--run-dir", str(tmp_path)], timeout=600)
    top = build_topology("exponential", 4)
    for rank in range(4):
        with h5py.File(tmp_path / "metrics" / f"rank{rank:05d}.h5", "r") as f:
            t, cons = f["train"], f["consensus"]
            loss = t["loss"][()]
            sent = np.diff(np.concatenate([[0], t["comm_bytes_sent"][()]]))
            recv = np.diff(np.concatenate([[0], t["comm_bytes_recv"][()]]))
            assert len(loss) == 30 and np.all(np.isfinite(loss))
            assert loss[-5:].mean() < 0.7 * loss[:5].mean()
            # the same model-sized message to each of the 2 out-neighbours, from the 2 in-ones
            assert len(set(sent)) == 1 and sent[0] > 0 and np.array_equal(sent, recv)
            assert len(top.out_neighbors(rank)) == 2
            assert np.all(np.isfinite(cons["distance"][()])) and len(cons["step"][()]) >= 3
