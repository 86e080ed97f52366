"""int8/fp8 communication at any world size (size 1 under plain pytest, 2/4/5 ranks under
mpirun through tests/test_parallel_mpi.py, mpi and torch backends; Horovod refuses it).

The quantized allreduce and broadcasts end with the same bits on every rank, within the
quantization bound of the exact result, and count the documented bytes; error feedback
removes the bias that rounding leaves and follows its update rule exactly; every periodic
method trains with int8 and fp8 in a quarter of the bytes; a run with error feedback resumes
exactly from its state_dict (lsgd_hpc.comm.quantized). At layouts of several nodes with more
than one rank on some node (4 ranks as 2 + 2, 5 as 2 + 2 + 1) the methods' allreduces are
hierarchical: node sums in float32, the compressed exchange between the node roots (whose
counters hold the bytes between nodes), the result spread inside the node; checked by hand.
"""

import copy
import hashlib
import io
import os

import numpy as np
import pytest
import torch
from torch import nn

from lsgd_hpc.comm.quantized import (BITS, BLOCK, KINDS, Quantized, allreduce_bytes,
                                     broadcast_bytes, layout, quantized_groups, roundtrip)
from lsgd_hpc.comm.sparse import payload_bytes, select, sparse_layout
from lsgd_hpc.methods import METHODS

BACKEND = os.environ.get("LSGD_TEST_BACKEND", "mpi")
#: one quantization's largest error relative to its block's max|x| (tests/comm/test_quantized.py)
REL = {"int8": 0.5 / 127, "fp8": 16 / 448, "int4": 0.5 / 7, "int2": 0.5}
#: the one-byte kinds (the methods' training test: int4 and int2 have one of their own)
ONE_BYTE = [k for k in sorted(KINDS) if BITS[k] == 8]
PERIODIC = ["lsgd", "easgd", "local-sgd", "diloco", "slowmo"]
OPTIONS = {"lsgd": dict(tau_local=2, tau_global=4), "easgd": dict(easgd_tau=2),
           "local-sgd": dict(local_steps=4), "diloco": dict(local_steps=4, outer_lr=0.7),
           "slowmo": dict(local_steps=2, slowmo_every=8)}


def topk_backend():
    """Every backend runs top-k (Horovod: its allgather of the records)."""


def quantized_backend(world):
    if world.size == 1:
        pytest.skip("a group of one sends nothing and rounds nothing")


def digest(t: torch.Tensor) -> str:
    return hashlib.blake2b(t.contiguous().view(torch.uint8).numpy().tobytes(),
                           digest_size=16).hexdigest()


