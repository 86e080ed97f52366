"""Update rules of every method against their formulas, with rank-valued parameters.

Runs at any world size: directly under pytest (size 1) and under mpirun -np 2/4 through
tests/test_parallel_mpi.py (with LSGD_TEST_RPN grouping ranks into nodes).
"""

import math

import pytest
import torch
from torch import nn

from lsgd_hpc.methods.rules import (AllreduceRule, DiLoCoRule, EASGDRule, GossipRule, LeaderRule,
                                    LocalSGDRule, SlowMoRule)
from lsgd_hpc.comm import FlatParams
from lsgd_hpc.topology import build_topology

class Rows:
    """A metrics sink that keeps rows in lists (the trainer's is the HDF5 writer)."""

    def __init__(self):
        self.rows = {}

    def __call__(self, group, **row):
        self.rows.setdefault(group, []).append(row)


def tiny(value: float, dtype=torch.float64) -> FlatParams:
    model = nn.Linear(3, 2).to(dtype)
    flat = FlatParams(model)
    flat.flat.fill_(value)
    return flat


def x_of(rank: int, n: int = 8) -> torch.Tensor:
    """Rank-valued parameters, different per coordinate."""
    return torch.arange(n, dtype=torch.float64) * 0.25 + rank


def test_lsgd_global_pull_matches_formula(groups):
    world = groups.world
    flat = tiny(0.0)
    flat.flat.copy_(x_of(world.rank))
    rows = Rows()
    c = 0.3
    algo = LeaderRule(groups, flat, tau_local=5, tau_global=5, pull_local=0.0, pull_global=c,
                     window=3, log=rows)
    # scores: rank with the lowest mean loss leads; make the last rank the best
    losses = [10.0 - world.rank] * 2
    algo.after_step(1, losses[0])
    algo.after_step(2, losses[1])
    before = world.stats.snapshot()
    algo.after_step(5, 10.0 - world.rank)   # global election at step 5 (5 % 5 == 0)
    leader = world.size - 1
    want = x_of(world.rank) - c * (x_of(world.rank) - x_of(leader))
    assert torch.allclose(flat.flat, want, rtol=0, atol=1e-12)
    if world.rank == leader:
        assert torch.equal(flat.flat, x_of(leader))   # the leader's own pull is zero
    g = [r for r in rows.rows["leader"] if r["scope"] == 0]
    assert len(g) == 1 and g[0]["leader_rank"] == leader and g[0]["step"] == 5
    assert g[0]["score"] == pytest.approx(10.0 - world.rank)
    if world.size > 1:
        # no communication on the steps between periods; on the period: one model + election
        assert world.stats.bytes_recv - before.bytes_recv >= (0 if world.rank == leader
                                                              else flat.nbytes)


def test_lsgd_local_then_global(groups):
    world = groups.world
    flat = tiny(0.0)
    flat.flat.copy_(x_of(world.rank))
    rows = Rows()
    cl, cg = 0.5, 0.25
    algo = LeaderRule(groups, flat, tau_local=2, tau_global=4, pull_local=cl, pull_global=cg,
                     window=1, log=rows)
    score = float((world.rank * 7) % 5)           # a scrambled order of scores
    scores = [float((r * 7) % 5) for r in range(world.size)]
    for step in (1, 2):
        algo.after_step(step, score)
    x = x_of(world.rank)
    multi = 1 < groups.n_nodes < world.size
    if multi:
        mates = list(groups.node.world_ranks)
        local = min(mates, key=lambda r: (scores[r], r))
        locs = [r for r in rows.rows["leader"] if r["scope"] == 1]
        assert [r["leader_rank"] for r in locs] == [local]
        x = x - cl * (x - x_of(local))
    else:
        assert "leader" not in rows.rows      # one level only: nothing at step 2
    assert torch.allclose(flat.flat, x, atol=1e-12)
    # step 4: local pull (multi) then global pull toward the best worker overall
    expected = {}
    for r in range(world.size):
        xr = x_of(r)
        if multi:
            mates_r = [m for m in range(world.size) if groups.node_of[m] == groups.node_of[r]]
            loc = min(mates_r, key=lambda m: (scores[m], m))
            # steps 2 and 4: pulled toward the local leader, whose own pull is zero so it
            # still holds x_of(loc); the global leader is a local leader too
            for _ in range(2):
                xr = xr - cl * (xr - x_of(loc))
        expected[r] = xr
    for step in (3, 4):
        algo.after_step(step, score)
    lead = min(range(world.size), key=lambda r: (scores[r], r))
    want = expected[world.rank] - cg * (expected[world.rank] - expected[lead])
    assert torch.allclose(flat.flat, want, atol=1e-12)
    glob = [r for r in rows.rows["leader"] if r["scope"] == 0]
    assert [r["leader_rank"] for r in glob] == [lead]
    assert "consensus" not in rows.rows     # measured by the trainer, the same for every method


