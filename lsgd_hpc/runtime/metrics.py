"""The per-rank HDF5 metrics file (schema_version 1): buffered rows, atomic flushes."""

from __future__ import annotations

import datetime as _dt
import json
import os
import time
from typing import Dict, List, Optional

import h5py
import numpy as np

__all__ = ["SCHEMA_VERSION", "GROUPS", "OPTIONAL_GROUPS", "TIME_COLUMNS", "MetricsWriter", "rank_file", "encode_config"]

SCHEMA_VERSION = 1

#: Required columns of each group, in order, and their dtypes. Algorithms may add columns
#: (EASGD's centre accuracy in /eval, local SGD's T in /train); readers ignore what they
#: do not know.
GROUPS: Dict[str, Dict[str, str]] = {
    "train": {"step": "i8", "epoch": "f8", "wall_time": "f8", "loss": "f8", "accuracy": "f8",
              "lr": "f8", "comm_bytes_sent": "i8", "comm_bytes_recv": "i8",
              "comm_seconds": "f8", "compute_seconds": "f8",
              # cumulative seconds (docs/metrics.md): control traffic (stop flag), consensus
              # probes, evaluations, checkpoints, metric flushes, and the training time =
              # wall_time less probes, evaluations, checkpoints and flushes
              "overhead_seconds": "f8", "probe_seconds": "f8", "eval_seconds": "f8",
              "checkpoint_seconds": "f8", "metrics_seconds": "f8", "training_time": "f8"},
    "eval": {"step": "i8", "epoch": "f8", "wall_time": "f8", "training_time": "f8",
             "test_loss": "f8", "test_accuracy": "f8"},
    "leader": {"step": "i8", "scope": "i8", "leader_rank": "i8", "score": "f8"},
    "consensus": {"step": "i8", "distance": "f8"},
    # one row per recovery from lost ranks (on_failure="shrink"; docs/metrics.md): the step
    # the survivors go on from, the run's clock, the ranks lost (initial numbering, e.g.
    # "1,3" or "8-15"; n_lost of them), the world size after it, the seconds it took, and
    # the nodes left without a rank (host names, comma-separated; empty when none)
    "faults": {"step": "i8", "wall_time": "f8", "lost_ranks": "S256", "n_lost": "i8",
               "world_size_after": "i8", "recovery_seconds": "f8", "lost_nodes": "S256"},
}

#: groups written only when they have rows (a file without failures has no /faults)
OPTIONAL_GROUPS = ("faults",)


#: Columns that hold measured times: they differ between two runs of the same seed (a
#: resumed run is compared with an uninterrupted one on everything else).
TIME_COLUMNS = ("wall_time", "training_time", "comm_seconds", "compute_seconds",
                "overhead_seconds", "probe_seconds", "eval_seconds", "checkpoint_seconds",
                "metrics_seconds", "worker_seconds", "recovery_seconds")


def rank_file(run_dir: str, rank: int) -> str:
    return os.path.join(run_dir, "metrics", f"rank{rank:05d}.h5")


