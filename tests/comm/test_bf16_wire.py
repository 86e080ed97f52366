"""bf16 on the compressed wire (issue 47, item 1d): top-k records with bf16 values
(lsgd_hpc.comm.sparse: 2 bytes a value, no scale) and error feedback for bf16
(lsgd_hpc.comm.lowprec: e <- (v + beta e) - bf16(v + beta e)), by hand in this process; the
options that now take them; a method's residuals saved and resumed bit for bit; and under
mpirun -np 4 (2 ranks a node) the hierarchical top-k allreduce with bf16 values, the dense
bf16 broadcast beside it, and the bf16 allreduce with error feedback across ranks."""

import sys

import pytest
import torch
from torch import nn

import lsgd_hpc
from lsgd_hpc.comm.lowprec import LowPrecisionGroups, Residuals
from lsgd_hpc.comm.quantized import QuantizedGroups
from lsgd_hpc.comm.sparse import (decode, encode, payload_bytes, reduce_records, select,
                                  sent_vector, sparse_layout)
from lsgd_hpc.methods.spec import comm_dtype_problem, error_feedback_problem, topk_problem
from mpi_util import run_mpi


def bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).to(torch.float32)


# -- top-k records with bf16 values ------------------------------------------------------------
def test_bf16_records_layout_and_bytes():
    """k int16 indices and k bf16 values a chunk, no scale: S = m (2 k + 2 k) bytes."""
    lay = sparse_layout(10_000, 0.01, "bf16")
    assert (lay.c, lay.m, lay.k, lay.scale_bytes) == (4096, 3, 41, 0)
    assert lay.counted == 3 * (41 * 2 + 41 * 2)
    assert lay.record % 4 == 0 and lay.record == 41 * 4
    assert sparse_layout(300, 0.5, "bf16").counted == 150 * 4
    # half fp32's values, the indices the same
    fp32 = sparse_layout(10_000, 0.01, "fp32").counted
    assert fp32 - lay.counted == 3 * 41 * 2
    assert payload_bytes(10_000, 4, 0.01, "bf16") == (lay.counted, 3 * lay.counted)


def test_bf16_records_by_hand():
    """Chunks of 4, the 2 largest |w| of each; values rounded to nearest even bf16 (8 bits of
    mantissa): 1/3 -> 0.333984375, 1 + 2^-8 (a tie) -> 1, 1 + 3 2^-8 -> 1 + 2^-6; the
    rank-order sum of two ranks' records."""
    w = torch.tensor([0.25, -3.0, 1 / 3, 0.1, 0.0, 1 + 2 ** -8, 7.0, -1.0, 4.0, 1 + 3 * 2 ** -8])
    lay = sparse_layout(10, 0.5, "bf16", chunk=4)
    assert (lay.c, lay.m, lay.k) == (4, 3, 2)
    idx, values = select(w, lay)
    assert idx.tolist() == [[1, 2], [1, 2], [0, 1]]
    buf = torch.zeros(lay.m * lay.record, dtype=torch.uint8)
    encode(idx, values, lay, buf)
    i2, v2 = decode(buf, lay)
    assert torch.equal(i2, idx) and v2.dtype == torch.float32
    assert v2.tolist() == [[-3.0, 0.333984375], [1.0, 7.0], [4.0, 1 + 2 ** -6]]
    assert torch.equal(v2, bf16(values))
    sent = sent_vector(i2, v2, lay)
    assert sent.tolist() == [0, -3, 0.333984375, 0, 0, 1, 7, 0, 4, 1 + 2 ** -6]
    both = torch.stack([buf, buf])
    assert torch.equal(reduce_records(both, lay, 2), 2 * sent)