def test_lsgd_nan_worker_never_leads(groups):
    world = groups.world
    flat = tiny(float(world.rank))
    rows = Rows()
    algo = LeaderRule(groups, flat, 1, 1, 0.1, 0.1, window=4, log=rows)
    loss = math.nan if world.rank == 0 else 1.0 + world.rank
    algo.after_step(1, loss)
    lead = [r["leader_rank"] for r in rows.rows["leader"] if r["scope"] == 0][0]
    assert lead == (1 if world.size > 1 else 0)
    assert algo.state_dict()["losses"] == [loss] or math.isnan(algo.state_dict()["losses"][0])


def test_easgd_centre_identical_and_formula(world, groups):
    alpha = 0.9 / world.size
    flat = tiny(0.0)
    flat.flat.copy_(x_of(0))                 # the common x_0
    rows = Rows()
    algo = EASGDRule(groups, flat, alpha=alpha, tau=2, log=rows)
    flat.flat.copy_(x_of(world.rank))        # workers moved apart
    algo.after_step(1, 0.0)                  # not a round
    assert torch.equal(algo.center, x_of(0))
    algo.after_step(2, 0.0)
    xs = [x_of(r) for r in range(world.size)]
    c0 = x_of(0)
    want_c = c0 + sum(alpha * (x - c0) for x in xs)
    assert torch.allclose(algo.center, want_c, atol=1e-12)
    assert torch.allclose(flat.flat, x_of(world.rank) - alpha * (x_of(world.rank) - c0), atol=1e-12)
    centres = world.allgather_object(algo.center.tolist())
    assert all(c == centres[0] for c in centres)       # bit-identical on every rank


def test_local_sgd_exact_average_on_period_only(world, groups):
    flat = tiny(0.0)
    flat.flat.copy_(x_of(world.rank))
    rows = Rows()
    algo = LocalSGDRule(groups, flat, local_steps=3, log=rows)
    before = world.stats.snapshot()
    algo.after_step(1, 1.0)
    algo.after_step(2, 1.0)
    assert torch.equal(flat.flat, x_of(world.rank))
    assert world.stats.bytes_sent == before.bytes_sent
    algo.after_step(3, 1.0)
    want = torch.arange(8, dtype=torch.float64) * 0.25 + (world.size - 1) / 2
    assert torch.equal(flat.flat, want)
    if world.size > 1:
        assert world.stats.bytes_sent - before.bytes_sent == flat.nbytes


