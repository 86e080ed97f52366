"""Allreduce SGD with a compressed gradient (int8/fp8/int4/int2, top-k, error feedback):
docs/algorithms.md, "Allreduce SGD with a compressed gradient".

In process: the options it now takes and those still refused; the serial bucket plan that
keeps one staged collective in flight (a fake communicator records the order of the starts);
the re-keying of residuals left under another communicator's key and the reset of a residual
that turned inf or NaN. Under mpirun -np 4 as 2 nodes (the hierarchical compressed allreduce,
residuals on the node roots): bucketed (non-blocking, started from gradient hooks) and
blocking, int8 and top-k int2 with error feedback, the replicas bit-identical at every step,
the bytes between the nodes as the formula counts them, the residuals in the state and a
resume from it exact, also when the residuals were saved under another communicator's key.
One rank lost under ULFM (on_failure="shrink"): the survivors' replicas agree and their
residuals go on being fed back. Through the trainer (2 ranks): a resume from a checkpoint
ends with exactly the rows of the uninterrupted run."""

from __future__ import annotations

import sys

import pytest
import torch
from torch import nn

from mpi_util import run_mpi
from lsgd_hpc.comm import FlatParams, GradBuckets
from lsgd_hpc.methods.rules.allreduce import AllreduceRule
from lsgd_hpc.methods.spec import (comm_dtype_problem, error_feedback_decay_problem,
                                   error_feedback_problem, topk_problem)


# -- the options --------------------------------------------------------------------------
def test_allreduce_takes_the_compressed_gradient_options():
    """Before: int8/fp8/int4/int2, topk < 1 and error_feedback_decay were refused for
    allreduce; now they are accepted on mpi, torch and Horovod (its alltoall and allgather
    of byte buffers); error feedback without compression is refused."""
    for kind in ("int8", "fp8", "int4", "int2"):
        assert comm_dtype_problem(kind, "mpi", "allreduce") is None
        assert comm_dtype_problem(kind, "torch", "allreduce") is None
        assert comm_dtype_problem(kind, "horovod", "allreduce") is None
        assert error_feedback_problem(True, kind) is None
    for kind in ("fp32", "int8", "fp8", "int4", "int2"):
        assert topk_problem(0.01, kind, "mpi", "allreduce") is None
    assert topk_problem(0.01, "fp32", "horovod", "allreduce") is None
    assert error_feedback_decay_problem(0.9, True, "allreduce") is None
    assert "needs --error-feedback" in error_feedback_decay_problem(0.9, False, "allreduce")
    assert "--topk < 1" in error_feedback_problem(True, "fp32", 1.0)


def test_allreduce_sgd_check_accepts_them_without_a_world():
    import lsgd_hpc
    model = nn.Linear(8, 4)
    opt = torch.optim.SGD(model.parameters(), 0.1)
    for kw in (dict(comm_dtype="int8", error_feedback=True),
               dict(comm_dtype="int2", topk=0.01, error_feedback=True,
                    error_feedback_decay=0.95),
               dict(comm_dtype="fp32", topk=0.1), dict(comm_dtype="fp8", bucket_mb=0)):
        lsgd_hpc.AllreduceSGD.check(model, opt, world_size=4, node_of=[0, 0, 1, 1], **kw)
    for kind in ("int8", "bf16"):
        lsgd_hpc.AllreduceSGD.check(model, opt, world_size=4, backend="horovod",
                                    comm_dtype=kind)


# -- one staged collective in flight -------------------------------------------------------
class _Request:
    def __init__(self, log, b):
        self.log, self.b, self.complete = log, b, False

    def test(self):
        return self.complete

    def wait(self):
        if not self.complete:            # (waiting for a completed request does nothing)
            self.log.append(("wait", self.b))
        self.complete = True


class _FakeComm:
    """Two members that agree; records each bucket's start; requests complete on demand."""
    size = 2

    def __init__(self):
        self.log, self.requests = [], []

    def allgather_object(self, obj):
        return [obj, obj]

    def iallreduce_(self, tensor, op, agreed=False):
        req = _Request(self.log, len(self.requests))
        self.requests.append(req)
        self.log.append(("start", req.b))
        return req


def _three_layers():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 16, bias=False), nn.Linear(16, 16, bias=False),
                         nn.Linear(16, 4, bias=False))


