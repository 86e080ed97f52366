"""Communication in int8 or fp8 (one byte per element), int4 (half a byte) or int2 (a quarter
of a byte), with per-block scales and error feedback.

``Quantized(comm, "int8")`` wraps one communicator: model-sized float32 tensors (at least
``MIN_ELEMENTS``) move as one byte per element (int4: two per byte; int2: four per byte) plus
one float32 scale per block; everything else (elections, scalars, float64 measurements,
integers) passes through unchanged, and so does a group of one (nothing is sent, nothing is
rounded).

Quantizing a block x of at most ``BLOCK`` elements: s = max|x| / QMAX (QMAX 127 for int8,
448 for fp8 e4m3, 7 for int4, 1 for int2), q = round(x / s) clamped to [-QMAX, QMAX] (int8,
int4, int2; halves to even), or x / s rounded to float8_e4m3fn (fp8); Q(x) = q s, so
|x - Q(x)| <= s / 2 for the integer kinds. int4 and int2 are packed (:func:`pack`):
u = q + 2^(bits-1) (1..15, or 1..3), 8 / bits values a byte, the first in the low bits. A
block of zeros has s = 0; a block holding inf or NaN comes back as NaN throughout (it cannot
be scaled).

Allreduce of v over p ranks (sum or mean), two phases over byte buffers:

1. v is split into p chunks of c elements (the last ones padded with zeros), each chunk into
   b = ceil(ceil(n / p) / BLOCK) equal blocks (of a multiple of 32 / bits elements, so a
   block fills whole bytes). Each rank quantizes every chunk; an alltoall sends chunk j (its
   b scales and c bits / 8 bytes) to rank j.
2. Rank j dequantizes the p contributions to its chunk and adds them in float32 (rank order),
   divides by p for a mean, requantizes that reduced chunk, and an allgather gives every rank
   every reduced chunk, which every rank (rank j too) dequantizes: every rank ends with the
   same bits.

Bytes counted (the package's logical-payload convention: an allreduce of m bytes is sent m,
received m): sent = received = ceil(n bits / 8) + 4 p b for an n-element vector (bits 8,
4 or 2), against 4 n in float32, so 0.25 (int8, fp8), 0.125 (int4) or 0.0625 (int2) of the
float32 bytes plus the scales' (about 4 n / 4096 bytes, 1/4096 of the float32 bytes, for
large n). A broadcast sends (root) or receives (the others) ceil(n bits / 8) +
4 ceil(n / BLOCK): the root quantizes, payload and scales are broadcast as bytes, every rank
(the root too) dequantizes, so the copy is the same bits everywhere; across node boundaries
(``NodeGroups.broadcast_from_``) the same bytes are forwarded, never requantized. The
padding (fewer than 4 b + 1 bytes a chunk) travels but is not counted. The counted seconds
are those of the whole operation, quantization included.

Hierarchical allreduce (the world of :func:`quantized_groups`, which every method's stack
uses, :func:`lsgd_hpc.comm.stack.compose`): when the job spans N > 1 nodes and some node holds
more than one of the P ranks, an allreduce of a model tensor v_r (rank r on node i) is

1. S_i = sum of the node's v_r in float32, by an allreduce of the plain node communicator
   (shared memory; nothing leaves the node);
2. the compressed allreduce above, dense or top-k, of the S_i over the node-roots
   communicator only (p = N: chunks by the number of nodes), sum divided by P (not N) for a
   mean; with error feedback the residuals live on the node roots, e_i <- (S_i + e_i) -
   Q(S_i + e_i), keyed as below (the world's key);
3. the result broadcast in float32 from each node root to the rest of its node, so every
   rank of the job holds the same bits (the roots hold the same bits after step 2).

So a node's link carries one compressed vector, not one per rank. With one rank a node the
roots are the world: the flat allreduce above, unchanged. On one node nothing crosses a node
boundary, so compression buys nothing there (use fp32 on a single node); the flat compressed
allreduce is kept for that layout, so that a run on one host still runs and measures the
wire format it would use between nodes. A bare ``Quantized(comm)`` is always flat.

Bytes of the hierarchical allreduce: the job's counters (``comm.stats``, comm_bytes_*) hold
what crosses between nodes: on a node root the exchange between the roots, ceil(n bits /
8) + 4 N b each way (allreduce_bytes(n, N)), nothing on the other ranks; one call and the
whole operation's seconds on every rank. Per node that is 0.25 (int8) of the 4 n bytes a
float32 allreduce counts, plus the scales. The float32 phases inside the node (the node's
allreduce, 4 n each way on every rank of a node of more than one; the root's broadcast, 4 n
sent by the root, 4 n received by each other rank) are counted apart, in ``node_stats``
(``QuantizedGroups.node_stats``), as the traffic inside a worker is
(:mod:`lsgd_hpc.comm.workers`).

Error feedback (``error_feedback=True``; SparseLoCo, MuLoCo, 1-bit Adam): each rank keeps a
residual e per buffer it allreduces and sends Q(v + e) in phase 1, then sets
e <- (v + e) - Q(v + e): what rounding dropped is sent in later rounds instead of lost, so
the running mean of what arrives converges to the true mean. Phase 2's requantization
(identical on every rank, at most half a step of the reduced chunk's scale) is not fed back,
nor is a broadcast's (a leader's copy is a new vector each time, not a sum over rounds).
With ``decay`` beta < 1 (``error_feedback_decay``) the input is v + beta e instead of
v + e and e <- (v + beta e) - Q(v + beta e): SparseLoCo's decayed accumulator, old residual
shrinking by beta a round (beta = 1, the default, is the plain recursion, bit for bit).
A residual is keyed by the buffer it belongs to: the index of the buffer registered with
``agree_buffers`` that holds it (rules register their scratch buffers at construction, in the
same order on every rank and in every run) and its offset and length there, so a resumed
run finds its residuals (``state_dict``). A tensor outside every registered buffer is keyed
by its length.

Top-k (``topk`` < 1; ``kind`` may then be fp32 or bf16): every allreduce of a model tensor
sends, of each chunk of ``block`` elements, its top-k entries as (index, value) records,
exchanged by an allgather and summed in rank order by every rank (the maths, the records
and their bytes: :mod:`lsgd_hpc.comm.sparse`); with error feedback
e <- (v + e) - sent(v + e), keyed and saved as above. Broadcasts stay dense (quantized by
``kind``, rounded to bfloat16 as :mod:`lsgd_hpc.comm.lowprec` sends them for bf16, or fp32 as
they are).

Non-blocking allreduce (``iallreduce_``; Streaming DiLoCo's overlapped fragments): the same
operation in stages, each exchange posted non-blocking (the backend's ``ialltoall`` and
``iallgather`` of the byte buffers; top-k: ``iallgather`` of the records) and the
computation between two exchanges run when ``test()`` finds the exchange before it
completed, the rest in ``wait()``: quantize (residual updated) and post the alltoall at the
call; dequantize, sum, requantize and post the allgather; dequantize into the tensor.
Hierarchical: the node's float32 sum (non-blocking at two ranks a node or fewer; blocking on
a larger node, so that its sum has the blocking path's bits whatever order the library's
non-blocking allreduce adds in), the staged exchange over the roots, the float32 broadcast
from the node root (non-blocking), on duplicates of the node and roots communicators made at
the first call. Each request has buffers of its own; the result, the residuals and the
counted bytes are the blocking allreduce's bit for bit; the bytes and the call are counted
at the call, the seconds spent in the call, in ``wait()`` and in the stages ``test()`` runs
(quantization included) as communication (a ``test()`` that finds the exchange in flight
counts none, as a plain request's). On Horovod (no non-blocking alltoall or allgather of the
package's) it runs the blocking allreduce at once and returns a completed request, as does a
non-blocking broadcast of a model tensor on every backend (no overlap). A neighbour exchange
of a model tensor is refused.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from lsgd_hpc.comm.base import CommError, CommStats, Communicator, Pending
from lsgd_hpc.comm.codec import (BITS, BLOCK, KINDS, QMAX, SCALE_BYTES, dequantize,
                                 kind_problem, pack, quantize, unpack)
from lsgd_hpc.comm.groups import NodeGroups
from lsgd_hpc.comm.lowprec import MIN_ELEMENTS, WIRE_DTYPES, residual_key, through_low
from lsgd_hpc.comm.monitor import MONITOR
from lsgd_hpc.comm.sparse import (FLOAT_VALUES, Sparse, decode, encode, reduce_records, select,
                                  sent_vector, sparse_layout)

__all__ = ["Quantized", "QuantizedGroups", "quantized_groups", "KINDS", "BLOCK", "QMAX", "BITS",
           "MIN_ELEMENTS", "kind_problem", "quantize", "dequantize", "pack", "unpack", "layout",
           "roundtrip", "allreduce_bytes", "broadcast_bytes"]

@dataclasses.dataclass(frozen=True)
class Layout:
    """How an n-element vector is cut for p ranks: p chunks of c = b * be elements (b blocks
    of ``be``), each element ``bits`` wide on the wire, and the bytes of one chunk on the wire
    (``record``: b scales, then the b blocks of ``block_bytes``)."""

    n: int
    p: int
    b: int
    be: int
    bits: int = 8

    @property
    def c(self) -> int:
        return self.b * self.be

    @property
    def block_bytes(self) -> int:
        return self.be * self.bits // 8

    @property
    def record(self) -> int:
        return SCALE_BYTES * self.b + self.b * self.block_bytes

    @property
    def counted(self) -> int:
        """The bytes counted: the packed payload, ceil(n bits / 8), plus four per scale
        (padding left out)."""
        return -(-self.n * self.bits // 8) + SCALE_BYTES * self.p * self.b


def layout(n: int, p: int, block: int = BLOCK, kind: str = "int8") -> Layout:
    """b = ceil(ceil(n / p) / block) blocks per chunk, each ceil(ceil(n / p) / b) elements
    rounded up to a multiple of 32 / bits (4 for int8 and fp8, 8 for int4, 16 for int2), so
    that every block fills whole bytes and every chunk's scales stay 4-byte aligned."""
    bits = BITS[kind]
    m = -(-n // p)
    b = -(-m // block)
    be = -(-m // b)
    be += -be % (32 // bits)
    return Layout(n, p, b, be, bits)


def allreduce_bytes(n: int, p: int, block: int = BLOCK, kind: str = "int8") -> int:
    """Bytes a quantized allreduce of n float32 elements over p ranks counts (each way)."""
    return layout(n, p, block, kind).counted


def broadcast_bytes(n: int, block: int = BLOCK, kind: str = "int8") -> int:
    """Bytes a quantized broadcast of n float32 elements counts (root: sent; others: received)."""
    return layout(n, 1, block, kind).counted


def roundtrip(x: torch.Tensor, p: int, kind: str, block: int = BLOCK) -> torch.Tensor:
    """Q(x) as phase 1 of an allreduce over p ranks sees it (float32, x's shape)."""
    lay = layout(x.numel(), p, block, kind)
    pad = torch.zeros(lay.p * lay.c, dtype=torch.float32, device=x.device)
    pad[:x.numel()] = x.reshape(-1)
    q, s = quantize(pad.view(lay.p, lay.b, lay.be), kind)
    return dequantize(q, s, kind).reshape(-1)[:x.numel()].view_as(x)


# -- shared state: registered buffers, residuals, work buffers -----------------------------------
class _Shared:
    """What the wrappers of one method's communicators share."""

    def __init__(self, kind: str, error_feedback: bool, block: int, topk: float = 1.0,
                 decay: float = 1.0):
        self.kind, self.error_feedback, self.block = kind, error_feedback, block
        #: beta: an allreduce compresses v + beta e (1: plain error feedback)
        self.decay = decay
        #: the fraction of each chunk an allreduce sends (1: dense; lsgd_hpc.comm.sparse)
        self.topk = topk
        #: buffers registered with agree_buffers, in registration order (the residuals' keys)
        self.agreed: List[torch.Tensor] = []
        self.residuals: Dict[str, torch.Tensor] = {}
        self.work: Dict[tuple, dict] = {}
        #: the float32 phases of hierarchical allreduces, inside the node (not comm_bytes_*)
        self.node_stats = CommStats()

    def registered(self, t: torch.Tensor) -> bool:
        return any(a.data_ptr() == t.data_ptr() and a.numel() == t.numel()
                   and a.dtype == t.dtype for a in self.agreed)

    def key(self, comm_key: str, t: torch.Tensor) -> str:
        return residual_key(self.agreed, comm_key, t)

    def feed(self, x: torch.Tensor, e: torch.Tensor) -> None:
        """x <- x + beta e: the residual fed back into an allreduce's input."""
        if self.decay == 1:
            x.add_(e)
        else:
            x.add_(e, alpha=self.decay)

    def residual(self, key: str, t: torch.Tensor) -> torch.Tensor:
        e = self.residuals.get(key)
        if e is None or e.numel() != t.numel() or e.device != t.device:
            e = self.residuals[key] = torch.zeros(t.numel(), dtype=torch.float32,
                                                  device=t.device)
        return e


class _Booked:
    """Count one quantized collective as its logical payload: the backend's own counts of the
    byte buffers it moved are replaced by (sent, received) (``keep``: the bytes booked inside
    stay as they are); the seconds are the whole operation's, quantization included; one
    call."""

    def __init__(self, stats, sent: int = 0, recv: int = 0,
                 unit: Optional[Tuple[int, int]] = None, keep: bool = False):
        self.stats, self.sent, self.recv, self.unit = stats, sent, recv, unit
        self.keep = keep

    def __enter__(self):
        self.before = self.stats.snapshot()
        self.t0 = time.perf_counter()

    def __exit__(self, *exc) -> bool:
        st, b = self.stats, self.before
        if self.keep:
            self.sent = st.bytes_sent - b.bytes_sent
            self.recv = st.bytes_recv - b.bytes_recv
        elif self.unit is not None:     # forwarded hops: each wire record counts as logical
            wire, logical = self.unit
            self.sent = (st.bytes_sent - b.bytes_sent) // wire * logical
            self.recv = (st.bytes_recv - b.bytes_recv) // wire * logical
        st.bytes_sent = b.bytes_sent + int(self.sent)
        st.bytes_recv = b.bytes_recv + int(self.recv)
        st.calls = b.calls + 1
        st.seconds = b.seconds + time.perf_counter() - self.t0
        return False


class _Apart:
    """Move what a collective counts in ``stats`` (bytes, calls, seconds) to ``apart``: the
    float32 phases inside the node of a hierarchical allreduce."""

    def __init__(self, stats: CommStats, apart: CommStats):
        self.stats, self.apart = stats, apart

    def __enter__(self):
        self.before = self.stats.snapshot()

    def __exit__(self, *exc) -> bool:
        st, b, a = self.stats, self.before, self.apart
        a.bytes_sent += st.bytes_sent - b.bytes_sent
        a.bytes_recv += st.bytes_recv - b.bytes_recv
        a.calls += st.calls - b.calls
        a.seconds += st.seconds - b.seconds
        st.bytes_sent, st.bytes_recv = b.bytes_sent, b.bytes_recv
        st.calls, st.seconds = b.calls, b.seconds
        return False


class Quantized:
    """A communicator whose model-sized float32 traffic moves as ``kind`` (int8, fp8, int4,
    int2) with per-block scales; with ``error_feedback`` its allreduces carry each buffer's
    residual."""

    def __init__(self, inner: Communicator, kind: str = "int8", error_feedback: bool = False,
                 block: int = BLOCK, _shared: Optional[_Shared] = None, topk: float = 1.0,
                 decay: float = 1.0):
        if _shared is not None:
            topk = _shared.topk
        if isinstance(topk, bool) or not isinstance(topk, (int, float)) or not 0 < topk <= 1:
            raise CommError(f"topk must be in (0, 1], got {topk!r}")
        # top-k values may also go as fp32 or bf16 (lsgd_hpc.comm.sparse)
        problem = None if (kind in FLOAT_VALUES and topk < 1) else kind_problem(kind)
        if problem:
            raise CommError(problem)
        if isinstance(decay, bool) or not isinstance(decay, (int, float)) or not 0 < decay <= 1:
            raise CommError(f"decay must be in (0, 1], got {decay!r}")
        if not isinstance(block, int) or block < 4 or block % 4:
            raise CommError(f"block must be a positive multiple of 4, got {block!r}")
        self.inner, self.kind = inner, kind
        self.shared = _shared or _Shared(kind, bool(error_feedback), block, float(topk),
                                         float(decay))
        #: the QuantizedGroups whose world this is (its allreduces go hierarchical), or None
        self._groups: Optional["QuantizedGroups"] = None
        #: duplicates of the hierarchy's (node, roots) for the non-blocking allreduce
        self._levels: Optional[Tuple[Communicator, Optional[Communicator]]] = None

    def __getattr__(self, name):          # everything not overridden: the inner communicator
        return getattr(self.inner, name)

    @property
    def error_feedback(self) -> bool:
        return self.shared.error_feedback

    @property
    def block(self) -> int:
        return self.shared.block

    @property
    def topk(self) -> float:
        return self.shared.topk

    @property
    def sparse(self) -> bool:
        """Whether allreduces send each chunk's top-k entries (lsgd_hpc.comm.sparse)."""
        return self.shared.topk < 1

    def quantizes(self, t: torch.Tensor) -> bool:
        """Whether ``t`` moves quantized (model-sized float32, in a group of more than one)."""
        return t.dtype == torch.float32 and t.numel() >= MIN_ELEMENTS and self.inner.size > 1

    def agree_buffers(self, *tensors: torch.Tensor) -> None:
        self.inner.agree_buffers(*tensors)
        self.shared.agreed.extend(tensors)

    def _agree(self, what: str, t: torch.Tensor) -> None:
        """The per-call agreement check of the backend, for a tensor not registered at set-up
        (its numel decides the layout, so every member must pass the same)."""
        if not self.shared.registered(t):
            check = getattr(self.inner, "_agree", None)
            if check is not None:
                check(what, t)

    def _work(self, lay: Layout, device, what: str,
              comm: Optional[Communicator] = None) -> dict:
        """Work buffers of one layout on ``comm`` (default: this communicator), made once
        (collectively: every member makes them at the same call) and agreed on at creation."""
        comm = self.inner if comm is None else comm
        key = (comm.key, what, lay, str(device))
        w = self.shared.work.get(key)
        if w is None:
            u8 = dict(dtype=torch.uint8, device=device)
            w = {"x": torch.zeros(lay.p * lay.c, dtype=torch.float32, device=device),
                 "send": torch.zeros(lay.p, lay.record, **u8)}
            if what == "allreduce":
                w["recv"] = torch.zeros(lay.p, lay.record, **u8)
                w["own"] = torch.zeros(lay.record, **u8)
                w["all"] = torch.zeros(lay.p, lay.record, **u8)
                comm.agree_buffers(w["send"], w["own"])
            else:
                comm.agree_buffers(w["send"])
            self.shared.work[key] = w
        return w

    @staticmethod
    def _split(buf: torch.Tensor, lay: Layout) -> Tuple[torch.Tensor, torch.Tensor]:
        """(bytes (rows, b, be), scales (rows, b)) views of records ``buf`` (rows, record)."""
        rows = buf.view(-1, lay.record)
        k = SCALE_BYTES * lay.b
        return (rows[:, k:].unflatten(-1, (lay.b, lay.block_bytes)),
                rows[:, :k].view(torch.float32))

    def _pack(self, x: torch.Tensor, buf: torch.Tensor,
              lay: Layout) -> Tuple[torch.Tensor, torch.Tensor]:
        """Quantize ``x`` (rows * c float32) into the records ``buf``; returns their views."""
        q, s = quantize(x.view(-1, lay.b, lay.be), self.kind)
        qv, sv = self._split(buf, lay)
        qv.copy_(q)
        sv.copy_(s)
        return qv, sv

    # -- allreduce ---------------------------------------------------------------------------
    def allreduce_(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        if not self.quantizes(tensor):
            return self.inner.allreduce_(tensor, op)
        self.inner._check_allreduce(tensor, op)
        self._agree("allreduce_", tensor)
        key = self.shared.key(self.inner.key, tensor)
        levels = self.hierarchy()
        if levels is not None:
            return self._hierarchical_allreduce(tensor, op, key, *levels)
        div = self.inner.size if op == "mean" else 1
        return self._reduce(self.inner, tensor, div, key)

    def hierarchy(self) -> Optional[Tuple[Communicator, Optional[Communicator]]]:
        """(node, roots), the plain communicators of the hierarchical allreduce, when this
        is the world of :func:`quantized_groups` over more than one node with more than one
        member on some node; None otherwise (the flat allreduce over ``inner``)."""
        groups = self._groups
        if groups is None:
            return None
        node_of = groups.node_of
        if max(node_of) < 1 or max(node_of.count(i) for i in set(node_of)) < 2:
            return None
        unwrap = lambda c: None if c is None else getattr(c, "inner", c)  # noqa: E731
        return unwrap(groups.node), unwrap(groups.roots)

    def _hierarchical_allreduce(self, tensor: torch.Tensor, op: str, key: str,
                                node: Communicator, roots: Optional[Communicator]
                                ) -> torch.Tensor:
        """Sum in float32 inside the node, the compressed allreduce of the node sums over the
        node roots (divided by the world size for a mean; residuals on the roots), the
        result broadcast in float32 inside the node. The job's counters get the exchange
        between the roots (and one call, the whole operation's seconds); the two float32
        phases inside the node are counted in ``node_stats``."""
        div = self.inner.size if op == "mean" else 1
        with _Booked(self.inner.stats, keep=True):
            with _Apart(node.stats, self.shared.node_stats):
                node.allreduce_(tensor, "sum")                 # the node's sum, float32
            if roots is not None:
                self._reduce(roots, tensor, div, key)
            with _Apart(node.stats, self.shared.node_stats):
                node.broadcast_(tensor, 0)                     # the root's bits to all
        return tensor

    def _reduce(self, comm: Communicator, tensor: torch.Tensor, div: int,
                key: str) -> torch.Tensor:
        """The flat compressed allreduce of ``tensor`` over ``comm`` (its sum divided by
        ``div``; residual ``key``), booked in ``comm.stats``."""
        if self.sparse:
            return self._sparse_allreduce(comm, tensor, div, key)
        p, n = comm.size, tensor.numel()
        lay = layout(n, p, self.block, self.kind)
        w = self._work(lay, tensor.device, "allreduce", comm)
        with _Booked(comm.stats, lay.counted, lay.counted):
            x = w["x"]
            x[:n].copy_(tensor.reshape(-1))
            e = None
            if self.error_feedback:
                e = self.shared.residual(key, tensor)
                self.shared.feed(x[:n], e)                      # v + beta e
            qv, sv = self._pack(x, w["send"], lay)
            if e is not None:                                   # e <- (v + e) - Q(v + e)
                torch.sub(x[:n], dequantize(qv, sv, self.kind).reshape(-1)[:n], out=e)
            # phase 1: chunk j to rank j
            comm.alltoall(w["send"].view(-1), w["recv"].view(-1))
            rq, rs = self._split(w["recv"], lay)
            reduced = dequantize(rq, rs, self.kind).sum(0)      # (b, be), float32
            if div != 1:
                reduced.div_(div)
            self._pack(reduced.reshape(-1), w["own"], lay)
            # phase 2: every reduced chunk to every rank; all dequantize the same bytes
            comm.allgather(w["own"], w["all"].view(-1))
            aq, as_ = self._split(w["all"], lay)
            tensor.view(-1).copy_(dequantize(aq, as_, self.kind).reshape(-1)[:n])
        return tensor

    def _sparse_allreduce(self, comm: Communicator, tensor: torch.Tensor, div: int,
                          key: str) -> torch.Tensor:
        """Top-k of every chunk of v (+ e), an allgather of every rank's records, the sum
        in rank order (lsgd_hpc.comm.sparse), divided by ``div``; e <- (v + e) - sent(v + e)."""
        p, n = comm.size, tensor.numel()
        lay = sparse_layout(n, self.topk, self.kind, self.block)
        w = self._sparse_work(lay, tensor.device, comm)
        sent_bytes, recv_bytes = lay.counted, (p - 1) * lay.counted
        with _Booked(comm.stats, sent_bytes, recv_bytes):
            x = w["x"]
            x.copy_(tensor.reshape(-1))
            e = None
            if self.error_feedback:
                e = self.shared.residual(key, tensor)
                self.shared.feed(x, e)                          # w = v + beta e
            idx, values = select(x, lay)
            encode(idx, values, lay, w["send"])
            if e is not None:                                   # e <- w - sent(w)
                torch.sub(x, sent_vector(*decode(w["send"], lay), lay), out=e)
            comm.allgather(w["send"], w["all"].view(-1))
            total = reduce_records(w["all"], lay, p)
            if div != 1:
                total.div_(div)
            tensor.view(-1).copy_(total)
        return tensor

    def _sparse_work(self, lay: Sparse, device, comm: Communicator) -> dict:
        """The sparse allreduce's buffers of one layout on ``comm``, made once and agreed on."""
        p = comm.size                      # (a shrunk world gathers fewer messages)
        key = (comm.key, "sparse", lay, p, str(device))
        w = self.shared.work.get(key)
        if w is None:
            u8 = dict(dtype=torch.uint8, device=device)
            w = {"x": torch.zeros(lay.n, dtype=torch.float32, device=device),
                 "send": torch.zeros(lay.m * lay.record, **u8),
                 "all": torch.zeros(p, lay.m * lay.record, **u8)}
            comm.agree_buffers(w["send"])
            self.shared.work[key] = w
        return w

    def iallreduce_(self, tensor: torch.Tensor, op: str = "sum", *, agreed: bool = False):
        """The allreduce above, staged (:class:`_Staged`): its first stage runs now, the next
        ones as ``test()`` finds the previous one completed, the rest in ``wait()``; the same
        bits, residuals and counted bytes as ``allreduce_``. On a backend without
        non-blocking alltoall and allgather (Horovod): the blocking allreduce at once and a
        completed request."""
        if not self.quantizes(tensor):
            return self.inner.iallreduce_(tensor, op, agreed=agreed)
        levels = self.hierarchy()
        comms = [self.inner] if levels is None else [c for c in levels if c is not None]
        if not all(_nonblocking(c) for c in comms):
            self.allreduce_(tensor, op)               # blocking: a completed request
            return Pending(self.inner, tensor, op, lambda: None, lambda: True,
                           finish=lambda: tensor)
        self.inner._check_allreduce(tensor, op)
        if not agreed:
            self._agree("iallreduce_", tensor)
        key = self.shared.key(self.inner.key, tensor)
        div = self.inner.size if op == "mean" else 1
        if levels is None:
            sent, recv = self._exchange_bytes(self.inner, tensor.numel())
            stages = self._staged_reduce(self.inner, tensor, div, key)
        else:
            node, roots = self._own_levels()
            sent, recv = ((0, 0) if roots is None
                          else self._exchange_bytes(roots, tensor.numel()))
            stages = self._staged_hierarchical(tensor, div, key, node, roots)
        return _Staged(self.inner, tensor, op, stages, sent, recv, self.shared.node_stats)

    def _own_levels(self) -> Tuple[Communicator, Optional[Communicator]]:
        """Duplicates of the hierarchy's node and roots communicators, made at this
        communicator's first non-blocking hierarchical allreduce (collectively: every rank
        posts it at the same point), so that its stages, posted from ``test()`` at different
        moments on different ranks, never interleave with the blocking collectives on the
        shared node and roots communicators."""
        if self._levels is None:
            node, roots = self.hierarchy()
            self._levels = (node.dup(), None if roots is None else roots.dup())
        return self._levels

    def _exchange_bytes(self, comm: Communicator, n: int) -> Tuple[int, int]:
        """(sent, received) the compressed allreduce of n elements over ``comm`` counts."""
        if self.sparse:
            lay = sparse_layout(n, self.topk, self.kind, self.block)
            return lay.counted, (comm.size - 1) * lay.counted
        lay = layout(n, comm.size, self.block, self.kind)
        return lay.counted, lay.counted

    def _staged_hierarchical(self, tensor: torch.Tensor, div: int, key: str,
                             node: Communicator, roots: Optional[Communicator]):
        """The stages of ``_hierarchical_allreduce``: the node's float32 sum (non-blocking at
        two ranks a node or fewer, where a sum of two is the same bits in any algorithm;
        blocking on larger nodes, so that the sum is the blocking path's bits whatever order
        the library's non-blocking allreduce adds in), the staged compressed allreduce over
        the roots, the non-blocking float32 broadcast from the node root."""
        apart = self.shared.node_stats
        if node.size <= 2:
            with _Apart(node.stats, apart):
                request = node.iallreduce_(tensor, "sum", agreed=True)
            yield request, True
        else:
            with _Apart(node.stats, apart):
                node.allreduce_(tensor, "sum")
        if roots is not None:
            yield from self._staged_reduce(roots, tensor, div, key)
        with _Apart(node.stats, apart):
            request = node.ibroadcast_(tensor, 0)
        yield request, True

    def _staged_reduce(self, comm: Communicator, tensor: torch.Tensor, div: int, key: str):
        """The stages of ``_reduce`` over ``comm`` (buffers of their own: several may be in
        flight): quantize (residual updated), a non-blocking alltoall; dequantize, sum,
        requantize, a non-blocking allgather; dequantize into ``tensor``. Top-k: select and
        encode (residual updated), a non-blocking allgather of the records; their sum."""
        p, n = comm.size, tensor.numel()
        u8 = dict(dtype=torch.uint8, device=tensor.device)
        if self.sparse:
            lay = sparse_layout(n, self.topk, self.kind, self.block)
            x = tensor.reshape(-1).to(torch.float32, copy=True)
            send = torch.zeros(lay.m * lay.record, **u8)
            every = torch.zeros(p, lay.m * lay.record, **u8)
            e = None
            if self.error_feedback:
                e = self.shared.residual(key, tensor)
                self.shared.feed(x, e)                          # w = v + beta e
            idx, values = select(x, lay)
            encode(idx, values, lay, send)
            if e is not None:                                   # e <- w - sent(w)
                torch.sub(x, sent_vector(*decode(send, lay), lay), out=e)
            yield comm.iallgather(send, every.view(-1), agreed=True), False
            total = reduce_records(every, lay, p)
            if div != 1:
                total.div_(div)
            tensor.view(-1).copy_(total)
            return
        lay = layout(n, p, self.block, self.kind)
        x = torch.zeros(lay.p * lay.c, dtype=torch.float32, device=tensor.device)
        send, recv = torch.zeros(lay.p, lay.record, **u8), torch.zeros(lay.p, lay.record, **u8)
        own, every = torch.zeros(lay.record, **u8), torch.zeros(lay.p, lay.record, **u8)
        x[:n].copy_(tensor.reshape(-1))
        e = None
        if self.error_feedback:
            e = self.shared.residual(key, tensor)
            self.shared.feed(x[:n], e)                          # v + beta e
        qv, sv = self._pack(x, send, lay)
        if e is not None:                                       # e <- (v + e) - Q(v + e)
            torch.sub(x[:n], dequantize(qv, sv, self.kind).reshape(-1)[:n], out=e)
        yield comm.ialltoall(send.view(-1), recv.view(-1), agreed=True), False   # phase 1
        rq, rs = self._split(recv, lay)
        reduced = dequantize(rq, rs, self.kind).sum(0)          # (b, be), float32
        if div != 1:
            reduced.div_(div)
        self._pack(reduced.reshape(-1), own, lay)
        yield comm.iallgather(own, every.view(-1), agreed=True), False          # phase 2
        aq, as_ = self._split(every, lay)
        tensor.view(-1).copy_(dequantize(aq, as_, self.kind).reshape(-1)[:n])

    # -- broadcast ---------------------------------------------------------------------------
    def _broadcast(self, tensor: torch.Tensor, is_root: bool, move) -> torch.Tensor:
        """The root quantizes ``tensor``; ``move(bytes)`` broadcasts its records; every rank
        (the root too) dequantizes them into ``tensor``."""
        n = tensor.numel()
        lay = layout(n, 1, self.block, self.kind)
        w = self._work(lay, tensor.device, "broadcast")
        buf = w["send"]
        with _Booked(self.inner.stats, unit=(lay.record, lay.counted)):
            if is_root:
                x = w["x"]
                x[:n].copy_(tensor.reshape(-1))
                self._pack(x, buf, lay)
            move(buf.view(-1))
            q, s = self._split(buf, lay)
            tensor.view(-1).copy_(dequantize(q, s, self.kind).reshape(-1)[:n])
        return tensor

    def broadcast_(self, tensor: torch.Tensor, root: int) -> torch.Tensor:
        if not self.quantizes(tensor) or self.kind == "fp32":
            return self.inner.broadcast_(tensor, root)
        if self.kind in WIRE_DTYPES:          # bf16 (with top-k): the dense bf16 broadcast
            return through_low(tensor, lambda t: self.inner.broadcast_(t, root),
                               WIRE_DTYPES[self.kind])
        self.inner._check_root(root)
        self._agree("broadcast_", tensor)
        return self._broadcast(tensor, self.inner.rank == root,
                               lambda b: self.inner.broadcast_(b, root))

    def ibroadcast_(self, tensor: torch.Tensor, root: int):
        if not self.quantizes(tensor) or self.kind == "fp32":
            return self.inner.ibroadcast_(tensor, root)
        self.broadcast_(tensor, root)
        return Pending(self.inner, tensor, "sum", lambda: None, lambda: True,
                       name="ibroadcast_", finish=lambda: tensor)

    def neighbor_allgather(self, tensor: torch.Tensor, sources: Sequence[int],
                           destinations: Sequence[int], out: Optional[torch.Tensor] = None,
                           graph_key=None) -> torch.Tensor:
        if self.quantizes(tensor) and (self.kind != "fp32" or self.sparse):
            raise CommError(f"comm_dtype {self.kind}: no quantized neighbour exchange (gossip "
                            "sends parameters, not sums; use fp32 or bf16)")
        return self.inner.neighbor_allgather(tensor, sources, destinations, out, graph_key)

    # -- groups and state --------------------------------------------------------------------
    def dup(self) -> "Quantized":
        q = Quantized(self.inner.dup(), self.kind, _shared=self.shared)
        q._groups = self._groups               # (the world's dup stays hierarchical)
        return q

    @property
    def node_stats(self) -> CommStats:
        """What the float32 phases inside the node of hierarchical allreduces counted (the
        job's counters, ``stats``, hold what crossed between the node roots)."""
        return self.shared.node_stats

    @property
    def counters(self) -> tuple:
        """Every counter this communicator's collectives count in (lsgd_hpc.comm.accounting
        restores them all): the inner one's, and ``node_stats`` for a hierarchical world."""
        inner = getattr(self.inner, "counters", None) or (self.inner.stats,)
        return (*inner, self.shared.node_stats) if self._groups is not None else tuple(inner)

    def split(self, color: int, key: Optional[int] = None) -> Optional["Quantized"]:
        sub = self.inner.split(color, key)
        return None if sub is None else Quantized(sub, self.kind, _shared=self.shared)

    def state_dict(self) -> dict:
        """The error-feedback residuals (copies), by buffer key, with the compressor that
        left them (for the record: a resume may change it, the residuals stay what was not
        sent yet)."""
        return {"comm_dtype": self.kind, "topk": self.topk,
                "error_feedback_decay": self.shared.decay,
                "residuals": {k: v.detach().clone() for k, v in self.shared.residuals.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.shared.residuals = {k: v.detach().clone().to(torch.float32)
                                 for k, v in state.get("residuals", {}).items()}


def _nonblocking(comm: Communicator) -> bool:
    """Whether ``comm``'s backend has non-blocking alltoall and allgather of its own (MPI,
    torch.distributed; not Horovod, whose are the base class's blocking ones)."""
    kind = type(comm)
    return (kind.ialltoall is not Communicator.ialltoall
            and kind.iallgather is not Communicator.iallgather)


class _Staged:
    """A non-blocking compressed allreduce in flight: ``stages``, a generator that does the
    computation between two exchanges and yields each posted exchange as (request, inside the
    node), is advanced as far as the posted requests have completed by every :meth:`test`
    and to its end by :meth:`wait`. The bytes and the one call are counted when it starts, as
    the blocking allreduce counts them (``sent``, ``recv``: the compressed exchange's); the
    seconds spent starting, testing and waiting (quantization included) are communication
    time; what the float32 stages inside the node count (their bytes, calls and seconds) is
    also moved to ``apart`` (``node_stats``), as the blocking path does; a ``test()`` that
    finds the exchange still in flight counts no seconds (as ``Pending.test``). The Pending
    interface: ``test``, ``wait``, ``done``, ``result``."""

    def __init__(self, comm: Communicator, tensor: torch.Tensor, op: str, stages,
                 sent: int, recv: int, apart: CommStats, name: str = "iallreduce_"):
        self.comm, self.tensor, self.op, self.name = comm, tensor, op, name
        self.stats, self.apart = comm.stats, apart
        self.seq = MONITOR.post(comm.key, name)
        self.done = False
        self._stages, self._current = stages, None
        self._advance(block=False)
        self.stats.bytes_sent += int(sent)
        self.stats.bytes_recv += int(recv)
        self.stats.calls += 1

    def _advance(self, block: bool) -> bool:
        st = self.stats
        before, t0 = st.snapshot(), time.perf_counter()
        idle = 0.0          # a poll that finds the exchange in flight: not counted (Pending's)
        try:
            while not self.done:
                if self._current is not None:
                    request, inside = self._current
                    with (_Apart(request.comm.stats, self.apart) if inside
                          else contextlib.nullcontext()):
                        if block:
                            request.wait()
                        else:
                            t = time.perf_counter()
                            if not request.test():
                                idle += time.perf_counter() - t
                                return False
                try:
                    self._current = next(self._stages)
                except StopIteration:
                    self._current, self.done = None, True
            return True
        finally:           # what the stages counted replaced by the bytes counted at start
            st.bytes_sent, st.bytes_recv, st.calls = (before.bytes_sent, before.bytes_recv,
                                                      before.calls)
            st.seconds = before.seconds + time.perf_counter() - t0 - idle

    def test(self) -> bool:
        """Progress: run every stage whose exchange has completed; True once all have."""
        return self.done or self._advance(block=False)

    def wait(self) -> torch.Tensor:
        """Complete every stage left (blocking); returns the tensor."""
        if not self.done:
            self._advance(block=True)
        return self.tensor

    @property
    def result(self) -> torch.Tensor:
        if not self.done:
            raise CommError(f"{self.name}: result read before the collective completed")
        return self.tensor


@dataclasses.dataclass
class QuantizedGroups(NodeGroups):
    """NodeGroups over Quantized communicators; a broadcast across node boundaries
    (``broadcast_from_``) is quantized once, at the source, and its bytes forwarded."""

    plain: Optional[NodeGroups] = None

    def broadcast_from_(self, tensor, world_root: int):
        q: Quantized = self.world
        if not q.quantizes(tensor) or q.kind == "fp32":
            return self.plain.broadcast_from_(tensor, world_root)
        if q.kind in WIRE_DTYPES:             # bf16 (with top-k): the dense bf16 broadcast
            return through_low(tensor, lambda t: self.plain.broadcast_from_(t, world_root),
                               WIRE_DTYPES[q.kind])
        return q._broadcast(tensor, q.world_rank == world_root,
                            lambda b: self.plain.broadcast_from_(b, world_root))

    @property
    def node_stats(self) -> CommStats:
        """The float32 traffic inside the nodes of the world's hierarchical allreduces."""
        return self.world.node_stats

    def state_dict(self) -> dict:
        return self.world.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.world.load_state_dict(state)


def quantized_groups(groups: NodeGroups, kind: str = "int8", error_feedback: bool = False,
                     block: int = BLOCK, topk: float = 1.0,
                     decay: float = 1.0) -> QuantizedGroups:
    """The same node hierarchy with every communicator sending model tensors as ``kind``
    (with ``topk`` < 1: each allreduce sends the top-k of every chunk, values as ``kind``,
    fp32 allowed; residuals decayed by ``decay`` before each use); the three share their
    registered buffers and residuals."""
    world = Quantized(groups.world, kind, error_feedback, block, topk=topk, decay=decay)
    wrap = lambda c: None if c is None else Quantized(c, kind, _shared=world.shared)  # noqa: E731
    fields = {f.name: getattr(groups, f.name) for f in dataclasses.fields(NodeGroups)}
    fields.update(world=world, node=wrap(groups.node), roots=wrap(groups.roots))
    out = QuantizedGroups(**fields, plain=groups)
    world._groups = out
    return out
