"""Local SGD and SlowMo with --topk F < 1 (docs/algorithms.md, "Top-k sparsification"): the
average goes through a reference r, the common x after the last round (x_0 at the start).

By hand under mpirun -np 2 (one rank per node: the flat top-k allreduce), chunks of c = 8,
F = 1/4 (k = 2), error feedback, fp32 values: every round each rank sends the top-2 of
d_i + e_i = r - x_i + e_i per chunk, x <- r - mean, r <- x. With x_0 = 0 and no local motion
after the first round, four rounds deliver what the first one left out: x is then the exact
mean of the ranks' vectors and the residuals are zero. The same bits on both ranks after
every round, the bytes of the records, no traffic off the period; SlowMo's base average is
local SGD's, and after its slow step r is the slow step's x (not the average)."""

import sys

import pytest

from mpi_util import run_mpi
from lsgd_hpc.methods.spec import topk_problem

SCRIPT = r"""
import hashlib, torch
from torch import nn
from lsgd_hpc.comm import FlatParams, NodeGroups, make_world
from lsgd_hpc.comm.quantized import quantized_groups
from lsgd_hpc.methods.rules import LocalSGDRule, SlowMoRule

world = make_world("mpi")
assert world.size == 2
base = NodeGroups.build(world, 1)
me, n = world.rank, 256
i, j = torch.arange(n) // 8, torch.arange(n) % 8
scale = torch.arange(1, 33).float()                     # chunk i: i + 1


def tv(rank):
    # chunk i holds (i + 1)(j + 1) / 8 at position j, but (i + 1)(10 + rank)(-1)^rank at
    # position rank: rank r's top-2 of every chunk are positions r and 7
    v = (i + 1) * (j + 1) / 8.0
    v[j == rank] = ((i + 1) * (10.0 + rank) * (-1.0) ** rank)[j == rank]
    return v.float()


def build(cls, **kw):
    groups = quantized_groups(base, "fp32", error_feedback=True, block=8, topk=0.25)
    flat = FlatParams(nn.Linear(31, 8))          # 256 parameters, no buffers: 32 chunks of 8
    flat.flat.zero_()                            # x_0 = 0 on both ranks
    return cls(groups, flat, **kw), flat, groups.world


def digest(t):
    return hashlib.md5(t.detach().numpy().tobytes()).hexdigest()


def same_everywhere(*ts):
    for t in ts:
        assert len(set(world.allgather_object(digest(t)))) == 1


def residual(wire):
    (key,) = wire.shared.residuals
    return wire.shared.residuals[key]


def at(positions, values):
    v = torch.zeros(n)
    for p, c in zip(positions, values):
        v[p::8] = c * scale
    return v


rule, flat, wire = build(LocalSGDRule, local_steps=2)
assert rule.shared_state == ("T", "law", "since_avg", "last_estimate", "decision",
                             "reference")
rule.before_step(1)                                       # r <- x_0
flat.flat.copy_(-tv(me))                                  # d_i = r - x_i = tv(i)
before = world.stats.snapshot()
rule.after_step(1, 1.0)
assert world.stats.bytes_sent == before.bytes_sent and torch.equal(flat.flat, -tv(me))
rule.after_step(2, 1.0)                                   # round 1
assert world.stats.bytes_sent - before.bytes_sent == 32 * 2 * (2 + 4)   # m k (index + fp32)
# mean of the sent: rank 0's 10 (i+1) at 0, rank 1's -11 (i+1) at 1, both (i+1) at 7
X1 = at([0, 1, 7], [-5.0, 5.5, -1.0])
assert torch.equal(flat.flat, X1), flat.flat[:8]
assert torch.equal(rule.averaging.reference, X1)
E1 = tv(me) - at([me, 7], [tv(me)[me].item(), 1.0])
assert torch.equal(residual(wire), E1)                   # what top-k left out
same_everywhere(flat.flat, rule.averaging.reference)
# round 2: no local motion (d = 0): the residuals alone; top-2 of both: 6 (7/8), 5 (6/8)
rule.after_step(3, 1.0)
rule.after_step(4, 1.0)
X2 = X1 + at([5, 6], [-0.75, -0.875])
assert torch.equal(flat.flat, X2) and torch.equal(rule.averaging.reference, X2)
assert torch.equal(residual(wire), E1 - at([5, 6], [0.75, 0.875]))
same_everywhere(flat.flat, rule.averaging.reference)
for step in (5, 6, 7, 8):                                 # rounds 3 and 4 send the rest
    rule.after_step(step, 1.0)
assert torch.equal(flat.flat, -(tv(0) + tv(1)) / 2), flat.flat[:8]   # the exact mean
assert not residual(wire).any()
same_everywhere(flat.flat, rule.averaging.reference)
# SlowMo: the base's average is local SGD's; after the slow step (alpha 0.5: x_old moves
# half way, x_old = 0.5 X2) r is that x, not the average
opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.5)
slow, flat2, wire2 = build(SlowMoRule, local_steps=2, slowmo_every=4, slowmo_beta=0.5,
                           slowmo_alpha=0.5, optimizer=opt)
assert slow.shared_state == ("old", "u", "u_norm", "reference")
slow.before_step(1)
flat2.flat.copy_(-tv(me))
for step in (1, 2):
    slow.after_step(step, 1.0)
assert torch.equal(flat2.flat, X1) and torch.equal(residual(wire2), E1)
for step in (3, 4):
    slow.after_step(step, 1.0)
assert torch.equal(flat2.flat, 0.5 * X2), flat2.flat[:8]
assert torch.equal(slow.averaging.reference, 0.5 * X2) and torch.equal(slow.old, 0.5 * X2)
same_everywhere(flat2.flat, slow.averaging.reference, slow.u)
if me == 0:
    print("LOCAL_SGD_TOPK_OK", flush=True)
"""


@pytest.mark.mpi
def test_local_sgd_and_slowmo_topk_by_hand_at_two_ranks(tmp_path):
    script = tmp_path / "local_topk.py"
    script.write_text(SCRIPT)
    proc = run_mpi(2, [sys.executable, str(script)], timeout=120)
    assert "LOCAL_SGD_TOPK_OK" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-2000:]


def test_topk_accepted_for_local_sgd_and_slowmo_refused_elsewhere():
    for name in ("local-sgd", "slowmo"):
        for kind in ("fp32", "bf16", "int8", "fp8", "int4", "int2"):
            assert topk_problem(0.1, kind, "mpi", name) is None
    for name, words in (("lsgd-async", "no periodic average"),):
        why = topk_problem(0.1, "fp32", "mpi", name)
        assert why.startswith(f"0.1 is not for {name}: ") and words in why, why
