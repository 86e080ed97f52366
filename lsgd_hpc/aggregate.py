"""Offline aggregation of lsgd_hpc runs: ``python -m lsgd_hpc.aggregate RUN_DIR ... --out DIR``.

Reads every ``RUN_DIR/metrics/rank%05d.h5`` (read-only, h5py) and writes

* ``DIR/summary.csv``  one row per run (columns: ``SUMMARY_COLUMNS``);
* ``DIR/curves.csv``   tidy rows ``run, rank, step, wall_time, metric, value``;
* ``DIR/*.png``        test accuracy against training time (the default time axis), wall
  time, bytes sent and step, and the training loss against step.

Training time is the trainer's ``/train/training_time`` and ``/eval/training_time``: wall time
less evaluations, consensus probes, checkpoints and metric flushes (docs/metrics.md), so
that methods which evaluate or probe more are not charged for it. Files written before that
column existed have no training time; their runs are left out of that plot only.

A rank file that cannot be read (truncated, not HDF5) is reported on stderr in one line
and skipped. A RUN_DIR without ``metrics/`` whose sub-directories are runs (a sweep's
parent directory) stands for those runs.

Per-evaluation figures (one evaluation = one ``/eval`` step):

* ``mean``: mean test accuracy over the ranks that evaluated at that step;
* ``best``: the maximum over those ranks;
* ``leader``: the model the method reports --
  - LSGD (any run with global elections, ``/leader`` scope 0): the test accuracy of the
    rank that won the last global election at or before the evaluation step (for the
    final evaluation of a complete run that is the last election). Before the first
    election all workers are peers and rank 0 stands in;
  - EASGD: the centre model (``/eval/center_test_accuracy``), as EASGD reports the centre;
  - methods without elections (allreduce, local-sgd, gossip): rank 0's model.
  A figure whose rank file was skipped is left empty.

``final_*`` is the last evaluation that every readable rank reached; ``best_*`` is the
maximum over evaluations of the per-evaluation figure (evaluations that every readable rank
reached; all evaluations if there is none). ``wall_time`` and ``training_time`` are the
maxima over ranks of the last ``/train`` wall and training times, ``total_bytes_sent`` the sum over ranks of the last
``comm_bytes_sent``, ``steps`` the last logged training step (maximum over ranks).

Plots: one line per configuration. Runs whose config.yaml differ only in ``seed`` (and the
bookkeeping keys in ``NON_CONFIG_KEYS``) form one configuration and are drawn as the mean
over seeds with a shaded min-max band. The y value of a run is the per-evaluation mean over
ranks (test accuracy) or the per-step mean over ranks (training loss); its wall time is the
latest rank's (training time likewise), its bytes sent the total over all ranks; with 300 or more steps the training
loss is smoothed by a centred moving average over 1% of the steps. The legend names a configuration by
its algorithm plus the options that differ between the configurations shown.

In curves.csv, ``consensus_distance`` rows take their wall time from the rank's /train rows
(linear interpolation in step; empty outside the logged range); EASGD runs also get
``center_test_loss`` and ``center_test_accuracy`` rows; ``training_time`` rows (one per
/train row, value in seconds) let a reader put any metric on the training-time axis.
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import os
import sys
import textwrap
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import numpy as np

# Part of this module's interface: the experiments rank predictors against measurements.
from lsgd_hpc.stats import rank_correlation

__all__ = ["AggregateError", "Run", "RunGroup", "read_rank_file", "read_run", "read_runs",
           "eval_table", "summarize_run", "group_runs", "rank_correlation", "aggregate", "main"]

PROG = "lsgd_hpc.aggregate"

GROUPS = ("train", "eval", "leader", "consensus")

SUMMARY_COLUMNS = (
    "run", "algorithm", "world_size", "n_nodes", "epochs", "seed", "wall_time", "training_time",
    "final_test_acc_leader", "final_test_acc_mean", "final_test_acc_best",
    "best_test_acc_leader", "best_test_acc_mean", "best_test_acc_best",
    "total_bytes_sent", "steps",
)
CURVE_COLUMNS = ("run", "rank", "step", "wall_time", "metric", "value")

# Config keys that name where/how a run was started, not what it trains: runs whose configs
# differ only in these keys (and the seed) are the same configuration.
NON_CONFIG_KEYS = frozenset({"seed", "run_dir", "resume", "config", "data_dir",
                             # bookkeeping that does not change what is trained
                             "flush_every", "flush_seconds", "log_every", "checkpoint_every",
                             "eval_batch_size"})
# Derived from other options (epochs, batch size, world size, max steps): never a label.
DERIVED_KEYS = frozenset({"steps_per_epoch", "total_steps"})

PLOTS = {
    "test_acc_vs_training_time.png": ("training_time", "test_accuracy"),
    "test_acc_vs_wall_time.png": ("wall_time", "test_accuracy"),
    "test_acc_vs_bytes_sent.png": ("bytes_sent", "test_accuracy"),
    "test_acc_vs_step.png": ("step", "test_accuracy"),
    "train_loss_vs_step.png": ("step", "train_loss"),
}


class AggregateError(Exception):
    """Bad input: reported as one line and exit status 2."""


def _warn(msg: str) -> None:
    print(f"{PROG}: warning: {msg}", file=sys.stderr)


# --------------------------------------------------------------------------- reading

def _py(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    return value


def _open_h5(path: Path):
    import h5py
    try:
        return h5py.File(path, "r", locking=False)  # readable while a trainer still writes
    except TypeError:  # pragma: no cover - old h5py without the locking keyword
        return h5py.File(path, "r")


def read_rank_file(path: str | os.PathLike) -> dict:
    """Read one rank's HDF5 metrics file.

    Returns ``{"path", "rank", "attrs", "config", "train", "eval", "leader", "consensus"}``;
    each group is a dict name -> 1-D numpy array (all columns cut to the shortest, so rows
    stay aligned; a missing group is empty). Raises OSError/ValueError/KeyError when the
    file cannot be read.
    """
    path = Path(path)
    out: dict[str, Any] = {"path": str(path)}
    with _open_h5(path) as f:
        attrs = {k: _py(v) for k, v in f.attrs.items()}
        for name in GROUPS:
            cols: dict[str, np.ndarray] = {}
            grp = f.get(name)
            if grp is not None:
                for key, ds in grp.items():
                    if hasattr(ds, "shape") and len(ds.shape) == 1:
                        cols[key] = np.asarray(ds[()])
            if cols:
                n = min(len(v) for v in cols.values())
                cols = {k: v[:n] for k, v in cols.items()}
            out[name] = cols
    cfg = attrs.get("config", "{}")
    try:
        config = json.loads(cfg) if isinstance(cfg, str) and cfg else {}
    except ValueError:
        config = {}
    out["attrs"] = attrs
    out["config"] = config if isinstance(config, dict) else {}
    rank = attrs.get("rank")
    if rank is None:
        stem = path.stem
        rank = int(stem[4:]) if stem.startswith("rank") and stem[4:].isdigit() else -1
    out["rank"] = int(rank)
    return out


def col(rank_data: dict, group: str, name: str, dtype=float) -> np.ndarray:
    """Column ``group/name`` of a rank (empty array when absent)."""
    arr = rank_data.get(group, {}).get(name)
    return np.asarray(arr if arr is not None else [], dtype=dtype)


@dataclass
class Run:
    """One run directory: its config and the rank files that could be read."""
    path: Path
    name: str
    config: dict
    ranks: dict[int, dict]                      # rank -> read_rank_file(...)
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (file, reason)

    def _attr(self, key: str, default=None):
        for r in sorted(self.ranks):
            v = self.ranks[r]["attrs"].get(key)
            if v is not None:
                return v
        return default

    @property
    def algorithm(self) -> str:
        return str(self.config.get("algorithm") or self._attr("algorithm", ""))

    @property
    def world_size(self) -> int:
        ws = self._attr("world_size") or self.config.get("world_size")
        return int(ws) if ws is not None else len(self.ranks) + len(self.skipped)

    @property
    def n_nodes(self) -> int:
        n = self._attr("n_nodes")
        if n is not None:
            return int(n)
        return len({d["attrs"].get("node_index", 0) for d in self.ranks.values()})

    @property
    def seed(self):
        return self.config.get("seed")

    @property
    def epochs(self):
        return self.config.get("epochs")


def _rank_files(metrics: Path) -> list[Path]:
    return sorted(p for p in metrics.glob("rank*.h5") if p.is_file())


def read_run(run_dir: str | os.PathLike, name: str | None = None,
             warn: Callable[[str], None] = _warn) -> Run:
    """Read a run directory. Unreadable rank files are warned about and skipped;
    raises AggregateError when there is nothing to read."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise AggregateError(f"run directory not found: {run_dir}")
    metrics = run_dir / "metrics"
    files = _rank_files(metrics) if metrics.is_dir() else []
    if not files:
        raise AggregateError(f"no metrics files (metrics/rank*.h5) in {run_dir}")
    ranks: dict[int, dict] = {}
    skipped: list[tuple[str, str]] = []
    for p in files:
        try:
            data = read_rank_file(p)
        except Exception as exc:  # truncated / corrupt file: skip it, keep the rest
            reason = " ".join(str(exc).split()) or type(exc).__name__
            skipped.append((str(p), reason))
            warn(f"skipping unreadable metrics file {p}: {reason[:200]}")
            continue
        ranks[data["rank"]] = data
    if not ranks:
        raise AggregateError(f"no readable metrics files in {run_dir}")
    config: dict = {}
    cfg_path = run_dir / "config.yaml"
    if cfg_path.is_file():
        try:
            import yaml
            loaded = yaml.safe_load(cfg_path.read_text())
            config = loaded if isinstance(loaded, dict) else {}
        except Exception as exc:
            warn(f"cannot read {cfg_path} ({' '.join(str(exc).split())[:200]}); "
                 "using the config stored in the metrics files")
    if not config:
        config = dict(ranks[min(ranks)]["config"])
    return Run(path=run_dir, name=name or run_dir.resolve().name, config=config,
               ranks=ranks, skipped=skipped)


