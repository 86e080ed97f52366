"""Allreduce SGD: gradients averaged over all workers every step, replicas stay identical."""

from __future__ import annotations

from typing import Optional

import torch

from lsgd_hpc.comm import FlatParams, GradBuckets, NodeGroups
from lsgd_hpc.comm.quantized import QuantizedGroups
from lsgd_hpc.methods.rules.base import Rule
from lsgd_hpc.methods.rules.state import REPLICA

__all__ = ["AllreduceRule"]


class AllreduceRule(Rule):
    """Synchronous data parallel SGD, as Horovod's DistributedOptimizer and PyTorch DDP:
        g <- (1/p) sum_i g_i   (allreduce of the fused gradient buffer)
    then every worker takes the same step. With ``bucket_bytes > 0`` the buffer is averaged
    in buckets of about that size whose non-blocking allreduces start from gradient hooks
    during backward (see :class:`~lsgd_hpc.comm.GradBuckets`) and complete in
    ``before_step``; with 0, one blocking allreduce of the whole buffer after backward.
    Either way the same bytes move and every rank gets the same mean.
    Floating-point buffers (BatchNorm statistics) are broadcast from rank 0 each step, as
    DDP does, exactly (float32 whatever the wire), so that replicas stay bit-identical
    (their consensus distance, measured by the trainer as for every method, is zero).

    Compressed gradients (``groups`` the method's :class:`QuantizedGroups`: ``comm_dtype``
    int8, fp8, int4 or int2, or ``topk`` < 1), with C the wire's compressor (per-block
    quantization, or each chunk's top-k with quantized values; lsgd_hpc.comm.quantized) and,
    with error feedback, e_i rank i's residual (beta its decay, 1 by default):

        w_i = g_i + beta e_i;   e_i <- w_i - C(w_i);   g <- (1/p) sum_i C(w_i)

    (each bucket on its own; hierarchical on several nodes: the node's float32 sum is
    compressed on its root, and the residual is the root's). Every rank decodes the same
    bytes in the same order, so every rank holds the same g, bit for bit, and the replicas
    stay identical. The buckets' staged allreduces run on a duplicate of the world, one in
    flight at a time (``GradBuckets(serial=True)``). The residuals are the wire's (the
    method's ``state_dict()["error_feedback"]``); a residual left under another
    communicator's key (a recovery's shrunk world, the checkpoint of one) is this rank's
    gradient not sent yet and is taken over under the key the averaging uses now
    (:meth:`_adopt_residuals`). A residual that turned inf or NaN (an fp16 step that
    overflowed, which GradScaler skips) is reset to zero.
    """

    name = "allreduce"
    #: the replicas (parameters, buffers, optimizer state) are bit-identical
    shared_state = (REPLICA,)

    def __init__(self, groups: NodeGroups, flat: FlatParams, log=None, bucket_bytes: int = 0):
        super().__init__(groups, flat, log)
        self.buffers = flat.flat[flat.n_params:]
        #: the wire that compresses the gradient (None: fp32 or bf16)
        self.wire: Optional[QuantizedGroups] = groups if isinstance(groups, QuantizedGroups) \
            else None
        #: the buffers' broadcast: exact, whatever the wire
        self.exact = self.world.inner if self.wire is not None else self.world
        self.buckets = None
        if bucket_bytes > 0:
            self.buckets = GradBuckets(self._bucket_comm(), flat, bucket_bytes,
                                       serial=self.wire is not None)
            self.buckets.before_start = self._adopt_pending
        #: residuals may be keyed by an older communicator (set by a load or a recovery)
        self._adopt = False

    def _bucket_comm(self):
        """The buckets' communicator: the world, or with a compressing wire a duplicate of it
        (collective), on which the staged exchanges posted from gradient hooks never meet
        another collective."""
        return self.world.dup() if self.wire is not None else self.world

    @property
    def averaging_comm(self):
        """The communicator whose key the gradient's residuals carry."""
        return self.buckets.comm if self.buckets is not None else self.world

    def before_step(self, step: int) -> None:
        self._adopt_pending()
        if self.buckets is not None:
            self.buckets.finish()
        else:
            self.world.allreduce_(self.flat.grad, "mean")
        if self.wire is not None and self.wire.world.error_feedback \
                and not bool(torch.isfinite(self.flat.grad).all()):
            self._reset_nonfinite_residuals()

    def after_step(self, step: int, loss: float) -> None:
        if self.buffers.numel():
            self.exact.broadcast_(self.buffers, 0)

    # -- error feedback's residuals --------------------------------------------------------
    def _adopt_pending(self) -> None:
        """Before the gradient's first allreduce of a step (a bucket's, from its hook, or the
        blocking one): the residuals re-keyed if a load or a recovery asked for it."""
        if self._adopt:
            self._adopt_residuals()

    def _adopt_residuals(self) -> None:
        """Re-key every residual to the averaging communicator's key (the key is that
        communicator's plus the buffer's index, offset and length, lsgd_hpc.comm.quantized;
        a shrunk world and its duplicates have new keys). Of two residuals of one buffer
        slice the one already under the current key is kept."""
        self._adopt = False
        wire = self.wire
        if wire is None or not wire.world.error_feedback:
            return
        prefix = self.averaging_comm.key
        state = wire.state_dict()
        kept = {}
        for key, e in state["residuals"].items():
            head, _, tail = key.rpartition("/")
            new = f"{prefix}/{tail}"
            if new not in kept or head == prefix:
                kept[new] = e
        if kept.keys() != state["residuals"].keys():
            wire.load_state_dict({"residuals": kept})

    def _reset_nonfinite_residuals(self) -> None:
        """Zero the residuals holding inf or NaN: an inf or NaN gradient (fp16 overflow) would
        otherwise stay in e and poison every later step."""
        state = self.wire.state_dict()
        residuals = {k: (e if bool(torch.isfinite(e).all()) else torch.zeros_like(e))
                     for k, e in state["residuals"].items()}
        self.wire.load_state_dict({"residuals": residuals})

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self._adopt = True          # the method loads the wire's residuals after the rule

    # -- ranks lost --------------------------------------------------------------------------
    def suspend(self, complete: bool, recovery) -> None:
        """The gradient averaging cut off is not redone (a survivor's own gradient is gone:
        the in-place allreduce overwrote it); the source's replica is taken instead. A
        residual already updated for the cut-off step stays (what it holds was not sent)."""
        if self.buckets is not None:
            self.buckets.abandon()
        return None

    def resume(self, recovery) -> None:
        """Collective over the survivors: the buckets' duplicate of the world is made again
        (the old one died with the lost ranks); the residuals are taken over under its key."""
        if self.wire is not None and self.buckets is not None:
            self.buckets.comm = self._bucket_comm()
        self._adopt = self.wire is not None

    def rejoin(self, world, joined: bool, source: int) -> str:
        self._adopt = self.wire is not None
        return f"the replica of rank {source} (parameters and optimizer state)"
