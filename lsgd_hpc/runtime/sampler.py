"""A deterministic, resumable sharded sampler for a torch DataLoader (ShardedSampler)."""

from __future__ import annotations

from typing import Dict, Iterator, List

import torch

__all__ = ["ShardedSampler"]


class ShardedSampler(torch.utils.data.Sampler):
    """This rank's batches of every epoch, deterministic and resumable; use it as a torch
    ``DataLoader``'s ``batch_sampler``.

    Epoch e: one permutation of the ``num_samples`` indices from a generator seeded by
    (seed, e), the same on every rank, padded by wrapping to a multiple of the world size;
    rank r takes ``perm[r::size]``, cut into ``batch_size`` batches (the short tail dropped,
    so every rank takes ``steps_per_epoch`` steps per epoch). The position is the global
    step: ``set_step(k)`` makes the next iteration start at batch k (the Checkpointer does it
    on resume), and an iteration runs to the end of that epoch, then moves to the next."""

    def __init__(self, num_samples: int, comm, batch_size: int, seed: int = 0,
                 shuffle: bool = True):
        for name, v, low in (("num_samples", num_samples, 1), ("batch_size", batch_size, 1)):
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {v!r}")
        self.n, self.rank, self.size = num_samples, comm.rank, comm.size
        self.batch_size, self.seed, self.shuffle = batch_size, int(seed), bool(shuffle)
        self.per_rank = -(-num_samples // self.size)
        self.steps_per_epoch = self.per_rank // batch_size
        if self.steps_per_epoch == 0:
            raise ValueError(f"batch_size {batch_size} is larger than the {self.per_rank} "
                             f"samples each of the {self.size} ranks gets")
        self.step = 0

    def __len__(self) -> int:
        return self.steps_per_epoch - self.step % self.steps_per_epoch

    def set_step(self, step: int) -> None:
        self.step = int(step)

    @property
    def epoch(self) -> int:
        return self.step // self.steps_per_epoch

    def indices(self, epoch: int) -> torch.Tensor:
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            perm = torch.randperm(self.n, generator=g)
        else:
            perm = torch.arange(self.n)
        total = self.per_rank * self.size
        if total > self.n:
            perm = torch.cat([perm, perm.repeat(-(-total // self.n))[:total - self.n]])
        return perm[self.rank:total:self.size]

    def __iter__(self) -> Iterator[List[int]]:
        epoch, start = divmod(self.step, self.steps_per_epoch)
        idx = self.indices(epoch)
        b = self.batch_size
        for i in range(start, self.steps_per_epoch):
            yield idx[i * b:(i + 1) * b].tolist()
        self.step = (epoch + 1) * self.steps_per_epoch

    def state_dict(self) -> Dict[str, int]:
        return {"n": self.n, "size": self.size, "batch_size": self.batch_size,
                "seed": self.seed, "shuffle": int(self.shuffle)}

    def load_state_dict(self, state: Dict[str, int]) -> None:
        mine = self.state_dict()
        if state != mine:
            diff = ", ".join(f"{k} {state.get(k)} -> {mine[k]}" for k in mine
                             if state.get(k) != mine[k])
            raise ValueError(f"ShardedSampler: the checkpoint's sharding differs ({diff})")
