"""The compressed wire on Horovod (issue 47, item 2): the quantized allreduce's alltoall and
allgather of byte records, and top-k's allgather of index/value records, through Horovod's
own collectives (hvd.alltoall with splits, hvd.allgather on uint8 tensors). Under mpirun -np 4
(two nodes of two ranks, so the hierarchical allreduce and its process sets run too) the same
inputs give the same bits and the same counted bytes on the Horovod world as on the MPI world;
and a short trainer run with --backend horovod --comm-dtype int8 --error-feedback finishes."""

import sys

import pytest

from lsgd_hpc.methods.spec import comm_dtype_problem, topk_problem
from mpi_util import horovod_available, run_mpi

needs_horovod = pytest.mark.skipif(not horovod_available(),
                                   reason="Horovod is not installed in this venv (make horovod)")


def test_horovod_takes_the_compressed_wire():
    for kind in ("int8", "fp8", "int4", "int2"):
        assert comm_dtype_problem(kind, "horovod", "local-sgd") is None
    assert topk_problem(0.05, "int8", "horovod", "local-sgd") is None
    assert comm_dtype_problem("bf16", "horovod", "local-sgd") is None
    # what is not for a method stays refused on every backend alike
    assert comm_dtype_problem("int8", "horovod", "lsgd-async") == \
        comm_dtype_problem("int8", "mpi", "lsgd-async")


