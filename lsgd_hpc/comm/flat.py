"""A fused parameter buffer: a model's parameters (and their gradients) as views of one flat tensor.

A whole-model broadcast, average or pull is then one collective over one contiguous buffer,
as in Horovod's tensor fusion, without the copy in and out of a fusion buffer.
"""

from __future__ import annotations

from typing import List, Tuple

import torch
from torch import nn

from lsgd_hpc.comm.memory import host_zeros

__all__ = ["FlatParams", "state_buffers"]


def state_buffers(model: nn.Module) -> List[Tuple[str, torch.Tensor]]:
    """The model's floating-point buffers that are part of its state (``named_buffers`` order):
    BatchNorm's running statistics, but not a buffer registered with ``persistent=False`` (a
    constant the model builds itself, such as a causal attention mask of -inf: nothing to
    average, pull or checkpoint, and no finite number to quantize)."""
    persistent = set()
    for prefix, mod in model.named_modules():
        for name, b in mod._buffers.items():
            if b is not None and name not in mod._non_persistent_buffers_set:
                persistent.add(f"{prefix}.{name}" if prefix else name)
    return [(n, b) for n, b in model.named_buffers()
            if n in persistent and b.is_floating_point()]


class FlatParams:
    """Re-seat ``model``'s parameters and floating-point buffers into one flat tensor.

    ``flat`` holds the parameters first (``flat[:n_params]``), then the floating-point buffers
    of the model's state (BatchNorm running statistics; see state_buffers), so that the
    model's whole state moves in one call.
    ``grad`` holds the parameters' gradients in the same order; the parameters' ``.grad``
    are views into it, and autograd accumulates into them in place. Call ``zero_grad()``
    (not ``optimizer.zero_grad()``, whose default sets .grad to None and breaks the views).
    """

    def __init__(self, model: nn.Module):
        self.model = model
        params = [p for p in model.parameters()]
        buffers = [b for _, b in state_buffers(model)]
        if not params:
            raise ValueError("model has no parameters")
        dtypes = {p.dtype for p in params} | {b.dtype for b in buffers}
        devices = {p.device for p in params} | {b.device for b in buffers}
        if len(dtypes) != 1 or len(devices) != 1:
            raise ValueError(f"FlatParams needs one dtype and one device, got {dtypes} {devices}")
        dtype, device = dtypes.pop(), devices.pop()
        self.n_params = sum(p.numel() for p in params)
        self.numel = self.n_params + sum(b.numel() for b in buffers)
        # huge pages: MPI's shared-memory copies of these buffers are 2x faster (see memory)
        self.flat = host_zeros(self.numel, dtype, device)
        self.grad = host_zeros(self.n_params, dtype, device)
        self.slices: List[Tuple[str, int, int]] = []
        offset = 0
        for name, p in model.named_parameters():
            n = p.numel()
            view = self.flat[offset:offset + n].view_as(p)
            view.copy_(p.data)
            p.data = view
            if p.requires_grad:     # a frozen parameter keeps .grad None (optimizers skip it)
                p.grad = self.grad[offset:offset + n].view_as(p)
            self.slices.append((name, offset, n))
            offset += n
        for name, b in state_buffers(model):
            n = b.numel()
            view = self.flat[offset:offset + n].view_as(b)
            view.copy_(b)
            b.data = view
            self.slices.append((name, offset, n))
            offset += n

    @property
    def params(self) -> torch.Tensor:
        """The parameter part of the flat buffer (a view)."""
        return self.flat[: self.n_params]

    @property
    def nbytes(self) -> int:
        return self.numel * self.flat.element_size()

    def zero_grad(self) -> None:
        self.grad.zero_()

    def check(self) -> None:
        """Assert the views are still in place (an optimizer or user may have replaced them)."""
        ptr = self.flat.data_ptr()
        end = ptr + self.nbytes
        for p in self.model.parameters():
            if not ptr <= p.data_ptr() < end:
                raise RuntimeError("a parameter no longer lives in the flat buffer")
            if not p.requires_grad:
                continue
            if p.grad is None or not (self.grad.data_ptr() <= p.grad.data_ptr()
                                      < self.grad.data_ptr() + self.grad.numel()
                                      * self.grad.element_size()):
                raise RuntimeError("a gradient no longer lives in the flat gradient buffer")
