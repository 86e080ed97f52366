"""LSGD's compressed global pull (--topk F < 1; docs/algorithms.md, "Compressed leader pull"),
by hand under mpirun -np 2 (one rank per node: the pull crosses the roots' communicator).

Every rank keeps the reference r (x_0 at the first step); at a pull the leader sends the top-k
of x_L - r, every rank sets r <- r + d and the others pull toward r. Two pulls with rank-valued
parameters and a leader change between them: r and the parameters equal the hand-computed
ones on every rank, bit for bit; the records count their logical bytes; a rule restored from
the state after the first pull (the reference in it) ends the second pull with the same bits.
The refusals: lsgd with pull_delay, lsgd-async."""

import sys

import pytest
import torch

from mpi_util import run_mpi
from lsgd_hpc.methods.spec import topk_problem

SCRIPT = r"""
import hashlib, torch
from torch import nn
from lsgd_hpc.comm import FlatParams, NodeGroups, make_world
from lsgd_hpc.comm.quantized import quantized_groups
from lsgd_hpc.comm.sparse import sparse_layout
from lsgd_hpc.methods.rules.lsgd import LeaderRule

KIND = __KIND__
world = make_world("mpi")
assert world.size == 2
groups = quantized_groups(NodeGroups.build(world, 1), KIND, topk=0.25)   # k = 2 of 8


def build():
    model = nn.Linear(3, 2)                 # 8 parameters: one chunk of 8, k = 2
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()                          # x_0 = 0 on every rank: r = 0
    flat = FlatParams(model)
    rule = LeaderRule(groups, flat, tau_local=2, tau_global=2, pull_local=0.5,
                      pull_global=0.5, window=1)
    return rule, flat


def digest(t):
    return hashlib.md5(t.detach().numpy().tobytes()).hexdigest()


def same_everywhere(t):
    assert len(set(world.allgather_object(digest(t)))) == 1


T = lambda *v: torch.tensor(v, dtype=torch.float32)
me = world.rank
rule, flat = build()
assert rule.compressed and not rule.multi_level
rule.before_step(1)                                      # r <- x_0
assert torch.equal(rule.reference, torch.zeros(8))
# pull 1 at step 2: rank 1 leads (lower loss); x_1 - r = x_1, its top 2: 8 (index 0), 6 (3)
X1 = {0: T(1, -1, 2, -2, 3, -3, 4, -4), 1: T(8, 0, 0, 6, 0, 1, 0, 2)}
flat.params.copy_(X1[me])
rule.after_step(1, 1.0)
before = world.stats.snapshot()
rule.after_step(2, [1.0, 0.5][me])
lay = sparse_layout(8, 0.25, KIND)
got = (world.stats.bytes_sent - before.bytes_sent, world.stats.bytes_recv - before.bytes_recv)
# (the election's MINLOC counts alike on both: the leader's extra is the message's payload)
(s0, r0), (s1, r1) = world.allgather_object(got)
assert (s1 - s0, r0 - r1) == (lay.counted, lay.counted), (got, lay.counted)
R1 = T(8, 0, 0, 6, 0, 0, 0, 0)
if KIND == "int8":      # scale s = 8/127: 8 goes as 127, 6 as round(6 / s) = 95, back q s
    R1 = T(127, 0, 0, 95, 0, 0, 0, 0) * (torch.tensor(8.0) / 127)
assert torch.equal(rule.reference, R1), rule.reference
P1 = {0: 0.5 * X1[0] + 0.5 * R1, 1: X1[1]}                 # the leader is not pulled
assert torch.allclose(flat.params, P1[me], rtol=0, atol=1e-6), flat.params
same_everywhere(rule.reference)
saved = rule.state_dict()
assert torch.equal(saved["reference"], R1) and saved["reference_ready"]
x_saved = flat.params.clone()
# pull 2 at step 4: rank 0 leads; x_0 - r = (-3.5, -.5, 1, -4, 1.5, -1.5, 2, -12) for fp32,
# its top 2: -12 (index 7), -4 (index 3); the old leader's residual (index 5, 7) is rank 1's
# own business: no residual moves between ranks
X2 = {0: P1[0] + T(0, 0, 0, 0, 0, 0, 0, -10), 1: P1[1] + T(0, 0, 3, 0, 0, 0, 0, 0)}


def pull2(rule, flat):
    flat.params.copy_(X2[me])
    rule.after_step(3, 1.0)
    rule.after_step(4, [0.25, 1.0][me])


pull2(rule, flat)
D = X2[0] - R1
top = D.abs().topk(2).indices
d2 = torch.zeros(8)
d2[top] = D[top]
if KIND == "int8":
    s = d2.abs().max() / 127
    d2 = torch.round(d2 / s) * s
if KIND == "fp32":
    assert sorted(top.tolist()) == [3, 7] and torch.equal(d2, T(0, 0, 0, -4, 0, 0, 0, -12))
R2 = R1 + d2
assert torch.equal(rule.reference, R2), (rule.reference, R2)
P2 = {0: X2[0], 1: 0.5 * X2[1] + 0.5 * R2}
assert torch.allclose(flat.params, P2[me], rtol=0, atol=1e-6), flat.params
if KIND == "fp32":
    assert torch.equal(R2, T(8, 0, 0, 2, 0, 0, 0, -12))
    assert torch.equal(flat.params, [X2[0], T(8, 0, 1.5, 4, 0, 0.5, 0, -5)][me])
same_everywhere(rule.reference)
# an exact resume: a fresh rule loads the state after pull 1 and runs pull 2 alike
rule2, flat2 = build()
rule2.load_state_dict(saved)
flat2.params.copy_(x_saved)
rule2.before_step(3)                                   # (a resumed reference is kept)
assert torch.equal(rule2.reference, R1)
pull2(rule2, flat2)
assert torch.equal(rule2.reference, rule.reference)
assert torch.equal(flat2.params, flat.params)
# pull_delay is refused with one line
try:
    LeaderRule(groups, FlatParams(nn.Linear(3, 2)), 2, 2, 0.5, 0.5, 1, pull_delay=1)
except ValueError as exc:
    assert str(exc).startswith("topk 0.25 is not for lsgd with pull_delay 1") and \
        "\n" not in str(exc), exc
else:
    raise AssertionError("pull_delay with topk was accepted")
if me == 0:
    print("COMPRESSED_PULL_OK", flush=True)
"""


