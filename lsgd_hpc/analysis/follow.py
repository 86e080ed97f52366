"""``python -m lsgd_hpc.summary RUN_DIR --follow``: the progress of a running job, one line per
interval, read from its per-rank metrics files while they are being written.

A writer appends each flush's rows to its file as a SWMR writer (a change of the file's
layout replaces it whole: a temporary file, fsync, rename), so any file opened holds complete
rows up to a flush (``lsgd_hpc.runtime.metrics.open_rank_file``; columns cut to the shortest
while a flush is under way); files are opened without HDF5 locking, each one
re-read only when it changed (inode, size, modification time), and a file that vanishes or
cannot be read between the listing and the read is read again at the next interval (its
previous rows stand meanwhile). Each line::

    elapsed 0:01:05 | step 120/480 | epoch 10.91 | loss 0.4312 | test acc 93.61% (best 95.00%)
    | leader 3 | sent 12.40 MiB | 18.4 steps/s

elapsed: the run's own clock (``wall_time`` of the newest /train row); step: the newest /train
step, ``min-max`` over the ranks when they differ, ``/total`` when the configuration has it;
epoch: of the rank furthest ahead; loss: mean over the ranks of each one's last
``LOSS_WINDOW`` training losses; test acc: mean over the ranks at the newest evaluation every
rank has written (else each rank's newest), and the best rank's; leader: the newest global
election's leader (LSGD only); sent: bytes sent by all ranks together; steps/s: steps per
second of the run's clock between the rows read for this line and for the line before.

The run has **ended** (the last line says why, exit status 0) when every rank of its world
size has a file and either

* every file carries the ``end_time`` attribute (``MetricsWriter.close()``; a library loop
  that closes its writer), or
  (ranks lost to a failure, named in the survivors' ``/faults``, are left out of both rules),
* the configuration has ``total_steps`` (the trainer's; else ``max_steps``) T and the ranks'
  newest /train steps add up to world size x T (every rank at step T; asynchronous LSGD's
  ranks take uneven steps whose sum is the budget).

A stopped run (preempted, killed, crashed) never ends by this rule: ``--timeout SECONDS``
stops following when no file of the run directory changed for that long (one line, exit
status 1), Ctrl-C stops quietly (exit status 0).
"""

from __future__ import annotations

import math
import os
import sys
import time
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from lsgd_hpc.analysis.formatting import fmt_acc, fmt_bytes, fmt_num
from lsgd_hpc.analysis.rundir import AggregateError, Run, col, read_rank_file, read_run

__all__ = ["LOSS_WINDOW", "CachedReader", "progress", "format_progress", "run_ended", "follow"]

#: training losses per rank averaged into a line's loss
LOSS_WINDOW = 10
#: files besides the rank files whose change counts as the run moving (for --timeout)
WATCHED = ("config.yaml", "checkpoints/latest.json")


def _fmt_time(seconds: float) -> str:
    if seconds is None or not math.isfinite(seconds):
        return "-"
    s = int(seconds)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


class CachedReader:
    """``read_rank_file`` with one cached copy per file, re-read only when the file changed.
    A file that cannot be stat'ed or read keeps its cached copy (the next call tries again);
    without one the error propagates (``read_run`` then leaves the file out this time), and
    ``failed`` names it, so that the caller need not warn about a file that is being
    replaced."""

    def __init__(self, read: Callable = read_rank_file):
        self._read = read
        self.cache: dict = {}
        self.failed: set = set()

    def __call__(self, path) -> dict:
        path = str(path)
        hit = self.cache.get(path)
        try:
            st = os.stat(path)
            key = (st.st_ino, st.st_size, st.st_mtime_ns)
            if hit is not None and hit[0] == key:
                return hit[1]
            data = self._read(path)
        except Exception:
            if hit is not None:
                return hit[1]
            self.failed.add(path)
            raise
        self.failed.discard(path)
        self.cache[path] = (key, data)
        return data