@pytest.mark.parametrize("serial", [False, True])
def test_serial_buckets_keep_one_collective_in_flight(serial):
    """Buckets of one layer each (backward order: layer 3, 2, 1). Without ``serial`` every
    bucket starts from its hook as soon as its gradients are in; with it bucket k starts only
    once bucket k - 1 completed (a hook's test found it done, or finish waited for it), so
    the starts and completions alternate in bucket order on every rank."""
    model = _three_layers()
    flat = FlatParams(model)
    comm = _FakeComm()
    buckets = GradBuckets(comm, flat, bucket_bytes=16 * 4, serial=serial)
    assert buckets.n_buckets == 3
    model(torch.randn(2, 16)).sum().backward()
    started = [b for what, b in comm.log if what == "start"]
    assert started == ([0, 1, 2] if not serial else [0]), comm.log
    buckets.finish()
    if serial:
        assert comm.log == [("start", 0), ("wait", 0), ("start", 1), ("wait", 1),
                            ("start", 2), ("wait", 2)]
    else:
        assert comm.log == [("start", 0), ("start", 1), ("start", 2), ("wait", 0),
                            ("wait", 1), ("wait", 2)]
    # a request found complete by a later hook lets the next bucket start there
    comm.log.clear()
    comm.requests.clear()
    flat.grad.zero_()
    real = comm.iallreduce_

    def complete_at_once(tensor, op, agreed=False):
        req = real(tensor, op, agreed)
        req.complete = True
        return req
    comm.iallreduce_ = complete_at_once
    model(torch.randn(2, 16)).sum().backward()
    assert [b for what, b in comm.log if what == "start"] == [0, 1, 2]
    buckets.finish()
    buckets.remove()


# -- the residuals ------------------------------------------------------------------------
class _Wire:
    """What AllreduceRule reads of its wire: the residuals' state and error_feedback."""

    def __init__(self, residuals):
        self.residuals = dict(residuals)
        self.world = type("W", (), {"error_feedback": True})()

    def state_dict(self):
        return {"residuals": {k: v.clone() for k, v in self.residuals.items()}}

    def load_state_dict(self, state):
        self.residuals = {k: v.clone() for k, v in state.get("residuals", {}).items()}


def _rule_with(wire, key):
    rule = object.__new__(AllreduceRule)
    rule.wire, rule.buckets, rule._adopt = wire, None, True
    rule.world = type("C", (), {"key": key})()
    return rule


def test_residuals_left_under_another_key_are_taken_over():
    """A shrunk world (world~1) and its duplicates have new keys: the residual of a buffer
    slice saved under the old key is this rank's gradient not sent yet, and is taken over
    under the averaging communicator's key; of two, the one already under it is kept."""
    a, b, c = torch.tensor([1.0, 2.0]), torch.tensor([3.0]), torch.tensor([9.0, 9.0])
    wire = _Wire({"world/dup0/buffer2@0+2": a, "world/dup0/buffer2@2+1": b})
    rule = _rule_with(wire, "world~1/dup0")
    rule._adopt_residuals()
    assert sorted(wire.residuals) == ["world~1/dup0/buffer2@0+2", "world~1/dup0/buffer2@2+1"]
    assert torch.equal(wire.residuals["world~1/dup0/buffer2@0+2"], a)
    assert torch.equal(wire.residuals["world~1/dup0/buffer2@2+1"], b)
    assert rule._adopt is False
    wire = _Wire({"world~1/dup0/buffer2@0+2": c, "world/dup0/buffer2@0+2": a})
    _rule_with(wire, "world~1/dup0")._adopt_residuals()
    assert list(wire.residuals) == ["world~1/dup0/buffer2@0+2"]
    assert torch.equal(wire.residuals["world~1/dup0/buffer2@0+2"], c)


def test_a_residual_holding_inf_or_nan_is_reset():
    ok, bad = torch.tensor([1.0, -2.0]), torch.tensor([float("inf"), 1.0])
    wire = _Wire({"w/buffer2@0+2": ok, "w/buffer2@2+2": bad,
                  "w/buffer2@4+1": torch.tensor([float("nan")])})
    _rule_with(wire, "w")._reset_nonfinite_residuals()
    assert torch.equal(wire.residuals["w/buffer2@0+2"], ok)
    assert torch.equal(wire.residuals["w/buffer2@2+2"], torch.zeros(2))
    assert torch.equal(wire.residuals["w/buffer2@4+1"], torch.zeros(1))


