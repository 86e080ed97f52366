"""FlatParams holds the parameters and the floating-point buffers of the model's state, never a
buffer registered with persistent=False (a constant such as a causal mask of -inf, which no
method should average, pull or quantize)."""

import math

import torch
from torch import nn

from lsgd_hpc.comm.flat import FlatParams, state_buffers


class Masked(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.bn = nn.BatchNorm1d(4)
        self.register_buffer("mask", torch.full((4, 4), -math.inf).triu(1), persistent=False)
        self.register_buffer("scale", torch.ones(4))               # persistent: state

    def forward(self, x):
        return self.bn(self.lin(x)) * self.scale


def test_non_persistent_buffers_stay_out_of_the_flat_buffer():
    model = Masked()
    names = [n for n, _ in state_buffers(model)]
    assert names == ["scale", "bn.running_mean", "bn.running_var"]      # num_batches: an int
    flat = FlatParams(model)
    n_params = sum(p.numel() for p in model.parameters())
    assert flat.n_params == n_params and flat.numel == n_params + 4 + 4 + 4
    assert torch.isfinite(flat.flat).all()                 # the -inf mask is not in it
    assert model.mask.data_ptr() != flat.flat.data_ptr()
    assert torch.isinf(model.mask).sum() == 6              # and kept as it was
    # the buffers of the state are views of the flat buffer (they move with it)
    flat.flat[n_params:n_params + 4] = 2.0
    assert torch.equal(model.scale, torch.full((4,), 2.0))
    assert set(model.state_dict()) >= set(names) and "mask" not in model.state_dict()