@pytest.mark.parametrize("measured", [False, True])
def test_auto_local_steps_ranks_with_different_evidence_end_on_the_same_T(world, groups,
                                                                           measured):
    """Every rank sees its own local law (beta = 0.4 + 0.1 rank) and, when measured, its own
    timings; one allreduce of the evidence and one decision must give every rank the same T.
    With a given cost ratio c the decision is the power law of the pooled fit: the pooled
    slope of equal-step segments is the mean of the ranks' betas, T = ceil(c^(1/mean beta))."""
    from lsgd_hpc.methods.rules.auto_period import LAW_POWER, choose_local_steps
    n, c = world.size, 3.0
    beta = 0.4 + 0.1 * world.rank
    rows = Rows()
    algo = LocalSGDRule(groups, tiny(0.0), "auto", t_max=64, t_initial=4, reestimate_steps=40,
                    cost_ratio=None if measured else c, log=rows)
    Ts, laws, rounds = [], [], []
    for step in range(1, 121):
        algo.after_step(step, 2.0 * step ** -beta * 0.9 ** len(rounds))   # drop at averagings
        if algo.since_avg == 0:           # this step averaged
            rounds.append(step)
        Ts.append(algo.T)
        laws.append(algo.law)
    everyone = world.allgather_object((Ts, laws))
    assert all(e == everyone[0] for e in everyone)
    # averaging rounds follow the T in force: the T set at a round is the gap to the next
    assert all(b - a == Ts[a - 1] for a, b in zip(rounds, rounds[1:]))
    if not measured:
        mean_beta = 0.4 + 0.05 * (n - 1)
        assert algo.law == LAW_POWER
        assert algo.last_decision.rate == pytest.approx(mean_beta, rel=1e-9)
        assert algo.T == choose_local_steps(LAW_POWER, algo.last_decision.rate, c, 64)
        assert algo.T == math.ceil(c ** (1 / mean_beta)) and algo.T != 4   # T did change


def test_allreduce_sgd_mean_gradient(world, groups):
    flat = tiny(1.0)
    flat.grad.copy_(x_of(world.rank))
    before = world.stats.snapshot()
    AllreduceRule(groups, flat).before_step(1)
    assert torch.equal(flat.grad, torch.arange(8, dtype=torch.float64) * 0.25
                       + (world.size - 1) / 2)
    if world.size > 1:
        assert world.stats.bytes_sent - before.bytes_sent == flat.grad.numel() * 8


@pytest.mark.parametrize("name", ["ring", "torus", "exponential", "exponential-undirected",
                                  "complete", "star"])
def test_gossip_preserves_mean_neighbour_only(world, groups, name):
    topo = build_topology(name, world.size, node_of=groups.node_of)
    flat = tiny(0.0)
    flat.flat.copy_(x_of(world.rank) * (1 + world.rank))
    algo = GossipRule(groups, flat, topo)
    mean0 = sum(x_of(r) * (1 + r) for r in range(world.size)) / world.size
    before = world.stats.snapshot()
    for step in range(1, 4):
        algo.after_step(step, 0.0)
    sent = world.stats.bytes_sent - before.bytes_sent
    total = flat.flat.clone()
    world.allreduce_(total, "mean")
    assert torch.allclose(total, mean0, rtol=0, atol=1e-12)
    deg = len(topo.out_neighbors(world.rank, 0))
    assert sent == 3 * deg * flat.nbytes        # to neighbours only, never all ranks
    # one gossip step equals one row of W applied to the gathered parameters
    W = torch.tensor(topo.mixing_matrix(0))
    X = torch.stack([x_of(r) * (1 + r) for r in range(world.size)])
    flat.flat.copy_(X[world.rank])
    algo.after_step(4, 0.0)
    assert torch.allclose(flat.flat, W[world.rank] @ X, atol=1e-12)


#: One gossip step on the directed static exponential graph when every rank holds its rank:
#: rank i averages itself with i - 2^k mod n, k < ceil(log2 n), weight 1/(ceil(log2 n) + 1).
EXPONENTIAL_ONE_STEP = {
    1: [0.0],
    2: [(0 + 1) / 2, (1 + 0) / 2],
    4: [(0 + 3 + 2) / 3, (1 + 0 + 3) / 3, (2 + 1 + 0) / 3, (3 + 2 + 1) / 3],
    5: [(0 + 4 + 3 + 1) / 4, (1 + 0 + 4 + 2) / 4, (2 + 1 + 0 + 3) / 4, (3 + 2 + 1 + 4) / 4,
        (4 + 3 + 2 + 0) / 4],
}


