"""Consensus distance and the LSGD reference options against hand computations.

Runs at any world size: directly under pytest (size 1) and under mpirun -np 2/4 through
tests/cli/test_measurement.py (LSGD_TEST_RPN groups ranks into nodes).
"""

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from lsgd_hpc.methods.rules import (AllreduceRule, DiLoCoRule, EASGDRule, GossipRule, LeaderRule,
                                    LocalSGDRule, SlowMoRule)
from lsgd_hpc.comm import FlatParams, NodeGroups
from lsgd_hpc.topology import build_topology
from lsgd_hpc.cli.build import make_optimizer

@pytest.fixture(scope="module")
def flat_groups(world):
    """One rank per node: single-level LSGD, whatever the runner's grouping."""
    return NodeGroups.build(world, 1)


class Rows:
    def __init__(self):
        self.rows = {}

    def __call__(self, group, **row):
        self.rows.setdefault(group, []).append(row)


def bn_model() -> FlatParams:
    """Linear(3, 4) + BatchNorm1d(4) in float64: 16 + 8 parameters, 8 float buffers."""
    return FlatParams(nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)).double())


def params_of(rank: int, n: int) -> torch.Tensor:
    return torch.arange(n, dtype=torch.float64) * 0.125 + rank * (1 + rank)


def set_state(flat: FlatParams, rank: int) -> None:
    """Known parameters per rank, and BatchNorm statistics far apart (100 x rank): if they
    were counted, the distance would be off by orders of magnitude."""
    flat.params.copy_(params_of(rank, flat.n_params))
    flat.flat[flat.n_params:].fill_(100.0 * rank + 1.0)


def hand_distance(size: int, n: int) -> float:
    xs = [params_of(r, n) for r in range(size)]
    mean = sum(xs) / size
    return float(sum(((x - mean) ** 2).sum() for x in xs) / size)


def make_methods(groups, flat, rows):
    topo = build_topology("ring", groups.world.size, node_of=groups.node_of)
    return {
        "lsgd": LeaderRule(groups, flat, 2, 4, 0.1, 0.1, window=2, log=rows),
        "allreduce": AllreduceRule(groups, flat, log=rows),
        "easgd": EASGDRule(groups, flat, alpha=0.5 / groups.world.size, tau=2, log=rows),
        "local-sgd": LocalSGDRule(groups, flat, local_steps=2, log=rows),
        "diloco": DiLoCoRule(groups, flat, local_steps=2, log=rows),
        "slowmo": SlowMoRule(groups, flat, local_steps=2, slowmo_every=4, log=rows,
                         optimizer=torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)),
        "gossip": GossipRule(groups, flat, topo, log=rows),
    }


def test_consensus_distance_same_for_every_method(world, groups):
    flat = bn_model()
    rows = Rows()
    methods = make_methods(groups, flat, rows)
    want = hand_distance(world.size, flat.n_params)
    for name, algo in methods.items():
        set_state(flat, world.rank)
        before = world.stats.snapshot()
        got = algo.measure_consensus(7)
        assert got == pytest.approx(want, rel=1e-12, abs=1e-12), name
        # measurement, not the method's traffic; its time is booked as a probe
        assert world.stats.bytes_sent == before.bytes_sent, name
        assert world.stats.probe_seconds >= before.probe_seconds
        assert torch.equal(flat.params, params_of(world.rank, flat.n_params))   # untouched
    logged = rows.rows["consensus"]
    assert [r["step"] for r in logged] == [7] * len(methods)
    assert len({r["distance"] for r in logged}) == 1        # bit-identical across methods


@pytest.mark.parametrize("op", ["sum", "mean"])
def test_iallreduce_completes_later_with_the_allreduce_result(world, op):
    """Posted, then a blocking collective in between (as the trainer's steps do), then
    completed: the same result as allreduce_, bytes counted once, at the post."""
    t = torch.full((3,), float(world.rank + 1), dtype=torch.float64)
    before = world.stats.snapshot()
    req = world.iallreduce_(t, op)
    other = torch.ones(2, dtype=torch.float64)
    world.allreduce_(other, "sum")
    assert torch.equal(other, torch.full((2,), float(world.size), dtype=torch.float64))
    out = req.wait()
    total = world.size * (world.size + 1) / 2
    assert out is t and req.test()
    assert torch.equal(t, torch.full((3,), total / (world.size if op == "mean" else 1),
                                     dtype=torch.float64))
    if world.size > 1:
        assert world.stats.bytes_sent - before.bytes_sent == 24 + 16   # 3 + 2 doubles


def test_stop_agreement_same_step_on_every_rank(world):
    from lsgd_hpc.runtime.stopping import StopAgreement
    agree = StopAgreement(world, every=3)
    decided = []
    for step in range(1, 16):
        raised = world.rank == world.size - 1 and step >= 4     # one rank, after step 4
        if agree.check(step, raised):
            decided.append(step)
            break
    # posted at step 6 (first agreement after the signal), read at step 9, on every rank
    assert decided == [9]
    assert world.allgather_object(decided) == [[9]] * world.size
    agree.drain()


def _scores(size):
    return [float((r * 7) % 5) for r in range(size)]     # a scrambled order, ties broken low


def _leader(ranks, scores):
    return min(ranks, key=lambda r: (scores[r], r))