def vector(rank: int, n: int) -> torch.Tensor:
    """Rank ``rank``'s input: magnitudes that vary along the vector (blocks differ)."""
    g = torch.Generator().manual_seed(7 + rank)
    return torch.randn(n, generator=g) * torch.linspace(0.1, 3.0, n)


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("op", ["mean", "sum"])
@pytest.mark.parametrize("n", [256, 1001, 3 * BLOCK * 4 + 5])
def test_allreduce_same_bits_bound_and_bytes(world, kind, op, n):
    """Sizes not divisible by p nor by the block; every rank ends with the same bits, within
    two quantizations of the exact sum or mean, and counts ceil(n bits / 8) + 4 p b bytes
    each way."""
    quantized_backend(world)
    q = Quantized(world, kind)
    p = world.size
    t = vector(world.rank, n)
    before = world.stats.snapshot()
    assert q.allreduce_(t, op) is t
    nb = allreduce_bytes(n, p, kind=kind)
    assert world.stats.bytes_sent - before.bytes_sent == nb
    assert world.stats.bytes_recv - before.bytes_recv == nb
    assert world.stats.calls - before.calls == 1
    assert nb == -(-n * BITS[kind] // 8) + 4 * p * layout(n, p, kind=kind).b
    assert len(set(world.allgather_object(digest(t)))) == 1
    inputs = torch.stack([vector(r, n) for r in range(p)]).double()
    exact = inputs.sum(0) / (p if op == "mean" else 1)
    amax = inputs.abs().max().item()
    # phase 1: each rank's rounding (<= REL amax); phase 2: the reduced chunk's
    scale = 1 if op == "mean" else p
    bound = REL[kind] * amax * scale * (2 + REL[kind]) + 1e-5
    err = (t.double() - exact).abs().max().item()
    assert 0 < err <= bound, (err, bound)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_broadcast_same_bits_and_bytes(world, kind):
    """The root quantizes once; every rank, the root too, holds Q(root's vector)."""
    quantized_backend(world)
    q, n = Quantized(world, kind), 5003
    for root in range(world.size):
        t = vector(world.rank, n)
        before = world.stats.snapshot()
        q.broadcast_(t, root)
        assert torch.equal(t, roundtrip(vector(root, n), 1, kind))
        sent = world.stats.bytes_sent - before.bytes_sent
        recv = world.stats.bytes_recv - before.bytes_recv
        nb = broadcast_bytes(n, kind=kind)
        assert (sent, recv) == ((nb, 0) if world.rank == root else (0, nb))
        assert nb == -(-n * BITS[kind] // 8) + 4 * 2        # ceil(5003 / 4096) scales


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_broadcast_across_nodes_forwards_the_same_bytes(world, groups, kind):
    """NodeGroups.broadcast_from_ over quantized groups: quantized once at the source, the
    bytes forwarded hop by hop (never requantized), so every rank holds the same bits; each
    hop counts ceil(n bits / 8) + 4 ceil(n / BLOCK) where float32 counts 4 n."""
    quantized_backend(world)
    qg = quantized_groups(groups, kind)
    n = 3000
    for root in range(world.size):
        ref = vector(world.rank, n)
        before = world.stats.snapshot()
        groups.broadcast_from_(ref, root)                      # float32, for the hop counts
        sent32 = world.stats.bytes_sent - before.bytes_sent
        recv32 = world.stats.bytes_recv - before.bytes_recv
        t = vector(world.rank, n)
        before = world.stats.snapshot()
        qg.broadcast_from_(t, root)
        assert torch.equal(t, roundtrip(vector(root, n), 1, kind))
        nb = broadcast_bytes(n, kind=kind)
        assert world.stats.bytes_sent - before.bytes_sent == sent32 // (4 * n) * nb
        assert world.stats.bytes_recv - before.bytes_recv == recv32 // (4 * n) * nb
    assert len(set(world.allgather_object(digest(t)))) == 1


#: an outlier that makes 0.1 round to 0 in its block: int8's step is 100 / 127; fp8's
#: smallest (subnormal) step is 2^-9 of 1e5 / 448, 0.44; int4's 5 / 7; int2's 1 (small enough
#: that the residual of 0.1 a round reaches half a step within the 40 rounds)
OUTLIER = {"int8": 100.0, "fp8": 1e5, "int4": 5.0, "int2": 1.0}


def outliers(rank: int, size: int, big: float, n: int = 1024) -> torch.Tensor:
    """0.1 everywhere but every 32nd element: +-big alternating over the ranks (0 on the last
    of an odd world), so the outliers cancel in the mean (0) while they set the rank's block
    scale: alone, 0.1 rounds to 0."""
    v = torch.full((n,), 0.1)
    sign = 0.0 if (size % 2 and rank == size - 1) else (1.0 if rank % 2 == 0 else -1.0)
    v[::32] = big * sign
    return v


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_error_feedback_removes_the_bias(world, kind):
    """The same vector allreduced (mean) 40 times: without error feedback the small entries
    are lost at every round (a bias that persists); with it the running mean of the results
    converges to the true mean 0.1."""
    quantized_backend(world)
    n, rounds = 1024, 40
    small = torch.ones(n, dtype=torch.bool)
    small[::32] = False
    error = {}
    for ef in (False, True):
        q = Quantized(world, kind, error_feedback=ef)
        buf = torch.empty(n)
        q.agree_buffers(buf)
        total = torch.zeros(n, dtype=torch.float64)
        for _ in range(rounds):
            buf.copy_(outliers(world.rank, world.size, OUTLIER[kind], n))
            q.allreduce_(buf, "mean")
            total += buf.double()
        avg = total / rounds
        error[ef] = (avg[small] - 0.1).abs().max().item()
        assert avg[~small].abs().max().item() < 0.05, (ef, avg[~small].abs().max())
    assert error[False] > 0.05, error      # 0.1, or 0.1 (p - 1) / p in an odd world
    assert error[True] < 0.02, error       # at most half a step / rounds


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_error_feedback_rule_exact(world, kind):
    """e <- (v + e) - Q(v + e) with Q phase 1's quantization for this world size, bit for bit,
    over two rounds; the residual is keyed by the registered buffer, offset and length."""
    quantized_backend(world)
    q = Quantized(world, kind, error_feedback=True)
    buf = torch.zeros(1024)
    q.agree_buffers(buf)
    view = buf[256:768]
    p = world.size
    v1, v2 = vector(world.rank, 512), vector(world.rank + 100, 512)
    view.copy_(v1)
    q.allreduce_(view, "mean")
    key = "world/buffer0@256+512"
    assert list(q.shared.residuals) == [key]
    e1 = q.shared.residuals[key].clone()
    assert torch.equal(e1, v1 - roundtrip(v1, p, kind))
    view.copy_(v2)
    q.allreduce_(view, "mean")
    w = v2 + e1
    assert torch.equal(q.shared.residuals[key], w - roundtrip(w, p, kind))
    loose = vector(world.rank, 300)                        # outside every registered buffer
    q.allreduce_(loose, "sum")
    assert "world/numel300" in q.shared.residuals


@pytest.mark.parametrize("kind,topk", [("int8", 1.0), ("int2", 0.05), ("fp32", 0.05)])
def test_error_feedback_decay_feeds_back_beta_e(world, kind, topk):
    """error_feedback_decay beta: round 2 compresses v2 + beta e1 and keeps
    e2 = (v2 + beta e1) - C(v2 + beta e1). Checked bit for bit against beta 1 given
    beta e1 as its residual by hand (beta 0.5: exact in float32), with the same
    compressor at this world size; every rank ends with the same bits."""
    quantized_backend(world)
    n, beta = 3 * BLOCK + 77, 0.5
    out = {}
    for decay in (beta, 1.0):
        q = Quantized(world, kind, error_feedback=True, topk=topk, decay=decay)
        buf = torch.zeros(n)
        q.agree_buffers(buf)
        key = f"world/buffer0@0+{n}"
        buf.copy_(vector(world.rank, n))
        q.allreduce_(buf, "mean")
        e1 = q.shared.residuals[key].clone()
        assert e1.abs().max() > 0                       # something was left out
        if decay == 1.0:
            q.shared.residuals[key].mul_(beta)          # by hand: beta e1
        buf.copy_(vector(world.rank + 100, n))
        q.allreduce_(buf, "mean")
        out[decay] = (e1, buf.clone(), q.shared.residuals[key].clone())
    assert torch.equal(out[beta][0], out[1.0][0])       # round 1: no residual yet
    assert torch.equal(out[beta][1], out[1.0][1])       # round 2: the same mean
    assert torch.equal(out[beta][2], out[1.0][2])       # and the same residual
    assert not torch.equal(out[beta][2], out[beta][0])
    assert len(set(world.allgather_object(digest(out[beta][1])))) == 1


# -- hierarchical: node sums in float32, the compressed exchange between node roots ------------
def hierarchical(groups) -> bool:
    """Whether quantized_groups' world runs its allreduces hierarchically at this layout:
    more than one node, and some node with more than one rank."""
    node_of = list(groups.node_of)
    return groups.n_nodes > 1 and max(node_of.count(i) for i in set(node_of)) > 1


def node_sums(groups, vectors):
    """Each node's float32 sum of its ranks' ``vectors`` (rank order: at two ranks a node the
    order cannot matter), by node index."""
    sums = {}
    for r, v in enumerate(vectors):
        i = groups.node_of[r]
        sums[i] = v.clone() if i not in sums else sums[i] + v
    return [sums[i] for i in range(groups.n_nodes)]


def flat_by_hand(inputs, kind, div):
    """The flat two-phase allreduce of ``inputs`` (one per member, float32) by hand: each
    member's Q, the float32 sum in member order, divided by ``div``, Q again."""
    m, n = len(inputs), inputs[0].numel()
    total = torch.zeros(n)
    for v in inputs:
        total += roundtrip(v, m, kind)
    return roundtrip(total / div if div != 1 else total, m, kind)


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_hierarchical_allreduce_by_hand(world, groups, kind):
    """quantized_groups' world with error feedback, two rounds (mean): the node sums in
    float32, their compressed allreduce over the node roots (chunks by the number of nodes),
    divided by the world size, spread in float32: the result by hand, the same bits on every
    rank; the residuals on the node roots only, e <- (S + e) - Q(S + e) of the node sum S; the
    job's counters hold the roots' exchange (allreduce_bytes(n, nodes)), the node's float32
    phases are counted apart. At one rank a node (or one node): the flat allreduce."""
    quantized_backend(world)
    p, n = world.size, 3 * BLOCK + 77
    qg = quantized_groups(groups, kind, error_feedback=True)
    q = qg.world
    buf = torch.zeros(n)
    q.agree_buffers(buf)
    key = "world/buffer0@0+%d" % n
    hier = hierarchical(groups)
    N = groups.n_nodes if hier else p
    residual = [torch.zeros(n) for _ in range(N)]
    for rnd in range(2):
        vs = [vector(r + 10 * rnd, n) for r in range(p)]
        buf.copy_(vs[world.rank])
        before, node_before = world.stats.snapshot(), q.node_stats.snapshot()
        q.allreduce_(buf, "mean")
        sent = world.stats.bytes_sent - before.bytes_sent
        recv = world.stats.bytes_recv - before.bytes_recv
        sums = node_sums(groups, vs) if hier else vs
        w = [s + e for s, e in zip(sums, residual)]
        residual = [x - roundtrip(x, N, kind) for x in w]
        expected = flat_by_hand(w, kind, p)
        assert torch.equal(buf, expected), (rnd, (buf - expected).abs().max())
        assert len(set(world.allgather_object(digest(buf)))) == 1
        assert world.stats.calls - before.calls == 1
        mine = groups.node_index if hier else world.rank
        if not hier or groups.is_root:
            assert torch.equal(q.shared.residuals[key], residual[mine])
            assert (sent, recv) == (allreduce_bytes(n, N, kind=kind),) * 2
        else:
            assert key not in q.shared.residuals and (sent, recv) == (0, 0)
        node_sent = q.node_stats.bytes_sent - node_before.bytes_sent
        if hier:             # float32: the node's allreduce (4 n), the root's broadcast (4 n)
            assert node_sent == 4 * n * (1 + groups.is_root) * (groups.local_size > 1)
        else:
            assert node_sent == 0
    # the bytes between nodes: about a quarter (int8) or an eighth (int4) of float32's 4 n
    if hier and groups.is_root:
        ratio = allreduce_bytes(n, N, kind=kind) / (4 * n)
        assert ratio <= {"int8": 0.2505, "int4": 0.1255}[kind], ratio


def test_hierarchical_topk_by_hand(world, groups):
    """Top-k (F = 1/4 of chunks of 8, float32 values) through quantized_groups' world, sum:
    the roots send the top-2 of every chunk of their node's float32 sum; at two ranks a
    node the sum of ranks r and r + 1 of topk_vector has its two outliers at positions r and
    r + 1, which are what is sent; the records summed in node order, the same bits
    everywhere."""
    topk_backend()
    quantized_backend(world)
    p, n = world.size, 256
    qg = quantized_groups(groups, "fp32", error_feedback=True, block=8, topk=0.25)
    buf = torch.zeros(n)
    qg.world.agree_buffers(buf)
    buf.copy_(topk_vector(world.rank, n))
    qg.world.allreduce_(buf, "sum")
    hier = hierarchical(groups)
    vs = [topk_vector(r, n) for r in range(p)]
    sums = node_sums(groups, vs) if hier else vs
    lay = sparse_layout(n, 0.25, "fp32", 8)
    expected = torch.zeros(n)
    for s in sums:                                          # in node (member) order
        idx, values = select(s, lay)
        dense = torch.zeros(lay.m, lay.c)
        dense.scatter_(1, idx, values)
        expected += dense.view(-1)[:n]
    assert torch.equal(buf, expected)
    assert len(set(world.allgather_object(digest(buf)))) == 1
    if hier and groups.local_size == 2:
        first = groups.root_of_node(groups.node_index)
        got = (buf.view(32, 8) != 0).nonzero()[:, 1].unique().tolist()
        assert set(range(first, first + 2)) <= set(got)


# -- top-k (lsgd_hpc.comm.sparse) ------------------------------------------------------------
def topk_vector(rank: int, n: int = 256) -> torch.Tensor:
    """Rank r's input by hand, in chunks of 8: chunk i holds (i + 1) (j + 1) / 8 at position j,
    except position r, which holds (i + 1) (10 + r), negative for odd r. With k = 2 of 8, rank
    r's top-2 of every chunk are positions r (its own outlier) and 7."""
    j = torch.arange(n) % 8
    i = torch.arange(n) // 8
    v = (i + 1) * (j + 1) / 8.0
    v[j == rank] = ((i + 1) * (10.0 + rank) * (-1.0) ** rank)[j == rank]
    return v.float()


def test_topk_by_hand(world):
    """Chunks of c = 8, F = 1/4: k = 2. Round 1: rank r sends positions (r, 7) of every chunk,
    values (i + 1)(+-(10 + r), 1); its residual is its vector with those zeroed; the mean is
    +-(i + 1)(10 + r') / p at position r' < p, i + 1 at 7, zero elsewhere, the same bits on
    every rank. Round 2 (the same v, plus the residual): position 7 was sent, so 6 (doubled,
    1.75 (i + 1)) replaces it. A group of one sends nothing: the vector stays as it is."""
    topk_backend()
    p, r, n = world.size, world.rank, 256
    q = Quantized(world, "fp32", error_feedback=True, block=8, topk=0.25)
    buf = torch.zeros(n)
    q.agree_buffers(buf)
    v = topk_vector(r, n)
    lay = sparse_layout(n, 0.25, "fp32", 8)
    assert (lay.c, lay.m, lay.k) == (8, 32, 2)
    idx, values = select(v, lay)
    scale = torch.arange(1, 33, dtype=torch.float32)
    assert torch.equal(idx, torch.tensor([[r, 7]] * 32))
    assert torch.equal(values, torch.stack([scale * (10.0 + r) * (-1.0) ** r, scale], 1))
    before = world.stats.snapshot()
    buf.copy_(v)
    q.allreduce_(buf, "mean")
    if p == 1:
        assert torch.equal(buf, v) and not q.shared.residuals
        return
    assert world.stats.bytes_sent - before.bytes_sent == 32 * 2 * (2 + 4)
    assert world.stats.bytes_recv - before.bytes_recv == (p - 1) * 32 * 2 * (2 + 4)
    sent = torch.zeros(n)
    sent[r::8], sent[7::8] = v[r::8], v[7::8]
    e1 = q.shared.residuals["world/buffer0@0+256"].clone()
    assert torch.equal(e1, v - sent)
    expected = torch.zeros(n)
    for rr in range(p):
        expected[rr::8] = topk_vector(rr, n)[rr::8] / p
    expected[7::8] = (scale * p) / p
    assert torch.equal(buf, expected)
    assert len(set(world.allgather_object(digest(buf)))) == 1
    buf.copy_(v)
    q.allreduce_(buf, "mean")
    w = v + e1
    sent2 = torch.zeros(n)
    sent2[r::8], sent2[6::8] = w[r::8], w[6::8]
    assert torch.equal(w[6::8], scale * 1.75)
    assert torch.equal(q.shared.residuals["world/buffer0@0+256"], w - sent2)
    expected[7::8] = 0.0
    expected[6::8] = (scale * 1.75 * p) / p
    assert torch.equal(buf, expected)
    assert len(set(world.allgather_object(digest(buf)))) == 1


def test_topk_int2_values_by_hand(world):
    """The same vectors with int2 values: one scale per chunk, s = max |selected| =
    (i + 1)(10 + r); the outlier goes as its sign times s, exactly; the 1 at position 7
    (below s / 2) as 0, and stays in the residual. The sum is +-(i + 1)(10 + r') at r'."""
    topk_backend()
    p, r, n = world.size, world.rank, 256
    q = Quantized(world, "int2", error_feedback=True, block=8, topk=0.25)
    buf = torch.zeros(n)
    q.agree_buffers(buf)
    v = topk_vector(r, n)
    buf.copy_(v)
    q.allreduce_(buf, "sum")
    if p == 1:
        assert torch.equal(buf, v)
        return
    lay = sparse_layout(n, 0.25, "int2", 8)
    assert lay.counted == 32 * (4 + 2 * 2 + 1)             # scale, 2 int16 indices, 1 byte
    e = q.shared.residuals["world/buffer0@0+256"]
    expected_e = v.clone()
    expected_e[r::8] = 0.0
    assert torch.equal(e, expected_e)
    expected = torch.zeros(n)
    for rr in range(p):
        expected[rr::8] = topk_vector(rr, n)[rr::8]
    assert torch.equal(buf, expected)
    assert len(set(world.allgather_object(digest(buf)))) == 1


@pytest.mark.parametrize("kind", ["fp32", "int8", "int4", "int2"])
def test_topk_same_bits_and_error_feedback_converges(world, kind):
    """Random vectors, the default chunk (4096), F = 0.05, an odd length: every rank ends with
    the same bits, the result has at most p k entries per chunk, and over rounds of the same
    vectors the running mean of what arrives approaches the true mean (error feedback)."""
    quantized_backend(world)
    p, n, topk = world.size, 3 * BLOCK + 77, 0.05
    truth = torch.stack([vector(r, n) for r in range(p)]).double().mean(0)
    errors = {}
    for ef in (True, False):
        q = Quantized(world, kind, error_feedback=ef, topk=topk)
        buf = torch.zeros(n)
        q.agree_buffers(buf)
        total = torch.zeros(n, dtype=torch.float64)
        errors[ef] = []
        for t in range(1, 61):
            buf.copy_(vector(world.rank, n))
            q.allreduce_(buf, "mean")
            if t == 1:
                lay = sparse_layout(n, topk, kind)
                per_chunk = torch.zeros(lay.m * lay.c)
                per_chunk[:n] = (buf != 0).float()
                assert per_chunk.view(lay.m, lay.c).sum(1).max() <= p * lay.k
            total += buf.double()
            errors[ef].append(((total / t) - truth).norm().item() / truth.norm().item())
        assert len(set(world.allgather_object(digest(buf)))) == 1
    first, last = errors[True][0], errors[True][-1]
    assert first > 0.5, first                           # one round sends a twentieth
    assert last < 0.25 * first, (first, last)           # measured: 0.83 -> 0.14 at 2 ranks
    assert errors[False][-1] > 0.9 * first, errors[False][-1]    # without it: no better


def test_topk_bytes_at_one_percent_with_int2_values(world):
    """F = 0.01 with int2 values on a vector of 1 048 583 elements: each rank sends
    S = m (4 + 2 k + ceil(k / 4)) bytes (k = 41 of every 4096), under 0.01 of fp32's 4 n;
    it receives the other p - 1 ranks' S (at 2 ranks: S, the same ratio)."""
    quantized_backend(world)
    p, n = world.size, 1_048_583
    q = Quantized(world, "int2", error_feedback=True, topk=0.01)
    buf = vector(world.rank, n)
    before = world.stats.snapshot()
    q.allreduce_(buf, "mean")
    sent = world.stats.bytes_sent - before.bytes_sent
    recv = world.stats.bytes_recv - before.bytes_recv
    lay = sparse_layout(n, 0.01, "int2")
    assert (lay.m, lay.k) == (257, 41)
    assert sent == lay.m * (4 + 2 * 41 + 11) == payload_bytes(n, p, 0.01, "int2")[0]
    assert recv == (p - 1) * sent
    ratio = sent / (4 * n)
    assert ratio <= 0.01, ratio
    assert 0.0059 < ratio < 0.0060, ratio                # 24 929 / 4 194 332
    assert len(set(world.allgather_object(digest(buf)))) == 1


def test_topk_state_dict_round_trip(world):
    """The residuals saved by state_dict and loaded into a fresh wrapper give the same next
    round, bit for bit; a fresh wrapper without them gives another."""
    quantized_backend(world)
    n = 5000

    def wrapper():
        q = Quantized(world, "int4", error_feedback=True, topk=0.1)
        buf = torch.zeros(n)
        q.agree_buffers(buf)
        return q, buf
    q, buf = wrapper()
    for t in range(3):
        buf.copy_(vector(world.rank + t, n))
        q.allreduce_(buf, "mean")
    state = q.state_dict()
    assert state["topk"] == 0.1 and list(state["residuals"]) == ["world/buffer0@0+5000"]
    buf.copy_(vector(world.rank + 3, n))
    q.allreduce_(buf, "mean")
    results = []
    for load in (True, False):
        q2, buf2 = wrapper()
        if load:
            q2.load_state_dict(copy.deepcopy(state))
        buf2.copy_(vector(world.rank + 3, n))
        q2.allreduce_(buf2, "mean")
        results.append(buf2)
    assert torch.equal(results[0], buf)
    assert not torch.equal(results[1], buf)


def rank_data(rank: int, n: int = 64):
    g = torch.Generator().manual_seed(1000 + rank)
    x = torch.randn(n, 10, generator=g)
    y = (x[:, :3].sum(1) > 0).long() + 2 * (x[:, 3] > 0).long()
    return x, y


def train_measured(comm, name, dtype, error_feedback, topk=1.0, model=None, **options):
    """``name`` trained 40 steps on the rank-valued task with what it sends in ``dtype``
    (``topk``, ``error_feedback``): (the method, the bytes this rank sent, the reported
    model's accuracy on held-out data). ``model``: a 10-in, 4-out model (default an MLP)."""
    torch.manual_seed(0)
    model = model or nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    method = METHODS[name](model, opt, comm, max_steps=40, comm_dtype=dtype, topk=topk,
                           error_feedback=error_feedback, **{**OPTIONS[name], **options})
    x, y = rank_data(comm.rank, 256)
    s0 = comm.stats.bytes_sent
    while not method.done:
        i = (method.steps % 8) * 32
        loss = nn.functional.cross_entropy(model(x[i:i + 32]), y[i:i + 32])
        opt.zero_grad()
        loss.backward()
        method.step(loss)
    method.drain()
    sent = comm.stats.bytes_sent - s0
    xt, yt = rank_data(10_000, 512)
    with method.reported_model() as m, torch.no_grad():
        acc = float((m(xt).argmax(1) == yt).float().mean())
    return method, sent, acc


def between_nodes(comm, total, key, fp32_key):
    """(ratio, over all ranks): bytes sent with ``key`` against float32's (``total``: every
    rank's bytes by run). At a hierarchical layout (hierarchical()) the ratio is taken over
    the node roots, the ranks whose counters hold what crosses between nodes (the float32
    phases of a hierarchical allreduce inside a node are counted apart; the other ranks'
    counters hold what else they send); elsewhere over all ranks."""
    everyone = sum(t[key] for t in total) / sum(t[fp32_key] for t in total)
    if not hierarchical(comm.groups):
        return everyone, everyone
    g = comm.groups
    roots = [total[g.root_of_node(i)] for i in range(g.n_nodes)]
    return sum(t[key] for t in roots) / sum(t[fp32_key] for t in roots), everyone


@pytest.mark.parametrize("name", PERIODIC)
def test_methods_train_in_a_quarter_of_the_bytes(comm, name):
    """Each periodic method, the same loop in fp32, int8, fp8 and int8 with error feedback:
    the reported model learns the task, and the bytes are about a quarter (the scales and the
    elections add a little)."""
    quantized_backend(comm.world)
    if comm.size not in (2, 4):
        pytest.skip("training bodies run at 2 and 4 ranks (suite time)")
    sent = {}
    runs = [("fp32", False)] + [(k, False) for k in ONE_BYTE] + [("int8", True)]
    for dtype, ef in runs:
        method, sent[(dtype, ef)], acc = train_measured(comm, name, dtype=dtype,
                                                        error_feedback=ef)
        assert acc > 0.75, (name, dtype, ef, acc)
        method.close()
    total = comm.allgather_object(sent)
    for key in sent:
        if key != ("fp32", False):
            ratio, everyone = between_nodes(comm, total, key, ("fp32", False))
            assert 0.24 <= ratio <= 0.30 and everyone <= 0.30, (name, key, ratio, everyone)


@pytest.mark.parametrize("name", ["easgd", "diloco"])
def test_methods_train_in_int4_and_int2(comm, name):
    """The methods that send differences (EASGD's elastic difference, DiLoCo's
    pseudo-gradient) train with int4 values (with error feedback) and int2 values (without),
    in an eighth and a sixteenth of fp32's bytes (plus scales and elections). (Averages of
    the parameters themselves, local SGD and SlowMo, would round every weight to 15 or 3
    levels of its block: int4 and int2 are for differences.)"""
    quantized_backend(comm.world)
    if comm.size not in (2, 4):
        pytest.skip("training bodies run at 2 and 4 ranks (suite time)")
    sent = {}
    for dtype, ef in (("fp32", False), ("int4", True), ("int2", False)):
        method, sent[dtype], acc = train_measured(comm, name, dtype=dtype, error_feedback=ef)
        assert acc > 0.7, (name, dtype, acc)
        method.close()
    total = comm.allgather_object(sent)
    for dtype, (low, high) in {"int4": (0.12, 0.15), "int2": (0.06, 0.09)}.items():
        ratio, everyone = between_nodes(comm, total, dtype, "fp32")
        assert low <= ratio <= high and everyone <= high, (name, dtype, ratio, everyone)


def test_node_traffic_in_the_metrics_file(comm):
    """DiLoCo in int8 (2 outer steps of 4 local steps) writing its metrics (open_metrics,
    log_step: the trainer's path). At a hierarchical layout (4 ranks as 2 + 2, 5 as
    2 + 2 + 1) /train has cumulative node_bytes_sent, node_bytes_recv, node_seconds: per
    outer step the float32 node sum of the n-element [delta | buffers] (4 n sent and received
    on every rank of a node of more than one) and the root's float32 spread (4 n sent by the
    root, 4 n received by each other rank of its node), nothing on a node of one rank; the
    comm_bytes_* columns then hold the roots' compressed exchange only
    (allreduce_bytes(n, nodes) each way), nothing on the other ranks; node_seconds is part of
    comm_seconds; method.state_dict() carries the counters (a resumed method goes on from
    them). At any other layout: no node_* columns."""
    import shutil
    import tempfile

    import h5py

    from lsgd_hpc.runtime.run_metrics import open_metrics
    run_dir = comm.allgather_object(tempfile.mkdtemp(prefix="lsgd-node-cols-")
                                    if comm.rank == 0 else None)[0]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    method = METHODS["diloco"](model, opt, comm, max_steps=8, comm_dtype="int8",
                               local_steps=4, outer_lr=0.7)
    writer = open_metrics(run_dir, comm, method=method)
    x, y = rank_data(comm.rank, 64)
    s0 = comm.stats.snapshot()
    while not method.done:
        i = (method.steps % 2) * 32
        loss = nn.functional.cross_entropy(model(x[i:i + 32]), y[i:i + 32])
        opt.zero_grad()
        loss.backward()
        method.step(loss)
        writer.log_step(method.steps, loss.item())
    method.drain()
    state = method.state_dict()
    writer.close()
    with h5py.File(os.path.join(run_dir, "metrics", f"rank{comm.initial_rank:05d}.h5"),
                   "r") as f:
        t = {c: f["train"][c][()] for c in f["train"]}
    method.close()
    comm.barrier()                                  # every rank has read its file
    if comm.rank == 0:
        shutil.rmtree(run_dir, ignore_errors=True)
    g, n, outer = comm.groups, method.flat.flat.numel(), 2
    assert n >= 256 and len(t["step"]) == 8                   # (quantized: model-sized)
    node_cols = {"node_bytes_sent", "node_bytes_recv", "node_seconds"}
    if comm.size == 1 or not hierarchical(g):
        assert method.node_stats is None and not node_cols & set(t), sorted(t)
        assert "node_stats" not in state
        return
    root, many = g.is_root, g.local_size > 1
    want_sent = outer * 4 * n * (1 + root) * many
    want_recv = outer * 4 * n * (1 + (not root)) * many
    assert (t["node_bytes_sent"][-1], t["node_bytes_recv"][-1]) == (want_sent, want_recv)
    assert np.all(np.diff(t["node_bytes_sent"]) >= 0) and np.all(np.diff(t["node_seconds"]) >= 0)
    assert len(set(t["node_bytes_sent"].tolist())) == (1 + outer if many else 1)
    between = outer * allreduce_bytes(n, g.n_nodes) if root else 0
    assert t["comm_bytes_sent"][-1] - s0.bytes_sent == between
    assert t["comm_bytes_recv"][-1] - s0.bytes_recv == between
    assert (t["node_seconds"][-1] > 0) == many
    assert t["node_seconds"][-1] <= t["comm_seconds"][-1] - s0.seconds
    assert state["node_stats"]["bytes_sent"] == want_sent
    again = METHODS["diloco"](model, opt, comm, max_steps=8, comm_dtype="int8",
                              local_steps=4, outer_lr=0.7)       # a resume goes on counting
    assert again.node_stats.bytes_sent == 0
    again.load_state_dict(state)
    assert again.node_stats.state_dict() == state["node_stats"]
    again.close()
    if comm.size == 4:          # 2 + 2: every rank sends inside its node
        assert t["node_bytes_sent"][-1] > 0


#: (method, its options, the value kinds tried, the bytes' bound against fp32 for each)
TOPK_RUNS = {
    # EASGD with int2 values and error feedback ends near 0.62 here (as dense int2 with error
    # feedback does): its fp32 and int8 values are tried
    "easgd": ("easgd", {}, {"fp32": 0.2, "int8": 0.12}),
    "diloco": ("diloco", {}, {"fp32": 0.2, "int2": 0.1}),
    # the change since the last average, through the shared reference (FlatAverage)
    "local-sgd": ("local-sgd", {}, {"fp32": 0.2, "int8": 0.12}),
    "slowmo": ("slowmo", {}, {"fp32": 0.2, "int2": 0.1}),
    # two fragments of 352 and 132 elements: the second is under MIN_ELEMENTS (256) and
    # moves dense in fp32 (control-sized), so the ratio is about 0.4
    "streaming-diloco": ("diloco", dict(fragments=2, fragment_sync_delay=1),
                         {"fp32": 0.5, "int2": 0.45}),
}


@pytest.mark.parametrize("case", sorted(TOPK_RUNS))
def test_methods_train_with_topk(comm, case):
    """EASGD, DiLoCo, Streaming DiLoCo, local SGD and SlowMo with F = 0.1 and error feedback:
    the reported model learns the task in a fraction of fp32's bytes; every rank's DiLoCo
    outer state, and local SGD's and SlowMo's reference and model (the 40th step averages),
    have the same bits (each rank sums the same records in the same order)."""
    quantized_backend(comm.world)
    if comm.size not in (2, 4):
        pytest.skip("training bodies run at 2 and 4 ranks (suite time)")
    name, options, bounds = TOPK_RUNS[case]
    sent = {}
    for dtype, topk in [("fp32", 1.0)] + [(k, 0.1) for k in bounds]:
        method, sent[(dtype, topk)], acc = train_measured(
            comm, name, dtype=dtype, topk=topk, error_feedback=topk < 1, **options)
        assert acc > 0.8, (case, dtype, topk, acc)
        if name == "diloco":
            assert len(set(comm.allgather_object(digest(method.rule.prev.data)))) == 1
        if name in ("local-sgd", "slowmo") and topk < 1:
            r = method.rule.averaging.reference
            assert torch.equal(r, method.flat.flat)
            assert len(set(comm.allgather_object(digest(r)))) == 1
        method.close()
    total = comm.allgather_object(sent)
    fp32 = sum(t[("fp32", 1.0)] for t in total)
    for dtype, high in bounds.items():
        ratio = sum(t[(dtype, 0.1)] for t in total) / fp32
        assert ratio <= high, (case, dtype, ratio)


@pytest.mark.parametrize("name", ["local-sgd", "slowmo"])
def test_topk_average_with_batchnorm_same_bits(comm, name):
    """Local SGD and SlowMo with F = 0.1 and error feedback on a model with BatchNorm: the
    first forward pass moves every rank's statistics its own way before the reference is
    taken (rank 0's x, broadcast), so the reference and the averaged model (the 40th step
    averages) still have the same bits on every rank, and the model learns the task."""
    topk_backend()
    if comm.size not in (1, 2, 4):
        pytest.skip("training bodies run at 1, 2 and 4 ranks (suite time)")
    torch.manual_seed(0)
    bn = nn.Sequential(nn.Linear(10, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 4))
    method, _, acc = train_measured(comm, name, "fp32", True, topk=0.1, model=bn)
    r = method.rule.averaging.reference
    n = method.flat.n_params              # (the evaluation's forward moved the statistics)
    assert n < r.numel() and torch.equal(r[:n], method.flat.params)
    assert len(set(comm.allgather_object(digest(r)))) == 1
    assert acc > 0.75, (name, acc)
    method.close()


def test_refusals(comm):
    """Asynchronous LSGD refuses int8/fp8 (on every backend, Horovod too), and
    error feedback needs them: a ValueError on every rank, before any collective."""
    def build(name, **kw):
        model = nn.Linear(4, 2)
        return METHODS[name](model, torch.optim.SGD(model.parameters(), 0.1), comm, **kw)
    for name in ("lsgd-async",):
        with pytest.raises(ValueError, match=f"comm_dtype int8 is not for {name}: "):
            build(name, comm_dtype="int8")
    with pytest.raises(ValueError, match="error_feedback needs --comm-dtype bf16, int8, fp8, "):
        build("diloco", error_feedback=True)


def test_topk_refusals(comm):
    """topk outside (0, 1], topk < 1 with a method that has no periodic average to sparsify
    (allreduce SGD, asynchronous LSGD): a ValueError naming topk, one line, on every rank.
    EASGD, local SGD, SlowMo and DiLoCo take it, BatchNorm included (DiLoCo sends the
    statistics dense beside the records)."""
    topk_backend()
    def build(name, model=None, **kw):
        model = model or nn.Linear(4, 2)
        return METHODS[name](model, torch.optim.SGD(model.parameters(), 0.1), comm, **kw)
    for bad in (0, 0.0, -0.5, 1.5, float("nan")):
        with pytest.raises(ValueError, match=r"^topk must be in \(0, 1\], got "):
            build("diloco", topk=bad)
    why = {"lsgd-async": "no periodic average"}
    for name, words in why.items():
        with pytest.raises(ValueError, match=f"^topk 0.1 is not for {name}: .*{words}") as info:
            build(name, topk=0.1)
        assert "\n" not in str(info.value)
    bn = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    with pytest.raises(ValueError, match="^error_feedback needs"):
        build("easgd", error_feedback=True, topk=1.0)
    for name in ("easgd", "local-sgd", "slowmo", "diloco"):             # accepted
        build(name, model=bn, topk=0.1, error_feedback=True).close()


@pytest.mark.parametrize("name,dtype,topk", [
    ("local-sgd", "int8", 1.0), ("diloco", "int8", 1.0), ("diloco", "int4", 1.0),
    ("diloco", "int2", 1.0), ("diloco", "int2", 0.1), ("easgd", "fp32", 0.05),
    ("local-sgd", "fp32", 0.1), ("slowmo", "int2", 0.1)])
def test_error_feedback_resumes_exactly(comm, name, dtype, topk):
    """int8, int4 or int2, or top-k (fp32 or int2 values), with error feedback: 7 steps,
    state saved (through torch.save), 9 more equals a fresh model/optimizer/method loaded
    from that state and trained the same 9 steps, bit for bit; loaded without the residuals
    it differs (they matter). Local SGD and SlowMo with top-k: the state at step 7 holds
    their reference (the average of step 4, resp. 6), which is neither x nor SlowMo's x_old
    (the slow steps are at 8 and 16)."""
    def fresh():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 4))
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        return model, opt, METHODS[name](model, opt, comm, comm_dtype=dtype, topk=topk,
                                         error_feedback=True, **OPTIONS[name])

    x, y = rank_data(comm.rank, 128)

    def train(model, opt, method, steps):
        for _ in range(steps):
            s = (method.steps % 8) * 16
            loss = nn.functional.cross_entropy(model(x[s:s + 16]), y[s:s + 16])
            opt.zero_grad()
            loss.backward()
            method.step(loss)

    model, opt, method = fresh()
    train(model, opt, method, 7)
    if name in ("local-sgd", "slowmo") and topk < 1:
        ref = method.state_dict()["rule"]["reference"]
        assert not torch.equal(ref, method.flat.flat)
        if name == "slowmo":
            assert not torch.equal(ref[:method.flat.n_params], method.rule.old)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(),
                "method": method.state_dict()}, buf)
    residuals = method.state_dict()["error_feedback"]["residuals"]
    if comm.size > 1 and hierarchical(comm.groups) and not comm.groups.is_root:
        assert not residuals             # hierarchical: the residuals live on the node roots
    elif comm.size > 1:
        assert residuals and all(k.startswith("world/buffer") for k in residuals)
        assert all(v.abs().max() > 0 for v in residuals.values())
    train(model, opt, method, 9)
    finals = []
    for keep in (True, False):
        buf.seek(0)
        saved = torch.load(buf, weights_only=False)
        model2, opt2, method2 = fresh()
        model2.load_state_dict(saved["model"])
        opt2.load_state_dict(saved["opt"])
        state = copy.deepcopy(saved["method"])
        if not keep:
            del state["error_feedback"]
        method2.load_state_dict(state)
        train(model2, opt2, method2, 9)
        finals.append(torch.cat([p.detach().reshape(-1) for p in model2.parameters()]))
    mine = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    assert torch.equal(finals[0], mine)
    if comm.size > 1:
        assert not torch.equal(finals[1], mine)


