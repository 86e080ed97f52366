"""Communication-interface tests that hold at any world size.

Run directly by pytest (size 1), and under `mpirun -np 2/4/5 python -m pytest` by
tests/test_comm_mpi.py. The backend comes from LSGD_TEST_BACKEND (mpi by default).
Every expectation is exact: rank-valued tensors, elections worked out from the full score list.
"""

import math
import os

import pytest
import torch
from torch import nn

from lsgd_hpc.comm import CommError, FlatParams, NodeGroups, make_world

BACKEND = os.environ.get("LSGD_TEST_BACKEND", "mpi")


@pytest.fixture(scope="module")
def world():
    w = make_world(BACKEND)
    yield w
    w.barrier()


def expected_leader(scores):
    """Reference election: lowest finite score, ties to the lowest rank; all non-finite -> 0."""
    finite = [(s, r) for r, s in enumerate(scores) if math.isfinite(s)]
    return min(finite)[1] if finite else 0


def test_world_ranks(world):
    assert world.allgather_object(world.rank) == list(range(world.size))
    assert list(world.world_ranks) == list(range(world.size))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int64])
def test_allreduce_sum_exact(world, dtype):
    t = torch.full((7,), world.rank + 1, dtype=dtype)
    before = world.stats.snapshot()
    out = world.allreduce_(t, "sum")
    assert out is t
    assert torch.equal(t, torch.full((7,), world.size * (world.size + 1) // 2, dtype=dtype))
    if world.size > 1:
        nbytes = 7 * t.element_size()
        assert world.stats.bytes_sent - before.bytes_sent == nbytes
        assert world.stats.bytes_recv - before.bytes_recv == nbytes
        assert world.stats.seconds > before.seconds


def test_allreduce_mean_exact(world):
    t = torch.arange(5, dtype=torch.float64) + world.rank
    world.allreduce_(t, "mean")
    assert torch.equal(t, torch.arange(5, dtype=torch.float64) + (world.size - 1) / 2)


def test_broadcast_from_every_root(world):
    for root in range(world.size):
        t = torch.full((3, 4), float(world.rank))
        before = world.stats.snapshot()
        world.broadcast_(t, root)
        assert torch.equal(t, torch.full((3, 4), float(root)))
        if world.size > 1:
            sent = world.stats.bytes_sent - before.bytes_sent
            recv = world.stats.bytes_recv - before.bytes_recv
            assert (sent, recv) == ((48, 0) if world.rank == root else (0, 48))


SCENARIOS = {
    "all_tied": lambda r, n: 1.0,
    "descending": lambda r, n: float(n - r),
    "tie_at_min": lambda r, n: 0.5 if r >= n // 2 else 2.0,
    "nan_on_rank0": lambda r, n: math.nan if r == 0 else 3.0 + r,
    "inf_and_minus_inf": lambda r, n: (-math.inf if r == n - 1 else math.inf if r == 0
                                       else 10.0 - r),
    "all_nan": lambda r, n: math.nan,
    "nan_and_inf_only": lambda r, n: math.nan if r % 2 else math.inf,
}


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_elect(world, scenario):
    scores = [SCENARIOS[scenario](r, world.size) for r in range(world.size)]
    el = world.elect(scores[world.rank])
    want = expected_leader(scores)
    assert el.rank == want and el.world_rank == want
    s = scores[want]
    assert el.score == (s if math.isfinite(s) else math.inf)
    # every member got the same answer
    assert world.allgather_object((el.rank, el.score)) == [(el.rank, el.score)] * world.size


def test_split_uneven_and_shared_stats(world):
    color = 0 if world.rank < (world.size + 1) // 2 else 1
    sub = world.split(color)
    members = [r for r in range(world.size) if (0 if r < (world.size + 1) // 2 else 1) == color]
    assert list(sub.world_ranks) == members
    assert sub.size == len(members) and sub.rank == members.index(world.rank)
    assert sub.stats is world.stats
    t = torch.tensor([float(world.rank)])
    sub.allreduce_(t, "sum")
    assert t.item() == sum(members)
    el = sub.elect(-float(world.rank))  # highest world rank of the group wins
    assert el.world_rank == members[-1] and el.rank == len(members) - 1
    none = world.split(-1)
    assert none is None


@pytest.mark.parametrize("k", [None, 1, 2, 3])
def test_node_groups(world, k):
    groups = NodeGroups.build(world, ranks_per_node=k)
    n = world.size
    if k is None:  # one host name here -> one node
        want_node_of = [0] * n
    else:
        want_node_of = [r // k for r in range(n)]
    assert groups.node_of == want_node_of
    me = world.rank
    assert groups.node_index == want_node_of[me]
    assert groups.n_nodes == max(want_node_of) + 1
    mates = [r for r in range(n) if want_node_of[r] == want_node_of[me]]
    assert list(groups.node.world_ranks) == mates
    assert groups.local_rank == mates.index(me)
    assert (groups.roots is not None) == (me == mates[0])
    if groups.roots is not None:
        roots = [want_node_of.index(j) for j in range(groups.n_nodes)]
        assert list(groups.roots.world_ranks) == roots


@pytest.mark.parametrize("k", [1, 2, 3])
def test_hierarchical_broadcast_crosses_once_per_node(world, k):
    groups = NodeGroups.build(world, ranks_per_node=k)
    for leader in range(world.size):
        t = torch.full((10,), float(world.rank))
        before = world.stats.snapshot()
        groups.broadcast_from_(t, leader)
        assert torch.equal(t, torch.full((10,), float(leader)))
        recv = world.stats.bytes_recv - before.bytes_recv
        # every rank but the leader receives the model exactly once
        assert recv == (0 if world.rank == leader else 40)
        # node boundaries: only node roots talk on the roots communicator, one copy each
        sent = world.stats.bytes_sent - before.bytes_sent
        assert sent <= 2 * 40


def test_neighbor_allgather_ring(world):
    n, r = world.size, world.rank
    nbrs = sorted({(r - 1) % n, (r + 1) % n} - {r})
    t = torch.full((6,), float(r))
    before = world.stats.snapshot()
    out = world.neighbor_allgather(t, nbrs, nbrs)
    assert out.shape == (len(nbrs), 6)
    for row, j in zip(out, nbrs):
        assert torch.equal(row, torch.full((6,), float(j)))
    assert world.stats.bytes_sent - before.bytes_sent == 24 * len(nbrs)
    assert world.stats.bytes_recv - before.bytes_recv == 24 * len(nbrs)


def test_neighbor_allgather_directed_and_cached(world):
    n, r = world.size, world.rank
    src = [(r - 1) % n] if n > 1 else []
    dst = [(r + 1) % n] if n > 1 else []
    for rep in range(3):
        t = torch.tensor([r * 10.0 + rep, -1.0])
        out = world.neighbor_allgather(t, src, dst)
        assert [row.tolist() for row in out] == [[j * 10.0 + rep, -1.0] for j in src]


# -- bad arguments: a clear error, no corruption, no hang ----------------------------------
def test_rejects_non_contiguous(world):
    t = torch.zeros(4, 4).t()
    with pytest.raises(CommError, match="contiguous"):
        world.allreduce_(t)
    with pytest.raises(CommError, match="contiguous"):
        world.broadcast_(t, 0)


def test_rejects_bad_dtype_op_root(world):
    with pytest.raises(CommError, match="dtype"):
        world.allreduce_(torch.zeros(3, dtype=torch.complex64))
    with pytest.raises(CommError, match="op"):
        world.allreduce_(torch.zeros(3), "max")
    with pytest.raises(CommError, match="root"):
        world.broadcast_(torch.zeros(3), world.size)
    with pytest.raises(CommError, match="torch.Tensor"):
        world.allreduce_([1.0, 2.0])
    with pytest.raises(CommError, match="outside"):
        world.neighbor_allgather(torch.zeros(2), [world.size], [world.size])
    with pytest.raises(CommError, match="shape"):
        world.neighbor_allgather(torch.zeros(2), [], [], out=torch.zeros(1, 2))


def test_mismatched_sizes_raise_on_every_rank(world):
    if world.size == 1:
        pytest.skip("needs two ranks to disagree")
    t = torch.zeros(4 + world.rank)
    with pytest.raises(CommError, match="disagree"):
        world.allreduce_(t)
    with pytest.raises(CommError, match="disagree"):
        world.broadcast_(torch.zeros(3), world.rank % 2)
    # the communicator is still usable afterwards
    ok = torch.ones(2)
    world.allreduce_(ok)
    assert ok.tolist() == [world.size] * 2


class _CountingComm:
    """Forwards to an mpi4py communicator and counts its blocking Allreduce calls."""

    def __init__(self, real):
        self.real, self.allreduces = real, 0

    def __getattr__(self, name):
        if name == "Allreduce":
            self.allreduces += 1
        return getattr(self.real, name)


def test_agreed_buffers_skip_the_per_call_check(world):
    if world.size == 1:
        pytest.skip("a one-rank communicator neither checks nor communicates")
    if BACKEND == "torch":
        pytest.skip("counts the mpi4py communicator's Allreduce calls (MPI/Horovod backends)")
    mpi = getattr(world, "_mpi", world)          # Horovod checks on its mpi4py side
    agreed, other = torch.ones(6), torch.ones(6)
    world.agree_buffers(agreed)
    spy = _CountingComm(mpi.comm)
    mpi.comm = spy
    try:
        world.allreduce_(agreed)
        with_agreement = spy.allreduces
        world.allreduce_(other)
        without = spy.allreduces - with_agreement
        spy.allreduces = 0
        world.broadcast_(agreed, world.size - 1)
        bcast_checks = spy.allreduces
        world.broadcast_(agreed[:3], 0)            # a view of another length: not agreed
        view_checks = spy.allreduces - bcast_checks
    finally:
        mpi.comm = spy.real
    assert without == with_agreement + 1           # exactly the one agreement allreduce
    assert bcast_checks == 0 and view_checks == 1
    assert agreed.tolist() == [world.size] * 6     # the collectives still did their work
    assert other.tolist() == [world.size] * 6


def test_agree_buffers_mismatch_raises_on_every_rank(world):
    if world.size == 1:
        pytest.skip("needs two ranks to disagree")
    with pytest.raises(CommError, match="disagree"):
        world.agree_buffers(torch.zeros(4 + world.rank))
    ok = torch.ones(2)
    world.allreduce_(ok)
    assert ok.tolist() == [world.size] * 2


def test_inconsistent_graph_raises(world):
    if world.size == 1:
        pytest.skip("needs two ranks to disagree")
    r = world.rank
    src = [(r + 1) % world.size]                      # but nobody sends to its left
    dst = [(r + 1) % world.size] if world.size > 2 else []
    with pytest.raises(CommError, match="edges"):
        world.neighbor_allgather(torch.zeros(2), src, dst)


# -- fused parameter buffer ----------------------------------------------------------------
class _Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(3, 2)
        self.bn = nn.BatchNorm1d(2)
        self.b = nn.Linear(2, 1, bias=False)


def test_flat_params_one_collective(world):
    torch.manual_seed(0)
    model = _Tiny()
    flat = FlatParams(model)
    n_params = sum(p.numel() for p in model.parameters())
    assert flat.n_params == n_params == 3 * 2 + 2 + 2 + 2 + 2
    assert flat.numel == n_params + 2 + 2  # running mean and var; num_batches_tracked is int
    for p in model.parameters():
        p.data.fill_(float(world.rank))
    model.bn.running_mean.fill_(float(world.rank))
    before = world.stats.snapshot()
    world.allreduce_(flat.flat, "mean")
    assert world.stats.calls - before.calls == (1 if world.size > 1 else 0)
    if world.size > 1:
        assert world.stats.bytes_sent - before.bytes_sent == flat.nbytes
    avg = (world.size - 1) / 2
    for p in model.parameters():
        assert torch.equal(p.data, torch.full_like(p.data, avg))
    assert torch.equal(model.bn.running_mean, torch.full((2,), avg))
    # autograd writes into the flat gradient buffer
    for p in model.parameters():
        p.data.uniform_(0.5, 1.0)
    x = torch.randn(4, 3)
    model.train()
    model.b(model.bn(model.a(x))).sum().backward()
    flat.check()
    assert flat.grad.abs().sum() > 0
    assert torch.equal(flat.grad[:6].view(2, 3), model.a.weight.grad)
    flat.zero_grad()
    assert all(torch.count_nonzero(p.grad) == 0 for p in model.parameters())


def test_graph_cache_hit_on_some_ranks_only(world):
    """Two graphs that give rank 0 the same neighbours: rank 0 hits its cache, the others
    must create a graph communicator, a collective call. This must not hang."""
    n, r = world.size, world.rank
    if n < 3:
        pytest.skip("needs a star and a complete graph that differ (3+ ranks)")
    complete = [j for j in range(n) if j != r]
    star = complete if r == 0 else [0]
    for nbrs in (complete, star, complete):
        out = world.neighbor_allgather(torch.tensor([float(r)]), nbrs, nbrs)
        assert out.flatten().tolist() == [float(j) for j in nbrs]
    # with a key naming the whole graph; reusing a key with other edges is refused
    out = world.neighbor_allgather(torch.tensor([float(r)]), star, star, graph_key=("star", 0))
    assert out.flatten().tolist() == [float(j) for j in star]
    if r == 1:
        with pytest.raises(CommError, match="graph_key"):
            world.neighbor_allgather(torch.zeros(1), complete, complete, graph_key=("star", 0))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_allreduce(world, dtype):
    """Summed on the torch backend (gloo/NCCL add them); bfloat16 also on the MPI backend
    (its own MPI sum) and on Horovod (a reduce-scatter and allgather of its words, summed in
    rank order); refused where there is no sum for the type (float16 on MPI and Horovod)."""
    t = torch.full((5,), float(world.rank + 1), dtype=dtype)
    sums = BACKEND == "torch" or dtype == torch.bfloat16
    if not sums:
        if world.size > 1:
            with pytest.raises(CommError, match="not supported"):
                world.allreduce_(t)
        return
    world.allreduce_(t, "mean")
    assert t.dtype == dtype
    assert torch.equal(t, torch.full((5,), (world.size + 1) / 2, dtype=dtype))