def test_gossip_on_the_directed_exponential_graph_mixes_from_in_neighbours(world, groups):
    n = world.size
    if n not in EXPONENTIAL_ONE_STEP:
        pytest.skip(f"no hand-computed step for n={n} (have {sorted(EXPONENTIAL_ONE_STEP)})")
    topo = build_topology("exponential", n)
    flat = tiny(float(world.rank))
    algo = GossipRule(groups, flat, topo)
    before = world.stats.snapshot()
    algo.combine(1)
    want = EXPONENTIAL_ONE_STEP[n][world.rank]
    assert torch.allclose(flat.flat, torch.full_like(flat.flat, want), rtol=0, atol=1e-12)
    # directed: this rank sent to its out-neighbours only and heard from its in-neighbours
    deg = len(topo.in_neighbors(world.rank))
    assert len(topo.out_neighbors(world.rank)) == deg
    assert world.stats.bytes_sent - before.bytes_sent == deg * flat.nbytes
    assert world.stats.bytes_recv - before.bytes_recv == deg * flat.nbytes


def test_one_peer_exponential_exact_average_over_period(world, groups):
    n = world.size
    if n & (n - 1):
        pytest.skip(f"one-peer exponential averages exactly only for a power of two (n={n})")
    topo = build_topology("one-peer-exponential", n)
    flat = tiny(0.0)
    flat.flat.copy_(x_of(world.rank))
    algo = GossipRule(groups, flat, topo)
    for step in range(topo.period):
        algo.combine(step)
    want = torch.arange(8, dtype=torch.float64) * 0.25 + (n - 1) / 2
    assert torch.equal(flat.flat, want)      # dyadic weights: exact


# ------------------------------------------------------------------- DiLoCo and SlowMo

def inner_step(flat: FlatParams, step: int, rank: int) -> None:
    """A stand-in for a worker's optimizer step: different on every rank and step, nonlinear,
    so that an error in the averaging would show in the following steps."""
    x = flat.params
    x.sub_(0.05 * (rank + 1) * torch.sin(x + 0.3 * step))


def bn_flat(dtype=torch.float64) -> FlatParams:
    """Parameters followed by floating-point buffers (BatchNorm running statistics)."""
    model = nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2)).to(dtype)
    return FlatParams(model)


def set_rank_values(flat: FlatParams, rank: int) -> None:
    flat.flat.copy_(torch.arange(flat.numel, dtype=flat.flat.dtype) * 0.25 + rank)


def opt_holder(lr: float) -> torch.optim.Optimizer:
    """An optimizer whose param group carries the learning rate (SlowMo reads it there)."""
    return torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=lr)


#: x_prev - mean(x_prev - x_i) against mean(x_i): a few roundings of numbers of size < 10
#: in float64 (eps 2.2e-16), accumulated over the 12 steps the tests run
TOL64 = 1e-13


@pytest.mark.parametrize("H", [1, 3])
def test_diloco_outer_lr_1_momentum_0_is_local_sgd_step_for_step(world, groups, H):
    a, b = bn_flat(), bn_flat()
    for f in (a, b):
        set_rank_values(f, 0)                    # the common x_0 ...
    diloco = DiLoCoRule(groups, a, local_steps=H, outer_lr=1.0, outer_momentum=0.0,
                    outer_nesterov=False)
    local = LocalSGDRule(groups, b, local_steps=H)
    for step in range(1, 13):
        diloco.before_step(step)
        local.before_step(step)
        for f in (a, b):
            if step == 1:
                f.flat[f.n_params:].add_(world.rank)      # ... but statistics of their own
            inner_step(f, step, world.rank)
        diloco.after_step(step, 0.0)
        local.after_step(step, 0.0)
        assert torch.allclose(a.flat, b.flat, rtol=0, atol=TOL64), step
    assert diloco.outer_steps == 12 // H