@pytest.mark.parametrize("name", ["local-sgd", "slowmo"])
def test_dense_average_is_the_plain_allreduce(comm, name):
    """topk 1 with fp32 (the default): local SGD and SlowMo keep no reference (no state, no
    memory) and train to the bits of the loop they ran before top-k: every T steps the flat
    vector's copy allreduced (mean) and copied back, SlowMo's slow step (beta 0.5, alpha 1)
    on top in fairscale's order. 16 steps: local SGD averages 4 times, SlowMo 8 times with
    2 slow steps."""
    from lsgd_hpc.comm import FlatParams
    options, lr = OPTIONS[name], 0.05
    T, every = options["local_steps"], options.get("slowmo_every", 0)
    x, y = rank_data(comm.rank, 128)
    finals = []
    for plain in (False, True):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 4))
        opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
        if plain:
            flat = FlatParams(model)
            comm.world.broadcast_(flat.flat, 0)                  # the common x_0
            old, u = flat.params.detach().clone(), torch.zeros(flat.n_params)
        else:
            method = METHODS[name](model, opt, comm, **options)
            rule = method.rule
            assert rule.averaging.reference is None and rule.shared_state == \
                type(rule).shared_state and "reference" not in rule.state_dict()
        for step in range(1, 17):
            s = (step % 8) * 16
            loss = nn.functional.cross_entropy(model(x[s:s + 16]), y[s:s + 16])
            opt.zero_grad()
            loss.backward()
            if not plain:
                method.step(loss)
                continue
            opt.step()
            if step % T == 0:
                v = flat.flat.detach().clone()
                comm.world.allreduce_(v, "mean")
                flat.flat.copy_(v)
            if every and step % every == 0:
                u.mul_(0.5).sub_(flat.params, alpha=1 / lr).add_(old, alpha=1 / lr)
                old.sub_(u, alpha=lr)
                flat.params.copy_(old)
        finals.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
        if not plain:
            method.close()
    assert torch.equal(finals[0], finals[1])