def _files_state(run_dir: Path) -> tuple:
    """What identifies the current content of the run's files: a change means the run moved."""
    out = []
    paths = [run_dir / w for w in WATCHED]
    try:
        paths += sorted(p for p in (run_dir / "metrics").glob("rank*.h5"))
    except OSError:
        pass
    for p in paths:
        try:
            st = os.stat(p)
        except OSError:
            continue
        out.append((str(p), st.st_ino, st.st_size, st.st_mtime_ns))
    return tuple(out)


def _total_steps(run: Run) -> Optional[int]:
    for key in ("total_steps", "max_steps"):
        v = run.config.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0:
            return int(v)
    return None


def _last(values: np.ndarray, default=math.nan):
    return values[-1] if len(values) else default


def progress(run: Run) -> dict:
    """The figures of one line (see the module docstring); None where not known yet."""
    ranks = run.ranks
    steps = {r: int(_last(col(d, "train", "step", int), -1)) for r, d in ranks.items()}
    have = {r: s for r, s in steps.items() if s >= 0}
    out = {"ranks": len(ranks), "world_size": run.world_size, "total": _total_steps(run),
           "step_min": min(have.values()) if have else None,
           "step_max": max(have.values()) if have else None,
           "step_sum": sum(have.values()) if have else 0}
    ahead = max(have, key=lambda r: (have[r], -r)) if have else None
    out["epoch"] = float(_last(col(ranks[ahead], "train", "epoch"))) if have else None
    walls = [float(_last(col(d, "train", "wall_time"))) for d in ranks.values()]
    walls = [w for w in walls if math.isfinite(w)]
    out["wall"] = max(walls) if walls else None
    losses = []
    for d in ranks.values():
        tail = col(d, "train", "loss")[-LOSS_WINDOW:]
        tail = tail[np.isfinite(tail)]
        if len(tail):
            losses.append(float(tail.mean()))
    out["loss"] = float(np.mean(losses)) if losses else None
    # test accuracy at the newest evaluation every rank has written, else each rank's newest
    evals = {r: (col(d, "eval", "step", int), col(d, "eval", "test_accuracy"))
             for r, d in ranks.items()}
    common = None
    for s, _ in evals.values():
        common = set(s.tolist()) if common is None else common & set(s.tolist())
    if common:
        at = max(common)
        accs = [float(a[s == at][-1]) for s, a in evals.values()]
    else:
        at = None
        accs = [float(a[-1]) for _, a in evals.values() if len(a)]
    accs = [a for a in accs if math.isfinite(a)]
    out["eval_step"] = at
    out["acc_mean"] = float(np.mean(accs)) if accs else None
    out["acc_best"] = max(accs) if accs else None
    newest = None                                   # (step, leader) of the newest global election
    for d in ranks.values():
        scope, st = col(d, "leader", "scope", int), col(d, "leader", "step", int)
        lead = col(d, "leader", "leader_rank", int)
        glob = scope == 0
        if glob.any():
            cand = (int(st[glob][-1]), int(lead[glob][-1]))
            newest = cand if newest is None or cand[0] > newest[0] else newest
    out["leader"] = newest[1] if newest else None
    out["elects"] = run.algorithm.startswith("lsgd") or newest is not None
    sent = [float(_last(col(d, "train", "comm_bytes_sent"), 0.0)) for d in ranks.values()]
    out["sent"] = float(sum(sent))
    return out


