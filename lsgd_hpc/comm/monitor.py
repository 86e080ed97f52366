"""Which collective this rank is in: every collective of the communication layer, numbered.

Every collective of the communication layer is numbered per communicator: on a communicator
every member enters the same collectives in the same order, so the k-th collective of one
member is the k-th of all. The monitor keeps, per communicator, how many collectives this
rank has entered (blocking or posted non-blocking) and which one it is blocked in now.

The monitor is cheap (a lock and a few assignments per collective) and always on. The
collective watchdog (lsgd_hpc.runtime.watchdog) writes its record to a heartbeat file and
reads the other ranks' to name the ones that have not arrived.
"""

from __future__ import annotations

import threading
import time
from typing import Dict, Optional, Sequence

__all__ = ["CollectiveMonitor", "MONITOR"]


class CollectiveMonitor:
    """This rank's collective record: per communicator (named by a key that is the same on
    every member) the number of collectives entered and the last one's name and step, and
    the collective the main thread is blocked in now (if any)."""

    def __init__(self):
        self.rank = 0
        self.step = 0                     # the trainer keeps this current
        #: after a recovery (on_failure="shrink"): the initial rank of each current world
        #: rank (heartbeat files keep the initial numbering); None before any
        self.rank_map = None
        self._lock = threading.Lock()
        self._entered: Dict[str, list] = {}          # key -> [count, name, step]
        self._inside: Optional[dict] = None

    def post(self, key: str, name: str) -> int:
        """Count one collective entered (a blocking one, or a non-blocking one posted) on
        communicator ``key``; returns its number there (1, 2, ...)."""
        with self._lock:
            return self._count(key, name)

    def _count(self, key: str, name: str) -> int:
        """post() with the lock held."""
        rec = self._entered.get(key)
        if rec is None:
            rec = self._entered[key] = [0, "", 0]
        rec[0] += 1
        rec[1], rec[2] = name, self.step
        return rec[0]

    def inside(self, key: str, members: Sequence[int], seq: int, name: str) -> "_Inside":
        """The main thread is blocked in collective ``seq`` of ``key`` (a blocking call or the
        wait for a posted one), a context."""
        return _Inside(self, key, members, name, seq)

    def blocking(self, key: str, members: Sequence[int], name: str) -> "_Inside":
        """Enter a blocking collective: count it and be inside it until it returns.

        On the path of every collective: one lock taken on entry (count and mark), one on
        exit, and ``members`` kept as given (a communicator's tuple), not copied."""
        return _Inside(self, key, members, name, None)

    def record(self) -> dict:
        with self._lock:
            return {"rank": self.rank, "step": self.step, "time": time.time(),
                    "entered": {k: list(v) for k, v in self._entered.items()},
                    "inside": dict(self._inside) if self._inside else None}


class _Inside:
    """The context of :meth:`CollectiveMonitor.inside` and ``.blocking`` (``seq`` None: count
    the collective on entry). A class, not a generator: it is on every collective's path."""

    __slots__ = ("mon", "key", "members", "name", "seq", "outer")

    def __init__(self, mon: CollectiveMonitor, key: str, members: Sequence[int], name: str,
                 seq: Optional[int]):
        self.mon, self.key, self.members, self.name, self.seq = mon, key, members, name, seq

    def __enter__(self) -> None:
        mon = self.mon
        with mon._lock:
            seq = mon._count(self.key, self.name) if self.seq is None else self.seq
            self.outer = mon._inside
            mon._inside = {"key": self.key, "members": self.members, "seq": seq,
                           "name": self.name, "step": mon.step, "since": time.time()}

    def __exit__(self, *exc) -> bool:
        with self.mon._lock:
            self.mon._inside = self.outer
        return False


#: The process's monitor; the communication layer reports to it.
MONITOR = CollectiveMonitor()