# -- non-blocking: the staged allreduce, bit for bit the blocking one ------------------------
NONBLOCKING = [("int8", 1.0), ("int4", 1.0), ("fp32", 0.1), ("int8", 0.1)]


@pytest.mark.parametrize("kind,topk", NONBLOCKING)
def test_nonblocking_allreduce_equals_blocking(world, groups, kind, topk):
    """iallreduce_ on a duplicate of quantized_groups' world (as Streaming DiLoCo posts it),
    error feedback, three rounds (mean), compute and a blocking collective of the world
    between the start and the wait: the same bits as the blocking allreduce of a twin, the
    same residuals, the same bytes and one call counted at the start and nothing more by
    test() or wait(), the same float32 bytes inside the node (hierarchical layouts)."""
    quantized_backend(world)
    if topk < 1:
        topk_backend()
    n = 2 * BLOCK + 333
    blocking = quantized_groups(groups, kind, error_feedback=True, topk=topk).world
    staged = quantized_groups(groups, kind, error_feedback=True, topk=topk).world.dup()
    a, b = torch.zeros(n), torch.zeros(n)
    blocking.agree_buffers(a)
    staged.agree_buffers(b)
    other = torch.ones(4)
    for rnd in range(3):
        v = vector(world.rank + 10 * rnd, n)
        a.copy_(v)
        b.copy_(v)
        before, node_before = world.stats.snapshot(), blocking.node_stats.snapshot()
        blocking.allreduce_(a, "mean")
        want = [world.stats.bytes_sent - before.bytes_sent,
                world.stats.bytes_recv - before.bytes_recv, world.stats.calls - before.calls,
                blocking.node_stats.bytes_sent - node_before.bytes_sent]
        before, node_before = world.stats.snapshot(), staged.node_stats.snapshot()
        request = staged.iallreduce_(b, "mean")
        got = [world.stats.bytes_sent - before.bytes_sent,
               world.stats.bytes_recv - before.bytes_recv, world.stats.calls - before.calls]
        for _ in range(3):                      # compute between the start and the wait
            torch.randn(64, 64) @ torch.randn(64, 64)
            request.test()
        world.allreduce_(other, "sum")          # the trainer's blocking collective
        mid = world.stats.snapshot()
        assert request.wait() is b and request.done and request.result is b
        assert (world.stats.bytes_sent, world.stats.bytes_recv, world.stats.calls) == \
            (mid.bytes_sent, mid.bytes_recv, mid.calls)
        got.append(staged.node_stats.bytes_sent - node_before.bytes_sent)
        assert torch.equal(a, b), (kind, topk, rnd, (a - b).abs().max())
        assert got == want, (kind, topk, rnd, got, want)
        ra = [blocking.shared.residuals[k] for k in sorted(blocking.shared.residuals)]
        rb = [staged.shared.residuals[k] for k in sorted(staged.shared.residuals)]
        assert len(ra) == len(rb) and all(torch.equal(x, y) for x, y in zip(ra, rb))
    assert len(set(world.allgather_object(digest(b)))) == 1