def expand_run_dirs(paths: Iterable[str | os.PathLike]) -> list[Path]:
    """RUN_DIR arguments -> run directories. A directory without ``metrics/`` whose
    sub-directories hold ``metrics/`` (a sweep's parent) stands for those sub-directories."""
    out: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir() and not (p / "metrics").is_dir():
            subs = sorted(d for d in p.iterdir() if (d / "metrics").is_dir())
            if subs:
                out.extend(subs)
                continue
        out.append(p)
    return out


def read_runs(paths: Iterable[str | os.PathLike],
              warn: Callable[[str], None] = _warn) -> list[Run]:
    dirs = expand_run_dirs(paths)
    names = [d.resolve().name for d in dirs]
    dup = {n for n, c in Counter(names).items() if c > 1}
    return [read_run(d, name=(str(d) if n in dup else n), warn=warn)
            for d, n in zip(dirs, names)]


# --------------------------------------------------------------------------- figures

def global_elections(run: Run) -> tuple[np.ndarray, np.ndarray]:
    """Global (scope 0) elections of a run: sorted steps and the elected world ranks.
    Every rank records each election; the union over readable ranks is used (lowest rank
    first), so one truncated file does not lose elections."""
    by_step: dict[int, int] = {}
    for r in sorted(run.ranks):
        d = run.ranks[r]
        steps = col(d, "leader", "step", np.int64)
        scope = col(d, "leader", "scope", np.int64)
        leader = col(d, "leader", "leader_rank", np.int64)
        n = min(len(steps), len(scope), len(leader))
        for s, sc, lr in zip(steps[:n], scope[:n], leader[:n]):
            if sc == 0:
                by_step.setdefault(int(s), int(lr))
    keys = sorted(by_step)
    return (np.asarray(keys, dtype=np.int64),
            np.asarray([by_step[k] for k in keys], dtype=np.int64))


