"""The in-memory data set every loader returns (and that splits, sampler and the methods'
callers take): train and test tensors in a compact stored form, with their normalization.
The bottom of the data layer: it imports nothing of lsgd_hpc but the errors."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, Tuple

import torch

from lsgd_hpc.data.errors import DataError

__all__ = ["Dataset"]


@dataclass
class Dataset:
    """A whole data set in memory, train and test, with its normalization.

    x_* are stored NCHW in a compact form: uint8 pixels for cifar10 (150 MB at full size),
    float32 otherwise.  ``normalize`` turns a batch of the stored form into the model's float32
    input: ``(x / pixel_scale - mean) / std`` per channel.
    """

    name: str
    num_classes: int
    input_shape: Tuple[int, int, int]
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    augment: bool
    mean: Tuple[float, ...] = (0.0,)
    std: Tuple[float, ...] = (1.0,)
    pixel_scale: float = 1.0
    class_names: Tuple[str, ...] = field(default_factory=tuple)

    def normalize(self, xb: torch.Tensor) -> torch.Tensor:
        """Stored form (N,C,H,W) or (C,H,W) -> normalized float32 of the same shape."""
        c = self.input_shape[0]
        mean = torch.as_tensor(self.mean, dtype=torch.float32).expand(c).reshape(c, 1, 1)
        std = torch.as_tensor(self.std, dtype=torch.float32).expand(c).reshape(c, 1, 1)
        x = xb.to(torch.float32)
        if self.pixel_scale != 1.0:
            x = x / self.pixel_scale
        return ((x - mean) / std).contiguous()

    def test_batches(self, batch_size: int) -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
        """The whole test set in order, normalized, in batches of at most ``batch_size``."""
        if batch_size < 1:
            raise DataError(f"evaluation batch size must be >= 1, got {batch_size}")
        for i in range(0, len(self.y_test), batch_size):
            yield self.normalize(self.x_test[i:i + batch_size]), self.y_test[i:i + batch_size]

    @property
    def n_train(self) -> int:
        return int(self.y_train.shape[0])

    @property
    def n_test(self) -> int:
        return int(self.y_test.shape[0])