def test_bf16_records_error_feedback_recursion():
    """e <- w - sent(w) with w = v + e: what top-k and the bf16 rounding left out is sent
    later; the sum of what was sent over rounds is the sum of the inputs minus the last
    residual, and the running mean approaches the input."""
    torch.manual_seed(0)
    v = torch.randn(4096 * 2)
    lay = sparse_layout(v.numel(), 0.05, "bf16")
    e = torch.zeros_like(v)
    total = torch.zeros_like(v)
    buf = torch.zeros(lay.m * lay.record, dtype=torch.uint8)
    errors = []
    for t in range(1, 61):
        w = v + e
        encode(*select(w, lay), lay, buf)
        sent = sent_vector(*decode(buf, lay), lay)
        e = w - sent
        total += sent
        errors.append(float((total / t - v).norm() / v.norm()))
    assert torch.allclose(total + e, 60 * v, atol=1e-3)
    assert errors[0] > 0.8 and errors[-1] < 0.2 * errors[0], (errors[0], errors[-1])


# -- error feedback for bf16 ------------------------------------------------------------------
def test_bf16_error_feedback_by_hand():
    """v = 1 + 2^-10 rounds to 1 in bf16 every round without feedback; with it the residual
    grows by 2^-10 a round until the input rounds up to 1 + 2^-7: sent + e = what came in,
    exactly (dyadic values), and after 128 rounds the mean sent is v within 2^-10 / 128."""
    res = Residuals()
    v = torch.full((4,), 1 + 2 ** -10)
    sent, seen = [], []
    for _ in range(128):
        low = res.rounded("world", v, torch.bfloat16)
        assert low.dtype == torch.bfloat16
        sent.append(low.to(torch.float32))
        (e,) = res.residuals.values()
        seen.append(float(e[0]))
    assert seen[:4] == [2 ** -10, 2 * 2 ** -10, 3 * 2 ** -10, 4 * 2 ** -10]
    assert sent[0][0] == 1.0 and sent[4][0] == 1 + 2 ** -7      # 5 2^-10 rounds up
    total = torch.stack(sent).sum(0)
    assert torch.equal(total + e, 128 * v)                      # nothing lost
    assert abs(float(total[0]) / 128 - float(v[0])) <= 2 ** -8 / 128      # |e| <= half a step
    assert bf16(v)[0] == 1.0                                    # without: 2^-10 lost a round


def test_bf16_error_feedback_decay():
    """beta < 1: w = v + beta e, e <- w - bf16(w)."""
    res = Residuals(decay=0.5)
    v = torch.full((2,), 1 + 2 ** -9)
    res.rounded("k", v, torch.bfloat16)
    (e,) = res.residuals.values()
    assert e.tolist() == [2 ** -9] * 2                          # 1 + 2^-9 -> 1
    low = res.rounded("k", v, torch.bfloat16)
    w = 1 + 2 ** -9 + 0.5 * 2 ** -9                              # 1 + 1.5 2^-9 -> 1
    assert low.to(torch.float32).tolist() == [1.0] * 2
    assert res.residuals["k/numel2"].tolist() == [w - 1.0] * 2


def test_residuals_are_keyed_by_the_registered_buffer():
    res = Residuals()
    buf = torch.zeros(1000)
    res.agreed.extend([torch.zeros(10), buf])
    res.rounded("world", buf[200:700], torch.bfloat16)
    res.rounded("world", torch.zeros(300), torch.bfloat16)
    assert sorted(res.residuals) == ["world/buffer1@200+500", "world/numel300"]
    state = res.state_dict("bf16")
    assert state["comm_dtype"] == "bf16" and state["error_feedback_decay"] == 1.0
    other = Residuals()
    other.load_state_dict(state)
    assert all(torch.equal(other.residuals[k], res.residuals[k]) for k in res.residuals)


# -- the options --------------------------------------------------------------------------------
def test_bf16_options_accepted_where_they_mean_something():
    for name in ("lsgd", "easgd", "local-sgd", "diloco", "slowmo"):
        assert topk_problem(0.01, "bf16", "mpi", name) is None
        assert topk_problem(0.01, "bf16", "torch", name) is None
        assert error_feedback_problem(True, "bf16", 0.01, name) is None
    for name in ("easgd", "local-sgd", "diloco", "slowmo", "allreduce"):
        assert error_feedback_problem(True, "bf16", 1.0, name) is None
    for name in ("lsgd", "lsgd-async", "gossip"):               # no allreduce: nothing to feed
        why = error_feedback_problem(True, "bf16", 1.0, name)
        assert why.startswith(f"is not for {name}: ") and "no allreduce" in why
    assert error_feedback_problem(True, "fp32").startswith("needs --comm-dtype bf16")
    assert topk_problem(0.01, "bf16", "horovod", "diloco") is None  # records: Horovod's allgather
    assert comm_dtype_problem("bf16", "horovod", "diloco") is None


