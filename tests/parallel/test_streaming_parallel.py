"""Streaming DiLoCo (fragments, fragment_sync_delay, fragment_update_alpha) and LSGD's
pull_delay against hand computations with rank-valued parameters, their reductions to DiLoCo
and LSGD, resume with a collective in flight, and Streaming DiLoCo against torchft's.

Runs at any world size: directly under pytest (size 1) and under mpirun -np 2/4/5 through
tests/test_parallel_mpi.py (LSGD_TEST_RPN ranks per node).
"""

import importlib.util

import pytest
import torch
from torch import nn

from lsgd_hpc.comm import FlatParams
from lsgd_hpc.methods.rules import DiLoCoRule, LeaderRule
from lsgd_hpc.methods.rules.diloco import fragment_tensors, split_tensors


def bn_flat(dtype=torch.float64) -> FlatParams:
    """Linear(3, 2) then BatchNorm1d(2): 12 parameters in 4 tensors (6, 2, 2, 2), then the
    running mean and variance (2 + 2 floating-point buffers)."""
    return FlatParams(nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2)).to(dtype))


def x0_of(flat: FlatParams) -> torch.Tensor:
    return torch.arange(flat.numel, dtype=flat.flat.dtype) * 0.25


def u(rank: int, step: int, n: int) -> torch.Tensor:
    """The inner step of worker ``rank`` at ``step``: x <- x - u (different on every rank and
    step, on the buffers too, as BatchNorm's running statistics move)."""
    return 0.01 * (rank + 1) * torch.cos(torch.arange(n, dtype=torch.float64) + step) \
        + 0.003 * step


# ------------------------------------------------------------------ Streaming DiLoCo

def test_split_tensors_near_equal_whole_tensors():
    assert split_tensors([6, 2, 2, 2], 2) == [range(0, 1), range(1, 4)]
    assert split_tensors([1, 1, 1, 1], 4) == [range(i, i + 1) for i in range(4)]
    assert split_tensors([100, 1, 1], 3) == [range(0, 1), range(1, 2), range(2, 3)]
    # boundaries nearest to 7.5, 15, 22.5 of 30 (ties: the earlier)
    assert split_tensors([5, 5, 5, 5, 5, 5], 4) == [range(0, 1), range(1, 3), range(3, 4),
                                                   range(4, 6)]
    with pytest.raises(ValueError, match="cannot split 2 tensors into 3"):
        split_tensors([4, 4], 3)


def test_fragments_from_modules_cover_every_parameter_once():
    model = nn.Sequential(nn.Linear(3, 2), nn.Tanh(), nn.Linear(2, 2), nn.Linear(2, 1))
    assert fragment_tensors(model, [model[0], nn.ModuleList([model[2], model[3]])]) == \
        [[0, 1], [2, 3, 4, 5]]
    with pytest.raises(ValueError, match=r"parameter\(s\) 3.weight, 3.bias belong to no"):
        fragment_tensors(model, [model[0], model[2]])
    with pytest.raises(ValueError, match="2.weight is in fragments 1 and 2"):
        fragment_tensors(model, [model[0], model[2], nn.ModuleList([model[2], model[3]])])
    with pytest.raises(ValueError, match="not a parameter of the model"):
        fragment_tensors(model, [model, nn.Linear(1, 1)])
    with pytest.raises(ValueError, match="fragment 1 .Tanh. has no parameters"):
        fragment_tensors(model, [model, model[1]])
    with pytest.raises(ValueError, match="fragments is 7 but the model has 6"):
        fragment_tensors(model, 7)


