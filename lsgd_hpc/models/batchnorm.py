"""BatchNorm running statistics for a model no worker trained (EASGD's centre, an average).

Such a model's parameters are a mix of the workers' parameters, but the running statistics
that a mix of the workers' statistics gives are not the statistics of that model's own
activations. Before it is evaluated, its statistics are re-estimated on training batches,
as the reference EASGD/LSGD code does.
"""

from __future__ import annotations

from typing import Iterable, List, Tuple

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

__all__ = ["DEFAULT_BN_BATCHES", "batchnorm_layers", "recompute_bn_stats", "int_buffers"]

#: training batches of a recompute when --bn-recompute is not given (and the model has
#: BatchNorm): enough for the cumulative average of the batch moments to settle, a small
#: fraction of an evaluation's cost
DEFAULT_BN_BATCHES = 16


def batchnorm_layers(model: nn.Module) -> List[_BatchNorm]:
    return [m for m in model.modules() if isinstance(m, _BatchNorm)]


def int_buffers(model: nn.Module) -> List[torch.Tensor]:
    """Buffers outside the flat parameter buffer (BatchNorm's num_batches_tracked), which a
    caller saves and restores around a recompute."""
    return [b for b in model.buffers() if not b.is_floating_point()]


def recompute_bn_stats(model: nn.Module, batches: Iterable[torch.Tensor]) -> int:
    """Replace every BatchNorm layer's running statistics by their cumulative average over
    ``batches`` (inputs only), with the model's current parameters:

        running_mean = (1/N) sum_b mean_b,   running_var = (1/N) sum_b var_b (unbiased),

    where mean_b, var_b are the per-channel moments of the layer's input on batch b
    (BatchNorm with momentum None). Everything else stays in evaluation mode (dropout off,
    so no random numbers are drawn). The statistics are overwritten in place: a caller that
    needs the old ones saves them first. Returns the number of batches used.
    """
    layers = batchnorm_layers(model)
    if not layers:
        return 0
    saved: List[Tuple[object, bool]] = [(m.momentum, m.training) for m in layers]
    was_training = model.training
    model.eval()
    for m in layers:
        m.reset_running_stats()      # in place: the buffers stay views of the flat buffer
        m.momentum = None            # cumulative average over the batches seen
        m.train()
    n = 0
    try:
        with torch.no_grad():
            for xb in batches:
                model(xb)
                n += 1
    finally:
        for m, (momentum, training) in zip(layers, saved):
            m.momentum = momentum
            m.train(training)
        model.train(was_training)
    return n