@pytest.fixture(scope="module")
def comm():
    return lsgd_hpc.init(backend="mpi")


def test_the_method_gets_the_bf16_wire(comm):
    """bf16 + error feedback: the low-precision groups hold the residuals (the method's
    wire); bf16 + top-k: the quantized groups with bf16 values; bf16 alone: no wire."""
    model = nn.Linear(64, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    m = lsgd_hpc.DiLoCo(model, opt, comm, comm_dtype="bf16", error_feedback=True)
    assert isinstance(m.wire, LowPrecisionGroups) and m.wire.world.error_feedback
    assert m.node_stats is None
    m.close()
    m = lsgd_hpc.EASGD(model, opt, comm, comm_dtype="bf16", topk=0.05, error_feedback=True)
    assert isinstance(m.wire, QuantizedGroups) and m.wire.world.kind == "bf16"
    m.close()
    m = lsgd_hpc.DiLoCo(model, opt, comm, comm_dtype="bf16")
    assert m.wire is None
    m.close()


def test_bf16_error_feedback_resumes_exactly(comm, tmp_path):
    """DiLoCo in bf16 with error feedback on one rank (the rounding happens there too; top-k's
    residuals, on more than one rank: the mpirun test below): 6 steps, state saved through torch.save, 6 more equals
    a fresh model/optimizer/method loaded from that state, bit for bit; the residuals are in
    the state, are not zero, and matter (loaded without them, the run differs)."""
    def make():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(32, 16), nn.Tanh(), nn.Linear(16, 4))
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        m = lsgd_hpc.DiLoCo(model, opt, comm, comm_dtype="bf16", error_feedback=True,
                            local_steps=2, max_steps=100)
        return model, opt, m

    def train(model, opt, m, steps, seed):
        g = torch.Generator().manual_seed(seed)
        for _ in range(steps):
            x = torch.randn(8, 32, generator=g)
            loss = (model(x) - 1).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            m.step(loss)

    model, opt, m = make()
    train(model, opt, m, 6, 1)
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "m": m.state_dict()},
               tmp_path / "ck.pt")
    state = m.state_dict()["error_feedback"]
    assert state["comm_dtype"] == "bf16" and state["residuals"]
    assert any(float(e.abs().max()) > 0 for e in state["residuals"].values())
    train(model, opt, m, 6, 2)
    want = [p.detach().clone() for p in model.parameters()]
    m.close()
    for keep in (True, False):
        model2, opt2, m2 = make()
        ck = torch.load(tmp_path / "ck.pt")
        if not keep:
            ck["m"]["error_feedback"]["residuals"] = {}
        model2.load_state_dict(ck["model"])
        opt2.load_state_dict(ck["opt"])
        m2.load_state_dict(ck["m"])
        train(model2, opt2, m2, 6, 2)
        same = all(torch.equal(a, b) for a, b in zip(want, model2.parameters()))
        assert same == keep, keep
        m2.close()


