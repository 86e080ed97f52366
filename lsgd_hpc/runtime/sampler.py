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
    on resume), and an iteration runs to the end of that epoch, then moves to the next.

    After lost ranks (``on_failure="shrink"``), ``reshard(comm)`` (e.g. from
    ``comm.on_failure``) shards over the survivors from the next epoch on: the epoch under
    way keeps its shards (the dead ranks' shards are left out until it ends), then every
    epoch is cut over the new world's ranks (``steps_per_epoch`` grows)."""

    def __init__(self, num_samples: int, comm, batch_size: int, seed: int = 0,
                 shuffle: bool = True):
        for name, v, low in (("num_samples", num_samples, 1), ("batch_size", batch_size, 1)):
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {v!r}")
        self.n, self.rank, self.size = num_samples, comm.rank, comm.size
        self.batch_size, self.seed, self.shuffle = batch_size, int(seed), bool(shuffle)
        self._shard(self.rank, self.size)
        self.step = 0
        # where the current sharding began (a reshard after lost ranks): step and epoch
        self.base_step, self.base_epoch = 0, 0
        self._pending = None

    def _shard(self, rank: int, size: int) -> None:
        per_rank = -(-self.n // size)
        if per_rank // self.batch_size == 0:
            raise ValueError(f"batch_size {self.batch_size} is larger than the {per_rank} "
                             f"samples each of the {size} ranks gets")
        self.rank, self.size = rank, size
        self.per_rank = per_rank
        self.steps_per_epoch = per_rank // self.batch_size

    def reshard(self, comm) -> None:
        """Shard over ``comm``'s current ranks from the next epoch boundary on (after lost
        ranks: call it on every survivor, e.g. from ``comm.on_failure``)."""
        self._pending = (comm.rank, comm.size)

    def _locate(self, step: int):
        """(epoch, batch within it) of a global step."""
        epoch, start = divmod(max(0, step - self.base_step), self.steps_per_epoch)
        return self.base_epoch + epoch, start

    def __len__(self) -> int:
        return self.steps_per_epoch - self._locate(self.step)[1]

    def set_step(self, step: int) -> None:
        self.step = int(step)

    @property
    def epoch(self) -> int:
        return self._locate(self.step)[0]

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
        epoch, start = self._locate(self.step)
        if self._pending is not None and start == 0:      # an epoch boundary: reshard now
            self._shard(*self._pending)
            self._pending = None
            self.base_step, self.base_epoch = self.step, epoch
        idx = self.indices(epoch)
        b, per_epoch, base = self.batch_size, self.steps_per_epoch, self.base_step
        for i in range(start, per_epoch):
            yield idx[i * b:(i + 1) * b].tolist()
        self.step = base + (epoch - self.base_epoch + 1) * per_epoch

    def state_dict(self) -> Dict[str, int]:
        state = {"n": self.n, "size": self.size, "batch_size": self.batch_size,
                 "seed": self.seed, "shuffle": int(self.shuffle)}
        if self.base_step or self.base_epoch:       # resharded after lost ranks
            state.update(base_step=self.base_step, base_epoch=self.base_epoch)
        return state

    def load_state_dict(self, state: Dict[str, int]) -> None:
        self.base_step = int(state.get("base_step", 0))
        self.base_epoch = int(state.get("base_epoch", 0))
        mine = self.state_dict()
        if state != mine:
            diff = ", ".join(f"{k} {state.get(k)} -> {mine[k]}" for k in mine
                             if state.get(k) != mine[k])
            raise ValueError(f"ShardedSampler: the checkpoint's sharding differs ({diff})")
