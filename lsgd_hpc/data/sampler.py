"""This rank's batches of every epoch, one sharding scheme for all: ShardedSampler (index
batches, for a torch DataLoader's ``batch_sampler`` in a user's loop, and what a checkpoint
records) and ShardedBatches (the trainer's in-memory batches with augmentation, drawn from a
ShardedSampler), so a run the trainer started can be resumed by a library loop and the
reverse."""

from __future__ import annotations

import operator
from types import SimpleNamespace
from typing import TYPE_CHECKING, Dict, Iterator, List, Optional, Tuple

import torch

from lsgd_hpc.data.augment import random_crop_flip
from lsgd_hpc.data.errors import DataError
from lsgd_hpc.data.seeds import AUG_TAG, PERM_TAG, generator

if TYPE_CHECKING:
    from lsgd_hpc.data.dataset import Dataset

__all__ = ["ShardedSampler", "ShardedBatches"]


def _int(v) -> Optional[int]:
    """v as a Python int (numpy and torch integers included), or None; bools are not ints."""
    if isinstance(v, bool):
        return None
    try:
        return operator.index(v)
    except TypeError:
        return None


class ShardedSampler(torch.utils.data.Sampler):
    """This rank's batches of every epoch, deterministic and resumable; use it as a torch
    ``DataLoader``'s ``batch_sampler``.

    Epoch e: one permutation of the ``num_samples`` indices from a generator seeded by
    (seed, e), the same on every rank, padded by wrapping to a multiple of the world size;
    rank r takes ``perm[r::size]``, cut into ``batch_size`` batches (the short tail dropped,
    so every rank takes ``steps_per_epoch`` steps per epoch). The position is the global
    step: ``set_step(k)`` makes the next iteration start at batch k (the Checkpointer does it
    on resume), and an iteration runs to the end of that epoch, then moves to the next.
    ``comm``: anything with ``rank`` and ``size`` (``lsgd_hpc.init``'s handle)."""

    def __init__(self, num_samples: int, comm, batch_size: int, seed: int = 0,
                 shuffle: bool = True):
        for name, v, low in (("num_samples", num_samples, 1), ("batch_size", batch_size, 1)):
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {v!r}")
        self.n = num_samples
        self.batch_size, self.seed, self.shuffle = batch_size, int(seed), bool(shuffle)
        self._shard(comm.rank, comm.size)
        self.step = 0
        # where the current sharding began (a reshard after lost ranks): step and epoch
        self.base_step, self.base_epoch = 0, 0
        self._pending: Optional[Tuple[int, int]] = None

    def _shard(self, rank: int, size: int) -> None:
        per_rank = -(-self.n // size)
        if per_rank // self.batch_size == 0:
            raise ValueError(f"batch_size {self.batch_size} is larger than the {per_rank} "
                             f"samples each of the {size} ranks gets")
        self.rank, self.size = rank, size
        self.per_rank = per_rank
        self.steps_per_epoch = per_rank // self.batch_size

    def reshard(self, comm) -> None:
        """After lost ranks (``on_failure="shrink"``): shard over ``comm``'s current ranks
        from the next epoch boundary on (the epoch under way keeps its shards, the dead ranks'
        left out until it ends; ``steps_per_epoch`` then grows). Call it on every survivor,
        e.g. from ``comm.on_failure``."""
        self._pending = (comm.rank, comm.size)

    def _locate(self, step: int, steps_per_epoch: Optional[int] = None) -> Tuple[int, int]:
        """(epoch, batch within it) of a global step (epochs of ``steps_per_epoch`` steps,
        by default this sampler's own)."""
        epoch, start = divmod(max(0, step - self.base_step),
                              steps_per_epoch or self.steps_per_epoch)
        return self.base_epoch + epoch, start

    def _begin(self, step: int, steps_per_epoch: Optional[int] = None) -> Tuple[int, int]:
        """``_locate(step)`` for an iteration that starts there: at an epoch boundary a
        waiting reshard begins."""
        epoch, start = self._locate(step, steps_per_epoch)
        if self._pending is not None and start == 0:
            self._shard(*self._pending)
            self._pending = None
            self.base_step, self.base_epoch = step, epoch
        return epoch, start

    def __len__(self) -> int:
        return self.steps_per_epoch - self._locate(self.step)[1]

    def set_step(self, step: int) -> None:
        self.step = int(step)

    @property
    def epoch(self) -> int:
        return self._locate(self.step)[0]

    def indices(self, epoch: int) -> torch.Tensor:
        """This rank's indices of ``epoch`` (``per_rank`` of them)."""
        if self.shuffle:
            perm = torch.randperm(self.n, generator=generator(PERM_TAG, self.seed, epoch))
        else:
            perm = torch.arange(self.n)
        total = self.per_rank * self.size
        if total > self.n:
            perm = torch.cat([perm, perm.repeat(-(-total // self.n))[:total - self.n]])
        return perm[self.rank:total:self.size]

    def __iter__(self) -> Iterator[List[int]]:
        epoch, start = self._begin(self.step)              # an epoch boundary: reshard now
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
        if self._pending is not None:               # a reshard waits for the epoch's end
            state.update(rank=self.rank, next_rank=self._pending[0],
                         next_size=self._pending[1])
        return state

    def load_state_dict(self, state: Dict[str, int]) -> None:
        self.base_step = int(state.get("base_step", 0))
        self.base_epoch = int(state.get("base_epoch", 0))
        if "next_size" in state:
            # Saved by the survivors of a failure before the epoch's end: this job is their
            # world (rank next_rank of next_size), and the epoch under way keeps the shard
            # this rank had in the world before (rank of size).
            nxt = (int(state["next_rank"]), int(state["next_size"]))
            if nxt != (self.rank, self.size):
                raise ValueError(f"ShardedSampler: the checkpoint was written for rank {nxt[0]} "
                                 f"of {nxt[1]}, this is rank {self.rank} of {self.size}")
            self._shard(int(state["rank"]), int(state["size"]))
            self._pending = nxt
        else:
            self._pending = None
        mine = self.state_dict()
        if state != mine:
            diff = ", ".join(f"{k} {state.get(k)} -> {mine[k]}" for k in mine
                             if state.get(k) != mine[k])
            raise ValueError(f"ShardedSampler: the checkpoint's sharding differs ({diff})")

    def load_rejoined(self, state: Dict[str, int], rejoin) -> None:
        """A full-size resume of a survivors' checkpoint (this sampler is rank r of the
        job's first size; ``state`` is this rank's own, or the lowest survivor's when r was
        lost; ``rejoin`` a runtime.checkpoint.Rejoin). When the epoch under way is still
        sharded over the full size (the ranks were lost in it), every rank goes on with its
        own shard of it, the rejoining ranks too. Otherwise (the survivors had resharded) a
        new epoch, sharded over the full size, begins at the checkpoint's step, and the rest
        of the survivors' epoch is skipped."""
        mine = {k: self.state_dict()[k] for k in ("n", "batch_size", "seed", "shuffle")}
        theirs = {k: state.get(k) for k in mine}
        if theirs != mine:
            diff = ", ".join(f"{k} {theirs[k]} -> {mine[k]}" for k in mine
                             if theirs[k] != mine[k])
            raise ValueError(f"ShardedSampler: the checkpoint's sharding differs ({diff})")
        # (a reshard waiting for the epoch's end: ranks lost during this restore; the
        # world it names is the one that resumes)
        rank, size = self._pending if self._pending is not None else (self.rank, self.size)
        self._pending = None
        self.base_step = int(state.get("base_step", 0))
        self.base_epoch = int(state.get("base_epoch", 0))
        if int(state["size"]) == size:
            if (rank, size) != (self.rank, self.size):
                self._shard(rank, size)
            return                     # the epoch's full-size shards: each rank its own
        self._shard(0, int(state["size"]))           # the survivors' epochs, to find the step
        epoch, start = self._locate(rejoin.step)
        self._shard(rank, size)
        self.base_step, self.base_epoch = rejoin.step, epoch + (1 if start else 0)


class ShardedBatches:
    """This rank's share of every epoch, as in torch's DistributedSampler, plus augmentation:
    the index batches of ``self.sampler`` (a ShardedSampler; with ``drop_last=False`` the short
    tail of each epoch too), read from an in-memory data set. Training batches of an
    augmenting data set (cifar10) are augmented with a generator seeded by (seed, rank, epoch,
    batch index). Same (seed, rank, world_size, epoch, start) -> bit-identical batches, so
    ``batches(epoch, start=k)`` resumes exactly mid-epoch.

    A data set that streams from disk names its own subclass (``ds.sharded_batches``, an
    image folder's ImageFolderBatches): ``ShardedBatches(ds, ...)`` builds that one.
    """

    def __new__(cls, ds, *args, **kwargs):
        sub = getattr(ds, "sharded_batches", None)
        if cls is ShardedBatches and sub is not None:
            cls = sub
        return super().__new__(cls)

    def __init__(self, ds: Dataset, rank: int, world_size: int, batch_size: int, seed: int,
                 drop_last: bool = True, augment: Optional[bool] = None):
        w, r, b = _int(world_size), _int(rank), _int(batch_size)
        if w is None or w < 1:
            raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}")
        if r is None or not 0 <= r < w:
            raise ValueError(f"rank must be in 0..{w - 1}, got {rank!r}")
        if b is None or b < 1:
            raise DataError(f"--batch-size must be an integer >= 1, got {batch_size!r}")
        rank, world_size, batch_size = r, w, b
        n = ds.n_train
        if n == 0:
            raise DataError(f"data set {ds.name} has no training samples")
        self.ds = ds
        self.batch_size = batch_size
        if _int(seed) is None:
            raise ValueError(f"seed must be an integer, got {seed!r}")
        self.seed = _int(seed)
        self.drop_last = bool(drop_last)
        self.augment = ds.augment if augment is None else bool(augment)
        per_rank = -(-n // world_size)
        # the index scheme (its batch size matters only to its own iteration); this object's
        # rank, world size and shard sizes are the sampler's, which a reshard changes
        self.sampler = ShardedSampler(n, SimpleNamespace(rank=rank, size=world_size),
                                      min(batch_size, per_rank), self.seed)
        if self.steps_per_epoch == 0:
            raise DataError(
                f"--batch-size {batch_size} is larger than the {self.samples_per_rank} training "
                f"samples each of the {world_size} ranks gets from {ds.name} ({n} in all); "
                f"use --batch-size <= {self.samples_per_rank}")

    @property
    def rank(self) -> int:
        return self.sampler.rank

    @property
    def world_size(self) -> int:
        return self.sampler.size

    @property
    def samples_per_rank(self) -> int:
        return self.sampler.per_rank

    @property
    def steps_per_epoch(self) -> int:
        per_rank, b = self.sampler.per_rank, self.batch_size
        return per_rank // b if self.drop_last else -(-per_rank // b)

    def __len__(self) -> int:
        return self.steps_per_epoch

    def reshard(self, rank: int, world_size: int) -> None:
        """After lost ranks: rank ``rank`` of ``world_size`` from the next epoch boundary
        that ``position``/``from_step`` reach (the epoch under way keeps its shards)."""
        self.sampler.reshard(SimpleNamespace(rank=rank, size=world_size))

    def position(self, step: int) -> Tuple[int, int]:
        """(epoch, batch within it) of the global step ``step``, counted from where the
        current sharding began; at an epoch boundary a waiting reshard begins here."""
        return self.sampler._begin(step, self.steps_per_epoch)

    def next_boundary(self, step: int) -> int:
        """The first epoch boundary at or after global step ``step`` (where a reshard that
        waits begins)."""
        start = self.sampler._locate(step, self.steps_per_epoch)[1]
        return step if start == 0 else step - start + self.steps_per_epoch

    def from_step(self, step: int) -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
        """The batches from global step ``step`` to the end of its epoch."""
        return self._iter(*self.position(step))

    def epoch_of(self, step: int) -> float:
        """Epochs done at global step ``step`` (fractional), under the current sharding."""
        s = self.sampler
        return s.base_epoch + max(0, step - s.base_step) / self.steps_per_epoch

    def indices(self, epoch: int) -> torch.Tensor:
        """This rank's training indices for ``epoch`` (samples_per_rank of them)."""
        return self.sampler.indices(epoch)

    def batches(self, epoch: int, start: int = 0) -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
        """Yield (x, y) for batch indices start..steps_per_epoch-1 of ``epoch``.

        x is normalized (and, for training of an augmenting data set, augmented) float32 NCHW,
        y int64.  Bad arguments raise at the call, not at the first ``next``.
        """
        s, e = _int(start), _int(epoch)
        if s is None or not 0 <= s <= self.steps_per_epoch:
            raise ValueError(f"start must be in 0..{self.steps_per_epoch}, got {start!r}")
        if e is None or e < 0:
            raise ValueError(f"epoch must be an integer >= 0, got {epoch!r}")
        return self._iter(e, s)

    def _iter(self, epoch: int, start: int) -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
        idx = self.indices(epoch)
        b = self.batch_size
        for i in range(start, self.steps_per_epoch):
            sel = idx[i * b:(i + 1) * b]
            x = self.ds.x_train[sel]
            if self.augment:
                x = random_crop_flip(x, generator(AUG_TAG, self.seed, self.rank, epoch, i))
            yield self.ds.normalize(x), self.ds.y_train[sel]
