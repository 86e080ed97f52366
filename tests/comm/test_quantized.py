"""The maths of int8/fp8 communication, without communication: block quantization worked out
by hand, the layout and its byte formula, non-finite blocks, the error bound, and the
options' refusals (lsgd_hpc.comm.quantized, lsgd_hpc.methods.spec). The collectives
themselves run under mpirun: tests/parallel/test_quantized_parallel.py."""

import pytest
import torch

from lsgd_hpc.comm.quantized import (BITS, BLOCK, KINDS, QMAX, allreduce_bytes, broadcast_bytes,
                                     dequantize, kind_problem, layout, pack, quantize, roundtrip,
                                     unpack)
from lsgd_hpc.comm.sparse import (decode, encode, payload_bytes, reduce_records, select,
                                  sent_vector, sparse_layout)
from lsgd_hpc.methods.spec import (COMM_DTYPES, comm_dtype_problem, error_feedback_problem,
                                   topk_problem)


def q_of(x, kind):
    q, s = quantize(x.view(1, -1), kind)
    return dequantize(q, s, kind).view(-1), s.item()


def test_int8_block_by_hand():
    """s = max|x| / 127; q = round(x / s), halves to even; Q(x) = q s."""
    x = torch.tensor([127.0, -63.5, 0.5, 1.5, -0.49, 2.5])
    back, s = q_of(x, "int8")
    assert s == 1.0
    assert back.tolist() == [127.0, -64.0, 0.0, 2.0, -0.0, 2.0]
    y = torch.tensor([0.5, -0.25, 0.125, 1 / 254])        # s = 0.5 / 127
    back, s = q_of(y, "int8")
    assert s == pytest.approx(0.5 / 127)
    assert torch.equal(back, torch.tensor([127.0, -64.0, 32.0, 1.0]) * torch.tensor(s))


@pytest.mark.skipif("fp8" not in KINDS, reason="this torch has no float8_e4m3fn")
def test_fp8_block_by_hand():
    """s = max|x| / 448, then x / s rounded to float8 e4m3 (3 mantissa bits, to nearest even)."""
    x = torch.tensor([448.0, 1.0, 17.0, -300.0, 0.0, 19.0])
    back, s = q_of(x, "fp8")
    assert s == 1.0
    assert back.tolist() == [448.0, 1.0, 16.0, -288.0, 0.0, 20.0]
    assert kind_problem("fp8") is None           # conversions work on this CPU


def test_layout_and_byte_formula():
    """p chunks of b equal blocks (at most BLOCK, a multiple of 4 elements each); counted
    bytes: one per element plus 4 per scale, p b scales."""
    lay = layout(10007, 4)
    assert (lay.b, lay.be, lay.c) == (1, 2504, 2504) and lay.p * lay.c >= 10007
    assert allreduce_bytes(10007, 4) == 10007 + 4 * 4
    n = 3 * BLOCK * 4 + 5                        # not divisible by p nor by the block
    lay = layout(n, 4)
    assert lay.b == 4 and lay.be <= BLOCK and lay.be % 4 == 0 and lay.p * lay.c >= n
    assert allreduce_bytes(n, 4) == n + 4 * 4 * 4
    assert broadcast_bytes(n) == n + 4 * 13      # ceil(n / 4096) = 13 scales
    for n, p in [(256, 2), (1001, 3), (4096 * 2 + 1, 2), (123457, 5)]:
        lay = layout(n, p)
        assert lay.p * lay.c >= n and lay.be <= BLOCK and lay.c % 4 == 0
        assert lay.p * lay.c - n < p * (4 * lay.b + 1)          # padding, never counted
        # the ratio to float32: a quarter plus the scales
        assert allreduce_bytes(n, p) / (4 * n) == pytest.approx(0.25 + lay.b * p / n)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_zero_and_non_finite_blocks(kind):
    x = torch.zeros(3, 8)
    x[1, 2] = float("nan")
    x[2] = torch.arange(8.0)
    q, s = quantize(x, kind)
    back = dequantize(q, s, kind)
    assert s[0] == 0 and torch.equal(back[0], torch.zeros(8))
    assert torch.isnan(back[1]).all()                            # the whole block
    assert (back[2] - x[2]).abs().max() <= s[2] / 2 + 1e-6 if kind != "fp8" else \
        torch.allclose(back[2], x[2], rtol=0.07, atol=0)
    y = torch.ones(8)
    y[3] = float("inf")
    q, s = quantize(y.view(1, 8), kind)
    assert torch.isnan(dequantize(q, s, kind)).all()


