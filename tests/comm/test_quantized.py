"""The maths of int8/fp8 communication, without communication: block quantization worked out
by hand, the layout and its byte formula, non-finite blocks, the error bound, and the
options' refusals (lsgd_hpc.comm.quantized, lsgd_hpc.methods.spec). The collectives
themselves run under mpirun: tests/parallel/test_quantized_parallel.py."""

import pytest
import torch

from lsgd_hpc.comm.quantized import (BLOCK, KINDS, allreduce_bytes, broadcast_bytes,
                                     dequantize, kind_problem, layout, quantize, roundtrip)
from lsgd_hpc.methods.spec import (COMM_DTYPES, comm_dtype_problem, error_feedback_problem)


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
    assert torch.allclose(back[2], x[2], rtol=0.07, atol=0)
    y = torch.ones(8)
    y[3] = float("inf")
    q, s = quantize(y.view(1, 8), kind)
    assert torch.isnan(dequantize(q, s, kind)).all()


#: the largest error of one quantization relative to its block's max|x|: half a step of
#: s = max/127 (int8); half an ulp at the top binade, 16 s with s = max/448 (fp8 e4m3)
REL = {"int8": 0.5 / 127, "fp8": 16 / 448}


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("p", [1, 3])
def test_roundtrip_error_within_half_a_step(kind, p):
    torch.manual_seed(0)
    x = torch.randn(3 * BLOCK + 17) * torch.linspace(0.01, 10, 3 * BLOCK + 17)
    lay = layout(x.numel(), p)
    back = roundtrip(x, p, kind)
    pad = torch.zeros(lay.p * lay.c)
    pad[:x.numel()] = x
    amax = pad.view(-1, lay.be).abs().amax(1, keepdim=True).expand(-1, lay.be).reshape(-1)
    err = (back - x).abs()
    assert (err <= REL[kind] * amax[:x.numel()] * (1 + 1e-6)).all()
    assert err.max() > 0


def test_options_and_their_refusals():
    assert COMM_DTYPES == ("fp32", "bf16", "int8", "fp8")
    for ok in ("lsgd", "easgd", "local-sgd", "diloco", "slowmo"):
        for kind in ("int8", "fp8"):
            assert comm_dtype_problem(kind, "mpi", ok) is None
            assert comm_dtype_problem(kind, "torch", ok) is None
    for bad in ("allreduce", "gossip", "lsgd-async"):
        why = comm_dtype_problem("int8", "mpi", bad)
        assert why.startswith(f"int8 is not for {bad}: ") and "\n" not in why
    assert "mpi or torch backend" in comm_dtype_problem("fp8", "horovod", "lsgd")
    assert comm_dtype_problem("bf16", "mpi", "gossip") is None     # bf16 stays as it was
    assert error_feedback_problem(False, "fp32") is None
    assert error_feedback_problem(True, "int8") is None
    assert "needs --comm-dtype int8 or fp8" in error_feedback_problem(True, "bf16")


@pytest.mark.parametrize("argv,option", [
    (["--algorithm", "allreduce", "--comm-dtype", "int8"], "--comm-dtype"),
    (["--algorithm", "gossip", "--comm-dtype", "fp8"], "--comm-dtype"),
    (["--algorithm", "lsgd", "--comm-dtype", "int8", "--backend", "horovod"], "--comm-dtype"),
    (["--algorithm", "diloco", "--error-feedback"], "--error-feedback"),
    (["--algorithm", "diloco", "--comm-dtype", "bf16", "--error-feedback"], "--error-feedback"),
], ids=["allreduce", "gossip", "hvd-backend", "ef-alone", "ef-bf16"])
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
    assert parse_config(["--algorithm", "easgd"], env={}).error_feedback is False
