"""Top-k sparsification of an allreduce, with error feedback (``topk=F``, 0 < F < 1).

The maths, without communication; :class:`lsgd_hpc.comm.quantized.Quantized` runs it
(``Quantized(comm, kind, error_feedback, topk=F)``, ``kind`` fp32, bf16, int8, fp8, int4 or
int2).

An n-element vector w (the allreduce input v, plus the residual e with error feedback) is cut
into m = ceil(n / c) chunks of c = min(``CHUNK``, n) elements (the last padded with zeros).
Of each chunk a rank sends the k = ceil(F c) entries of largest magnitude (ties: torch.topk's
choice, the same on every run), as (index in the chunk, value), indices ascending. Values go
as float32 (``kind`` fp32), or quantized by ``kind`` with one scale per chunk over the k
selected values: s = max |selected| / QMAX, q = round(value / s) (int8, int4, int2) or e4m3
(fp8), sent q s; or as bfloat16 (``kind`` bf16: each value rounded to nearest even, 8 bits of
mantissa, no scale). sent(w) is the vector holding those values at those indices, zero
elsewhere.
Error feedback: e <- w - sent(w).

Exchange: every rank's m records (``Sparse.record`` bytes each: scale, indices, values,
padded to 4 bytes) form one fixed-size message; an allgather gives every rank all p of them;
every rank adds the p contributions in float32 in rank order (a scatter-add per rank, rank
0 first) and divides by p for a mean. Every rank adds the same bytes in the same order, so
every rank ends with the same bits.

Bytes counted (the package's logical-payload convention, lsgd_hpc.comm.quantized): one
rank's payload S = m (k index_bytes + value_bytes(k) + scale_bytes) with index_bytes 2 (int16,
chunks of at most 32768 elements) or 4, value_bytes(k) = ceil(k bits / 8) (bits 32 for fp32)
and scale_bytes 4 (none for fp32). Sent: S (its message, once); received: (p - 1) S (the
other ranks' messages; what an allgather delivers grows with p, unlike a dense allreduce,
which counts the same each way). At p = 2 both are S; fp32's allreduce counts 4 n each way.
Padding is not counted.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

import torch

from lsgd_hpc.comm.codec import dequantize, quantize

__all__ = ["CHUNK", "Sparse", "sparse_layout", "select", "sent_vector", "encode", "decode",
           "reduce_records", "payload_bytes"]

#: elements per chunk (as the quantizer's BLOCK): its k entries are chosen within it
CHUNK = 4096
#: bits of each value kind on the wire (fp32: uncompressed values)
VALUE_BITS = {"fp32": 32, "bf16": 16, "int8": 8, "fp8": 8, "int4": 4, "int2": 2}
#: the value kinds that go as floats of their own (no scale): their torch dtype
FLOAT_VALUES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclasses.dataclass(frozen=True)
class Sparse:
    """The layout of one rank's message for an n-element vector: m chunks of c elements, k
    sent per chunk, values of ``kind``."""

    n: int
    c: int
    m: int
    k: int
    kind: str

    @property
    def index_dtype(self) -> torch.dtype:
        return torch.int16 if self.c <= 32768 else torch.int32

    @property
    def index_bytes(self) -> int:
        return 2 if self.index_dtype == torch.int16 else 4

    @property
    def bits(self) -> int:
        return VALUE_BITS[self.kind]

    @property
    def kp(self) -> int:
        """k rounded up to whole bytes of packed values (int4: 2, int2: 4 a byte)."""
        per = max(1, 8 // self.bits)
        return -(-self.k // per) * per

    @property
    def scale_bytes(self) -> int:
        return 0 if self.kind in FLOAT_VALUES else 4

    @property
    def value_bytes(self) -> int:
        return self.kp * self.bits // 8

    @property
    def record(self) -> int:
        """Bytes of one chunk's record on the wire: scale, indices, values, padded to 4."""
        raw = self.scale_bytes + self.k * self.index_bytes + self.value_bytes
        return raw + -raw % 4

    @property
    def counted(self) -> int:
        """S: one rank's payload, padding left out."""
        return self.m * (self.scale_bytes + self.k * self.index_bytes
                         + -(-self.k * self.bits // 8))


def sparse_layout(n: int, topk: float, kind: str = "fp32", chunk: int = CHUNK) -> Sparse:
    c = min(chunk, n)
    m = -(-n // c)
    k = max(1, min(c, int(torch.tensor(topk * c, dtype=torch.float64).ceil().item())))
    return Sparse(n, c, m, k, kind)


def payload_bytes(n: int, p: int, topk: float, kind: str = "fp32",
                  chunk: int = CHUNK) -> Tuple[int, int]:
    """(sent, received) bytes a top-k allreduce of n elements over p ranks counts."""
    s = sparse_layout(n, topk, kind, chunk).counted
    return s, (p - 1) * s


def select(w: torch.Tensor, lay: Sparse) -> Tuple[torch.Tensor, torch.Tensor]:
    """(indices (m, k) int64 ascending, values (m, k) float32): each chunk's k largest |w|."""
    pad = torch.zeros(lay.m * lay.c, dtype=torch.float32, device=w.device)
    pad[:lay.n] = w.reshape(-1)
    chunks = pad.view(lay.m, lay.c)
    idx = chunks.abs().topk(lay.k, dim=1, sorted=False).indices.sort(dim=1).values
    return idx, chunks.gather(1, idx)


def _quantized_values(values: torch.Tensor, lay: Sparse) -> Tuple[torch.Tensor, torch.Tensor]:
    """(value bytes (m, value_bytes), scales (m,)) of the selected values (k padded to kp)."""
    v = torch.zeros(lay.m, lay.kp, dtype=torch.float32, device=values.device)
    v[:, :lay.k] = values
    q, s = quantize(v, lay.kind)
    return q.reshape(lay.m, -1), s


def _views(buf: torch.Tensor, lay: Sparse):
    """(scales (m,) or None, indices (m, k), value bytes (m, value_bytes)) views of records
    ``buf`` (m * record bytes)."""
    rows = buf.view(lay.m, lay.record)
    a, b = lay.scale_bytes, lay.scale_bytes + lay.k * lay.index_bytes
    scales = rows[:, :a].view(torch.float32).view(lay.m) if a else None
    return scales, rows[:, a:b].view(lay.index_dtype), rows[:, b:b + lay.value_bytes]


def encode(idx: torch.Tensor, values: torch.Tensor, lay: Sparse, buf: torch.Tensor) -> None:
    """This rank's records into ``buf`` (m * record bytes)."""
    scales, ib, vb = _views(buf, lay)
    ib.copy_(idx)
    if lay.kind in FLOAT_VALUES:               # fp32 as they are, bf16 rounded to nearest even
        low = values.to(FLOAT_VALUES[lay.kind]).contiguous()
        vb.copy_(low.view(torch.uint8).view(lay.m, -1))
        return
    q, s = _quantized_values(values, lay)
    vb.copy_(q)
    scales.copy_(s)


def decode(buf: torch.Tensor, lay: Sparse) -> Tuple[torch.Tensor, torch.Tensor]:
    """(indices (m, k) int64, values (m, k) float32, dequantized) of records ``buf``."""
    scales, ib, vb = _views(buf, lay)
    if lay.kind in FLOAT_VALUES:
        values = vb.clone().view(FLOAT_VALUES[lay.kind]).to(torch.float32)   # (aligned: a copy)
    else:
        values = dequantize(vb.contiguous(), scales, lay.kind)[:, :lay.k]
    return ib.to(torch.int64), values


def sent_vector(idx: torch.Tensor, values: torch.Tensor, lay: Sparse,
                out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The dense n-vector of what a record sends (zeros where nothing is sent)."""
    dense = torch.zeros(lay.m, lay.c, dtype=torch.float32, device=values.device)
    dense.scatter_(1, idx, values)
    flat = dense.view(-1)[:lay.n]
    if out is None:
        return flat.clone()
    return out.copy_(flat)


def reduce_records(gathered: torch.Tensor, lay: Sparse, p: int) -> torch.Tensor:
    """The sum of the p ranks' records ``gathered`` (p, m * record bytes), added in float32
    in rank order (rank 0 first): an n-element vector, the same bits on every rank."""
    total = torch.zeros(lay.m, lay.c, dtype=torch.float32, device=gathered.device)
    for r in range(p):               # one scatter-add per rank: the order is the rank order
        idx, values = decode(gathered[r], lay)
        total.scatter_add_(1, idx, values)
    return total.view(-1)[:lay.n]
