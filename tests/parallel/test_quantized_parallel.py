"""int8/fp8 communication at any world size (size 1 under plain pytest, 2/4/5 ranks under
mpirun through tests/test_parallel_mpi.py, mpi and torch backends; Horovod refuses it).

The quantized allreduce and broadcasts end with the same bits on every rank, within the
quantization bound of the exact result, and count the documented bytes; error feedback
removes the bias that rounding leaves and follows its update rule exactly; every periodic
method trains with int8 and fp8 in a quarter of the bytes; a run with error feedback resumes
exactly from its state_dict (lsgd_hpc.comm.quantized).
"""

import copy
import hashlib
import io
import os

import pytest
import torch
from torch import nn

from lsgd_hpc.comm.quantized import (BLOCK, KINDS, Quantized, allreduce_bytes, broadcast_bytes,
                                     layout, quantized_groups, roundtrip)
from lsgd_hpc.methods import METHODS

BACKEND = os.environ.get("LSGD_TEST_BACKEND", "mpi")
#: one quantization's largest error relative to its block's max|x| (tests/comm/test_quantized.py)
REL = {"int8": 0.5 / 127, "fp8": 16 / 448}
PERIODIC = ["lsgd", "easgd", "local-sgd", "diloco", "slowmo"]
OPTIONS = {"lsgd": dict(tau_local=2, tau_global=4), "easgd": dict(easgd_tau=2),
           "local-sgd": dict(local_steps=4), "diloco": dict(local_steps=4, outer_lr=0.7),
           "slowmo": dict(local_steps=2, slowmo_every=8)}


def quantized_backend(world):
    if BACKEND == "horovod":
        pytest.skip("Horovod refuses int8/fp8 (test_refusals checks it)")
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
    two quantizations of the exact sum or mean, and counts n + 4 p b bytes each way."""
    quantized_backend(world)
    q = Quantized(world, kind)
    p = world.size
    t = vector(world.rank, n)
    before = world.stats.snapshot()
    assert q.allreduce_(t, op) is t
    assert world.stats.bytes_sent - before.bytes_sent == allreduce_bytes(n, p)
    assert world.stats.bytes_recv - before.bytes_recv == allreduce_bytes(n, p)
    assert world.stats.calls - before.calls == 1
    assert allreduce_bytes(n, p) == n + 4 * p * layout(n, p).b
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
        nb = broadcast_bytes(n)
        assert (sent, recv) == ((nb, 0) if world.rank == root else (0, nb))
        assert nb == n + 4 * 2        # ceil(5003 / 4096) scales


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_broadcast_across_nodes_forwards_the_same_bytes(world, groups, kind):
    """NodeGroups.broadcast_from_ over quantized groups: quantized once at the source, the
    bytes forwarded hop by hop (never requantized), so every rank holds the same bits; each
    hop counts n + 4 ceil(n / BLOCK) where float32 counts 4 n."""
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
        assert world.stats.bytes_sent - before.bytes_sent == sent32 // (4 * n) * broadcast_bytes(n)
        assert world.stats.bytes_recv - before.bytes_recv == recv32 // (4 * n) * broadcast_bytes(n)
    assert len(set(world.allgather_object(digest(t)))) == 1


#: an outlier that makes 0.1 round to 0 in its block: int8's step is 100 / 127; fp8's
#: smallest (subnormal) step is 2^-9 of 1e5 / 448, 0.44
OUTLIER = {"int8": 100.0, "fp8": 1e5}


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


def rank_data(rank: int, n: int = 64):
    g = torch.Generator().manual_seed(1000 + rank)
    x = torch.randn(n, 10, generator=g)
    y = (x[:, :3].sum(1) > 0).long() + 2 * (x[:, 3] > 0).long()
    return x, y


@pytest.mark.parametrize("name", PERIODIC)
def test_methods_train_in_a_quarter_of_the_bytes(comm, name):
    """Each periodic method, the same loop in fp32, int8, fp8 and int8 with error feedback:
    the reported model learns the task, and the bytes are about a quarter (the scales and the
    elections add a little)."""
    quantized_backend(comm.world)
    if comm.size not in (2, 4):
        pytest.skip("training bodies run at 2 and 4 ranks (suite time)")
    sent = {}
    runs = [("fp32", False)] + [(k, False) for k in sorted(KINDS)] + [("int8", True)]
    for dtype, ef in runs:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 4))
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        method = METHODS[name](model, opt, comm, max_steps=40, comm_dtype=dtype,
                               error_feedback=ef, **OPTIONS[name])
        x, y = rank_data(comm.rank, 256)
        s0 = comm.stats.bytes_sent
        while not method.done:
            i = (method.steps % 8) * 32
            loss = nn.functional.cross_entropy(model(x[i:i + 32]), y[i:i + 32])
            opt.zero_grad()
            loss.backward()
            method.step(loss)
        sent[(dtype, ef)] = comm.stats.bytes_sent - s0
        xt, yt = rank_data(10_000, 512)
        with method.reported_model() as m, torch.no_grad():
            acc = float((m(xt).argmax(1) == yt).float().mean())
        assert acc > 0.75, (name, dtype, ef, acc)
        method.close()
    total = comm.allgather_object(sent)
    fp32 = sum(t[("fp32", False)] for t in total)
    for key in sent:
        if key != ("fp32", False):
            ratio = sum(t[key] for t in total) / fp32
            assert 0.24 <= ratio <= 0.30, (name, key, ratio)


def test_refusals(comm):
    """Allreduce SGD, gossip and asynchronous LSGD refuse int8/fp8, Horovod refuses both, and
    error feedback needs them: a ValueError on every rank, before any collective."""
    def build(name, **kw):
        model = nn.Linear(4, 2)
        return METHODS[name](model, torch.optim.SGD(model.parameters(), 0.1), comm, **kw)
    for name in ("allreduce", "gossip", "lsgd-async"):
        with pytest.raises(ValueError, match=f"comm_dtype int8 is not for {name}: "):
            build(name, comm_dtype="int8")
    with pytest.raises(ValueError, match="error_feedback needs --comm-dtype int8 or fp8"):
        build("diloco", error_feedback=True)
    if comm.backend == "horovod":
        with pytest.raises(ValueError, match="int8 needs the mpi or torch backend"):
            build("lsgd", comm_dtype="int8")


@pytest.mark.parametrize("name", ["local-sgd", "diloco"])
def test_error_feedback_resumes_exactly(comm, name):
    """int8 with error feedback: 7 steps, state saved (through torch.save), 9 more equals a
    fresh model/optimizer/method loaded from that state and trained the same 9 steps, bit for
    bit; loaded without the residuals it differs (they matter)."""
    if BACKEND == "horovod":
        pytest.skip("Horovod refuses int8")

    def fresh():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 4))
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        return model, opt, METHODS[name](model, opt, comm, comm_dtype="int8",
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
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(),
                "method": method.state_dict()}, buf)
    residuals = method.state_dict()["error_feedback"]["residuals"]
    if comm.size > 1:
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
