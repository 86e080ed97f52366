"""The element codec of the compressed wire: int8, fp8, int4 and int2 values with per-block
float32 scales (the maths only, no communication). lsgd_hpc.comm.quantized (dense blocks) and
lsgd_hpc.comm.sparse (top-k values) both encode with it; quantized.py's docstring and
docs/algorithms.md give the formulas."""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch

__all__ = ["KINDS", "QMAX", "BITS", "BLOCK", "SCALE_BYTES", "kind_problem", "pack", "unpack",
           "quantize", "dequantize"]

#: the wire dtype of each quantized comm_dtype (fp8 where this torch has float8_e4m3fn);
#: int4 and int2 travel packed, two or four values a byte
KINDS: Dict[str, torch.dtype] = {"int8": torch.int8, "int4": torch.uint8, "int2": torch.uint8}
if hasattr(torch, "float8_e4m3fn"):
    KINDS["fp8"] = torch.float8_e4m3fn
#: the largest magnitude of each wire dtype: a block's scale is max|x| / QMAX
QMAX = {"int8": 127.0, "fp8": 448.0, "int4": 7.0, "int2": 1.0}
#: bits per element on the wire
BITS = {"int8": 8, "fp8": 8, "int4": 4, "int2": 2}
#: elements per scale, at most (a chunk is cut into equal blocks of at most this many)
BLOCK = 4096
SCALE_BYTES = 4


def kind_problem(kind: str, device=None) -> Optional[str]:
    """Why ``kind`` cannot be used on ``device`` with this torch, or None."""
    if kind not in QMAX:
        return f"must be one of {', '.join(QMAX)}, got {kind!r}"
    if kind not in KINDS:
        return f"{kind} needs torch.float8_e4m3fn, which torch {torch.__version__} lacks"
    try:
        x = torch.tensor([[QMAX[kind], -QMAX[kind], 0.0, 1.0]], device=device) / 2
        back = dequantize(*quantize(x, kind), kind)     # s = 1/2: every value exact
        if not torch.equal(back, x):
            return f"{kind}: conversions on {device or 'cpu'} do not round-trip"
    except (RuntimeError, TypeError) as exc:
        return f"{kind} conversions are not supported on {device or 'cpu'} ({exc})"
    return None


# -- the maths: pure functions, no communication --------------------------------------------------
def pack(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Signed values ``q`` (int8, in [-2^(bits-1) + 1, 2^(bits-1) - 1], last dimension a
    multiple of 8 / bits) as bytes: u = q + 2^(bits-1), element i of each group of 8 / bits at
    bits i (little end first)."""
    k = 8 // bits
    u = (q.to(torch.int16) + (1 << (bits - 1))).unflatten(-1, (-1, k))
    shifts = torch.arange(0, 8, bits, dtype=torch.int16, device=q.device)
    return (u << shifts).sum(-1).to(torch.uint8)   # disjoint bit fields: the sum is an or


def unpack(b: torch.Tensor, bits: int) -> torch.Tensor:
    """The signed values (int8) that :func:`pack` packed into bytes ``b``."""
    shifts = torch.arange(0, 8, bits, dtype=torch.int16, device=b.device)
    u = (b.to(torch.int16).unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return (u - (1 << (bits - 1))).to(torch.int8).flatten(-2)


def quantize(x: torch.Tensor, kind: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """Blocks along the last dimension of ``x`` (float32): (q as bytes, scales float32);
    int4 and int2 packed (the last dimension a multiple of 2 or 4)."""
    qmax = QMAX[kind]
    scales = x.abs().amax(-1) / qmax
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    y = x / safe.unsqueeze(-1)
    if kind == "fp8":
        return y.clamp_(-qmax, qmax).to(KINDS[kind]).view(torch.uint8), scales
    q = y.round_().clamp_(-qmax, qmax)
    nonfinite = ~torch.isfinite(scales)          # inf or NaN: the whole block comes back NaN
    if BITS[kind] == 8:
        return q.to(torch.int8).view(torch.uint8), scales
    q = torch.where(nonfinite.unsqueeze(-1), torch.zeros_like(q), q)
    return pack(q.to(torch.int8), BITS[kind]), torch.where(nonfinite, torch.nan, scales)


def dequantize(q: torch.Tensor, scales: torch.Tensor, kind: str) -> torch.Tensor:
    """float32 blocks from bytes ``q`` (..., bytes of a block) and ``scales`` (...)."""
    if BITS[kind] < 8:
        return unpack(q, BITS[kind]).to(torch.float32) * scales.unsqueeze(-1)
    return q.view(KINDS[kind]).to(torch.float32) * scales.unsqueeze(-1)
