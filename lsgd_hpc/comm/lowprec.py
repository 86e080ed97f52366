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

Error feedback (``LowPrecision(comm, error_feedback=True)``; ``--comm-dtype bf16
--error-feedback``): each rank keeps a residual e per buffer it allreduces, sends
bf16(v + beta e) and sets e <- (v + beta e) - bf16(v + beta e) (beta: ``decay``, 1 by
default), so what the rounding of its own input dropped is sent in later rounds instead of
lost. The backend's roundings inside the bfloat16 sum are not fed back (as the quantized
allreduce's phase 2), nor are broadcasts (a leader's copy is a new vector each time). The
residuals are keyed and saved as the quantized ones (lsgd_hpc.comm.quantized: the registered
buffer, offset and length; ``LowPrecisionGroups.state_dict``).
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Sequence

import torch

from lsgd_hpc.comm.base import Communicator
from lsgd_hpc.comm.groups import NodeGroups


__all__ = ["LowPrecision", "LowPrecisionGroups", "Residuals", "low_precision_groups",
           "through_low", "residual_key", "WIRE_DTYPES", "MIN_ELEMENTS"]


def residual_key(agreed: Sequence[torch.Tensor], comm_key: str, t: torch.Tensor) -> str:
    """The name of ``t``'s error-feedback residual on the communicator ``comm_key``: its
    place in a registered buffer (``agreed``: the same buffers in the same order on every
    rank, so the same name everywhere and across a checkpoint), else its size."""
    ptr, end = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
    for i, a in enumerate(agreed):
        lo = a.data_ptr()
        if (a.device == t.device and a.dtype == t.dtype and lo <= ptr
                and end <= lo + a.numel() * a.element_size()):
            return f"{comm_key}/buffer{i}@{(ptr - lo) // t.element_size()}+{t.numel()}"
    return f"{comm_key}/numel{t.numel()}"


#: the wire dtype of each low-precision comm_dtype (the names: lsgd_hpc.methods.spec.COMM_DTYPES)
WIRE_DTYPES = {"bf16": torch.bfloat16}
#: smaller float32 tensors are control values, not models: they pass through
MIN_ELEMENTS = 256