def test_streaming_diloco_int8_same_bits_as_blocking(comm, monkeypatch):
    """Streaming DiLoCo with int8 and error feedback (two fragments, delay 1, 12 steps)
    trains to the same bits with the staged non-blocking allreduce as with the blocking one
    that iallreduce_ ran before (a completed request); every compressed fragment's request
    is the staged one; the outer state has the same bits on every rank."""
    quantized_backend(comm.world)
    from lsgd_hpc.comm import quantized as qmod
    finals, staged = [], []
    real = qmod.Quantized.iallreduce_

    def watched(self, tensor, op="sum", *, agreed=False):
        request = real(self, tensor, op, agreed=agreed)
        if self.quantizes(tensor):
            staged.append(isinstance(request, qmod._Staged))
        return request

    def old(self, tensor, op="sum", *, agreed=False):
        if not self.quantizes(tensor):
            return self.inner.iallreduce_(tensor, op, agreed=agreed)
        self.allreduce_(tensor, op)
        return qmod.Pending(self.inner, tensor, op, lambda: None, lambda: True,
                            finish=lambda: tensor)
    x, y = rank_data(comm.rank, 64)
    for how in (old, watched):
        monkeypatch.setattr(qmod.Quantized, "iallreduce_", how)
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 4))
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        method = METHODS["diloco"](model, opt, comm, max_steps=12, comm_dtype="int8",
                                   error_feedback=True, local_steps=4, outer_lr=0.7,
                                   fragments=2, fragment_sync_delay=1)
        while not method.done:
            i = (method.steps % 4) * 16
            loss = nn.functional.cross_entropy(model(x[i:i + 16]), y[i:i + 16])
            opt.zero_grad()
            loss.backward()
            method.step(loss)
        method.drain()
        finals.append(torch.cat([method.rule.prev.data.reshape(-1),
                                 *[p.detach().reshape(-1) for p in model.parameters()]]))
        prev = method.rule.prev.data.clone()
        method.close()
    assert torch.equal(finals[0], finals[1])
    # Horovod has no non-blocking alltoall/allgather: over its own communicators (the node
    # hierarchy) the blocking one, a completed request (over a dup, the mpi4py side: staged)
    assert staged and (all(staged) or BACKEND == "horovod")
    assert len(set(comm.allgather_object(digest(prev)))) == 1
