"""Traffic that is not the method's: measurement and control collectives left out of the
communication counters (``uncounted``)."""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import TYPE_CHECKING, Iterator

if TYPE_CHECKING:
    from lsgd_hpc.comm.base import Communicator

__all__ = ["uncounted"]


@contextmanager
def uncounted(comm: "Communicator", probe: bool = False) -> Iterator[None]:
    """Measurement and control traffic (consensus probes, stop flags) is not the method's
    communication: restore the counters afterwards so comm_* report only the algorithm, and
    book the time as control overhead (``overhead_seconds``, still training time) or, with
    ``probe``, as measurement (``probe_seconds``, left out of the training time).
    A communicator whose collectives also count elsewhere (the world of workers of
    lsgd_hpc.comm.workers: inside each worker too) names all its counters in ``counters``;
    every one of them is restored."""
    counters = tuple(getattr(comm, "counters", None) or (comm.stats,))
    saved = [s.snapshot() for s in counters]
    t0 = time.perf_counter()
    try:
        yield
    finally:
        for s, old in zip(counters, saved):
            s.load_state_dict(old.state_dict())
        if probe:
            comm.stats.probe_seconds += time.perf_counter() - t0
        else:
            comm.stats.overhead_seconds += time.perf_counter() - t0