def through_low(tensor: torch.Tensor, move, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``move`` (an in-place collective) on ``tensor`` rounded to ``dtype``, widened back into
    ``tensor`` (every rank, the sender too, ends with the same bits)."""
    low = tensor.to(dtype)
    move(low)
    tensor.copy_(low.view_as(tensor))
    return tensor


class Residuals:
    """The error-feedback residuals of one method's low-precision communicators (the world's,
    the node's and the roots', shared), keyed by the buffer registered with
    ``agree_buffers`` that holds the allreduced tensor, its offset and its length (the keys
    of lsgd_hpc.comm.quantized), so a resumed run finds them; ``decay`` beta: the input is
    v + beta e."""

    def __init__(self, decay: float = 1.0):
        self.decay = float(decay)
        self.agreed: List[torch.Tensor] = []
        self.residuals: Dict[str, torch.Tensor] = {}

    def key(self, comm_key: str, t: torch.Tensor) -> str:
        return residual_key(self.agreed, comm_key, t)

    def rounded(self, comm_key: str, t: torch.Tensor, dtype: torch.dtype,
                out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """w = v + beta e rounded to ``dtype`` (into ``out``), and e <- w - rounded(w)."""
        key = self.key(comm_key, t)
        e = self.residuals.get(key)
        if e is None or e.numel() != t.numel() or e.device != t.device:
            e = self.residuals[key] = torch.zeros(t.numel(), dtype=torch.float32,
                                                  device=t.device)
        w = t.reshape(-1).to(torch.float32, copy=True)
        if self.decay == 1:
            w.add_(e)
        else:
            w.add_(e, alpha=self.decay)
        low = w.to(dtype) if out is None else out.copy_(w)
        torch.sub(w, low.to(torch.float32), out=e)
        return low

    def state_dict(self, comm_dtype: str) -> dict:
        return {"comm_dtype": comm_dtype, "topk": 1.0, "error_feedback_decay": self.decay,
                "residuals": {k: v.detach().clone() for k, v in self.residuals.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.residuals = {k: v.detach().clone().to(torch.float32)
                          for k, v in state.get("residuals", {}).items()}


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
    """A communicator whose model-sized float32 traffic moves in ``dtype`` (bfloat16); with
    ``error_feedback`` its allreduces carry each buffer's residual (``decay``: beta)."""

    def __init__(self, inner: Communicator, dtype: torch.dtype = torch.bfloat16,
                 error_feedback: bool = False, decay: float = 1.0,
                 _residuals: Optional[Residuals] = None):
        self.inner, self.dtype = inner, dtype
        self._buffers = {}
        #: the error-feedback residuals (shared by a method's communicators), or None
        self.residuals = _residuals if _residuals is not None else (
            Residuals(decay) if error_feedback else None)

    @property
    def error_feedback(self) -> bool:
        return self.residuals is not None

    def hierarchy(self):
        """None: a low-precision allreduce is the backend's own, over this communicator."""
        return None

    def _fed(self, tensor: torch.Tensor, reuse: bool = True) -> Optional[torch.Tensor]:
        """With error feedback, bf16(v + beta e) of a model-sized float32 ``tensor`` (in the
        communicator's buffer of its size when ``reuse``; the residual updated); None
        otherwise."""
        if (self.residuals is None or tensor.dtype != torch.float32
                or tensor.numel() < MIN_ELEMENTS):
            return None
        return self.residuals.rounded(self.inner.key, tensor, self.dtype,
                                      self._buffer(tensor) if reuse else None)

    def __getattr__(self, name):          # everything not overridden: the inner communicator
        return getattr(self.inner, name)

    def _buffer(self, t: torch.Tensor) -> torch.Tensor:
        key = (t.numel(), t.device)
        buf = self._buffers.get(key)
        if buf is None:
            buf = self._buffers[key] = torch.empty(t.numel(), dtype=self.dtype, device=t.device)
        return buf

    def _low(self, t: torch.Tensor) -> Optional[torch.Tensor]:
        if t.dtype != torch.float32 or t.numel() < MIN_ELEMENTS:
            return None
        return self._buffer(t).copy_(t.reshape(-1))

    def agree_buffers(self, *tensors: torch.Tensor) -> None:
        self.inner.agree_buffers(*tensors)
        if self.residuals is not None:
            self.residuals.agreed.extend(tensors)

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
        low = self._fed(tensor)
        if low is not None:
            self.inner.allreduce_(low, op)
            tensor.copy_(low.view_as(tensor))
            return tensor
        return self._through_low(tensor, lambda t: self.inner.allreduce_(t, op))

    def iallreduce_(self, tensor: torch.Tensor, op: str = "sum", *, agreed: bool = False):
        if tensor.dtype != torch.float32 or tensor.numel() < MIN_ELEMENTS:
            return self.inner.iallreduce_(tensor, op, agreed=agreed)
        # its own buffer: several buckets of one size may be in flight at once
        low = self._fed(tensor, reuse=False)
        if low is None:
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
        return LowPrecision(self.inner.dup(), self.dtype, _residuals=self.residuals)

    def split(self, color: int, key: Optional[int] = None) -> Optional["LowPrecision"]:
        sub = self.inner.split(color, key)
        return None if sub is None else LowPrecision(sub, self.dtype,
                                                     _residuals=self.residuals)


@dataclasses.dataclass
class LowPrecisionGroups(NodeGroups):
    """NodeGroups over LowPrecision communicators; with error feedback, the holder of their
    residuals (``state_dict``: the quantized wire's format, lsgd_hpc.comm.quantized)."""

    @property
    def node_stats(self):
        """None: nothing of a low-precision allreduce is counted apart."""
        return None

    def state_dict(self) -> dict:
        res = self.world.residuals
        if res is None:
            return {}
        name = next(k for k, v in WIRE_DTYPES.items() if v == self.world.dtype)
        return res.state_dict(name)

    def load_state_dict(self, state: dict) -> None:
        if self.world.residuals is not None:
            self.world.residuals.load_state_dict(state)


def low_precision_groups(groups: NodeGroups, dtype: torch.dtype = torch.bfloat16,
                         error_feedback: bool = False,
                         decay: float = 1.0) -> LowPrecisionGroups:
    """The same node hierarchy with every communicator sending model tensors in ``dtype``
    (with ``error_feedback``: their allreduces carry residuals, shared by the three, decayed
    by ``decay`` before each use)."""
    world = LowPrecision(groups.world, dtype, error_feedback, decay)
    wrap = lambda c: None if c is None else LowPrecision(  # noqa: E731
        c, dtype, _residuals=world.residuals)
    return LowPrecisionGroups(world, wrap(groups.node), wrap(groups.roots), groups.node_of,
                              groups.hostname)