def leader_rule(run: Run) -> str:
    """'centre' (EASGD), 'elected' (runs with global elections) or 'rank0'."""
    has_centre = any("center_test_accuracy" in d.get("eval", {}) for d in run.ranks.values())
    if run.algorithm == "easgd" or has_centre:
        return "centre"
    if len(global_elections(run)[0]):
        return "elected"
    return "rank0"


def _value_at(steps: np.ndarray, values: np.ndarray, step: int, default=np.nan):
    """Value of the last row with steps <= step (steps ascending)."""
    i = int(np.searchsorted(steps, step, side="right")) - 1
    return values[i] if i >= 0 else default


def eval_table(run: Run) -> dict[str, np.ndarray]:
    """One row per evaluation step (union over ranks, ascending). Columns: step,
    n_ranks, complete (every readable rank evaluated), wall_time and training_time (max over
    ranks; NaN where the files have no training time),
    bytes_sent (total over readable ranks of the cumulative counter at that step),
    acc_mean, acc_best, acc_leader, leader_rank (-1 for the centre), loss_mean."""
    per_rank: dict[int, dict[int, tuple[float, float, float, float]]] = {}
    centre: dict[int, float] = {}
    for r in sorted(run.ranks):
        d = run.ranks[r]
        steps = col(d, "eval", "step", np.int64)
        acc = col(d, "eval", "test_accuracy")
        loss = col(d, "eval", "test_loss")
        wt = col(d, "eval", "wall_time")
        tt = col(d, "eval", "training_time")
        n = min(len(steps), len(acc))
        loss = loss if len(loss) >= n else np.full(n, np.nan)
        wt = wt if len(wt) >= n else np.full(n, np.nan)
        tt = tt if len(tt) >= n else np.full(n, np.nan)
        per_rank[r] = {int(s): (float(a), float(l), float(w), float(t))
                       for s, a, l, w, t in zip(steps[:n], acc[:n], loss[:n], wt[:n], tt[:n])}
        c = col(d, "eval", "center_test_accuracy")
        for s, a in zip(steps[:len(c)], c):
            centre.setdefault(int(s), float(a))
    all_steps = sorted({s for m in per_rank.values() for s in m})
    rule = leader_rule(run)
    el_steps, el_leader = global_elections(run)
    bytes_cols = {r: (col(d, "train", "step", np.int64), col(d, "train", "comm_bytes_sent"))
                  for r, d in run.ranks.items()}
    rows: dict[str, list] = {k: [] for k in (
        "step", "n_ranks", "complete", "wall_time", "training_time", "bytes_sent", "acc_mean",
        "acc_best",
        "acc_leader", "leader_rank", "loss_mean")}
    for s in all_steps:
        have = {r: m[s] for r, m in per_rank.items() if s in m}
        accs = np.array([v[0] for v in have.values()])
        if rule == "centre":
            lr = -1
            lacc = centre.get(s, np.nan)
        else:
            lr = 0
            if rule == "elected":
                lr = int(_value_at(el_steps, el_leader, s, default=0))
            lacc = have[lr][0] if lr in have else np.nan
        total_bytes = 0.0
        for r, (st, b) in bytes_cols.items():
            n = min(len(st), len(b))
            total_bytes += float(_value_at(st[:n], b[:n], s, default=0.0))
        rows["step"].append(s)
        rows["n_ranks"].append(len(have))
        rows["complete"].append(len(have) == len(run.ranks))
        rows["wall_time"].append(_nanmax(np.array([v[2] for v in have.values()])))
        rows["training_time"].append(_nanmax(np.array([v[3] for v in have.values()])))
        rows["bytes_sent"].append(total_bytes)
        rows["acc_mean"].append(float(np.mean(accs)))
        rows["acc_best"].append(float(np.max(accs)))
        rows["acc_leader"].append(float(lacc))
        rows["leader_rank"].append(lr)
        rows["loss_mean"].append(float(np.mean([v[1] for v in have.values()])))
    dtypes = {"step": np.int64, "n_ranks": np.int64, "complete": bool, "leader_rank": np.int64}
    return {k: np.asarray(v, dtype=dtypes.get(k, float)) for k, v in rows.items()}