def test_lsgd_pull_every_step_matches_hand(world, groups):
    cl, cg, tl, tg = 0.5, 0.25, 2, 4
    flat = FlatParams(nn.Linear(3, 2).double())
    n = flat.n_params
    flat.flat.copy_(params_of(world.rank, n))
    algo = LeaderRule(groups, flat, tl, tg, cl, cg, window=1, pull_every_step=True)
    scores = _scores(world.size)
    me = world.rank
    multi = 1 < groups.n_nodes < world.size
    mates = [m for m in range(world.size) if groups.node_of[m] == groups.node_of[me]]
    loc, glead = _leader(mates, scores), _leader(range(world.size), scores)
    x = params_of(me, n)
    algo.after_step(1, scores[me])                 # no copy received yet: nothing moves
    assert torch.equal(flat.flat, x)
    algo.after_step(2, scores[me])                 # local pull (multi-level only)
    if multi:
        x = x - cl * (x - params_of(loc, n))
    else:                                          # single level: proximal toward nothing yet
        pass
    assert torch.allclose(flat.flat, x, rtol=0, atol=1e-12)
    algo.after_step(3, scores[me])                 # proximal toward the local copy, c_L / tau_L
    if multi:
        x = x - (cl / tl) * (x - params_of(loc, n))
    assert torch.allclose(flat.flat, x, rtol=0, atol=1e-12)
    # step 4: local pull (multi), then the global pull; the global leader leads its node too,
    # so it has not moved since its x_0 (its own pulls are zero, the proximal term toward its
    # own copy is zero as well)
    algo.after_step(4, scores[me])
    if multi:
        x = x - cl * (x - params_of(loc, n))
    xg = params_of(glead, n)
    x = x - cg * (x - xg)
    assert torch.allclose(flat.flat, x, rtol=0, atol=1e-12)
    algo.after_step(5, scores[me])                 # both proximal terms, local first
    if multi:
        x = x - (cl / tl) * (x - params_of(loc, n))
    x = x - (cg / tg) * (x - xg)
    assert torch.allclose(flat.flat, x, rtol=0, atol=1e-12)
    # the copies are part of the state: a resumed worker pulls toward the same points
    again = LeaderRule(groups, FlatParams(nn.Linear(3, 2).double()), tl, tg, cl, cg, window=1,
                      pull_every_step=True)
    again.load_state_dict(algo.state_dict())
    assert torch.equal(again.copies[0], algo.copies[0])


@pytest.mark.parametrize("policy", ["keep", "copy", "pull"])
def test_lsgd_batchnorm_policy_matches_hand(world, flat_groups, policy):
    c = 0.5
    flat = bn_model()
    n = flat.n_params
    set_state(flat, world.rank)
    x, buf = flat.params.clone(), flat.flat[n:].clone()
    algo = LeaderRule(flat_groups, flat, 1, 1, 0.0, c, window=1, bn=policy)
    scores = _scores(world.size)
    lead = _leader(range(world.size), scores)
    e0 = world.stats.bytes_recv
    flat_groups.world.elect(0.0)
    election = world.stats.bytes_recv - e0          # what an election receives, for the count
    before = world.stats.snapshot()
    algo.after_step(1, scores[world.rank])
    lead_x, lead_buf = params_of(lead, n), torch.full_like(buf, 100.0 * lead + 1.0)
    if world.rank == lead:
        want_x, want_buf = x, buf
    else:
        want_x = x - c * (x - lead_x)
        want_buf = {"keep": buf, "copy": lead_buf, "pull": buf - c * (buf - lead_buf)}[policy]
    assert torch.allclose(flat.params, want_x, rtol=0, atol=1e-12)
    assert torch.allclose(flat.flat[n:], want_buf, rtol=0, atol=1e-12)
    if world.size > 1 and world.rank != lead:
        # keep: only the parameters cross the wire; copy and pull need the statistics
        sent = n * 8 if policy == "keep" else flat.nbytes
        assert world.stats.bytes_recv - before.bytes_recv == sent + election


def test_nesterov_matches_hand():
    mu, lr, wd = 0.9, 0.1, 0.0
    x0 = torch.tensor([1.0, -2.0], dtype=torch.float64)
    g1 = torch.tensor([0.5, 0.25], dtype=torch.float64)
    g2 = torch.tensor([-1.0, 2.0], dtype=torch.float64)
    out = {}
    for nesterov in (True, False):
        p = nn.Parameter(x0.clone())
        opt = make_optimizer(SimpleNamespace(lr=lr, momentum=mu, weight_decay=wd,
                                             nesterov=nesterov), [p])
        for g in (g1, g2):
            p.grad = g.clone()
            opt.step()
        out[nesterov] = p.detach().clone()
    # Nesterov: b <- mu b + g;  x <- x - lr (g + mu b)
    b1 = g1
    x1 = x0 - lr * (g1 + mu * b1)
    b2 = mu * b1 + g2
    x2 = x1 - lr * (g2 + mu * b2)
    assert torch.allclose(out[True], x2, rtol=0, atol=1e-15)
    # heavy ball: x <- x - lr b
    assert torch.allclose(out[False], x0 - lr * b1 - lr * b2, rtol=0, atol=1e-15)
    assert not torch.allclose(out[True], out[False])
