"""Augmentation of the in-memory image data sets: a random crop of the zero-padded batch and
a random horizontal flip, vectorized over the batch."""

from __future__ import annotations

import torch

__all__ = ["random_crop_flip"]


def random_crop_flip(x: torch.Tensor, generator: torch.Generator, padding: int = 4) -> torch.Tensor:
    """Random crop back to H x W from the zero-padded batch, and a random horizontal flip.

    Vectorized over the batch (one gather); works on the stored form (uint8 or float), so the
    padding is black pixels as in torchvision's RandomCrop(32, padding=4).  Draws, in order,
    the N row offsets, N column offsets and N flips from ``generator``.
    """
    n, c, h, w = x.shape
    p = int(padding)
    rows0 = torch.randint(0, 2 * p + 1, (n,), generator=generator)
    cols0 = torch.randint(0, 2 * p + 1, (n,), generator=generator)
    flip = torch.randint(0, 2, (n,), generator=generator).bool()
    return _crop_flip(x, rows0, cols0, flip, p)


def _crop_flip(x: torch.Tensor, rows0: torch.Tensor, cols0: torch.Tensor, flip: torch.Tensor,
               p: int) -> torch.Tensor:
    n, c, h, w = x.shape
    padded = x.new_zeros((n, h + 2 * p, w + 2 * p, c))
    padded[:, p:p + h, p:p + w, :] = x.permute(0, 2, 3, 1)
    rows = rows0[:, None] + torch.arange(h)                       # (n, h)
    cols = cols0[:, None] + torch.arange(w)                       # (n, w)
    cols = torch.where(flip[:, None], cols.flip(1), cols)
    out = padded[torch.arange(n)[:, None, None], rows[:, :, None], cols[:, None, :]]  # n,h,w,c
    return out.permute(0, 3, 1, 2).contiguous()
