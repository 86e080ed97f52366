"""Seeds of the data layer's random streams: integers mixed into one seed, and the domain tag
of each stream, so that the permutation, augmentation, synthetic-data and split streams never
share a seed."""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["mix_seed", "generator", "PERM_TAG", "AUG_TAG", "SYNTH_TAG", "NOISE_TAG",
           "HELDOUT_TAG", "VALID_TAG"]

# Domain tags, so that the permutation and the augmentation streams never share a seed.
PERM_TAG = 0x5045524D
AUG_TAG = 0x41554721
SYNTH_TAG = 0x53594E54
NOISE_TAG = 0x4E4F4953
HELDOUT_TAG = 0x484F4C44
VALID_TAG = 0x56414C49


def mix_seed(*parts: int) -> int:
    """A 63-bit seed mixed from integers (numpy's SeedSequence: stable across platforms)."""
    words = [int(p) & 0xFFFFFFFFFFFFFFFF for p in parts]
    return int(np.random.SeedSequence(words).generate_state(1, np.uint64)[0]) & (2**63 - 1)


def generator(*parts: int) -> torch.Generator:
    """A torch generator seeded from ``mix_seed(*parts)``."""
    return torch.Generator().manual_seed(mix_seed(*parts))