def _last(arr: np.ndarray):
    return arr[-1] if len(arr) else None


def _nanmax(a: np.ndarray) -> float:
    a = np.asarray(a, dtype=float)
    return float(np.nanmax(a)) if len(a) and not np.all(np.isnan(a)) else math.nan


def summarize_run(run: Run) -> dict:
    """The summary.csv row of a run (see the module docstring for the rules)."""
    tab = eval_table(run)
    use = tab["complete"] if tab["complete"].any() else np.ones(len(tab["step"]), bool)
    row: dict[str, Any] = {
        "run": run.name, "algorithm": run.algorithm, "world_size": run.world_size,
        "n_nodes": run.n_nodes, "epochs": run.epochs, "seed": run.seed,
    }
    walls = [_last(col(d, "train", "wall_time")) for d in run.ranks.values()]
    walls = [w for w in walls if w is not None]
    row["wall_time"] = float(max(walls)) if walls else math.nan
    train_times = [_last(col(d, "train", "training_time")) for d in run.ranks.values()]
    row["training_time"] = _nanmax(np.array([t for t in train_times if t is not None]))
    for fig in ("leader", "mean", "best"):
        vals = tab[f"acc_{fig}"][use]
        row[f"final_test_acc_{fig}"] = float(vals[-1]) if len(vals) else math.nan
    for fig in ("leader", "mean", "best"):
        row[f"best_test_acc_{fig}"] = _nanmax(tab[f"acc_{fig}"][use])
    sent = [_last(col(d, "train", "comm_bytes_sent", np.int64)) for d in run.ranks.values()]
    row["total_bytes_sent"] = int(sum(int(b) for b in sent if b is not None))
    steps = [_last(col(d, "train", "step", np.int64)) for d in run.ranks.values()]
    steps = [int(s) for s in steps if s is not None]
    row["steps"] = max(steps) if steps else None
    return row


