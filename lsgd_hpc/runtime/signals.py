"""Stop signals as a flag (no torch, no MPI: the trainer installs it before its heavy imports)."""

from __future__ import annotations

import signal
from typing import Optional

__all__ = ["StopSignals"]


class StopSignals:
    """SIGUSR1 (SLURM's warning before the time limit) and SIGTERM (preemption, scancel,
    ``scontrol requeue``) set a flag instead of killing the process; pass it to a method as
    ``stop=`` and the ranks agree on it at a step boundary (``method.stopping``)."""

    def __init__(self, signals=(signal.SIGUSR1, signal.SIGTERM)):
        self.signum: Optional[int] = None
        for sig in signals:
            signal.signal(sig, self._handler)

    def _handler(self, signum, frame) -> None:
        self.signum = signum

    @property
    def raised(self) -> bool:
        return self.signum is not None

    @property
    def warned(self) -> bool:
        """SIGUSR1: the time limit is near; the job should requeue itself."""
        return self.signum == signal.SIGUSR1
