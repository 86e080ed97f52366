"""Top-k DiLoCo on a model with floating-point buffers (docs/algorithms.md, DiLoCo): the
pseudo-gradient goes as top-k records and the BatchNorm statistics dense, in the same round.

At 4 ranks (one a node: the flat top-k allreduce), F = 0.05, on an MLP with BatchNorm1d
whose ranks train on data of their own (so their statistics differ): after every outer step
the whole flat vector (parameters and buffers) has the same bits on every rank, the
buffers are the exact float32 mean of the ranks' own, the loss stays finite, and the
bytes of one outer step are the records' S(n) sent and 3 S(n) received plus 4 m each way
for the m buffer elements -- under 0.15 of the dense round's. Streaming DiLoCo (P = 2,
tau = 1, the two allreduces in flight together) the same for each fragment at its sync."""

import sys

import pytest
import torch
from torch import nn

from mpi_util import run_mpi
import lsgd_hpc

SCRIPT = r"""
import hashlib, math, torch
from torch import nn
from lsgd_hpc.comm import FlatParams, NodeGroups, make_world
from lsgd_hpc.comm.quantized import quantized_groups
from lsgd_hpc.comm.sparse import payload_bytes
from lsgd_hpc.methods.rules import DiLoCoRule

world = make_world("mpi")
assert world.size == 4
me = world.rank
base = NodeGroups.build(world, 1)


def digest(t):
    return hashlib.md5(t.detach().contiguous().numpy().tobytes()).hexdigest()


def same(t):
    return len(set(world.allgather_object(digest(t)))) == 1


def model():
    torch.manual_seed(0)                                   # x_0 the same on every rank
    return nn.Sequential(nn.Linear(32, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 8))


def run(**kw):
    net = model()
    groups = quantized_groups(base, "fp32", topk=0.05)
    flat = FlatParams(net)
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    rule = DiLoCoRule(groups, flat, local_steps=4, outer_lr=0.7, outer_momentum=0.9, **kw)
    n, m = flat.n_params, flat.flat.numel() - flat.n_params
    assert m == 128, m
    g = torch.Generator().manual_seed(100 + me)
    losses, outer = [], []
    for step in range(1, 17):
        rule.before_step(step)
        x = torch.randn(16, 32, generator=g) * (1 + me) + me   # each rank its own statistics
        y = torch.randn(16, 8, generator=g)
        loss = ((net(x) - y) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss))
        before = world.stats.snapshot()
        own = flat.flat[n:].clone()
        rule.after_step(step, float(loss))
        outer.append((step, own, world.stats.bytes_sent - before.bytes_sent,
                      world.stats.bytes_recv - before.bytes_recv))
    return rule, flat, n, m, losses, outer


# DiLoCo: one outer step every 4 steps
rule, flat, n, m, losses, outer = run()
assert all(math.isfinite(v) for v in losses), losses
assert rule.outer_steps == 4
assert same(flat.flat) and same(rule.prev.data)
assert torch.equal(flat.flat[:n], rule.prev.data)
s, r = payload_bytes(n, 4, 0.05)
for step, own, sent, recv in outer:
    if step % 4:
        assert sent == recv == 0, (step, sent)
    else:
        assert (sent, recv) == (s + 4 * m, r + 4 * m), (step, sent, recv, s, r, m)
        assert sent < 0.15 * 4 * (n + m), (sent, n, m)
# the buffers of the last outer step: the float32 mean of the ranks' own
own = outer[-1][1]
mean = torch.stack(world.allgather_object(own)).mean(0)
assert torch.allclose(flat.flat[n:], mean, rtol=1e-6, atol=1e-6)
assert not same(own)                                   # (they differed before it)

# Streaming DiLoCo: P = 2 fragments, tau = 1 (both allreduces of a fragment in flight)
rule, flat, n, m, losses, outer = run(fragments=2, fragment_sync_delay=1)
assert all(math.isfinite(v) for v in losses), losses
assert rule.outer_steps == 8 and same(rule.prev.data)
f = rule.fragment_at(16)
fr = rule.fragments[f]
assert fr.buffers, "the fragment of the last sync holds BatchNorm statistics"
for a, b in fr.params + fr.buffers:                    # synced at step 16, nothing since
    assert same(flat.flat[a:b]), (f, a, b)
sent = sum(o[2] for o in outer)
nb = sum(b - a for fr in rule.fragments for a, b in fr.buffers)
want = sum(4 * (payload_bytes(fr.n_params, 4, 0.05)[0] + 4 * (fr.size - fr.n_params))
           for fr in rule.fragments)
assert nb == m and sent == want, (sent, want)
if me == 0:
    print("DILOCO_TOPK_BUFFERS_OK")
"""


@pytest.mark.mpi
def test_topk_diloco_with_batchnorm_at_four_ranks(tmp_path):
    script = tmp_path / "diloco_topk_buffers.py"
    script.write_text(SCRIPT)
    proc = run_mpi(4, [sys.executable, str(script)], timeout=180)
    assert "DILOCO_TOPK_BUFFERS_OK" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-3000:]


def _bn_model():
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 2))


@pytest.mark.parametrize("fragments", [1, 2])
def test_topk_diloco_with_buffers_accepted_by_the_checks(fragments):
    from lsgd_hpc.methods import METHODS
    net = _bn_model()
    opts = METHODS["diloco"].check(net, torch.optim.SGD(net.parameters(), lr=0.1),
                                   world_size=4, backend="mpi", topk=0.01, local_steps=4,
                                   fragments=fragments)
    assert opts["fragments"] == fragments


def test_topk_diloco_with_batchnorm_accepted_by_the_dry_run():
    pre = lsgd_hpc.check_config({"dataset": "digits", "algorithm": "diloco", "topk": 0.01,
                                 "fragments": 2}, world_size=4, ranks_per_node=2)
    assert pre.accepted and pre.error is None, pre.error
    assert pre.model["name"] == "digits_cnn" and pre.model["buffer_elements"] > 0