def leader_counts(run: Run) -> dict[int, int]:
    """How many global elections each rank won."""
    _, leaders = global_elections(run)
    return dict(Counter(int(x) for x in leaders))


# --------------------------------------------------------------------------- CSV

def _fmt(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, (bool, np.bool_)):
        return str(int(v))
    if isinstance(v, (int, np.integer)):
        return str(int(v))
    if isinstance(v, (float, np.floating)):
        v = float(v)
        return "" if math.isnan(v) else repr(v)
    return str(v)


def write_summary_csv(runs: list[Run], path: str | os.PathLike) -> list[dict]:
    rows = [summarize_run(r) for r in runs]
    with open(path, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(SUMMARY_COLUMNS)
        for row in rows:
            w.writerow([_fmt(row[c]) for c in SUMMARY_COLUMNS])
    return rows


def curve_rows(run: Run) -> Iterator[tuple]:
    """Tidy rows (run, rank, step, wall_time, metric, value) of a run, rank by rank."""
    for r in sorted(run.ranks):
        d = run.ranks[r]
        tstep = col(d, "train", "step", np.int64)
        twall = col(d, "train", "wall_time")
        n = min(len(tstep), len(twall))
        tstep, twall = tstep[:n], twall[:n]
        for metric, name, dtype in (("train_loss", "loss", float),
                                    ("train_accuracy", "accuracy", float),
                                    ("comm_bytes_sent", "comm_bytes_sent", np.int64),
                                    ("training_time", "training_time", float)):
            vals = col(d, "train", name, dtype)
            for s, wt, v in zip(tstep, twall, vals):
                yield (run.name, r, s, wt, metric, v)
        estep = col(d, "eval", "step", np.int64)
        ewall = col(d, "eval", "wall_time")
        for metric in ("test_loss", "test_accuracy", "center_test_loss", "center_test_accuracy"):
            if metric not in d.get("eval", {}):
                continue
            for s, wt, v in zip(estep, ewall, col(d, "eval", metric)):
                yield (run.name, r, s, wt, metric, v)
        cstep = col(d, "consensus", "step", np.int64)
        cdist = col(d, "consensus", "distance")
        order = np.argsort(tstep, kind="stable")
        for s, v in zip(cstep, cdist):
            if n and tstep[order[0]] <= s <= tstep[order[-1]]:
                wt = float(np.interp(s, tstep[order], twall[order]))
            else:
                wt = None
            yield (run.name, r, s, wt, "consensus_distance", v)


def write_curves_csv(runs: list[Run], path: str | os.PathLike) -> int:
    n = 0
    with open(path, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(CURVE_COLUMNS)
        for run in runs:
            for row in curve_rows(run):
                w.writerow([_fmt(v) for v in row])
                n += 1
    return n


# --------------------------------------------------------------------------- grouping

def config_key(config: dict) -> str:
    """The configuration a run belongs to: its config minus seed and NON_CONFIG_KEYS."""
    return json.dumps({k: v for k, v in config.items() if k not in NON_CONFIG_KEYS},
                      sort_keys=True, default=str)


@dataclass
class RunGroup:
    """Runs of one configuration (differing only in seed)."""
    key: str
    config: dict            # the configuration (config minus NON_CONFIG_KEYS)
    runs: list[Run]
    label: str = ""

    @property
    def seeds(self) -> list:
        return [r.seed for r in self.runs]


def _short(v: Any) -> str:
    return f"{v:g}" if isinstance(v, float) else str(v)


def group_runs(runs: list[Run]) -> list[RunGroup]:
    """Group runs by configuration (first-appearance order) and label each group by its
    algorithm plus the options that differ between the groups."""
    groups: dict[str, RunGroup] = {}
    for run in runs:
        key = config_key(run.config)
        if key not in groups:
            cfg = {k: v for k, v in run.config.items() if k not in NON_CONFIG_KEYS}
            groups[key] = RunGroup(key=key, config=cfg, runs=[])
        groups[key].runs.append(run)
    out = list(groups.values())
    keys = sorted({k for g in out for k in g.config} - {"algorithm"} - DERIVED_KEYS)
    differing = [k for k in keys
                 if len({json.dumps(g.config.get(k), sort_keys=True, default=str)
                         for g in out}) > 1]
    for g in out:
        alg = str(g.config.get("algorithm") or g.runs[0].algorithm)
        opts = [f"{k}={_short(g.config.get(k))}" for k in differing]
        label = textwrap.fill(" ".join([alg] + opts), width=60, subsequent_indent="  ")
        if len(g.runs) > 1:
            label += f" ({len(g.runs)} seeds)"
        g.label = label
    return out


# --------------------------------------------------------------------------- plots

def run_curve(run: Run, x: str, y: str) -> tuple[np.ndarray, np.ndarray]:
    """One run's curve. y 'test_accuracy': per-evaluation mean over ranks against x in
    {'step', 'wall_time', 'training_time', 'bytes_sent'}. y 'train_loss': per-step mean over ranks
    against 'step'."""
    if y == "test_accuracy":
        tab = eval_table(run)
        xs, ys = tab[x].astype(float), tab["acc_mean"]
    elif y == "train_loss" and x == "step":
        acc: dict[int, list[float]] = {}
        for d in run.ranks.values():
            for s, v in zip(col(d, "train", "step", np.int64), col(d, "train", "loss")):
                acc.setdefault(int(s), []).append(float(v))
        xs = np.asarray(sorted(acc), dtype=float)
        ys = np.asarray([np.mean(acc[int(s)]) for s in xs], dtype=float)
    else:
        raise ValueError(f"no curve {y} against {x}")
    ok = np.isfinite(xs) & np.isfinite(ys)
    xs, ys = xs[ok], ys[ok]
    order = np.argsort(xs, kind="stable")
    return xs[order], ys[order]


def band(curves: list[tuple[np.ndarray, np.ndarray]]):
    """Mean, min and max over runs on the union of their x values; each run is linearly
    interpolated inside its own x range and left out beyond it."""
    curves = [(x, y) for x, y in curves if len(x)]
    if not curves:
        e = np.array([])
        return e, e, e, e
    grid = np.unique(np.concatenate([x for x, _ in curves]))
    stack = np.full((len(curves), len(grid)), np.nan)
    for i, (x, y) in enumerate(curves):
        inside = (grid >= x[0]) & (grid <= x[-1])
        stack[i, inside] = np.interp(grid[inside], x, y)
    return grid, np.nanmean(stack, 0), np.nanmin(stack, 0), np.nanmax(stack, 0)


def _smooth(y: np.ndarray, n_points: int) -> np.ndarray:
    """Centred moving average over about 1% of the points (loss per step is noisy)."""
    w = max(1, n_points // 100)
    if w < 3 or len(y) < 3 * w:
        return y
    kernel = np.ones(w) / w
    pad = np.concatenate([np.full(w // 2, y[0]), y, np.full(w - 1 - w // 2, y[-1])])
    return np.convolve(pad, kernel, mode="valid")


_XLABEL = {"step": "training step", "wall_time": "wall time (s)",
           "training_time": "training time (s): wall time less evaluation, probes, checkpoints",
           "bytes_sent": "bytes sent, all ranks together"}
_YLABEL = {"test_accuracy": "test accuracy (mean over ranks)",
           "train_loss": "training loss (mean over ranks)"}


def plot_all(runs: list[Run], out_dir: str | os.PathLike,
             groups: list[RunGroup] | None = None) -> list[Path]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import EngFormatter

    groups = groups if groups is not None else group_runs(runs)
    out_dir = Path(out_dir)
    written = []
    for fname, (x, y) in PLOTS.items():
        fig, ax = plt.subplots(figsize=(7.5, 4.8), dpi=120)
        smoothed = False
        for i, g in enumerate(groups):
            color = f"C{i % 10}"
            gx, mean, lo, hi = band([run_curve(r, x, y) for r in g.runs])
            if not len(gx):
                continue
            if y == "train_loss" and _smooth(mean, len(gx)) is not mean:
                mean, lo, hi = (_smooth(a, len(gx)) for a in (mean, lo, hi))
                smoothed = True
            ax.plot(gx, mean, color=color, lw=1.6, label=g.label,
                    marker="o" if len(gx) <= 30 else None, ms=3)
            if len(g.runs) > 1:
                ax.fill_between(gx, lo, hi, color=color, alpha=0.2, lw=0)
        ax.set_xlabel(_XLABEL[x])
        ax.set_ylabel(_YLABEL[y][:-1] + ", smoothed)" if smoothed else _YLABEL[y])
        if x == "bytes_sent":
            ax.xaxis.set_major_formatter(EngFormatter(unit="B"))
        ax.set_title(f"{_YLABEL[y].split(' (')[0]} vs {_XLABEL[x].split(',')[0].split(' (')[0]}"
                     + ("  (band: min-max over seeds)"
                        if any(len(g.runs) > 1 for g in groups) else ""), fontsize=10)
        ax.grid(True, alpha=0.3)
        if groups:
            ax.legend(fontsize=8, loc="best")
        fig.tight_layout()
        path = out_dir / fname
        fig.savefig(path)
        plt.close(fig)
        written.append(path)
    return written


# --------------------------------------------------------------------------- CLI

def aggregate(run_dirs: Iterable[str | os.PathLike], out_dir: str | os.PathLike,
              warn: Callable[[str], None] = _warn) -> dict:
    """Read the runs and write summary.csv, curves.csv and the plots into out_dir."""
    runs = read_runs(run_dirs, warn=warn)
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise AggregateError(f"--out {out} exists and is not a directory")
    try:
        out.mkdir(parents=True, exist_ok=True)
        summary = write_summary_csv(runs, out / "summary.csv")
        n_curves = write_curves_csv(runs, out / "curves.csv")
        groups = group_runs(runs)
        plots = plot_all(runs, out, groups)
    except OSError as exc:
        raise AggregateError(f"cannot write to {out}: {exc.strerror or exc}") from None
    return {"runs": runs, "summary": summary, "curve_rows": n_curves,
            "groups": groups, "plots": plots}


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2 (argparse prints usage too by default)
        print(f"{PROG}: error: {message}", file=sys.stderr)
        raise SystemExit(2)


def _first_paragraph_rules() -> str:
    doc = __doc__ or ""
    start = doc.find("Per-evaluation figures")
    end = doc.find("Plots:")
    return doc[start:end].strip() if start >= 0 and end > start else ""


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m lsgd_hpc.aggregate",
                description="Aggregate lsgd_hpc runs into summary.csv, curves.csv and plots.",
                epilog=_first_paragraph_rules() + "\n\nPlots show the per-evaluation mean over "
                "ranks; runs differing only in seed are one line (mean) with a min-max band.",
                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR",
                   help="run directory (holds metrics/rank*.h5), or a directory of runs")
    p.add_argument("--out", required=True, metavar="DIR", help="output directory")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        res = aggregate(args.run_dirs, args.out)
    except AggregateError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    print(f"{PROG}: {len(res['runs'])} run(s) in {len(res['groups'])} configuration(s) -> "
          f"{Path(args.out) / 'summary.csv'}, curves.csv ({res['curve_rows']} rows), "
          f"{len(res['plots'])} plots")
    return 0


if __name__ == "__main__":
    sys.exit(main())
