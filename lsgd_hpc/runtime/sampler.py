"""The resumable sharded sampler of a user's loop: lsgd_hpc.data.sampler.ShardedSampler, the
one sharding scheme of the package (the trainer's batches are drawn from it too)."""

from lsgd_hpc.data.sampler import ShardedSampler

__all__ = ["ShardedSampler"]