def format_progress(p: dict, prev: Optional[dict] = None) -> str:
    parts = [f"elapsed {_fmt_time(p['wall'])}"]
    if p["step_max"] is None:
        parts.append("step -")
    else:
        step = (f"{p['step_max']}" if p["step_min"] == p["step_max"]
                else f"{p['step_min']}-{p['step_max']}")
        parts.append(f"step {step}" + (f"/{p['total']}" if p["total"] else ""))
    if p["ranks"] < p["world_size"]:
        parts[-1] += f" ({p['ranks']} of {p['world_size']} ranks)"
    parts.append(f"epoch {p['epoch']:.2f}" if p["epoch"] is not None
                 and math.isfinite(p["epoch"]) else "epoch -")
    parts.append(f"loss {fmt_num(p['loss'])}")
    acc = f"test acc {fmt_acc(p['acc_mean'])}"
    if p["acc_best"] is not None and p["ranks"] > 1:
        acc += f" (best {fmt_acc(p['acc_best'])})"
    parts.append(acc)
    if p["elects"]:
        parts.append(f"leader {p['leader'] if p['leader'] is not None else '-'}")
    parts.append(f"sent {fmt_bytes(p['sent'])}")
    rate = None
    if prev is not None and p["wall"] is not None and prev["wall"] is not None \
            and p["step_max"] is not None and prev["step_max"] is not None \
            and p["wall"] > prev["wall"]:
        rate = (p["step_max"] - prev["step_max"]) / (p["wall"] - prev["wall"])
    parts.append(f"{rate:.1f} steps/s" if rate is not None else "- steps/s")
    return " | ".join(parts)


def run_ended(run: Run) -> Optional[str]:
    """Why the run has ended (the rule of the module docstring), or None while it has not."""
    n = run.world_size
    if len(run.ranks) < n:
        return None
    lost = run.lost_ranks                 # on_failure="shrink": the lost ranks never end
    live = {r: d for r, d in run.ranks.items() if r not in lost}
    if lost:
        n = len(live)
    # the steps say more than the closed files, so they are looked at first
    total = _total_steps(run)
    if total is not None:
        steps = [int(_last(col(d, "train", "step", int), -1)) for d in live.values()]
        if min(steps) >= 0 and sum(steps) >= n * total:
            if all(s == total for s in steps):
                return f"every rank reached step {total} of {total}"
            return f"the {n} ranks together took {sum(steps)} of {n} x {total} steps"
    if all("end_time" in d["attrs"] for d in live.values()):
        return f"every rank's metrics file is closed ({n} ranks" + (
            f"; {len(lost)} lost)" if lost else ")")
    return None


def _print(line: str) -> None:
    print(line, flush=True)


def follow(run_dir, interval: float = 10.0, timeout: Optional[float] = None,
           out: Callable[[str], None] = _print, err: Optional[Callable[[str], None]] = None,
           clock: Callable[[], float] = time.monotonic,
           sleep: Callable[[float], None] = time.sleep, prog: str = "lsgd_hpc.summary") -> int:
    """Print one progress line per ``interval`` seconds until the run ends (0) or no file
    changed for ``timeout`` seconds (1; checked at every line). ``out``/``err``: where lines
    and warnings go;
    ``clock``/``sleep``: injectable for tests."""
    run_dir = Path(run_dir)
    if err is None:
        def err(msg):
            print(msg, file=sys.stderr, flush=True)
    reader = CachedReader()
    warned: set = set()
    said_waiting = False
    prev = None
    start = clock()
    state, changed = _files_state(run_dir), start
    next_tick = start
    while True:
        reader.failed.clear()
        notes: list = []
        try:
            run = read_run(run_dir, warn=notes.append, read=reader)
        except AggregateError:
            run = None
        for msg in notes:
            # a file being replaced is read again next time; other problems are said once
            if not any(p in msg for p in reader.failed) and msg not in warned:
                warned.add(msg)
                err(f"{prog}: warning: {msg}")
        now = clock()
        new_state = _files_state(run_dir)
        if new_state != state:
            state, changed = new_state, now
        if run is None:
            if not said_waiting:
                out(f"waiting for metrics files in {run_dir / 'metrics'} ...")
                said_waiting = True
        else:
            p = progress(run)
            out(format_progress(p, prev))
            prev = p
            why = run_ended(run)
            if why:
                out(f"run ended: {why}")
                return 0
        if timeout is not None and now - changed >= timeout:
            what = "appeared" if run is None else "changed"
            out(f"stopped following: no metrics file {what} in {run_dir} for "
                f"{timeout:g} s (the run has not ended)")
            return 1
        next_tick += interval
        wait = next_tick - clock()
        if wait < 0:                              # a slow read: keep the cadence from now
            next_tick, wait = clock(), 0.0
        sleep(wait)
