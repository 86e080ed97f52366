"""LSGD's compressed global pull (--topk F < 1; docs/algorithms.md, "Compressed leader pull"),
by hand under mpirun -np 2 (one rank per node: the pull crosses the roots' communicator).

Every rank keeps the reference r (x_0 at the first step); at a pull the leader sends the top-k
of x_L - r, every rank sets r <- r + d and the others pull toward r. Two pulls with rank-valued
parameters and a leader change between them: r and the parameters equal the hand-computed
ones on every rank, bit for bit; the records count their logical bytes; a rule restored from
the state after the first pull (the reference in it) ends the second pull with the same bits.
With pull_delay d the message is in flight for d steps and lands at t + d (DELAYED_SCRIPT).
The refusal: lsgd-async. (A message in flight when ranks are lost:
tests/comm/test_lsgd_topk_pull_delay_faults.py.)"""

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
if me == 0:
    print("COMPRESSED_PULL_OK", flush=True)
"""


DELAYED_SCRIPT = r"""
import hashlib, torch
from torch import nn
from lsgd_hpc.comm import FlatParams, NodeGroups, make_world
from lsgd_hpc.comm.delta import BookedRequest
from lsgd_hpc.comm.quantized import quantized_groups
from lsgd_hpc.methods.rules.lsgd import GLOBAL, LeaderRule

KIND, D, RPN = __KIND__, __DELAY__, __RPN__
world = make_world("mpi")
# RPN ranks per node; the local pulls (RPN 2 of 4 ranks) have strength 0: x moves by the
# global pull alone, the local broadcasts are counted alike on both rules
groups = quantized_groups(NodeGroups.build(world, RPN), KIND, topk=0.25)   # k = 2 of 8
me, P = world.rank, world.size
T = lambda *v: torch.tensor(v, dtype=torch.float32)


def build(pull_delay):
    model = nn.Linear(3, 2)                 # 8 parameters: one chunk of 8, k = 2
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()                          # x_0 = 0 on every rank: r = 0
    flat = FlatParams(model)
    rule = LeaderRule(groups, flat, tau_local=4, tau_global=4, pull_local=0.0,
                      pull_global=0.5, window=1, pull_delay=pull_delay)
    rule.before_step(1)                    # r <- x_0
    return rule, flat


def digest(t):
    return hashlib.md5(t.detach().numpy().tobytes()).hexdigest()


def counted(fn):
    before = world.stats.snapshot()
    fn()
    st = world.stats
    return (st.bytes_sent - before.bytes_sent, st.bytes_recv - before.bytes_recv,
            st.calls - before.calls)


# the global pull of step 4: the last rank leads (lowest loss); the leader's x - r = x, top 2
X = T(1, -1, 2, -2, 3, -3, 4, -4) + 4 * me * T(1, 0, 0, 0, 0, 0, 0, 1)
LOSS = 1.0 - 0.1 * me
STEP = {5: T(0, 0, 1, 0, 0, 0, 0, 0), 6: T(0, 0, 0, 0.5, 0, 0, 0, 0)}    # x moves on meanwhile
blocking, fb = build(0)
fb.params.copy_(X)
got_blocking = counted(lambda: blocking.after_step(4, LOSS))
delayed, fd = build(D)
fd.params.copy_(X)
got_delayed = counted(lambda: delayed.after_step(4, LOSS))
assert isinstance(delayed.delayed[GLOBAL][1], BookedRequest)     # posted, not waited for
assert torch.equal(delayed.reference, torch.zeros(8)) and delayed.pulls_done[GLOBAL] == 0
assert torch.equal(delayed.msg, blocking.msg) or me != P - 1      # the leader's message


def steps(rule, flat, first, last):
    got = (0, 0, 0)
    for step in range(first, last + 1):
        flat.params.add_(STEP.get(step, torch.zeros(8)))
        before_landing = rule.reference.clone()
        c = counted(lambda: rule.after_step(step, LOSS))
        got = tuple(a + b for a, b in zip(got, c))
        if step < 4 + D:                                # in flight: r and x untouched by it
            assert torch.equal(rule.reference, before_landing) and \
                rule.pulls_done[GLOBAL] == 0, step
    return got


