"""What is done to a loaded data set's training samples: symmetric label noise, and the
held-out and validation slices taken out of it (each drawn from the run's seed alone, the
same on every rank)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Tuple

import torch

from lsgd_hpc.data.errors import DataError
from lsgd_hpc.data.seeds import HELDOUT_TAG, NOISE_TAG, VALID_TAG, generator

if TYPE_CHECKING:
    from lsgd_hpc.data.dataset import Dataset

__all__ = ["with_label_noise", "default_heldout_size", "split_heldout", "split_validation"]


def with_label_noise(ds: Dataset, p: float, seed: int) -> Dataset:
    """``ds`` with symmetric label noise of rate ``p`` on its training set; the test set is kept.

    Exactly ``round(p * n_train)`` training samples, a uniformly random subset, get a label
    drawn uniformly from the other ``k - 1`` classes, so a fraction ``p`` of the training
    labels is wrong and a wrong label carries no information about the true class. Both draws
    come from a generator seeded by ``seed`` alone: every rank of a run (same ``--seed``)
    trains on the same noisy labels, and each seed of an experiment on its own. For p below
    (k - 1) / k the true class stays the most frequent label of its images, so the Bayes
    classifier is unchanged and test accuracy measures how well training resists the noise.
    """
    p = float(p)
    if not 0.0 <= p < 1.0:
        raise DataError(f"label noise must be in [0, 1), got {p}")
    n, k = ds.n_train, ds.num_classes
    flip = int(round(p * n))
    if flip == 0:
        return ds
    g = generator(NOISE_TAG, seed)
    idx = torch.randperm(n, generator=g)[:flip]
    # adding 1..k-1 modulo k moves a label to a uniformly chosen other class
    shift = torch.randint(1, k, (flip,), generator=g)
    y = ds.y_train.clone()
    y[idx] = (y[idx] + shift) % k
    relabel = getattr(ds, "with_train_labels", None)
    if relabel is not None:            # an image folder: same files, other labels
        return relabel(y)
    return dataclasses.replace(ds, y_train=y)


def default_heldout_size(n_train: int) -> int:
    """--heldout-size when unset: 10% of the training set, at most 256, at least 1."""
    return max(1, min(256, n_train // 10))


def split_heldout(ds: Dataset, size: int, seed: int, option: str = "--heldout-size",
                  tag: int = HELDOUT_TAG) -> Tuple[Dataset, torch.Tensor]:
    """Take a held-out slice of ``size`` training samples out of the training set.

    The slice is a uniformly random subset drawn from a generator seeded by ``seed`` alone,
    so every rank of a run (same ``--seed``) holds out the same samples. Returns the data
    set without them (training order otherwise kept; the test set untouched) and the sorted
    indices of the slice in the original training set (``ds.x_train[idx]``). ``option`` names
    the size in the error message; ``tag`` keeps the draws of different slices apart.
    """
    n = ds.n_train
    if isinstance(size, bool) or not isinstance(size, int) or not 1 <= size < n:
        raise DataError(f"{option} must be in 1..{n - 1} for {ds.name} ({n} training "
                        f"samples), got {size!r}")
    perm = torch.randperm(n, generator=generator(tag, seed))
    held, keep = perm[:size].sort().values, perm[size:].sort().values
    train = dataclasses.replace(ds, x_train=ds.x_train[keep].contiguous(),
                                y_train=ds.y_train[keep].contiguous())
    return train, held


def split_validation(ds: Dataset, size: int, seed: int) -> Tuple[Dataset, torch.Tensor]:
    """Take a validation slice of ``size`` training samples out of the training set, for
    choosing settings without looking at the test set (--validation-size). Like
    :func:`split_heldout` (the same samples on every rank of a run, drawn from ``seed``) but
    from a stream of its own, and taken first: the leader score's held-out slice comes from
    what is left. Labels are the training set's, label noise included (what a user has)."""
    return split_heldout(ds, size, seed, option="--validation-size", tag=VALID_TAG)