# -- across ranks -------------------------------------------------------------------------------
SCRIPT = r"""
import hashlib, torch
from lsgd_hpc.comm import NodeGroups, make_world
from lsgd_hpc.comm.lowprec import low_precision_groups
from lsgd_hpc.comm.quantized import quantized_groups
from lsgd_hpc.comm.sparse import encode, decode, reduce_records, select, sent_vector, sparse_layout

world = make_world("mpi")
assert world.size == 4
base = NodeGroups.build(world, 2)                  # two nodes of two ranks: hierarchical
me, n = world.rank, 1000

def digest(t):
    return hashlib.md5(t.detach().numpy().tobytes()).hexdigest()

def same_everywhere(t):
    assert len(set(world.allgather_object(digest(t)))) == 1

def v_of(r):
    g = torch.Generator().manual_seed(100 + r)
    return torch.randn(n, generator=g)

# 1. top-k 5 %, bf16 values, error feedback, through the node hierarchy: node sums in float32,
#    the roots' records, the sum in rank order / P, the float32 broadcast in the node
wire = quantized_groups(base, "bf16", error_feedback=True, topk=0.05)
buf = torch.zeros(n)
wire.world.agree_buffers(buf)
lay = sparse_layout(n, 0.05, "bf16")
res = [torch.zeros(n), torch.zeros(n)]             # the node roots' residuals, by hand
before = world.stats.snapshot()
for rnd in range(3):
    buf.copy_(v_of(me) * (rnd + 1))
    wire.world.allreduce_(buf, "mean")
    every = []
    for node in (0, 1):
        s = v_of(2 * node) * (rnd + 1) + v_of(2 * node + 1) * (rnd + 1)
        w = s + res[node]
        rec = torch.zeros(lay.m * lay.record, dtype=torch.uint8)
        encode(*select(w, lay), lay, rec)
        res[node] = w - sent_vector(*decode(rec, lay), lay)
        every.append(rec)
    want = reduce_records(torch.stack(every), lay, 2) / 4
    assert torch.equal(buf, want), (rnd, float((buf - want).abs().max()))
    same_everywhere(buf)
state = wire.state_dict()
if base.is_root:
    (e,) = state["residuals"].values()
    assert torch.equal(e, res[base.node_index])
counted = world.stats.bytes_sent - before.bytes_sent
assert counted == (3 * lay.counted if base.is_root else 0), counted

# 2. the dense broadcast beside it: bf16, the same bits on every rank, the root's too
x = torch.randn(n, generator=torch.Generator().manual_seed(7)) * (1 + me)
wire.broadcast_from_(x, 3)
want = torch.randn(n, generator=torch.Generator().manual_seed(7)) * 4
assert torch.equal(x, want.to(torch.bfloat16).float())
same_everywhere(x)

# 3. the bf16 allreduce with error feedback over the world: each rank sends bf16(v + e) and
#    keeps e <- (v + e) - bf16(v + e); inputs below bf16's step near 1 are lost at every
#    round without it, and their mean over 64 rounds arrives with it
low = low_precision_groups(base, torch.bfloat16, error_feedback=True)
plain = low_precision_groups(base, torch.bfloat16)
b = torch.zeros(n)
low.world.agree_buffers(b)
def u_of(r):        # 1 + less than bf16's step, on every 4th element from r (disjoint: the
    u = torch.zeros(n)     # backend's bf16 sum of the four adds exact zeros)
    u[r::4] = 1 + torch.rand(n, generator=torch.Generator().manual_seed(r))[r::4] * 2 ** -7
    return u
v = u_of(me)
true = sum(u_of(r) for r in range(4)) / 4
fed, unfed = torch.zeros(n), torch.zeros(n)
e = torch.zeros(n)
for t in range(64):
    w = v + e                                       # by hand: sent bf16(w), e <- w - bf16(w)
    b.copy_(v)
    low.world.allreduce_(b, "mean")
    e = w - w.to(torch.bfloat16).float()
    assert torch.equal(low.world.residuals.residuals[f"{world.key}/buffer0@0+{n}"], e)
    fed += b
    c = v.clone()
    plain.world.allreduce_(c, "mean")
    unfed += c
    same_everywhere(b)
err_fed = float((fed / 64 - true).abs().mean())
err_unfed = float((unfed / 64 - true).abs().mean())
assert err_fed < err_unfed / 4, (err_fed, err_unfed)
assert list(low.state_dict()["residuals"]) == [f"{world.key}/buffer0@0+{n}"]
print("BF16_WIRE_OK", me, err_fed, err_unfed)
"""


@pytest.mark.mpi
def test_bf16_wire_across_four_ranks(tmp_path):
    script = tmp_path / "bf16_wire.py"
    script.write_text(SCRIPT)
    proc = run_mpi(4, [sys.executable, str(script)], timeout=180)
    assert proc.stdout.count("BF16_WIRE_OK") == 4, proc.stdout[-2000:] + proc.stderr[-2000:]