class MetricsWriter:
    """Rows kept in memory and written out whole, atomically, every flush.

    Each flush writes a temporary file in the same folder, fsyncs it and renames it over the
    previous one, so the file on disk is at every moment a complete HDF5 file holding every row
    up to the last flush: a job killed at any instant (even mid-flush) leaves a readable file.
    A rank's metrics are a few MB at most, so rewriting them is cheap next to a training step.

    ``trackers``: experiment trackers that mirror the rows (rank 0's; lsgd_hpc.runtime.trackers:
    ``open_trackers`` or ``make_trackers``): every row logged is sent to them as it comes,
    they are flushed at every flush and closed by ``close()``.
    """

    def __init__(self, path: str, attrs: dict, flush_every: int = 50,
                 flush_seconds: float = 30.0, extra_columns: Optional[Dict[str, Dict]] = None,
                 trackers=None):
        self.path = path
        self.attrs = dict(attrs)
        self.flush_every = flush_every
        self.flush_seconds = flush_seconds
        self.columns = {g: dict(cols) for g, cols in GROUPS.items()}
        for g, cols in (extra_columns or {}).items():
            self.columns[g].update(cols)
        self.rows: Dict[str, Dict[str, List]] = {
            g: {c: [] for c in cols} for g, cols in self.columns.items()}
        self._last_flush_time = time.monotonic()
        self._rows_since_flush = 0
        self.trackers = _mirror(trackers)
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)

    # -- rows ------------------------------------------------------------------------------
    def log(self, group: str, **row) -> None:
        cols = self.rows[group]
        if row.keys() != cols.keys():
            missing, extra = cols.keys() - row.keys(), row.keys() - cols.keys()
            raise KeyError(f"/{group} row: missing {sorted(missing)}, unknown {sorted(extra)}")
        for c, v in row.items():
            cols[c].append(v)
        if group == "train":
            self._rows_since_flush += 1
        if self.trackers:
            self.trackers.log_row(group, row)

    def track(self, step: int, **scalars: float) -> None:
        """Send values that have no column in the file to the trackers only, under the keys
        given (``track(step, **{"leader/score": s})``); nothing without trackers."""
        if self.trackers:
            self.trackers.log_scalars(step, scalars)

    def row_counts(self) -> Dict[str, int]:
        counts = {g: len(next(iter(cols.values()))) for g, cols in self.rows.items()}
        return {g: n for g, n in counts.items() if n or g not in OPTIONAL_GROUPS}

    def maybe_flush(self) -> bool:
        due = (self._rows_since_flush >= self.flush_every
               or time.monotonic() - self._last_flush_time >= self.flush_seconds)
        if due:
            self.flush()
        return due

    # -- disk ------------------------------------------------------------------------------
    def flush(self) -> None:
        tmp = f"{self.path}.tmp"
        with h5py.File(tmp, "w", locking=False) as f:
            for k, v in self.attrs.items():
                f.attrs[k] = str(v) if isinstance(v, str) else v
            for g, cols in self.rows.items():
                if g in OPTIONAL_GROUPS and not any(len(v) for v in cols.values()):
                    continue
                grp = f.create_group(g)
                for c, values in cols.items():
                    arr = np.asarray(values, dtype=self.columns[g][c])
                    # maxshape=None: chunked so that tools may append; small files either way.
                    grp.create_dataset(c, data=arr, maxshape=(None,),
                                       chunks=(max(1, min(len(arr), 4096)),))
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, self.path)
        self._last_flush_time = time.monotonic()
        self._rows_since_flush = 0
        if self.trackers:
            self.trackers.flush()

    def close(self) -> None:
        """The end of the run: stamp the file's ``end_time`` attribute (ISO 8601, UTC; how
        ``lsgd_hpc.summary --follow`` knows a run ended), flush, close the trackers. Rows
        logged after it still go to the file at the next flush, not to the trackers."""
        self.attrs["end_time"] = _dt.datetime.now(_dt.timezone.utc).isoformat()
        try:
            self.flush()
        finally:
            self.close_trackers()

    def close_trackers(self) -> None:
        if self.trackers is not None:
            self.trackers.close()
            self.trackers = None

    def load_existing(self, counts: Dict[str, int]) -> None:
        """Resume: take back the first ``counts[g]`` rows of each group from the file on disk
        (rows written after the checkpoint are dropped; they will be produced again)."""
        with h5py.File(self.path, "r", locking=False) as f:
            for g, n in counts.items():
                if g in OPTIONAL_GROUPS and n == 0 and g not in f:
                    continue
                for c in self.rows[g]:
                    if g in f and c in f[g]:
                        data = f[g][c][:n]
                        if len(data) < n:
                            raise RuntimeError(f"{self.path}: /{g}/{c} has {len(data)} rows, "
                                               f"checkpoint expects {n}")
                        self.rows[g][c] = data.tolist()
                    else:
                        raise RuntimeError(f"{self.path}: /{g}/{c} missing; cannot resume")


def _mirror(trackers):
    """None, a trackers.Mirror, or a list of trackers (wrapped in a Mirror)."""
    if trackers is None or hasattr(trackers, "log_row"):
        return trackers
    from lsgd_hpc.runtime.trackers import Mirror
    return Mirror(trackers) if trackers else None


def encode_config(config: dict) -> str:
    return json.dumps(config, sort_keys=True, default=str)

