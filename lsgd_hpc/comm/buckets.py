"""Gradient buckets: the fused gradient averaged in pieces while backward still runs.

Backward produces gradients roughly from the last layer to the first. The fused gradient
buffer of :class:`FlatParams` (parameters in model order) is cut into contiguous buckets
walking the parameters backwards, each about ``bucket_bytes``; a bucket's non-blocking
allreduce starts from the gradient hook of the last of its parameters to be accumulated,
so the averaging of the last layers overlaps the backward pass of the first ones (as in
PyTorch DDP and Horovod's DistributedOptimizer). :meth:`GradBuckets.finish`, called before
the optimizer step, starts what has not started (parameters without a gradient this step)
and waits for everything:

    g[lo_b:hi_b] <- (1/p) sum_i g_i[lo_b:hi_b]   for every bucket b

which is the allreduce of the whole buffer, bucket by bucket: the same bytes, the same mean
on every rank (each bucket's sum is one MPI reduction whose result every member receives).

Non-blocking collectives must start in the same order on every member, whatever order the
hooks fire in: bucket k starts only after buckets 0..k-1 (in backward order) have started.

A staged collective (the compressed allreduce of lsgd_hpc.comm.quantized, ``serial=True``)
posts its later exchanges from ``test()``, whenever a rank finds the earlier one completed:
two such collectives in flight on one communicator could post their exchanges in different
orders on different ranks, and MPI matches collectives by the order they are posted. So a
serial plan keeps one bucket in flight: bucket k starts once bucket k-1 has completed (found
by the hooks' ``test()``, or waited for in ``finish``). Every rank then posts every exchange
in the same order (bucket 0's, then bucket 1's, ...), and the averaging of a bucket still
runs behind the backward pass of the layers before it.

A second backward before the step (gradient accumulation outside ``no_sync``) is DDP's case:
before a gradient that already arrived is accumulated again, every bucket of the previous
backward is completed, so the buffer holds mean_i(g1_i); the new backward adds g2_i to it and
averages again: mean_i(mean(g1) + g2_i) = mean(g1) + mean(g2), the mean of the sums. Correct,
at the price of one more round of communication; ``no_sync`` saves it.
"""

from __future__ import annotations

from typing import Callable, List, Optional, Tuple

import torch

from lsgd_hpc.comm.base import CommError, Communicator, Pending
from lsgd_hpc.comm.flat import FlatParams

__all__ = ["GradBuckets", "bucket_bounds"]


