"""No silent hangs: which collective each rank is in, heartbeats, and a collective watchdog.

Every collective of the communication layer is numbered per communicator: on a communicator
every member enters the same collectives in the same order, so the k-th collective of one
member is the k-th of all. The monitor keeps, per communicator, how many collectives this
rank has entered (blocking or posted non-blocking) and which one it is blocked in now.

With ``--collective-timeout T`` a watchdog thread on every rank writes that record to
``<run dir>/heartbeat/rank<r>.json`` about once a second (atomically, by rename) and checks
how long the main thread has been blocked. Past T seconds it reads the other members'
heartbeats: a member whose count on that communicator is below k has not arrived. Reading a
file needs nothing from the stalled rank (it may sleep, spin, or be dead: its last heartbeat
says where it was), unlike a collective or a two-sided message. The watchdog prints one
report naming those ranks, their step and what they were last doing, lets the trainer write
the metrics it has, and aborts the job with exit status 1, like NCCL's watchdog or
Horovod's stall inspector.

The monitor (lsgd_hpc.comm.monitor: the communication layer counts into it) is cheap and
always on; only the thread is optional. mpi4py releases the GIL inside MPI calls, so the
thread runs while the main thread is blocked in one.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from typing import Callable, List, Optional

# The monitor lives with the communication layer that reports to it; its names stay
# importable from here for older callers.
from lsgd_hpc.comm.monitor import MONITOR, CollectiveMonitor

__all__ = ["CollectiveMonitor", "MONITOR", "Watchdog", "start_watchdog", "EXIT_STALLED",
           "heartbeat_path"]

#: exit status of a job the watchdog ended
EXIT_STALLED = 1


def heartbeat_path(run_dir: str, rank: int) -> str:
    return os.path.join(run_dir, "heartbeat", f"rank{rank:05d}.json")


def _describe(rec: Optional[dict], key: str, now: float) -> str:
    if rec is None:
        return "no heartbeat file (not started, or cannot write the run dir)"
    age = now - float(rec["time"])
    count, name, step = rec["entered"].get(key, [0, "", 0])
    last = f"last entered #{count} ({name}) at step {step}" if count else "entered none yet"
    ins = rec.get("inside")
    where = (f"blocked in #{ins['seq']} ({ins['name']}) of {ins['key']} for "
             f"{now - float(ins['since']):.0f} s" if ins else "outside any collective")
    return f"at step {rec['step']}, {last}; {where} (heartbeat {age:.0f} s old)"


class Watchdog:
    """A daemon thread: heartbeats every ``interval`` seconds, and the report-and-abort when
    the main thread has been blocked in one collective for ``timeout`` seconds.

    ``on_stall(report)`` runs before ``abort()`` (the trainer writes its metrics there);
    ``abort`` ends the whole job (MPI_Abort) and must not return.
    """

    def __init__(self, timeout: float, run_dir: str, rank: int,
                 abort: Callable[[], None], on_stall: Optional[Callable[[str], None]] = None,
                 monitor: CollectiveMonitor = MONITOR, interval: Optional[float] = None):
        self.timeout, self.run_dir, self.rank = float(timeout), run_dir, rank
        self.abort, self.on_stall, self.monitor = abort, on_stall, monitor
        self.interval = interval or max(0.05, min(1.0, self.timeout / 5))
        self.monitor.rank = rank
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="lsgd-watchdog", daemon=True)
        self.fired: Optional[str] = None

    def start(self) -> "Watchdog":
        os.makedirs(os.path.dirname(heartbeat_path(self.run_dir, self.rank)), exist_ok=True)
        self._beat()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _beat(self) -> dict:
        rec = self.monitor.record()
        path = heartbeat_path(self.run_dir, self.rank)
        tmp = f"{path}.tmp"
        try:
            with open(tmp, "w") as fh:
                json.dump(rec, fh)
            os.replace(tmp, path)
        except OSError:
            pass          # a full or vanished disk must not end training; the report says so
        return rec

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            rec = self._beat()
            ins = rec["inside"]
            if ins and rec["time"] - ins["since"] >= self.timeout:
                self._fire(ins)
                return

    def report(self, ins: dict) -> str:
        """Who has not arrived at collective ``ins`` (read from the members' heartbeats)."""
        now = time.time()
        key, seq = ins["key"], ins["seq"]
        late: List[str] = []
        rank_map = self.monitor.rank_map       # after a recovery: files by initial rank
        for m in ins["members"]:
            if rank_map is not None and m < len(rank_map):
                m = rank_map[m]
            if m == self.rank:
                continue
            try:
                with open(heartbeat_path(self.run_dir, m)) as fh:
                    rec = json.load(fh)
            except (OSError, ValueError):
                rec = None
            if rec is None or rec["entered"].get(key, [0])[0] < seq:
                late.append(f"  rank {m}: {_describe(rec, key, now)}")
        head = (f"collective watchdog: rank {self.rank} has waited {now - ins['since']:.0f} s "
                f"(--collective-timeout {self.timeout:g}) in collective #{seq} ({ins['name']}) "
                f"of communicator {key} at step {ins['step']}; ")
        if late:
            ranks = [int(line.split()[1].rstrip(":")) for line in late]
            return (head + f"rank(s) {', '.join(map(str, ranks))} have not arrived:\n"
                    + "\n".join(late))
        return head + "every member has entered it (the MPI library or network is stuck)"

    def _fire(self, ins: dict) -> None:
        self.fired = self.report(ins)
        print(self.fired, file=sys.stderr, flush=True)
        try:
            if self.on_stall is not None:
                self.on_stall(self.fired)
        finally:
            sys.stderr.flush()
            self.abort()
            os._exit(EXIT_STALLED)        # if the abort returned


def start_watchdog(comm, run_dir: str, timeout: float = 300.0, metrics=None) -> Watchdog:
    """Start the collective watchdog: a collective that waits longer than ``timeout`` seconds
    aborts the job with a report (in ``run_dir``) of the ranks that did not arrive; the
    metrics are flushed first. ``watchdog.stop()`` at the end."""
    on_stall = (lambda report: metrics.flush()) if metrics is not None else None
    return Watchdog(timeout, run_dir, getattr(comm, "initial_rank", comm.rank),
                    abort=lambda: comm.world.abort(1),
                    on_stall=on_stall).start()