def test_diloco_two_outer_steps_with_nesterov_against_the_formula(world, groups):
    p, lr, mu = world.size, 0.7, 0.9
    flat = bn_flat()
    set_rank_values(flat, 0)
    n = flat.n_params
    x0 = flat.params.clone()
    algo = DiLoCoRule(groups, flat, local_steps=2, outer_lr=lr, outer_momentum=mu,
                  outer_nesterov=True)
    algo.before_step(1)                                   # x_prev <- x_0
    g1 = [torch.linspace(-1, 1, n, dtype=torch.float64) * (r + 1) for r in range(p)]
    g2 = [torch.cos(torch.arange(n, dtype=torch.float64) + r) for r in range(p)]
    stats = [torch.arange(flat.numel - n, dtype=torch.float64) + 10 * r for r in range(p)]
    flat.params.copy_(x0 - g1[world.rank])
    flat.flat[n:].copy_(stats[world.rank])
    algo.after_step(1, 0.0)
    assert torch.equal(flat.params, x0 - g1[world.rank])   # no outer step at step 1
    algo.after_step(2, 0.0)
    d1 = sum(g1) / p
    b1 = d1                                               # torch: first buffer = gradient
    x1 = x0 - lr * (d1 + mu * b1)                         # Nesterov
    assert torch.allclose(flat.params, x1, rtol=0, atol=TOL64)
    assert torch.allclose(flat.flat[n:], sum(stats) / p, rtol=0, atol=TOL64)   # averaged
    assert torch.allclose(algo.prev.data, x1, rtol=0, atol=TOL64)
    # a resumed copy continues exactly like the original
    twin_flat = bn_flat()
    twin_flat.flat.copy_(flat.flat)
    twin = DiLoCoRule(groups, twin_flat, local_steps=2, outer_lr=lr, outer_momentum=mu)
    twin.load_state_dict(algo.state_dict())
    twin.before_step(3)                                   # must not re-anchor
    for f, al in ((flat, algo), (twin_flat, twin)):
        f.params.copy_(x1 - g2[world.rank])
        al.after_step(3, 0.0)
        al.after_step(4, 0.0)
    d2 = sum(g2) / p
    b2 = mu * b1 + d2
    x2 = x1 - lr * (d2 + mu * b2)
    assert torch.allclose(flat.params, x2, rtol=0, atol=TOL64)
    assert torch.equal(twin_flat.flat, flat.flat)
    everyone = world.allgather_object(flat.flat.tolist())
    assert all(e == everyone[0] for e in everyone)        # identical replicas after a step


def test_diloco_and_slowmo_refuse_bad_arguments(comm):
    """The public classes refuse bad options with the spec's words, on every rank, before
    any collective (the rules themselves trust their options)."""
    import lsgd_hpc
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for kwargs, word in ((dict(outer_lr=-1.0), "outer_lr must be > 0, got -1"),
                         (dict(outer_momentum=1.0), "outer_momentum"),
                         (dict(local_steps=0), "local_steps")):
        with pytest.raises(ValueError, match=word):
            lsgd_hpc.DiLoCo(model, opt, comm, **kwargs)
    for kwargs, word in ((dict(local_steps=2, slowmo_every=3), "slowmo_every must be a multiple"),
                         (dict(slowmo_beta=1.0), "slowmo_beta"),
                         (dict(slowmo_alpha=0.0), "slowmo_alpha"),
                         (dict(slowmo_every=0), "slowmo_every")):
        with pytest.raises(ValueError, match=word):
            lsgd_hpc.SlowMo(model, opt, comm, **kwargs)
    with pytest.raises(ValueError, match="optimizer"):
        lsgd_hpc.SlowMo(model, None, comm)


