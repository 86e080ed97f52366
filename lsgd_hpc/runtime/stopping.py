"""Agreeing on a stop signal without a blocking collective at every step.

A signal (SLURM's warning, a preemption) reaches one rank, some ranks or all of them at
different moments; every rank must still stop after the same step, or some would wait in a
collective that the others never enter. A blocking 4-byte allreduce after every step would
agree at once, but it couples every worker at every step, which is what LSGD and local SGD
are there to avoid, and costs one network latency per step.

Instead, every ``k`` steps each rank posts a non-blocking allreduce (MPI_Iallreduce) of its
own flag and completes the one it posted ``k`` steps before:

    step s, s % k == 0:   stop = (sum of flags posted at step s - k) > 0;   post flag(s)

Every rank completes the same request at the same step and reads the same sum, so all stop
at the same step. A rank waits only for what the others posted ``k`` steps ago: ranks may
drift up to ``k`` steps apart, and the wait is normally over at once. A signal is acted on
within 2k steps (posted at the next multiple of k, read k steps later).
"""

from __future__ import annotations

from typing import Optional

import torch

from lsgd_hpc.comm import Communicator, Pending, uncounted

__all__ = ["StopAgreement"]


class StopAgreement:
    """The stop decision, agreed every ``every`` steps with one non-blocking allreduce."""

    def __init__(self, world: Communicator, every: int):
        if every < 1:
            raise ValueError(f"every must be >= 1, got {every}")
        self.world, self.every = world, every
        self.pending: Optional[Pending] = None

    def check(self, step: int, raised: bool) -> bool:
        """Call after every step with this rank's flag; True on every rank at the same step."""
        if step % self.every:
            return False
        with uncounted(self.world):              # control traffic, not the method's
            stop = False
            if self.pending is not None:
                stop = bool(self.pending.wait().item() > 0)
                self.pending = None
            if not stop:
                flag = torch.tensor([1 if raised else 0], dtype=torch.int32)
                self.pending = self.world.iallreduce_(flag, "sum", agreed=True)
        return stop

    def abandon(self) -> None:
        """Forget the request in flight: it died with lost ranks (on_failure="shrink"); the
        flags raised since are posted again at the next check."""
        self.pending = None

    def drain(self) -> None:
        """Complete the request in flight (before a checkpoint's barriers or MPI_Finalize)."""
        if self.pending is not None:
            with uncounted(self.world):
                self.pending.wait()
            self.pending = None