# -- under mpirun: 4 ranks as 2 nodes -------------------------------------------------------
SCRIPT = r"""
import hashlib, io
import torch
from torch import nn
import lsgd_hpc
from lsgd_hpc.comm.quantized import allreduce_bytes
from lsgd_hpc.comm.sparse import sparse_layout
from lsgd_hpc.comm.buckets import bucket_bounds

comm = lsgd_hpc.init(backend="mpi", ranks_per_node=2, device="cpu")
me, root = comm.rank, comm.local_rank == 0
assert comm.size == 4 and comm.n_nodes == 2
g = torch.Generator().manual_seed(100 + me)
X = torch.randn(256, 12, generator=g)
Y = (X[:, :3].sum(1) > 0).long() + 2 * (X[:, 3] > 0).long()


def build(**kw):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 64), nn.ReLU(), nn.Linear(64, 4))   # 1092 values
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return model, opt, lsgd_hpc.AllreduceSGD(model, opt, comm, check_replicas_every=1, **kw)


def train(model, opt, method, steps, start=0):
    losses = []
    for i in range(start, start + steps):
        lo = (16 * i) % 256
        loss = nn.functional.cross_entropy(model(X[lo:lo + 16]), Y[lo:lo + 16])
        opt.zero_grad()
        loss.backward()
        method.step(loss)            # check_replicas_every=1: raises unless bit-identical
        losses.append(loss.item())
    return losses


def digest(t):
    return hashlib.md5(t.detach().numpy().tobytes()).hexdigest()


def saved(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


n = 1092
CASES = [("int8", 1.0, 0.0), ("int8", 1.0, 0.001), ("int2", 0.01, 0.0), ("int2", 0.01, 0.001)]
for kind, topk, mb in CASES:
    kw = dict(comm_dtype=kind, topk=topk, error_feedback=True, bucket_mb=mb)
    model, opt, method = build(**kw)
    assert method.wire is not None and method.wire.world.hierarchy() is not None
    buckets = method.rule.buckets
    sizes = [n] if mb == 0 else [hi - lo for lo, hi in bucket_bounds(
        [p.numel() for p in model.parameters()], 4, int(mb * 2 ** 20))]
    assert (mb == 0) == (buckets is None) and (mb == 0 or len(sizes) > 1), sizes
    # what a node root counts per step: its compressed exchange with the other root
    per_step = sum(allreduce_bytes(s, 2, kind=kind) if topk == 1 else
                   sparse_layout(s, topk, kind).counted for s in sizes)
    before = comm.stats.bytes_sent
    losses = train(model, opt, method, 8)
    assert comm.stats.bytes_sent - before == (8 * per_step if root else 0), \
        (kind, topk, mb, comm.stats.bytes_sent - before, per_step)
    assert losses[-1] < losses[0], losses
    # the residuals: on the node roots, under the averaging communicator's key
    residuals = method.wire.world.shared.residuals
    prefix = method.rule.averaging_comm.key + "/"
    if root:
        assert len(residuals) == len(sizes) and all(k.startswith(prefix) for k in residuals)
        assert all(float(e.abs().sum()) > 0 for e in residuals.values())
    else:
        assert not residuals
    state = saved({"model": model.state_dict(), "opt": opt.state_dict(),
                   "method": method.state_dict()})
    assert set(state["method"]["error_feedback"]["residuals"]) == set(residuals)
    after = train(model, opt, method, 4, start=8)
    want = digest(method.flat.flat)
    method.close()
    # resumed from the state: the same bits; and again with the residuals saved under another
    # communicator's key (a shrunk world's checkpoint): taken over, the same bits
    for rename in (False, True):
        st = saved(state)
        if rename:
            res = st["method"]["error_feedback"]["residuals"]
            st["method"]["error_feedback"]["residuals"] = {
                "world~7/dup3/" + k.rpartition("/")[2]: v for k, v in res.items()}
        m2, o2, meth2 = build(**kw)
        m2.load_state_dict(st["model"])
        o2.load_state_dict(st["opt"])
        meth2.load_state_dict(st["method"])
        got = train(m2, o2, meth2, 4, start=8)
        assert got == after, (kind, topk, mb, rename, got, after)
        assert digest(meth2.flat.flat) == want, (kind, topk, mb, rename)
        assert all(k.startswith(meth2.rule.averaging_comm.key + "/")
                   for k in meth2.wire.world.shared.residuals)
        meth2.close()

# an inf gradient (an fp16 step that overflowed): the residuals are reset, not poisoned
model, opt, method = build(comm_dtype="int8", error_feedback=True, bucket_mb=0)
train(model, opt, method, 2)
loss = nn.functional.cross_entropy(model(X[:16]), Y[:16])
opt.zero_grad()
loss.backward()
if me == 0:
    next(model.parameters()).grad[0, 0] = float("inf")
method.synchronize()
assert not torch.isfinite(method.flat.grad).all()
assert all(torch.isfinite(e).all() for e in method.wire.world.shared.residuals.values())
method.close()
if me == 0:
    print("COMPRESSED_ALLREDUCE_OK", flush=True)
"""