saved = {}                                   # a message in flight: completed, kept to land
drained = counted(lambda: saved.update(delayed.state_dict()))      # (its last hops posted)
assert saved["global_delayed"]["pull_step"] == 4 + D and "copy" not in saved["global_delayed"]
assert len(set(world.allgather_object(digest(saved["global_delayed"]["message"])))) == 1
x_saved = fd.params.clone()
more = steps(delayed, fd, 5, 4 + D)
got_delayed = tuple(a + b + c for a, b, c in zip(got_delayed, drained, more))
# lands at 4 + D: r is the blocking pull's r bit for bit, on every rank
assert delayed.pulls_done[GLOBAL] == 1 and GLOBAL not in delayed.delayed
assert torch.equal(delayed.reference, blocking.reference)
assert len(set(world.allgather_object(digest(delayed.reference)))) == 1
lead = T(1, -1, 2, -2, 3, -3, 4, -4) + 4 * (P - 1) * T(1, 0, 0, 0, 0, 0, 0, 1)
top = lead.abs().topk(2).indices
R1 = torch.zeros(8)
R1[top] = lead[top]
if KIND == "int8":
    s = R1.abs().max() / 127
    R1 = torch.round(R1 / s) * s
if KIND == "fp32" and P == 1:
    assert torch.equal(R1, T(0, 0, 0, 0, 0, 0, 4, -4))
assert torch.equal(delayed.reference, R1), (delayed.reference, R1)
# every rank, the leader too, pulled toward r on its x of step 4 + D
x_now = X + sum(STEP[s] for s in range(5, 5 + D))
assert torch.allclose(fd.params, 0.5 * x_now + 0.5 * R1, rtol=0, atol=1e-6), fd.params
# the bytes and calls of the pull: the blocking pull's
assert got_delayed == got_blocking, (got_delayed, got_blocking)
if P > 1:
    assert got_delayed[0] > 0
# an exact resume with the message in flight
again, fa = build(D)
again.load_state_dict(saved)
fa.params.copy_(x_saved)
again.before_step(5)
steps(again, fa, 5, 4 + D)
assert torch.equal(again.reference, delayed.reference) and torch.equal(fa.params, fd.params)
# the next pull (step 8): r + d again the blocking rule's
for rule, flat in ((blocking, fb), (delayed, fd)):
    flat.params.copy_(X + 1.5 * T(0, 1, 0, 0, 0, 0, 0, 0))
    rule.after_step(8, LOSS)
steps(delayed, fd, 9, 8 + D)
assert torch.equal(delayed.reference, blocking.reference)
if me == 0:
    print("DELAYED_PULL_OK", flush=True)
"""


@pytest.mark.mpi
@pytest.mark.parametrize("ranks,rpn,kind,delay", [(1, 1, "fp32", 2), (2, 1, "fp32", 2),
                                                  (2, 1, "int8", 1), (4, 2, "int8", 2)])
def test_delayed_compressed_pull_lands_d_steps_later(tmp_path, ranks, rpn, kind, delay):
    """pull_delay d (4 ranks: 2 nodes of 2, the leader not its node's root): the message of
    step 4 is posted (non-blocking) and lands at 4 + d: r is
    the blocking pull's r, the same bits on every rank, and every rank is pulled toward it on
    its x of step 4 + d; the bytes and calls booked are the blocking pull's; a rule restored
    from a state saved with the message in flight lands it alike (bit for bit)."""
    script = tmp_path / "delayed.py"
    script.write_text(DELAYED_SCRIPT.replace("__KIND__", repr(kind))
                      .replace("__DELAY__", str(delay)).replace("__RPN__", str(rpn)))
    proc = run_mpi(ranks, [sys.executable, str(script)], timeout=120)
    assert "DELAYED_PULL_OK" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-2000:]


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