@pytest.mark.parametrize("H", [1, 3])
def test_streaming_path_with_one_fragment_is_diloco_bit_for_bit(world, groups, H):
    """P = 1, tau = 0, alpha = 0 through the streaming code (fragments given as a list of one
    module) equals DiLoCo's own code path step for step, bit for bit, buffers included."""
    a, b = bn_flat(), bn_flat()
    for f in (a, b):
        f.flat.copy_(x0_of(f))
    classic = DiLoCoRule(groups, a, local_steps=H)
    streaming = DiLoCoRule(groups, b, local_steps=H, fragments=[b.model])
    assert not classic.streaming and streaming.streaming and streaming.P == 1
    for step in range(1, 13):
        for rule, f in ((classic, a), (streaming, b)):
            rule.before_step(step)
            f.flat.sub_(u(world.rank, step, f.numel))
            rule.after_step(step, 0.0)
        assert torch.equal(a.flat, b.flat), step
        assert torch.equal(classic.prev.data, streaming.prev.data), step
    assert classic.outer_steps == streaming.outer_steps == 12 // H
    assert classic.last_grad_norm == streaming.last_grad_norm


def _reference_streaming(p, x0, steps, H, P, tau, alpha, lr, mu, frag_params, frag_buffers):
    """Streaming DiLoCo by hand for all p workers: x (per rank), x_prev, outer momentum per
    fragment, after every step."""
    X = [x0.clone() for _ in range(p)]
    prev = x0[:sum(len(i) for i in frag_params)].clone()
    mom = {}
    period, pending, out, norm = H // P, None, [], None
    for t in range(1, steps + 1):
        for r in range(p):
            X[r] -= u(r, t, len(x0))
        if (t + tau) % period == 0:                      # delta_f taken tau steps early
            f = ((t + tau) // period - 1) % P
            ip, ib = frag_params[f], frag_buffers[f]
            pending = (f, sum(prev[ip] - X[r][ip] for r in range(p)) / p,
                       sum(X[r][ib] for r in range(p)) / p)
        if t % period == 0:                              # fragment f's sync
            f, delta, bufs = pending
            assert f == (t // period - 1) % P
            ip, ib = frag_params[f], frag_buffers[f]
            mom[f] = delta.clone() if f not in mom else mu * mom[f] + delta
            norm = float(delta.norm())
            new = prev[ip] - lr * (delta + mu * mom[f])  # Nesterov
            prev[ip] = new
            for r in range(p):
                X[r][ip] = new + alpha * (X[r][ip] - new)
                X[r][ib] = bufs + alpha * (X[r][ib] - bufs)
        out.append(([x.clone() for x in X], prev.clone(), {k: v.clone() for k, v in mom.items()},
                    norm))
    return out


def test_two_fragments_delay_1_alpha_half_against_the_hand_computation(world, groups):
    """H = 4, P = 2 (fragment 0: Linear's weight; fragment 1: its bias and BatchNorm's
    weight and bias, and BatchNorm's running statistics), tau = 1, alpha = 0.5: fragment 0's
    delta is taken at steps 1, 5 and synced at 2, 6; fragment 1's at 3, 7 and 4, 8. x, x_prev
    and each fragment's outer momentum equal the formula's after every step; the momentum of
    a fragment moves only at its syncs; the allreduce's bytes are counted when it starts."""
    p, lr, mu, alpha = world.size, 0.7, 0.9, 0.5
    flat = bn_flat()
    flat.flat.copy_(x0_of(flat))
    rule = DiLoCoRule(groups, flat, local_steps=4, outer_lr=lr, outer_momentum=mu,
                      fragments=2, fragment_sync_delay=1, fragment_update_alpha=alpha)
    fr = rule.fragments
    assert [f.params for f in fr] == [[(0, 6)], [(6, 12)]]
    assert [f.buffers for f in fr] == [[], [(12, 16)]]            # with BatchNorm's fragment
    want = _reference_streaming(p, x0_of(flat), 8, 4, 2, 1, alpha, lr, mu,
                                [list(range(0, 6)), list(range(6, 12))],
                                [[], list(range(12, 16))])
    for t in range(1, 9):
        rule.before_step(t)
        flat.flat.sub_(u(world.rank, t, flat.numel))
        before = world.stats.snapshot()
        rule.after_step(t, 0.0)
        X, prev, mom, norm = want[t - 1]
        assert torch.allclose(flat.flat, X[world.rank], rtol=0, atol=1e-12), t
        assert torch.allclose(rule.prev.data, prev, rtol=0, atol=1e-12), t
        for f in range(2):
            state = fr[f].opt.state.get(fr[f].outer[0], {})
            if f in mom:
                assert torch.allclose(state["momentum_buffer"], mom[f], rtol=0, atol=1e-12)
            else:
                assert "momentum_buffer" not in state
        if p > 1:
            sent = world.stats.bytes_sent - before.bytes_sent
            assert sent == (fr[(t // 2) % 2].size * 8 if t % 2 else 0), t
        if t > 1:
            assert rule.last_grad_norm == pytest.approx(norm, rel=1e-12)   # the last sync's
    assert rule.outer_steps == 4
    everyone = world.allgather_object(rule.prev.data.tolist())
    assert all(e == everyone[0] for e in everyone)               # x_prev identical


def test_streaming_state_with_an_allreduce_in_flight_resumes_bit_for_bit(world, groups):
    """state_dict at step 5 (fragment 1's allreduce started at 4, synced at 6) completes it and
    keeps its mean; a twin built from that state continues exactly like the original."""
    kw = dict(local_steps=6, fragments=2, fragment_sync_delay=2, fragment_update_alpha=0.25)
    flat = bn_flat()
    flat.flat.copy_(x0_of(flat))
    rule = DiLoCoRule(groups, flat, **kw)
    for t in range(1, 6):
        rule.before_step(t)
        flat.flat.sub_(u(world.rank, t, flat.numel))
        rule.after_step(t, 0.0)
    assert rule._inflight[:2] == [1, 6]
    state = rule.state_dict()
    assert state["inflight"]["fragment"] == 1 and state["inflight"]["sync_step"] == 6
    twin_flat = bn_flat()
    twin_flat.flat.copy_(flat.flat)
    twin = DiLoCoRule(groups, twin_flat, **kw)
    twin.load_state_dict(state)
    for t in range(6, 16):
        for r, f in ((rule, flat), (twin, twin_flat)):
            r.before_step(t)
            f.flat.sub_(u(world.rank, t, f.numel))
            r.after_step(t, 0.0)
        assert torch.equal(flat.flat, twin_flat.flat), t
    assert rule.outer_steps == twin.outer_steps


def test_streaming_options_refused_by_the_class(comm):
    import lsgd_hpc
    model = nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for kwargs, word in (
            (dict(local_steps=6, fragments=4), r"fragments must divide local_steps \(4 "),
            (dict(local_steps=8, fragments=2, fragment_sync_delay=4),
             "fragment_sync_delay must be < local_steps / fragments = 4"),
            (dict(fragment_update_alpha=1.5), "fragment_update_alpha must be in"),
            (dict(local_steps=8, fragments=8), "fragments is 8 but the model has 4"),
            (dict(local_steps=8, fragments=[model[0]]), r"1.weight, 1.bias belong to no"),
            (dict(fragments=[]), "non-empty list")):
        with pytest.raises(ValueError, match=word):
            lsgd_hpc.DiLoCo(model, opt, comm, **kwargs)


# ------------------------------------------------------------------ LSGD's pull_delay

def x_of(rank: int, n: int = 8) -> torch.Tensor:
    return torch.arange(n, dtype=torch.float64) * 0.25 + rank


def tiny() -> FlatParams:
    return FlatParams(nn.Linear(3, 2).to(torch.float64))


def test_pull_delay_0_is_lsgd_bit_for_bit(groups):
    world = groups.world
    a, b = tiny(), tiny()
    for f in (a, b):
        f.flat.copy_(x_of(world.rank))
    plain = LeaderRule(groups, a, 2, 4, 0.3, 0.2, window=2)
    zero = LeaderRule(groups, b, 2, 4, 0.3, 0.2, window=2, pull_delay=0)
    assert not hasattr(zero, "delayed")                  # no communicator of its own
    for t in range(1, 13):
        for rule, f in ((plain, a), (zero, b)):
            f.flat.sub_(u(world.rank, t, 8))
            rule.after_step(t, float((world.rank * 7) % 5) + 0.01 * t)
        assert torch.equal(a.flat, b.flat), t


@pytest.mark.parametrize("d", [1, 2])
def test_delayed_pulls_land_at_s_plus_d_toward_the_leader_of_step_s(groups, d):
    """tau_L = 4, tau_G = 8 (both levels when the layout has two), pulls delayed by d: the
    election at s picks the leader by the scores, the pull lands at s + d, toward x_L(s), on
    every worker's x of step s + d (the leader's too: its pull is toward its own past)."""
    world = groups.world
    p, cl, cg = world.size, 0.5, 0.25
    flat = tiny()
    flat.flat.copy_(x_of(world.rank))
    scores = [float((r * 7) % 5) for r in range(p)]         # scrambled, constant
    rule = LeaderRule(groups, flat, 4, 8, cl, cg, window=1, pull_delay=d)
    multi = 1 < groups.n_nodes < p
    mates = {r: [m for m in range(p) if groups.node_of[m] == groups.node_of[r]]
             for r in range(p)}
    X = [x_of(r) for r in range(p)]
    snap = {}
    for t in range(1, 21):
        for r in range(p):
            X[r] = X[r] - u(r, t, 8)
        if multi and t - d in snap.get("L", {}):
            lead = snap["L"].pop(t - d)
            X = [X[r] - cl * (X[r] - lead[r]) for r in range(p)]
        if t - d in snap.get("G", {}):
            lead = snap["G"].pop(t - d)
            X = [X[r] - cg * (X[r] - lead) for r in range(p)]
        if multi and t % 4 == 0:
            loc = {r: min(mates[r], key=lambda m: (scores[m], m)) for r in range(p)}
            snap.setdefault("L", {})[t] = {r: X[loc[r]].clone() for r in range(p)}
        if t % 8 == 0:
            g = min(range(p), key=lambda m: (scores[m], m))
            snap.setdefault("G", {})[t] = X[g].clone()
        flat.flat.sub_(u(world.rank, t, 8))
        before = flat.flat.clone()
        rule.after_step(t, scores[world.rank])
        assert torch.allclose(flat.flat, X[world.rank], rtol=0, atol=1e-12), t
        if t % 4 == 0:
            assert torch.equal(flat.flat, before), t         # nothing pulled at an election
    assert rule.last_global.world_rank == min(range(p), key=lambda m: (scores[m], m))
    rule.drain()                              # the local broadcast of step 20 is in flight


def test_delayed_broadcast_in_flight_resumes_bit_for_bit(groups):
    """state_dict right after an election (broadcast in flight) completes it and keeps the
    leader's copy and the step to pull at; a twin loaded from it pulls the same."""
    world = groups.world
    flat = tiny()
    flat.flat.copy_(x_of(world.rank))
    kw = dict(tau_local=2, tau_global=4, pull_local=0.3, pull_global=0.2, window=3,
              pull_delay=1, bn="keep", pull_every_step=True)
    rule = LeaderRule(groups, flat, **kw)
    loss = lambda t: float((world.rank * 3) % 4) + 0.1 * t      # noqa: E731
    for t in range(1, 9):
        flat.flat.sub_(u(world.rank, t, 8))
        rule.after_step(t, loss(t))
    state = rule.state_dict()
    assert state["global_delayed"]["pull_step"] == 9
    twin_flat = tiny()
    twin_flat.flat.copy_(flat.flat)
    twin = LeaderRule(groups, twin_flat, **kw)
    twin.load_state_dict(state)
    for t in range(9, 20):
        for r, f in ((rule, flat), (twin, twin_flat)):
            f.flat.sub_(u(world.rank, t, 8))
            r.after_step(t, loss(t))
        assert torch.equal(flat.flat, twin_flat.flat), t


def test_pull_delay_refused_at_or_above_tau_local(comm):
    import lsgd_hpc
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="pull_delay must be < tau_local"):
        lsgd_hpc.LeaderSGD(model, opt, comm, tau_local=4, tau_global=8, pull_delay=4)
    with pytest.raises(ValueError, match="AsyncLeaderSGD: unknown option"):
        lsgd_hpc.AsyncLeaderSGD(model, opt, comm, max_steps=4, pull_delay=1)


# ------------------------------------------------------------------ against torchft

class _Work:
    def wait(self):
        return True


class _Manager:
    """What torchft's DiLoCo asks of its Manager, over our communicator: allreduce is
    the mean over the group, done at once (the result is what it is when posted); every
    commit succeeds, and the step counts commits (which fragment syncs next)."""

    _use_async_quorum = False

    def __init__(self, world):
        self.world, self.step = world, 0

    def allreduce(self, tensor, should_quantize=False):
        self.world.allreduce_(tensor, "mean")
        return _Work()

    def start_quorum(self):
        pass

    def should_commit(self):
        self.step += 1
        return True

    def current_step(self):
        return self.step

    def register_state_dict_fn(self, key, load_fn, save_fn):
        pass

    def allow_state_dict_read(self):
        pass

    def disallow_state_dict_read(self):
        pass


@pytest.mark.skipif(importlib.util.find_spec("torchft") is None,
                    reason="torchft is not installed (pip install -e '.[torchft]')")
@pytest.mark.parametrize("P,tau,alpha", [(1, 0, 0.0), (2, 1, 0.5), (3, 2, 0.25)])
def test_streaming_diloco_follows_torchft(comm, P, tau, alpha):
    """The same model, inner optimizer and data per rank under torchft's DiLoCo (one
    outer optimizer per fragment, as its Streaming DiLoCo tests do) and lsgd_hpc's: the same
    parameters after every step. Bit for bit at 1 and 2 ranks; beyond, the allreduces sum in
    an order that depends on the message size (torchft's per tensor, ours per fragment)."""
    from torchft.local_sgd import DiLoCo as TorchftDiLoCo

    import lsgd_hpc
    world = comm.world
    H = 4 * P                                          # a fragment syncs every 4 steps

    def build():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(),
                             nn.Linear(8, 3)).double()

    ours, theirs = build(), build()
    frags = ([ours] if P == 1 else [ours[0], ours[2], ours[4]][:P] if P == 3
             else [ours[0], nn.ModuleList([ours[2], ours[4]])])
    tfrags = ([theirs] if P == 1 else [theirs[0], theirs[2], theirs[4]][:P] if P == 3
              else [theirs[0], nn.ModuleList([theirs[2], theirs[4]])])
    opt = torch.optim.SGD(ours.parameters(), lr=0.05, momentum=0.5)
    topt = torch.optim.SGD(theirs.parameters(), lr=0.05, momentum=0.5)
    method = lsgd_hpc.DiLoCo(ours, opt, comm, local_steps=H, fragments=frags,
                             fragment_sync_delay=tau, fragment_update_alpha=alpha)
    outer = [torch.optim.SGD(f.parameters(), lr=0.7, momentum=0.9, nesterov=True)
             for f in tfrags]
    gen = torch.Generator().manual_seed(10 + world.rank)
    data = [(torch.randn(16, 4, generator=gen, dtype=torch.float64),
             torch.randint(0, 3, (16,), generator=gen)) for _ in range(3 * H)]
    exact = world.size <= 2
    with TorchftDiLoCo(_Manager(world), tfrags, topt, outer, sync_every=H,
                       fragment_sync_delay=tau, fragment_update_alpha=alpha):
        for step, (x, y) in enumerate(data, 1):
            for model, o, step_fn in ((ours, opt, method.step), (theirs, topt, None)):
                loss = nn.functional.cross_entropy(model(x), y)
                o.zero_grad()
                loss.backward()
                if step_fn is not None:
                    step_fn(loss)
                else:
                    o.step()
            for a, b in zip(ours.parameters(), theirs.parameters()):
                if exact:
                    assert torch.equal(a, b), step
                else:
                    assert torch.allclose(a, b, rtol=0, atol=1e-12), step
    assert method.rule.outer_steps == 3 * P
