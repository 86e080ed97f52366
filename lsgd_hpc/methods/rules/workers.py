"""A rule between workers that span ranks, with allreduce SGD inside each worker."""

from __future__ import annotations

import hashlib
from typing import Dict, Optional

from lsgd_hpc.comm import FlatParams, GradBuckets
from lsgd_hpc.comm.accounting import uncounted
from lsgd_hpc.comm.workers import Workers

__all__ = ["WorkerRule"]

#: attributes a user of the rule sets on it that belong to the rule between workers
_FORWARDED = ("log", "track", "consensus_every")


class WorkerRule:
    """``rule`` between workers (built over the world of workers, lsgd_hpc.comm.workers), and
    synchronous data parallel SGD inside each worker (as AllreduceRule over the worker):

        g <- (1/K) sum_{i in worker} g_i      every step, before the optimizer step

    in buckets of ``bucket_bytes`` started during backward (GradBuckets on the worker's
    communicator; 0: one allreduce after backward), then the worker's floating-point
    buffers (BatchNorm statistics) are broadcast from its first rank, before ``rule`` sees
    the step: the ranks of a worker hold the same bits when the rule runs, and the rule's
    results arrive from the representative, so they stay identical. Every
    ``check_every`` steps (0: never) the ranks of a worker compare a digest of their
    parameters and buffers (one object allgather inside the worker, uncounted) and raise
    RuntimeError on a difference.

    Everything else is ``rule``'s: ``state_dict`` holds its state and the counters of the
    traffic inside the worker; the metric files get the worker's attributes
    (``worker_index``, ``worker_size``, ``n_workers``) and its traffic columns
    (``worker_bytes_sent``, ``worker_bytes_recv``, ``worker_seconds``, cumulative).
    """

    name = "workers"

    def __init__(self, rule, workers: Workers, flat: FlatParams, bucket_bytes: int = 0,
                 check_every: int = 0):
        object.__setattr__(self, "rule", rule)
        self.workers, self.flat = workers, flat
        self.comm = workers.worker
        self.check_every = check_every
        self.buffers = flat.flat[flat.n_params:]
        self.buckets = None
        if bucket_bytes > 0 and self.comm.size > 1:
            self.buckets = GradBuckets(self.comm, flat, bucket_bytes)
            self.buckets.adopt_gradients = True      # copy a fresh .grad in from its hook
        extra = {g: dict(c) for g, c in rule.extra_columns.items()}
        extra.setdefault("train", {}).update(worker_bytes_sent="i8", worker_bytes_recv="i8",
                                             worker_seconds="f8")
        self.extra_columns = extra
        self.file_attrs = {**rule.file_attrs, "worker_index": workers.index,
                           "worker_size": workers.size, "n_workers": workers.n_workers}

    def __getattr__(self, name):          # what is not the worker's is the rule's
        return getattr(self.rule, name)

    def __setattr__(self, name, value):
        if name in _FORWARDED:
            setattr(self.rule, name, value)
        else:
            object.__setattr__(self, name, value)

    # -- the step ----------------------------------------------------------------------------
    def before_step(self, step: int) -> None:
        if self.buckets is not None:
            self.buckets.finish()
        elif self.comm.size > 1:
            self.comm.allreduce_(self.flat.grad, "mean")
        self.rule.before_step(step)

    def after_step(self, step: int, loss: float) -> None:
        if self.buffers.numel() and self.comm.size > 1:
            self.comm.broadcast_(self.buffers, 0)
        self.rule.after_step(step, loss)
        if self.check_every and step % self.check_every == 0:
            self.check_replicas(step)

    def check_replicas(self, step: Optional[int] = None) -> None:
        """Collective inside the worker: RuntimeError on its ranks unless they hold the same
        parameters and buffers, bit for bit."""
        if self.comm.size == 1:
            return
        digest = hashlib.blake2b(self.flat.flat.detach().cpu().numpy().tobytes(),
                                 digest_size=16).hexdigest()
        with uncounted(self.comm):
            digests = self.comm.allgather_object(digest)
        if len(set(digests)) > 1:
            ranks = self.comm.world_ranks
            groups: Dict[str, list] = {}
            for r, d in enumerate(digests):
                groups.setdefault(d, []).append(ranks[r])
            raise RuntimeError(
                f"worker {self.workers.index}: its replicas diverged by step {step}: "
                f"{len(groups)} different parameter sets among its ranks "
                f"({'; '.join(str(v) for v in groups.values())}). Were gradients read or "
                "changed while their averaging was in flight? Call method.synchronize() "
                "before clipping or unscaling them")

    # -- ranks lost (on_failure="shrink"): the worker goes on with its survivors --------------------
    def suspend(self, complete: bool, recovery):
        if self.buckets is not None:
            self.buckets.abandon()
        return self.rule.suspend(complete, recovery)

    def resume(self, recovery) -> None:
        """The workers were rebuilt over the survivors (``Workers.rebuild``): the gradient
        averaging runs over the ranks this worker has left (its batch per step shrinks with
        it), then the rule resumes between the workers."""
        self.comm = self.workers.worker
        if self.buckets is not None:
            self.buckets.comm = self.comm
        self.rule.resume(recovery)

    def rejoin(self, world, joined: bool, source: int) -> str:
        return self.rule.rejoin(world, joined, source)

    # -- what the rule reports -----------------------------------------------------------------
    def train_columns(self) -> Dict[str, float]:
        s = self.workers.stats
        return {**self.rule.train_columns(), "worker_bytes_sent": s.bytes_sent,
                "worker_bytes_recv": s.bytes_recv, "worker_seconds": s.seconds}

    def state_dict(self) -> dict:
        return {"rule": self.rule.state_dict(), "worker_stats": self.workers.stats.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if "worker_stats" not in state:
            raise ValueError("this state was saved without workers (worker_ranks 1); resume "
                             "with the worker_ranks it was saved with")
        self.rule.load_state_dict(state["rule"])
        self.workers.stats.load_state_dict(state["worker_stats"])