SCRIPT = r"""
import hashlib, torch
from lsgd_hpc.comm import NodeGroups, make_world
from lsgd_hpc.comm.quantized import Quantized, quantized_groups

mpi = make_world("mpi")
hvd = make_world("horovod")
assert hvd.size == mpi.size == 4 and type(hvd).__name__ == "HorovodCommunicator"
me, n = mpi.rank, 3001                       # not a multiple of the block or of 4: padding

def v_of(r, rnd):
    return torch.randn(n, generator=torch.Generator().manual_seed(1000 * rnd + r)) * (1 + r)

def digest(t):
    return hashlib.md5(t.numpy().tobytes()).hexdigest()

# 0. the byte collectives themselves, uint8 with chunks of 5
send = torch.arange(20, dtype=torch.uint8) + 40 * me
for w in (mpi, hvd):
    out = torch.zeros(20, dtype=torch.uint8)
    w.alltoall(send, out)
    assert out.tolist() == [40 * i + 5 * me + j for i in range(4) for j in range(5)], out
    out = torch.zeros(80, dtype=torch.uint8)
    w.allgather(send, out)
    assert out.tolist() == [40 * i + j for i in range(4) for j in range(20)], out

# 1. flat: int8, int4 (each with error feedback), top-k 5 % of int8; 3 rounds, mean
for kind, topk in (("int8", 1.0), ("int4", 1.0), ("int8", 0.05), ("fp32", 0.05)):
    got = {}
    for name, w in (("mpi", mpi), ("horovod", hvd)):
        q = Quantized(w, kind, error_feedback=True, topk=topk)
        buf = torch.zeros(n)
        q.agree_buffers(buf)
        before = w.stats.snapshot()
        outs = []
        for rnd in range(3):
            buf.copy_(v_of(me, rnd))
            q.allreduce_(buf, "mean")
            outs.append(buf.clone())
        got[name] = (torch.cat(outs), w.stats.bytes_sent - before.bytes_sent,
                     w.stats.bytes_recv - before.bytes_recv)
    a, b = got["mpi"], got["horovod"]
    assert torch.equal(a[0], b[0]), (kind, topk, float((a[0] - b[0]).abs().max()))
    print("SAME", kind, topk, a[1:], me)
    assert a[1:] == b[1:] and a[1] > 0, (kind, topk, a[1:], b[1:])
    assert len(set(mpi.allgather_object(digest(b[0])))) == 1
    # compressed: not the float32 result
    exact = sum(v_of(r, 2) for r in range(4)) / 4
    assert not torch.equal(b[0][-n:], exact), (kind, topk)
    if topk == 1:
        err = float((b[0][-n:] - exact).norm() / exact.norm())
        assert err < (0.02 if kind == "int8" else 0.3), (kind, err)

# 2. hierarchical (two nodes of two ranks): node sums, the roots' int8 exchange over a
#    Horovod process set, the node broadcast; the same bits as on MPI
got = {}
for name, w in (("mpi", mpi), ("horovod", hvd)):
    wire = quantized_groups(NodeGroups.build(w, 2), "int8", error_feedback=True)
    buf = torch.zeros(n)
    wire.world.agree_buffers(buf)
    outs = []
    for rnd in range(2):
        buf.copy_(v_of(me, rnd))
        wire.world.allreduce_(buf, "mean")
        outs.append(buf.clone())
    got[name] = torch.cat(outs)
assert torch.equal(got["mpi"], got["horovod"])

# 3. bf16 (Horovod has no bfloat16 sum): a reduce-scatter by alltoall, the rank-order sum
#    rounded after every addition, an allgather; by hand here; counted as MPI's bf16 allreduce
def by_hand(xs):
    acc = xs[0].to(torch.bfloat16)
    for x in xs[1:]:
        acc = (acc.float() + x.to(torch.bfloat16).float()).to(torch.bfloat16)
    return acc
for m in (1, 7, n):
    t = v_of(me, 5)[:m].to(torch.bfloat16)
    counts = []
    for w in (mpi, hvd):
        before = w.stats.snapshot()
        u = t.clone()
        w.allreduce_(u, "sum")
        counts.append((w.stats.bytes_sent - before.bytes_sent, w.stats.bytes_recv - before.bytes_recv))
        if w is hvd:
            assert torch.equal(u, by_hand([v_of(r, 5)[:m] for r in range(4)])), m
            assert len(set(mpi.allgather_object(digest(u.view(torch.int16))))) == 1
    assert counts[0] == counts[1] == (2 * m, 2 * m), counts
u = v_of(me, 6).to(torch.bfloat16)
req = hvd.iallreduce_(u, "mean")
req.wait()
want = by_hand([v_of(r, 6) for r in range(4)]) / 4
assert torch.equal(u, want)
# the bf16 wire with error feedback, through the node hierarchy (process sets): every rank
# the same bits
from lsgd_hpc.comm.lowprec import low_precision_groups
low = low_precision_groups(NodeGroups.build(hvd, 2), torch.bfloat16, error_feedback=True)
b = torch.zeros(n)
low.world.agree_buffers(b)
for rnd in range(3):
    b.copy_(v_of(me, rnd))
    low.world.allreduce_(b, "mean")
    assert len(set(mpi.allgather_object(digest(b)))) == 1
    exact = sum(v_of(r, rnd) for r in range(4)) / 4
    assert float((b - exact).norm() / exact.norm()) < 0.01
print("HOROVOD_WIRE_OK", me)
"""


@pytest.mark.mpi
@needs_horovod
def test_horovod_compressed_allreduce_same_bits_as_mpi(tmp_path):
    script = tmp_path / "horovod_wire.py"
    script.write_text(SCRIPT)
    proc = run_mpi(4, [sys.executable, str(script)], timeout=240)
    assert proc.stdout.count("HOROVOD_WIRE_OK") == 4, proc.stdout[-2000:] + proc.stderr[-2000:]


@pytest.mark.mpi
@needs_horovod
def test_horovod_trainer_int8_error_feedback_finishes(tmp_path):
    run_dir = tmp_path / "run"
    proc = run_mpi(2, [sys.executable, "-m", "lsgd_hpc.train", "--backend", "horovod",
                       "--comm-dtype", "int8", "--error-feedback", "--algorithm", "local-sgd",
                       "--max-steps", "20", "--run-dir", str(run_dir)], timeout=300)
    assert proc.returncode == 0
    assert any(run_dir.rglob("*")), "the run wrote nothing"