@pytest.mark.mpi
@pytest.mark.timeout(300)
def test_compressed_allreduce_four_ranks_two_nodes(tmp_path):
    script = tmp_path / "compressed_allreduce.py"
    script.write_text(SCRIPT)
    proc = run_mpi(4, [sys.executable, str(script)], timeout=280)
    assert "COMPRESSED_ALLREDUCE_OK" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.mark.mpi
@pytest.mark.timeout(300)
@pytest.mark.parametrize("wire", [['comm_dtype="int8"'], ['comm_dtype="int2"', "topk=0.01"]],
                         ids=["int8", "topk-int2"])
def test_compressed_allreduce_survives_a_lost_rank(tmp_path, wire):
    """on_failure="shrink" under ULFM (tests/drivers/ft_loop.py, as the periodic methods'
    test in tests/comm/test_faults_mpi.py): 4 ranks as 2 nodes, gradient buckets of about
    500 bytes, error feedback; rank 2, the root of node 1, killed at step 7. Rank 3 becomes
    that node's root (nodes of 2 and 1 ranks: still hierarchical); the 3 survivors finish
    the budget with bit-identical replicas (parameters and optimizer state), every value
    finite, residuals on both roots (non-zero: fed back after the recovery too) and none on
    the other rank."""
    from test_faults_mpi import check_survivors, run_ft
    options = [a for w in wire for a in ("-o", w)]
    proc, res, run_dir = run_ft(tmp_path, "allreduce", "--kill", "2:7", "--hidden", "64",
                                *options, "-o", "error_feedback=true")
    check_survivors(proc, res, [2])
    assert len({r["digest"] for r in res}) == 1
    roots = [r for r in res if r["local_rank"] == 0]
    assert len(roots) == 2 and all(r["residual_norm"] > 0 for r in roots), res
    assert all(r["residual_norm"] == 0 for r in res if r["local_rank"] != 0), res


@pytest.mark.mpi
@pytest.mark.timeout(600)
@pytest.mark.parametrize("wire", [["--comm-dtype", "int8"],
                                  ["--comm-dtype", "int2", "--topk", "0.05"]],
                         ids=["int8", "topk-int2"])
def test_trainer_resumes_exactly(tmp_path, wire):
    """Through the trainer (tests/runtime/test_checkpoint.py's check, 2 ranks): allreduce SGD
    with its gradient in buckets of about 10 kB (digits_cnn: several, each with its residual),
    error feedback, checkpoints at 20 and 24; the newest set damaged on rank 0, the resume
    falls back to step 20 and ends with exactly the rows of the uninterrupted run."""
    from test_checkpoint import resumes_like_the_uninterrupted_run
    args = ["--algorithm", "allreduce", *wire, "--error-feedback", "--bucket-mb", "0.01",
            "--max-steps", "24", "--checkpoint-every", "10", "--eval-every", "8", "--seed", "7",
            "--consensus-every", "4", "--check-replicas-every", "1"]
    reference = resumes_like_the_uninterrupted_run(tmp_path / "run", args)
    for r, rows in enumerate(reference):
        loss = rows["train"]["loss"]
        assert loss[-6:].mean() < 0.8 * loss[:6].mean(), (wire, r, loss)