@pytest.mark.parametrize("T,every", [(1, 1), (2, 6)])
def test_slowmo_beta_0_alpha_1_is_local_sgd_step_for_step(world, groups, T, every):
    a, b = bn_flat(), bn_flat()
    for f in (a, b):
        set_rank_values(f, 0)
    opt = opt_holder(0.1)
    slow = SlowMoRule(groups, a, local_steps=T, slowmo_every=every, slowmo_beta=0.0,
                  slowmo_alpha=1.0, optimizer=opt)
    local = LocalSGDRule(groups, b, local_steps=T)
    for step in range(1, 13):
        opt.param_groups[0]["lr"] = 0.1 / step           # gamma changes every step
        slow.before_step(step)
        for f in (a, b):
            if step == 1:
                f.flat[f.n_params:].add_(world.rank)
            inner_step(f, step, world.rank)
        slow.after_step(step, 0.0)
        local.after_step(step, 0.0)
        assert torch.allclose(a.flat, b.flat, rtol=0, atol=TOL64), step


def test_slowmo_slow_steps_against_the_formula(world, groups):
    p, beta, alpha = world.size, 0.5, 0.8
    flat = bn_flat()
    set_rank_values(flat, 0)
    n = flat.n_params
    x0 = flat.params.clone()
    opt = opt_holder(0.1)
    algo = SlowMoRule(groups, flat, local_steps=1, slowmo_every=2, slowmo_beta=beta,
                  slowmo_alpha=alpha, optimizer=opt)
    algo.before_step(1)
    ys = [torch.linspace(0, 1, n, dtype=torch.float64) * (r + 2) for r in range(p)]
    zs = [torch.sin(torch.arange(n, dtype=torch.float64) * (r + 1)) for r in range(p)]
    flat.params.copy_(x0 + ys[world.rank])
    algo.after_step(1, 0.0)                               # the base averages, no slow step
    assert torch.allclose(flat.params, x0 + sum(ys) / p, rtol=0, atol=TOL64)
    flat.params.add_(ys[world.rank])
    algo.after_step(2, 0.0)                               # average, then the slow step
    g1 = 0.1
    xbar = x0 + sum(ys) / p + sum(ys) / p
    u1 = (x0 - xbar) / g1
    old1 = x0 - alpha * g1 * u1
    assert torch.allclose(flat.params, old1, rtol=0, atol=TOL64)
    assert torch.allclose(algo.u, u1, rtol=0, atol=1e-12)
    opt.param_groups[0]["lr"] = g2 = 0.05                 # gamma read at the slow step
    flat.params.add_(zs[world.rank])
    algo.after_step(3, 0.0)
    flat.params.add_(zs[world.rank])
    algo.after_step(4, 0.0)
    xbar2 = old1 + 2 * sum(zs) / p
    u2 = beta * u1 + (old1 - xbar2) / g2
    old2 = old1 - alpha * g2 * u2
    assert torch.allclose(flat.params, old2, rtol=0, atol=TOL64)
    state = algo.state_dict()
    assert torch.equal(state["old"], flat.params) and torch.allclose(state["u"], u2, atol=1e-12)


def test_lsgd_score_fn_replaces_the_window_at_elections(groups):
    world = groups.world
    flat = tiny(0.0)
    flat.flat.copy_(x_of(world.rank))
    rows = Rows()
    calls = []

    def held_out_loss():
        calls.append(1)
        return 5.0 - world.rank if world.rank != 0 else 0.5    # rank 0 is best held out

    algo = LeaderRule(groups, flat, tau_local=4, tau_global=4, pull_local=0.0, pull_global=0.5,
                     window=2, log=rows, score_fn=held_out_loss)
    for step in range(1, 5):
        algo.after_step(step, 1.0 / (1 + world.rank))    # the last rank is best in training
    assert len(calls) == 1                                 # only at the election (step 4)
    g = [r for r in rows.rows["leader"] if r["scope"] == 0]
    assert len(g) == 1 and g[0]["leader_rank"] == 0
    assert g[0]["score"] == held_out_loss()
    assert torch.allclose(flat.flat, x_of(world.rank) - 0.5 * (x_of(world.rank) - x_of(0)),
                          atol=1e-12)