@pytest.mark.mpi
@pytest.mark.parametrize("kind", ["fp32", "int8"])
def test_two_pulls_by_hand_with_a_leader_change_and_exact_resume(tmp_path, kind):
    script = tmp_path / "pull.py"
    script.write_text(SCRIPT.replace("__KIND__", repr(kind)))
    proc = run_mpi(2, [sys.executable, str(script)], timeout=120)
    assert "COMPRESSED_PULL_OK" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-2000:]


def test_topk_accepted_for_lsgd_refused_for_lsgd_async():
    for kind in ("fp32", "int8", "fp8", "int4", "int2"):
        assert topk_problem(0.05, kind, "mpi", "lsgd") is None
    why = topk_problem(0.1, "fp32", "mpi", "lsgd-async")
    assert why.startswith("0.1 is not for lsgd-async: ") and "\n" not in why


def test_delta_maths_in_process():
    """apply_delta adds exactly what encode_delta selected (fp32 values): r + d, zeros
    elsewhere; what is left, x - r_new, is the rest of the difference."""
    from lsgd_hpc.comm.delta import apply_delta, delta_layout, encode_delta, message_buffer
    g = torch.Generator().manual_seed(3)
    n = 5000                                    # two chunks of 4096 and 904 (padded)
    x, r = torch.randn(n, generator=g), torch.randn(n, generator=g)
    lay = delta_layout(n, 0.01, "fp32")
    buf = message_buffer(lay)
    encode_delta(x, r, lay, buf)
    r_new = r.clone()
    d = apply_delta(r_new, buf, lay)
    assert int((d != 0).sum()) == 2 * lay.k
    assert torch.equal(r_new - r == 0, d == 0)
    sent = d != 0
    assert torch.allclose(r_new[sent], x[sent], rtol=0, atol=1e-6)   # (r + (x - r))
    # top-k contracts: |x - r_new|^2 <= (1 - k / c) |x - r|^2 per chunk (here overall)
    assert (x - r_new).norm() ** 2 <= (1 - lay.k / lay.c) * (x - r).norm() ** 2 + 1e-4


@pytest.mark.mpi
def test_compressed_pull_survives_its_leader_killed_before_the_broadcast(tmp_path):
    """on_failure=shrink, 4 ranks as 2 nodes (tests/drivers/ft_loop.py), --topk 0.1 with int8
    values: the global leader of step 8 dies after its election, before its message left.
    Nobody has the message, so nobody pulled and nobody's reference moved: the recovery's
    check that the shared state (the reference) is bit-identical passes, and the survivors
    go on pulling (global pulls at 4, 12, 16)."""
    import json
    from mpi_util import REPO
    driver = str(REPO / "tests" / "drivers" / "ft_loop.py")
    proc = run_mpi(4, [sys.executable, driver, "lsgd", str(tmp_path / "run"), "--steps", "16",
                       "--kill", "leader:8", "-o", "topk=0.1", "-o", 'comm_dtype="int8"'],
                   timeout=300, mpi_args=["--with-ft", "ulfm"])
    res = [json.loads(line.split(" ", 1)[1]) for line in proc.stdout.splitlines()
           if line.startswith("FTRESULT ")]
    assert len(res) == 3 and {r["steps"] for r in res} == {16}, proc.stdout[-3000:]
    assert all(r["finite"] for r in res)
    assert {r["pulls_done"]["0"] for r in res} == {3}
