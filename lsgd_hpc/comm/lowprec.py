"""Communication in bfloat16: what a method sends (pulls, averages, pseudo-gradients) goes over
the wire in half the bytes, and arrives back in the method's float32 buffers.

``LowPrecision(comm)`` wraps one communicator: model-sized float32 tensors (at least
``MIN_ELEMENTS``) are rounded to bfloat16 (round to nearest even), moved, and widened back in
place; everything else (elections, scalars, float64 measurements, integers) passes through
unchanged. Sums are taken in bfloat16 by the backend (a rounding at every reduction step, as
NCCL's bfloat16 allreduce does). The byte counters see the bfloat16 payload.

What it changes: every rank's copy of a broadcast (a leader's parameters) is the bfloat16
rounding of the sender's, and an average of parameters (local SGD, SlowMo) is rounded to
bfloat16 -- 8 bits of mantissa, so updates below about 2^-8 of a weight's size between two
averages are lost. Methods that send differences (DiLoCo's pseudo-gradient, EASGD's elastic
difference, allreduce's gradients) lose relatively less. docs/algorithms.md has the measured
effect.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from lsgd_hpc.comm.base import Communicator
from lsgd_hpc.comm.groups import NodeGroups

__all__ = ["LowPrecision", "low_precision_groups", "WIRE_DTYPES", "MIN_ELEMENTS"]

#: the wire dtype of each low-precision comm_dtype (the names: lsgd_hpc.methods.spec.COMM_DTYPES)
WIRE_DTYPES = {"bf16": torch.bfloat16}
#: smaller float32 tensors are control values, not models: they pass through
MIN_ELEMENTS = 256


class _Widen:
    """A posted low-precision collective; completing it widens the result into the caller's
    float32 tensor (the same interface as Pending: wait, test, done, result)."""

    def __init__(self, pending, low: torch.Tensor, target: torch.Tensor):
        self.pending, self.low, self.target = pending, low, target
        self.comm, self.seq, self.name = pending.comm, pending.seq, pending.name
        self._copied = False

    def _finish(self):
        if not self._copied:
            self.target.copy_(self.low)
            self._copied = True
        return self.target

    def wait(self):
        self.pending.wait()
        return self._finish()

    def test(self) -> bool:
        if self.pending.test():
            self._finish()
            return True
        return False

    @property
    def done(self) -> bool:
        return self.pending.done

    @property
    def result(self):
        self.pending.result
        return self._finish()


class LowPrecision:
    """A communicator whose model-sized float32 traffic moves in ``dtype`` (bfloat16)."""

    def __init__(self, inner: Communicator, dtype: torch.dtype = torch.bfloat16):
        self.inner, self.dtype = inner, dtype
        self._buffers = {}

    def __getattr__(self, name):          # everything not overridden: the inner communicator
        return getattr(self.inner, name)

    def _low(self, t: torch.Tensor) -> Optional[torch.Tensor]:
        if t.dtype != torch.float32 or t.numel() < MIN_ELEMENTS:
            return None
        key = (t.numel(), t.device)
        buf = self._buffers.get(key)
        if buf is None:
            buf = self._buffers[key] = torch.empty(t.numel(), dtype=self.dtype, device=t.device)
        buf.copy_(t.reshape(-1))
        return buf

    def agree_buffers(self, *tensors: torch.Tensor) -> None:
        self.inner.agree_buffers(*tensors)

    def _through_low(self, tensor: torch.Tensor, call) -> torch.Tensor:
        """``call`` (an in-place collective) on the low-precision copy of ``tensor``, widened
        back into it; on ``tensor`` itself when it is not sent in low precision."""
        low = self._low(tensor)
        if low is None:
            return call(tensor)
        call(low)
        tensor.copy_(low.view_as(tensor))
        return tensor

    def allreduce_(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        return self._through_low(tensor, lambda t: self.inner.allreduce_(t, op))

    def iallreduce_(self, tensor: torch.Tensor, op: str = "sum", *, agreed: bool = False):
        if tensor.dtype != torch.float32 or tensor.numel() < MIN_ELEMENTS:
            return self.inner.iallreduce_(tensor, op, agreed=agreed)
        # its own buffer: several buckets of one size may be in flight at once
        low = tensor.to(self.dtype)
        return _Widen(self.inner.iallreduce_(low, op), low, tensor)

    def broadcast_(self, tensor: torch.Tensor, root: int) -> torch.Tensor:
        return self._through_low(tensor, lambda t: self.inner.broadcast_(t, root))

    def ibroadcast_(self, tensor: torch.Tensor, root: int):
        if tensor.dtype != torch.float32 or tensor.numel() < MIN_ELEMENTS:
            return self.inner.ibroadcast_(tensor, root)
        low = tensor.to(self.dtype)
        return _Widen(self.inner.ibroadcast_(low, root), low, tensor)

    def neighbor_allgather(self, tensor: torch.Tensor, sources: Sequence[int],
                           destinations: Sequence[int], out: Optional[torch.Tensor] = None,
                           graph_key=None) -> torch.Tensor:
        if tensor.dtype != torch.float32 or tensor.numel() < MIN_ELEMENTS:
            return self.inner.neighbor_allgather(tensor, sources, destinations, out, graph_key)
        low_out = self.inner.neighbor_allgather(tensor.to(self.dtype), sources, destinations,
                                                None, graph_key)
        if out is None:
            return low_out.to(torch.float32)
        out.copy_(low_out)
        return out

    def dup(self) -> "LowPrecision":
        return LowPrecision(self.inner.dup(), self.dtype)

    def split(self, color: int, key: Optional[int] = None) -> Optional["LowPrecision"]:
        sub = self.inner.split(color, key)
        return None if sub is None else LowPrecision(sub, self.dtype)


def low_precision_groups(groups: NodeGroups, dtype: torch.dtype = torch.bfloat16) -> NodeGroups:
    """The same node hierarchy with every communicator sending model tensors in ``dtype``."""
    return NodeGroups(LowPrecision(groups.world, dtype), LowPrecision(groups.node, dtype),
                      None if groups.roots is None else LowPrecision(groups.roots, dtype),
                      groups.node_of, groups.hostname)