#: the largest error of one quantization relative to its block's max|x|: half a step of
#: s = max/127 (int8), max/7 (int4), max/1 (int2); half an ulp at the top binade, 16 s with
#: s = max/448 (fp8 e4m3)
REL = {"int8": 0.5 / 127, "fp8": 16 / 448, "int4": 0.5 / 7, "int2": 0.5}


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("p", [1, 3])
def test_roundtrip_error_within_half_a_step(kind, p):
    torch.manual_seed(0)
    x = torch.randn(3 * BLOCK + 17) * torch.linspace(0.01, 10, 3 * BLOCK + 17)
    lay = layout(x.numel(), p, kind=kind)
    back = roundtrip(x, p, kind)
    pad = torch.zeros(lay.p * lay.c)
    pad[:x.numel()] = x
    amax = pad.view(-1, lay.be).abs().amax(1, keepdim=True).expand(-1, lay.be).reshape(-1)
    err = (back - x).abs()
    assert (err <= REL[kind] * amax[:x.numel()] * (1 + 1e-6)).all()
    assert err.max() > 0


def test_int4_int2_blocks_by_hand():
    """int4: s = max|x| / 7, q = round(x / s) in [-7, 7]; int2: s = max|x|, q in {-1, 0, 1};
    halves to even."""
    x = torch.tensor([7.0, -3.4, 0.5, 1.5, -7.0, 2.5, 0.49, 6.6])
    back, s = q_of(x, "int4")
    assert s == 1.0
    assert back.tolist() == [7.0, -3.0, 0.0, 2.0, -7.0, 2.0, 0.0, 7.0]
    y = torch.tensor([2.0, -1.2, 0.9, -0.99, 1.0, -2.0, 0.0, 0.5] * 2)
    back, s = q_of(y, "int2")
    assert s == 2.0
    assert back.tolist() == [2.0, -2.0, 0.0, -0.0, 0.0, -2.0, 0.0, 0.0] * 2


