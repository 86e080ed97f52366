"""LSGD's compressed leader pull: the change of a reference copy, sent as top-k records.

Every rank keeps a reference r of the leader's parameters, the same bits on every rank. At a
pull the leader sends d = C(x_L - r): of each chunk of the difference the k = ceil(F c)
entries of largest magnitude, values as ``kind`` (fp32, int8, fp8, int4, int2; one scale per
chunk), as the records of :mod:`lsgd_hpc.comm.sparse` (the same selection and codec); every
rank, the leader too, decodes the records and sets r <- r + d. The maths and why it needs no
residual of its own: docs/algorithms.md, "Compressed leader pull".

This module holds the maths (no communication) and the byte booking of one broadcast of the
records: they travel as bytes (``NodeGroups.broadcast_from_``, crossing node boundaries once
per node; with a pull delay the non-blocking ``hierarchy.HierarchicalBroadcast``, booked by
``BookedRequest``), counted as their logical payload ``Sparse.counted`` per hop, as a broadcast
of a quantized copy counts ``quantized.broadcast_bytes``.
"""

from __future__ import annotations

import time
from typing import Optional

import torch

from lsgd_hpc.comm.sparse import Sparse, decode, encode, select, sent_vector, sparse_layout

__all__ = ["delta_layout", "message_buffer", "encode_delta", "apply_delta", "BookedBroadcast",
           "BookedRequest"]


def delta_layout(n: int, topk: float, kind: str) -> Sparse:
    """The records' layout for an n-element reference (chunks of at most 4096 elements)."""
    return sparse_layout(n, topk, kind)


def message_buffer(lay: Sparse, device=None) -> torch.Tensor:
    """A zeroed byte buffer for one message (m records)."""
    return torch.zeros(lay.m * lay.record, dtype=torch.uint8, device=device)


def encode_delta(x: torch.Tensor, r: torch.Tensor, lay: Sparse, buf: torch.Tensor) -> None:
    """The leader's message: the top-k records of x - r into ``buf``."""
    idx, values = select((x - r).reshape(-1), lay)
    encode(idx, values, lay, buf)


def apply_delta(r: torch.Tensor, buf: torch.Tensor, lay: Sparse,
                scratch: Optional[torch.Tensor] = None) -> torch.Tensor:
    """r <- r + decoded(buf), in float32; the same bits on every rank that holds the same r
    and the same bytes (the entries not sent add an exact zero). Returns d, the decoded
    change (a dense n-vector, ``scratch`` when given)."""
    idx, values = decode(buf, lay)
    d = sent_vector(idx, values, lay, scratch)
    r.view(-1).add_(d)
    return d


class BookedBroadcast:
    """Count one broadcast of records as its logical payload: each hop's wire bytes (whole
    records, padded to 4 bytes) become ``lay.counted``; the seconds are the whole
    operation's. ``stats``: the communicators' shared CommStats. ``calls``: what the
    operation counts as calls (``timed`` False: the calls and seconds as the communicators
    counted them, less their calls, plus ``calls``; for the parts of a non-blocking one)."""

    def __init__(self, stats, lay: Sparse, calls: int = 1, timed: bool = True):
        self.stats, self.wire, self.logical = stats, lay.m * lay.record, lay.counted
        self.calls, self.timed = calls, timed

    def __enter__(self):
        self.before = self.stats.snapshot()
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> bool:
        st, b = self.stats, self.before
        st.bytes_sent = b.bytes_sent + (st.bytes_sent - b.bytes_sent) // self.wire * self.logical
        st.bytes_recv = b.bytes_recv + (st.bytes_recv - b.bytes_recv) // self.wire * self.logical
        st.calls = b.calls + self.calls
        if self.timed:
            st.seconds = b.seconds + time.perf_counter() - self.t0
        return False


class BookedRequest:
    """A non-blocking broadcast of records (``post()`` starts it: a HierarchicalBroadcast of
    the message, whose hops are posted now and in its test/wait), booked as BookedBroadcast
    books the blocking one: each hop counts ``lay.counted``, the whole broadcast one call; the
    seconds are what its communicators count (the posts and the waits)."""

    def __init__(self, stats, lay: Sparse, post):
        self.stats, self.lay = stats, lay
        with BookedBroadcast(stats, lay, calls=1, timed=False):
            self.inner = post()

    def test(self) -> bool:
        with BookedBroadcast(self.stats, self.lay, calls=0, timed=False):
            return self.inner.test()

    def wait(self) -> torch.Tensor:
        with BookedBroadcast(self.stats, self.lay, calls=0, timed=False):
            return self.inner.wait()