def bucket_bounds(sizes: List[int], element_size: int,
                  bucket_bytes: int) -> List[Tuple[int, int]]:
    """Contiguous [lo, hi) element ranges over parameters of ``sizes`` (model order), walked
    from the last parameter to the first, each closed once it holds >= bucket_bytes.

    Returned in backward order (the range holding the last parameter first). A parameter is
    never split across buckets.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    bounds, hi, filled = [], sum(sizes), 0
    lo = hi
    for n in reversed(sizes):
        lo -= n
        filled += n * element_size
        if filled >= bucket_bytes:
            bounds.append((lo, hi))
            hi, filled = lo, 0
    if hi > 0:
        bounds.append((0, hi))
    return bounds


class GradBuckets:
    """Average ``flat.grad`` over ``comm`` in buckets started from gradient hooks.

    Hooks are registered on the model's parameters when this is built. The bucket plan is checked once, here, to be the same on every member
    (one object allgather), so the per-call agreement check is skipped afterwards.
    ``serial``: at most one bucket's collective in flight (a staged collective's, see the
    module docstring).
    """

    def __init__(self, comm: Communicator, flat: FlatParams, bucket_bytes: int,
                 serial: bool = False):
        self.comm, self.flat, self.serial = comm, flat, serial
        params = list(flat.model.parameters())
        offsets = [off for _, off, _ in flat.slices[:len(params)]]
        sizes = [p.numel() for p in params]
        self.bounds = bucket_bounds(sizes, flat.grad.element_size(), bucket_bytes)
        plan = (tuple(self.bounds), str(flat.grad.dtype))
        plans = comm.allgather_object(plan)
        if any(p != plan for p in plans):
            raise CommError(f"gradient buckets: ranks disagree on the bucket plan "
                            f"({len(set(plans))} different plans; same model and --bucket-mb "
                            "on every rank are needed)")
        self.views = [flat.grad[lo:hi] for lo, hi in self.bounds]
        #: False inside ``no_sync``: backward only accumulates, nothing starts
        self.enabled = True
        #: a user's ``optimizer.zero_grad()`` sets .grad to None and backward then makes a
        #: new tensor: with this set, the hook copies it into the flat buffer and re-seats it
        self.adopt_gradients = False
        self.grad_views = [flat.grad[off:off + p.numel()].view_as(p)
                           for p, off in zip(params, offsets)]
        # parameter index -> bucket index; parameters left to arrive per bucket
        self.bucket_of = [next(b for b, (lo, hi) in enumerate(self.bounds) if lo <= off < hi)
                          for off in offsets]
        self.expected = [0] * len(self.bounds)
        for b in self.bucket_of:
            self.expected[b] += 1
        self._handles = []
        #: a rank failure met inside a gradient hook, raised by finish()
        self.failure = None
        #: called (no argument) before the first bucket of each backward starts: the owner's
        #: last chance to set up what the averaging reads (AllreduceRule's residual keys)
        self.before_start: Optional[Callable[[], None]] = None
        if comm.size > 1:
            for i, p in enumerate(params):
                if p.requires_grad:
                    self._handles.append(p.register_hook(self._before_accumulate(i)))
                    self._handles.append(p.register_post_accumulate_grad_hook(self._hook(i)))
        self._reset()

    def abandon(self) -> None:
        """Forget the allreduces in flight and a failure kept (their communicator died with
        lost ranks, on_failure="shrink"); the next backward starts afresh."""
        self.failure = None
        self._reset()

    def _reset(self) -> None:
        self.missing = list(self.expected)
        self.arrived = [False] * len(self.bucket_of)
        self.pending: List[Pending] = []      # started buckets, in start (= bucket) order

    @property
    def n_buckets(self) -> int:
        return len(self.bounds)

    def _hook(self, index: int):
        def hook(param: torch.Tensor) -> None:
            if not self.enabled:
                return
            if self.adopt_gradients:
                view = self.grad_views[index]
                if param.grad is not None and param.grad.data_ptr() != view.data_ptr():
                    view.copy_(param.grad)
                    param.grad = view
            if self.failure is None:
                self._kept(self._arrived, index)
        return hook

    def _before_accumulate(self, index: int):
        def hook(grad: torch.Tensor):
            # a second backward before the step: complete the previous one's averaging
            # before anything is added to the buffer it is reading and writing
            if self.enabled and self.failure is None and \
                    (self.arrived[index] or self.bucket_of[index] < len(self.pending)):
                self._kept(self.finish)
            return grad
        return hook

    def _kept(self, call, *args) -> None:
        """``call`` inside a gradient hook: a dead rank's failure (on_failure="shrink") is kept
        for ``finish`` (inside the method's step, which recovers) instead of escaping from
        the user's backward()."""
        try:
            call(*args)
        except Exception as exc:                  # noqa: BLE001
            from lsgd_hpc.comm.failures import is_process_failure
            if not is_process_failure(exc):
                raise
            self.failure = exc

    def _arrived(self, index: int) -> None:
        b = self.bucket_of[index]
        self.arrived[index] = True
        self.missing[b] -= 1
        # Let MPI advance the buckets in flight (Open MPI progresses them only inside calls).
        for p in self.pending:
            p.test()
        self._start_ready()

    def _start_ready(self, all_: bool = False) -> None:
        while len(self.pending) < len(self.views):
            b = len(self.pending)
            if not all_ and self.missing[b]:
                return
            if b == 0 and self.before_start is not None:
                self.before_start()
            if self.serial and self.pending and not self.pending[-1].test():
                if not all_:              # bucket b starts once b - 1 has completed
                    return
                self.pending[-1].wait()
            self.pending.append(self.comm.iallreduce_(self.views[b], "mean", agreed=True))

    def finish(self) -> torch.Tensor:
        """Start the buckets not yet started, wait for all; ``flat.grad`` is then the mean."""
        if self.failure is not None:
            failure, self.failure = self.failure, None
            self._reset()
            raise failure
        if self.comm.size > 1:
            try:
                self._start_ready(all_=True)
                for p in self.pending:
                    p.wait()
            finally:
                self._reset()
        return self.flat.grad

    def remove(self) -> None:
        """Unregister the hooks."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