def test_pack_by_hand_and_exact_on_random_values():
    """u = q + 2^(bits-1), the first value in the low bits; unpack(pack(q)) == q."""
    assert pack(torch.tensor([-7, 7, 0, 3], dtype=torch.int8), 4).tolist() == [1 | 15 << 4,
                                                                               8 | 11 << 4]
    assert pack(torch.tensor([-1, 0, 1, 1], dtype=torch.int8), 2).tolist() == [
        1 | 2 << 2 | 3 << 4 | 3 << 6]
    g = torch.Generator().manual_seed(3)
    for kind in ("int4", "int2"):
        bits, qmax = BITS[kind], int(QMAX[kind])
        for shape in [(8 // bits,), (3, 5, 64), (1, 4096)]:
            q = torch.randint(-qmax, qmax + 1, shape, generator=g, dtype=torch.int8)
            b = pack(q, bits)
            assert b.dtype == torch.uint8 and b.shape[-1] == shape[-1] * bits // 8
            assert torch.equal(unpack(b, bits), q)
        extremes = torch.tensor([-qmax, qmax] * 8, dtype=torch.int8)
        assert torch.equal(unpack(pack(extremes, bits), bits), extremes)


def _block_scales(x: torch.Tensor, p: int, kind: str) -> torch.Tensor:
    """Each element's block scale s = max|block| / QMAX in an allreduce over p ranks."""
    lay = layout(x.numel(), p, kind=kind)
    pad = torch.zeros(lay.p * lay.c)
    pad[:x.numel()] = x
    amax = pad.view(-1, lay.be).abs().amax(1, keepdim=True).expand(-1, lay.be).reshape(-1)
    return amax[:x.numel()] / QMAX[kind]


@pytest.mark.parametrize("kind", ["int4", "int2"])
@pytest.mark.parametrize("n,p", [(1001, 1), (4097, 2), (257, 3), (3 * BLOCK + 17, 5)])
def test_int4_int2_roundtrip_bounds_and_edges(kind, n, p):
    """|x - Q(x)| <= s / 2 with s the element's block scale, on odd lengths; zeros come back
    zeros, a block with one nonzero keeps it exactly, negative extremes come back exactly."""
    torch.manual_seed(n)
    x = torch.randn(n) * torch.linspace(0.01, 10, n)
    err = (roundtrip(x, p, kind) - x).abs()
    assert (err <= _block_scales(x, p, kind) / 2 * (1 + 1e-6)).all()
    assert err.max() > 0
    assert torch.equal(roundtrip(torch.zeros(n), p, kind), torch.zeros(n))
    one = torch.zeros(n)
    one[n // 2] = -3.25
    assert torch.equal(roundtrip(one, p, kind), one)
    neg = torch.full((n,), -2.5)
    neg[::3] = -5.0                       # the extremes -QMAX s; -2.5 is -QMAX s / 2
    back = roundtrip(neg, p, kind)
    assert torch.equal(back[::3], neg[::3])
    assert (back - neg).abs().max() <= 2.5 / QMAX[kind] + 1e-6


@pytest.mark.parametrize("kind", ["int8", "int4", "int2"])
def test_packed_layout_and_bytes(kind):
    """Blocks of a multiple of 32 / bits elements (whole bytes, aligned scales); counted bytes:
    the packed payload ceil(n bits / 8) plus 4 per scale; quantize's bytes per block."""
    bits = BITS[kind]
    for n, p in [(256, 2), (1001, 3), (4096 * 2 + 1, 2), (123457, 5), (1_000_003, 4)]:
        lay = layout(n, p, kind=kind)
        assert lay.be % (32 // bits) == 0 and lay.be <= BLOCK and lay.p * lay.c >= n
        assert lay.block_bytes == lay.be * bits // 8 and lay.record % 4 == 0
        assert allreduce_bytes(n, p, kind=kind) == -(-n * bits // 8) + 4 * p * lay.b
        assert broadcast_bytes(n, kind=kind) == -(-n * bits // 8) + 4 * -(-n // BLOCK)
        q, s = quantize(torch.randn(p, lay.b, lay.be), kind)
        assert q.shape == (p, lay.b, lay.block_bytes) and s.shape == (p, lay.b)
    ratio = allreduce_bytes(1_000_000, 2, kind=kind) / 4e6
    assert ratio == pytest.approx(bits / 32 + 1 / 4096, rel=1e-3), ratio


def test_options_and_their_refusals():
    assert COMM_DTYPES == ("fp32", "bf16", "int8", "fp8", "int4", "int2")
    for ok in ("allreduce", "lsgd", "easgd", "local-sgd", "diloco", "slowmo"):
        for kind in ("int8", "fp8", "int4", "int2"):
            assert comm_dtype_problem(kind, "mpi", ok) is None
            assert comm_dtype_problem(kind, "torch", ok) is None
    for kind in ("int8", "fp8", "int4", "int2"):          # CHOCO-SGD (compressed gossip)
        assert comm_dtype_problem(kind, "mpi", "gossip") is None
    for bad in ("lsgd-async",):
        why = comm_dtype_problem("int8", "mpi", bad)
        assert why.startswith(f"int8 is not for {bad}: ") and "\n" not in why
    assert comm_dtype_problem("fp8", "horovod", "lsgd") is None     # Horovod's alltoall
    assert comm_dtype_problem("bf16", "mpi", "gossip") is None     # bf16 stays as it was
    assert comm_dtype_problem("bf16", "horovod", "lsgd") is None   # reduce-scatter + allgather
    assert error_feedback_problem(False, "fp32") is None
    for kind in ("int8", "int4", "int2"):
        assert error_feedback_problem(True, kind) is None
    assert "needs --comm-dtype bf16, int8, fp8, int4 or int2" in error_feedback_problem(
        True, "fp32")
    # bf16 rounds: its rounding is fed back where the method allreduces (issue 47)
    assert error_feedback_problem(True, "bf16") is None
    assert error_feedback_problem(True, "bf16", 1.0, "diloco") is None
    assert error_feedback_problem(True, "bf16", 1.0, "gossip").startswith("is not for gossip")


# -- top-k (lsgd_hpc.comm.sparse) ------------------------------------------------------------
def test_topk_layout_and_bytes():
    """k = ceil(F c) per chunk of c = min(4096, n); one rank's payload: k int16 indices, the
    values (fp32: 4 bytes; int8/fp8: 1; int4: ceil(k / 2); int2: ceil(k / 4)) and one scale
    per chunk unless fp32; sent S, received (p - 1) S."""
    lay = sparse_layout(10_000, 0.01, "int2")
    assert (lay.c, lay.m, lay.k) == (4096, 3, 41)
    assert lay.counted == 3 * (4 + 41 * 2 + 11)
    assert sparse_layout(10_000, 0.01, "fp32").counted == 3 * 41 * 6
    assert sparse_layout(10_000, 0.01, "int4").counted == 3 * (4 + 82 + 21)
    assert sparse_layout(300, 0.5, "int8").counted == 1 * (4 + 150 * 2 + 150)
    assert sparse_layout(300, 1e-9, "fp32").k == 1          # at least one entry a chunk
    for kind in ("fp32", "int8", "int4", "int2"):
        assert sparse_layout(123_457, 0.03, kind).record % 4 == 0
    assert payload_bytes(10_000, 5, 0.01, "int2") == (lay.counted, 4 * lay.counted)


@pytest.mark.parametrize("n", [1_000_000, 1_048_583])
def test_topk_one_percent_int2_under_a_hundredth_of_fp32(n):
    """F = 0.01 with int2 values, 2 ranks: the bytes sent (and received) over fp32's 4 n."""
    sent, recv = payload_bytes(n, 2, 0.01, "int2")
    assert sent == recv
    ratio = sent / (4 * n)
    lay = sparse_layout(n, 0.01, "int2")
    assert ratio == lay.m * (4 + 2 * 41 + 11) / (4 * n)
    assert ratio <= 0.01 and 0.0059 < ratio < 0.006, ratio      # 97 bytes a 4096 chunk
    assert payload_bytes(n, 2, 0.01, "fp32")[0] / (4 * n) > 0.01   # fp32 values: 246 bytes


def test_topk_select_encode_decode_by_hand():
    """Chunks of 4: the 2 largest |w| of each, indices ascending; fp32 values exactly,
    int2 values as sign times the chunk's largest selected; the rank-order sum of two
    ranks' records."""
    w = torch.tensor([0.5, -3.0, 2.0, 0.1, 0.0, 0.0, 7.0, -1.0, 4.0, 0.25])  # 3 chunks
    lay = sparse_layout(10, 0.5, "fp32", chunk=4)
    assert (lay.c, lay.m, lay.k) == (4, 3, 2)
    idx, values = select(w, lay)
    assert idx.tolist() == [[1, 2], [2, 3], [0, 1]]
    assert values.tolist() == [[-3.0, 2.0], [7.0, -1.0], [4.0, 0.25]]
    buf = torch.zeros(lay.m * lay.record, dtype=torch.uint8)
    encode(idx, values, lay, buf)
    i2, v2 = decode(buf, lay)
    assert torch.equal(i2, idx) and torch.equal(v2, values)
    assert sent_vector(i2, v2, lay).tolist() == [0, -3, 2, 0, 0, 0, 7, -1, 4, 0.25]
    lay2 = sparse_layout(10, 0.5, "int2", chunk=4)
    buf2 = torch.zeros(lay2.m * lay2.record, dtype=torch.uint8)
    encode(idx, values, lay2, buf2)
    i3, v3 = decode(buf2, lay2)
    assert torch.equal(i3, idx)
    assert v3.tolist() == [[-3.0, 3.0], [7.0, -0.0], [4.0, 0.0]]
    both = torch.stack([buf, buf])
    assert torch.equal(reduce_records(both, lay, 2), 2 * sent_vector(idx, values, lay))


def test_topk_options_and_refusals():
    assert topk_problem(1.0, "bf16", "horovod", "allreduce") is None     # dense: as before
    for ok in ("allreduce", "easgd", "diloco", "lsgd", "local-sgd", "slowmo"):
        for kind in ("fp32", "bf16", "int8", "fp8", "int4", "int2"):
            assert topk_problem(0.01, kind, "mpi", ok) is None
    for bad in ("lsgd-async",):
        why = topk_problem(0.1, "fp32", "mpi", bad)
        assert why.startswith(f"0.1 is not for {bad}: ") and "\n" not in why
    assert topk_problem(0.1, "fp32", "mpi", "gossip") is None      # CHOCO-SGD
    assert topk_problem(0.1, "bf16", "mpi", "diloco") is None     # bf16 values (issue 47)
    assert topk_problem(0.1, "fp32", "horovod", "diloco") is None   # Horovod's allgather
    assert error_feedback_problem(True, "fp32", 0.1) is None
    assert "--topk < 1" in error_feedback_problem(True, "fp32", 1.0)


@pytest.mark.parametrize("argv", [
    ["--algorithm", "diloco", "--topk", "0"], ["--algorithm", "diloco", "--topk", "1.5"],
    ["--algorithm", "diloco", "--topk", "-1"], ["--algorithm", "diloco", "--topk", "x"],
    ["--algorithm", "lsgd-async", "--topk", "0.1"],
], ids=["zero", "above-one", "negative", "word", "lsgd-async"])
def test_config_refuses_topk(argv):
    from lsgd_hpc.cli.config import ConfigError, parse_config
    with pytest.raises(ConfigError) as info:
        parse_config(argv, env={})
    assert info.value.option == "--topk" and "\n" not in str(info.value)


def test_config_accepts_topk():
    from lsgd_hpc.cli.config import parse_config
    cfg = parse_config(["--algorithm", "diloco", "--topk", "0.01", "--comm-dtype", "int2",
                        "--error-feedback"], env={})
    assert (cfg.topk, cfg.comm_dtype, cfg.error_feedback) == (0.01, "int2", True)
    cfg = parse_config(["--algorithm", "easgd", "--topk", "0.05", "--error-feedback"], env={})
    assert (cfg.topk, cfg.comm_dtype) == (0.05, "fp32")
    for method in ("local-sgd", "slowmo"):
        cfg = parse_config(["--algorithm", method, "--topk", "0.1", "--error-feedback"], env={})
        assert cfg.topk == 0.1
    assert parse_config(["--algorithm", "allreduce"], env={}).topk == 1.0


@pytest.mark.parametrize("argv,option", [
    (["--algorithm", "lsgd-async", "--comm-dtype", "int8"], "--comm-dtype"),
    (["--algorithm", "gossip", "--comm-dtype", "fp8", "--error-feedback",
      "--error-feedback-decay", "0.5"], "--error-feedback-decay"),
    (["--algorithm", "lsgd-async", "--comm-dtype", "int2"], "--comm-dtype"),
    (["--algorithm", "diloco", "--error-feedback"], "--error-feedback"),
    (["--algorithm", "diloco", "--comm-dtype", "fp32", "--error-feedback"], "--error-feedback"),
], ids=["lsgd-async", "gossip-decay", "lsgd-async-int2", "ef-alone",
        "ef-fp32"])
def test_config_refuses(argv, option):
    from lsgd_hpc.cli.config import ConfigError, parse_config
    with pytest.raises(ConfigError) as info:
        parse_config(argv, env={})
    assert info.value.option == option


def test_config_accepts():
    from lsgd_hpc.cli.config import parse_config
    cfg = parse_config(["--algorithm", "diloco", "--comm-dtype", "int8", "--error-feedback"],
                       env={})
    assert (cfg.comm_dtype, cfg.error_feedback) == ("int8", True)
    for kind in ("int4", "int2"):
        cfg = parse_config(["--algorithm", "easgd", "--comm-dtype", kind, "--error-feedback"],
                           env={})
        assert (cfg.comm_dtype, cfg.error_feedback) == (kind, True)
    assert parse_config(["--algorithm", "easgd"], env={}).error_feedback is False
    cfg = parse_config(["--algorithm", "diloco", "--comm-dtype", "bf16", "--error-feedback",
                        "--topk", "0.01"], env={})                  # issue 47: bf16 lifted
    assert (cfg.comm_dtype, cfg.error_feedback, cfg.topk) == ("bf16", True, 0.01)


def test_hierarchy_only_across_nodes_with_a_node_of_several():
    """The world of quantized_groups goes hierarchical (lsgd_hpc.comm.quantized) when the
    layout spans more than one node and some node holds more than one member: nodes of
    2 + 2 and 2 + 1, not one rank a node nor one node; a bare Quantized never; its
    counters then name node_stats too (accounting.uncounted restores them)."""
    from types import SimpleNamespace

    from lsgd_hpc.comm.base import CommStats
    from lsgd_hpc.comm.quantized import Quantized
    inner = SimpleNamespace(stats=CommStats(), key="world", size=4)
    q = Quantized(inner, "int8")
    assert q.hierarchy() is None and q.counters == (inner.stats,)
    node, roots = SimpleNamespace(inner="node"), SimpleNamespace(inner="roots")
    for node_of, hier in (([0, 0, 1, 1], True), ([0, 0, 1], True), ([0, 1, 1, 1], True),
                          ([0, 1, 2, 3], False), ([0, 0, 0, 0], False)):
        q._groups = SimpleNamespace(node_of=node_of, node=node, roots=roots)
        assert q.hierarchy() == (("node", "roots") if hier else None), node_of
    q._groups = SimpleNamespace(node_of=[0, 0, 1, 1], node=node, roots=None)   # not a root
    assert q.hierarchy() == ("node", None)
    assert q.counters == (inner.stats, q.node_stats)


@pytest.mark.parametrize("argv,why", [
    (["--algorithm", "diloco", "--topk", "0.01", "--error-feedback-decay", "0"], "(0, 1]"),
    (["--algorithm", "diloco", "--topk", "0.01", "--error-feedback-decay", "1.5"], "(0, 1]"),
    (["--algorithm", "diloco", "--topk", "0.01", "--error-feedback-decay", "0.9"],
     "needs --error-feedback"),
    (["--algorithm", "lsgd", "--topk", "0.01", "--error-feedback", "--error-feedback-decay",
      "0.9"], "not for lsgd"),
    (["--algorithm", "allreduce", "--error-feedback-decay", "0.9"], "needs --error-feedback"),
], ids=["zero", "above-one", "without-error-feedback", "lsgd", "allreduce"])
def test_config_refuses_error_feedback_decay(argv, why):
    from lsgd_hpc.cli.config import ConfigError, parse_config
    with pytest.raises(ConfigError) as info:
        parse_config(argv, env={})
    assert info.value.option == "--error-feedback-decay" and "\n" not in str(info.value)
    assert why in str(info.value), str(info.value)


def test_error_feedback_decay_accepted_and_passed_to_the_wire():
    """SparseLoCo's form: DiLoCo, outer momentum 0, top-k 1 % int2, beta 0.95; the
    library's method hands beta to the residuals' owner (a 1-rank world)."""
    from lsgd_hpc.cli.config import parse_config
    from lsgd_hpc.methods.spec import OptionError
    cfg = parse_config(["--algorithm", "diloco", "--outer-momentum", "0", "--topk", "0.01",
                        "--comm-dtype", "int2", "--error-feedback",
                        "--error-feedback-decay", "0.95"], env={})
    assert cfg.error_feedback_decay == 0.95
    assert parse_config(["--algorithm", "easgd"], env={}).error_feedback_decay == 1.0
    import lsgd_hpc
    from torch import nn
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    comm = lsgd_hpc.init(backend="mpi")
    m = lsgd_hpc.DiLoCo(model, opt, comm, topk=0.05, error_feedback=True,
                        error_feedback_decay=0.5, outer_momentum=0.0)
    assert m.wire.world.shared.decay == 0.5
    m.close()
    with pytest.raises(OptionError) as info:
        lsgd_hpc.LeaderSGD(model, opt, comm, topk=0.05, error_feedback=True,
                           error_feedback_decay=0.5)
    assert info.value.option == "error_feedback_decay"
