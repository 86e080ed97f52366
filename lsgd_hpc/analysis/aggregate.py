"""Offline aggregation of lsgd_hpc runs: ``python -m lsgd_hpc.aggregate RUN_DIR ... --out DIR``.

Reads every ``RUN_DIR/metrics/rank%05d.h5`` (read-only, h5py) and writes

* ``DIR/summary.csv``  one row per run (columns: ``summary_columns``);
* ``DIR/groups.csv``   one row per group of runs (columns: ``group_columns``): n_runs and the
  mean, std, min and max over its runs of the figures in ``group_metrics``;
* ``DIR/curves.csv``   tidy rows ``run, rank, step, wall_time, metric, value``;
* ``DIR/*.png``        test accuracy against training time (the default time axis), wall
  time, bytes sent and step, and the training loss against step;
* with predictions (``--predictions``): ``DIR/correlations.csv`` and one
  ``DIR/pred_<predictor>_vs_<figure>.png`` each (lsgd_hpc.predictions).

Training time is the trainer's ``/train/training_time`` and ``/eval/training_time``: wall time
less evaluations, consensus probes, checkpoints and metric flushes (docs/metrics.md), so
that methods which evaluate or probe more are not charged for it. Files written before that
column existed have no training time; their runs are left out of that plot only.

Files that are skipped (lsgd_hpc.analysis.rundir reads the run directories), each with one line on
stderr naming the file and why (the run is aggregated from the others; exit status 2 and a
one-line error only when no run has a file left): a rank file that cannot be read (truncated,
not HDF5); one whose ``schema_version`` is not in ``KNOWN_SCHEMA_VERSIONS`` or missing; one of
another run -- the files of a run share the ``config`` attribute (``resume`` aside) and come
from one chain of starts (``start_time``; a resumed start continues the run, a fresh one begins
another), and the run most files share is the directory's (on a tie, the one agreeing with
config.yaml on the most keys, then the one holding the lowest rank); two or more files claiming
one ``rank`` attribute -- the one whose file name is that rank's (``rank%05d.h5``) is kept, and
when none or several are, all of them are skipped. A RUN_DIR that does not exist or has
nothing readable left is skipped likewise. A run's configuration is the ``config`` attribute
of its kept files (config.yaml, written once by the first start, only when they have none; a
warning says where config.yaml differs). A RUN_DIR without ``metrics/`` whose
sub-directories are runs (a sweep's parent directory) stands for those runs.

Per-evaluation figures (one evaluation = one ``/eval`` step):

* ``mean``: mean test accuracy over the ranks that evaluated at that step;
* ``best``: the maximum over those ranks;
* ``leader``: the model the method reports --
  - LSGD (any run with global elections, ``/leader`` scope 0): the test accuracy of the
    rank that won the last global election at or before the evaluation step (for the
    final evaluation of a complete run that is the last election). Before the first
    election all workers are peers and rank 0 stands in;
  - EASGD: the centre model (``/eval/center_test_accuracy``), as EASGD reports the centre;
  - methods without elections (allreduce, local-sgd, diloco, slowmo, gossip): rank 0's model.
  A figure whose rank file was skipped is left empty.

``final_*`` is the last evaluation that every readable rank reached; ``best_*`` is the
maximum over evaluations of the per-evaluation figure (evaluations that every readable rank
reached; all evaluations if there is none). ``wall_time`` and ``training_time`` are the
maxima over ranks of the last ``/train`` wall and training times, ``total_bytes_sent`` and
``total_bytes_recv`` the sums over ranks of the last ``comm_bytes_sent`` and
``comm_bytes_recv`` (a broadcast counts its payload once as sent, at the root, but once per
receiver as received), ``steps`` the last logged training step (maximum over ranks).

``final_consensus_distance`` is the consensus distance at the run's last probe and
``mean_consensus_distance`` the mean over its probes (empty without probes).

Time to target (``--target-acc X``, ``--target-loss Y``; rules in ``Targets``): the training
time, the step and the bytes sent by all ranks together at the first evaluation whose test
accuracy (by default the mean over ranks; ``--target-figure leader|best``) is >= X, and at the
first logged step whose training loss (mean over ranks, optionally averaged over the last
``--loss-window`` steps) is <= Y. Empty when never reached.

Groups: by default the runs whose config.yaml differ only in ``seed`` (and the bookkeeping
keys in ``NON_CONFIG_KEYS``) form one group, named by its algorithm plus the options that
differ between the groups; with ``--by KEY[,KEY...]`` the runs that share the values of those
config keys, named by those values. In groups.csv the standard deviation is the sample one
(n - 1; empty for one run), and a time, step or byte count to a target is summarised over the
runs that reached it (``n_reached_acc``, ``n_reached_loss`` say how many did).

Plots: one line per group, the mean over its runs with a shaded min-max band. The y value of
a run is the per-evaluation mean over ranks (test accuracy) or the per-step mean over ranks
(training loss); its wall time is the latest rank's (training time likewise), its bytes sent
the total over all ranks; with 300 or more steps the training loss is smoothed by a centred
moving average over 1% of the steps. A target is drawn as a dashed horizontal line.

Predicted against measured (``--predictions FILE.csv``, needs ``--by``): the file's first
columns are the --by keys, the others predictors (lsgd_hpc.predictions); each row is joined onto
the group with the same key values and its predictors are added to groups.csv. correlations.csv
holds, for each predictor and each group figure (the mean over the group's runs) that differs
between groups, Spearman's rho and Kendall's tau-b over the groups (``rank_correlation``).

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
from typing import Any, Callable, Iterable, Iterator, Sequence

import numpy as np

from lsgd_hpc.analysis.rundir import (GROUPS, KNOWN_SCHEMA_VERSIONS, NON_CONFIG_KEYS,
                                      AggregateError, Run, canonical, col, expand_run_dirs,
                                      read_rank_file, read_run, run_identities)
from lsgd_hpc.analysis.rundir import read_runs as _read_runs
from lsgd_hpc.analysis.predictions import (CORRELATION_COLUMNS, PredictionsError,
                                           correlation_table, default_plot_measured,
                                           join_predictions, plot_predicted_vs_measured,
                                           read_predictions)
# Part of this module's interface: the experiments rank predictors against measurements.
from lsgd_hpc.analysis.stats import rank_correlation

__all__ = ["AggregateError", "Run", "RunGroup", "Targets", "GROUPS", "KNOWN_SCHEMA_VERSIONS",
           "NON_CONFIG_KEYS", "read_rank_file", "read_run", "read_runs", "expand_run_dirs",
           "run_identities", "col", "eval_table", "train_table", "time_to_accuracy",
           "time_to_loss", "consensus_figures", "summarize_run", "group_runs", "group_table",
           "group_metrics", "rank_correlation", "aggregate", "main"]

PROG = "lsgd_hpc.aggregate"

SUMMARY_COLUMNS = (
    "run", "algorithm", "world_size", "n_nodes", "epochs", "seed", "wall_time", "training_time",
    "final_test_acc_leader", "final_test_acc_mean", "final_test_acc_best",
    "best_test_acc_leader", "best_test_acc_mean", "best_test_acc_best",
    "total_bytes_sent", "total_bytes_recv", "steps", "final_consensus_distance",
    "mean_consensus_distance",
)
CURVE_COLUMNS = ("run", "rank", "step", "wall_time", "metric", "value")

# Derived from other options (epochs, batch size, world size, max steps): never a label.
DERIVED_KEYS = frozenset({"steps_per_epoch", "total_steps"})

PLOTS = {
    "test_acc_vs_training_time.png": ("training_time", "test_accuracy"),
    "test_acc_vs_wall_time.png": ("wall_time", "test_accuracy"),
    "test_acc_vs_bytes_sent.png": ("bytes_sent", "test_accuracy"),
    "test_acc_vs_step.png": ("step", "test_accuracy"),
    "train_loss_vs_step.png": ("step", "train_loss"),
}


def _warn(msg: str) -> None:
    print(f"{PROG}: warning: {msg}", file=sys.stderr)


def read_runs(paths: Iterable[str | os.PathLike],
              warn: Callable[[str], None] = _warn) -> list[Run]:
    """lsgd_hpc.analysis.rundir.read_runs, warnings prefixed with this program's name by default."""
    return _read_runs(paths, warn=warn)


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
    cols = [np.asarray(d["eval"]["center_test_accuracy"], dtype=float)
            for d in run.ranks.values() if "center_test_accuracy" in d.get("eval", {})]
    has_centre = any(np.isfinite(c).any() for c in cols)
    # a library run's file has the column but NaN when the loop logged no centre figures
    if has_centre or (run.algorithm == "easgd" and not cols):
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
            if np.isfinite(a):
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


def train_table(run: Run) -> dict[str, np.ndarray]:
    """One row per /train step that every readable rank logged (ascending). Columns: step,
    loss_mean (mean over ranks), training_time and wall_time (max over ranks; training_time NaN
    where the files have none), bytes_sent (sum over ranks of the cumulative counter)."""
    per_rank = []
    for d in run.ranks.values():
        steps = col(d, "train", "step", np.int64)
        cols = {k: col(d, "train", k) for k in ("loss", "training_time", "wall_time",
                                                 "comm_bytes_sent")}
        n = min([len(steps)] + [len(v) for v in cols.values() if len(v)])
        cols = {k: (v[:n] if len(v) >= n else np.full(n, np.nan)) for k, v in cols.items()}
        per_rank.append((steps[:n], cols))
    common = sorted(set.intersection(*(set(st.tolist()) for st, _ in per_rank))) \
        if per_rank else []
    grid = np.asarray(common, dtype=np.int64)
    picked = []
    for steps, cols in per_rank:
        first = {int(s): i for i, s in reversed(list(enumerate(steps)))}  # first row of a step
        idx = np.asarray([first[int(s)] for s in grid], dtype=np.int64)
        picked.append({k: v[idx] for k, v in cols.items()})
    if not picked:
        e = np.zeros(0)
        return {"step": grid, "loss_mean": e, "training_time": e, "wall_time": e,
                "bytes_sent": e}
    stack = {k: np.vstack([p[k] for p in picked]) for k in picked[0]}
    with np.errstate(all="ignore"):
        return {"step": grid, "loss_mean": stack["loss"].mean(0),
                "training_time": np.max(stack["training_time"], 0),
                "wall_time": np.max(stack["wall_time"], 0),
                "bytes_sent": stack["comm_bytes_sent"].sum(0)}


ACCURACY_FIGURES = ("mean", "leader", "best")


@dataclass(frozen=True)
class Targets:
    """What "reaching the target" means for the time-to-target columns.

    ``acc``: the first evaluation (one that every readable rank reached) whose test accuracy
    ``figure`` (``mean`` over ranks, the ``leader`` figure or the ``best`` worker; see
    "Per-evaluation figures") is >= acc. ``loss``: the first /train step logged by every
    readable rank whose training loss, averaged over the ranks and over the last
    ``loss_window`` such steps, is <= loss (the minibatch loss is noisy: a window > 1 keeps
    one lucky batch from counting)."""
    acc: float | None = None
    loss: float | None = None
    figure: str = "mean"
    loss_window: int = 1

    def __post_init__(self):
        if self.acc is not None and not 0.0 < self.acc <= 1.0:
            raise AggregateError(f"target accuracy must be a fraction in (0, 1], not {self.acc}")
        if self.loss is not None and not (math.isfinite(self.loss) and self.loss >= 0):
            raise AggregateError(f"target loss must be a number >= 0, not {self.loss}")
        if self.figure not in ACCURACY_FIGURES:
            raise AggregateError(f"target accuracy figure must be one of "
                                 f"{', '.join(ACCURACY_FIGURES)}, not {self.figure!r}")
        if self.loss_window < 1:
            raise AggregateError(f"loss window must be >= 1 step, not {self.loss_window}")

    def columns(self) -> tuple[str, ...]:
        out: tuple[str, ...] = ()
        if self.acc is not None:
            out += TARGET_ACC_COLUMNS
        if self.loss is not None:
            out += TARGET_LOSS_COLUMNS
        return out


TARGET_ACC_COLUMNS = ("target_acc", "time_to_target_acc", "steps_to_target_acc",
                      "bytes_to_target_acc")
TARGET_LOSS_COLUMNS = ("target_loss", "time_to_target_loss", "steps_to_target_loss",
                       "bytes_to_target_loss")


def _reached(steps: np.ndarray, times: np.ndarray, sent: np.ndarray, hit: np.ndarray) -> dict:
    """time, step and bytes of the first row where ``hit``; None each when never reached."""
    where = np.flatnonzero(hit)
    if not len(where):
        return {"time": None, "step": None, "bytes": None}
    i = int(where[0])
    return {"time": float(times[i]), "step": int(steps[i]), "bytes": int(round(sent[i]))}


def time_to_accuracy(run: Run, target: float, figure: str = "mean") -> dict:
    """{'time', 'step', 'bytes'} at the first complete evaluation whose ``acc_<figure>`` is >=
    target: its training time (max over ranks, as the evaluation started), its step, and the
    bytes all ranks had sent by then (eval_table). None each when never reached."""
    tab = eval_table(run)
    use = tab["complete"] if tab["complete"].any() else np.ones(len(tab["step"]), bool)
    acc = tab[f"acc_{figure}"][use]
    with np.errstate(invalid="ignore"):
        hit = acc >= target
    return _reached(tab["step"][use], tab["training_time"][use], tab["bytes_sent"][use], hit)


def time_to_loss(run: Run, target: float, window: int = 1) -> dict:
    """{'time', 'step', 'bytes'} at the first step (train_table) whose training loss, the mean
    over ranks averaged over the last ``window`` logged steps, is <= target: the training
    time (max over ranks), the step, the bytes all ranks had sent. None each when never."""
    tab = train_table(run)
    loss = tab["loss_mean"]
    if window > 1 and len(loss):
        csum = np.concatenate([[0.0], np.cumsum(loss)])
        idx = np.arange(1, len(loss) + 1)
        lo = np.maximum(idx - window, 0)
        loss = (csum[idx] - csum[lo]) / (idx - lo)
        loss[: window - 1] = np.nan          # not yet a full window
    with np.errstate(invalid="ignore"):
        hit = loss <= target
    return _reached(tab["step"], tab["training_time"], tab["bytes_sent"], hit)


def consensus_figures(run: Run) -> tuple[float, float]:
    """(final, mean) consensus distance of a run: at its last probe, and the mean over its
    probes. The distance is the same on every rank; the union over readable ranks is used
    (lowest rank first). NaN when the run has no probes (--consensus-every 0)."""
    by_step: dict[int, float] = {}
    for r in sorted(run.ranks):
        d = run.ranks[r]
        for s, v in zip(col(d, "consensus", "step", np.int64), col(d, "consensus", "distance")):
            by_step.setdefault(int(s), float(v))
    if not by_step:
        return math.nan, math.nan
    return by_step[max(by_step)], float(np.mean(list(by_step.values())))


def summarize_run(run: Run, targets: Targets | None = None) -> dict:
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
    # a broadcast's payload counts once as sent (at its root) but once per receiver here
    recv = [_last(col(d, "train", "comm_bytes_recv", np.int64)) for d in run.ranks.values()]
    row["total_bytes_recv"] = int(sum(int(b) for b in recv if b is not None))
    steps = [_last(col(d, "train", "step", np.int64)) for d in run.ranks.values()]
    steps = [int(s) for s in steps if s is not None]
    row["steps"] = max(steps) if steps else None
    row["final_consensus_distance"], row["mean_consensus_distance"] = consensus_figures(run)
    targets = targets or Targets()
    if targets.acc is not None:
        hit = time_to_accuracy(run, targets.acc, targets.figure)
        row.update(target_acc=targets.acc, time_to_target_acc=hit["time"],
                   steps_to_target_acc=hit["step"], bytes_to_target_acc=hit["bytes"])
    if targets.loss is not None:
        hit = time_to_loss(run, targets.loss, targets.loss_window)
        row.update(target_loss=targets.loss, time_to_target_loss=hit["time"],
                   steps_to_target_loss=hit["step"], bytes_to_target_loss=hit["bytes"])
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


def summary_columns(targets: Targets | None = None) -> tuple[str, ...]:
    """summary.csv's columns: SUMMARY_COLUMNS, then the target columns of the targets given."""
    return SUMMARY_COLUMNS + (targets.columns() if targets else ())


def write_table_csv(rows: list[dict], columns: Iterable[str], path: str | os.PathLike) -> None:
    """A CSV with a header; missing and NaN values are empty cells."""
    columns = list(columns)
    with open(path, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(columns)
        for row in rows:
            w.writerow([_fmt(row.get(c)) for c in columns])


def write_summary_csv(runs: list[Run], path: str | os.PathLike,
                      targets: Targets | None = None) -> list[dict]:
    rows = [summarize_run(r, targets) for r in runs]
    write_table_csv(rows, summary_columns(targets), path)
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
    """Runs drawn as one line: by default runs of one configuration (differing only in seed),
    with ``by`` the runs that share the values of the ``by`` config keys."""
    key: str
    config: dict            # the configuration (config minus NON_CONFIG_KEYS), or the by keys
    runs: list[Run]
    label: str = ""         # legend entry (wrapped, with the number of runs)
    name: str = ""          # one line: the group column of groups.csv
    values: dict = field(default_factory=dict)   # key columns of groups.csv -> value
    by: tuple[str, ...] | None = None

    @property
    def seeds(self) -> list:
        return [r.seed for r in self.runs]


def _short(v: Any) -> str:
    return f"{v:g}" if isinstance(v, float) else str(v)


def _check_by(runs: list[Run], by: Iterable[str]) -> tuple[str, ...]:
    by = tuple(by)
    if not by:
        raise AggregateError("--by needs at least one config key")
    known = sorted({k for r in runs for k in r.config})
    missing = [k for k in by if not any(k in r.config for r in runs)]
    if missing:
        raise AggregateError(f"--by {','.join(missing)}: not a key of any run's config.yaml "
                             f"(keys: {', '.join(known)})")
    return by


def _name(values: dict) -> str:
    return " ".join(_short(v) if k == "algorithm" else f"{k}={_short(v)}"
                    for k, v in values.items())


def group_runs(runs: list[Run], by: Iterable[str] | None = None) -> list[RunGroup]:
    """Group runs (first-appearance order).

    Without ``by``: by configuration (``config_key``: config minus the seed and NON_CONFIG_KEYS);
    a group is named by its algorithm plus the options that differ between the groups.
    With ``by`` (config keys, e.g. ``("topology", "world_size")``): by the values of those keys
    only, whatever else differs; a group is named by those values ("algorithm" by its value
    alone, the others as key=value). Raises AggregateError for a key no run's config has."""
    by = _check_by(runs, by) if by is not None else None
    groups: dict[str, RunGroup] = {}
    for run in runs:
        if by is None:
            key = config_key(run.config)
            cfg = {k: v for k, v in run.config.items() if k not in NON_CONFIG_KEYS}
        else:
            cfg = {k: run.config.get(k) for k in by}
            key = canonical([cfg[k] for k in by])
        if key not in groups:
            groups[key] = RunGroup(key=key, config=cfg, runs=[], by=by)
        groups[key].runs.append(run)
    out = list(groups.values())
    if by is None:
        keys = sorted({k for g in out for k in g.config} - {"algorithm"} - DERIVED_KEYS)
        differing = [k for k in keys if len({canonical(g.config.get(k)) for g in out}) > 1]
    for g in out:
        if by is None:
            alg = str(g.config.get("algorithm") or g.runs[0].algorithm)
            g.values = {"algorithm": alg, **{k: g.config.get(k) for k in differing}}
        else:
            g.values = dict(g.config)
        g.name = _name(g.values)
        g.label = textwrap.fill(g.name, width=60, subsequent_indent="  ")
        if len(g.runs) > 1:
            g.label += f" ({len(g.runs)} {'seeds' if by is None else 'runs'})"
    return out


#: Per-run summary columns that groups.csv summarises over each group's runs (mean, std, min,
#: max), before the target columns of the targets given.
GROUP_METRICS = ("final_test_acc_leader", "final_test_acc_mean", "training_time",
                 "total_bytes_sent", "total_bytes_recv", "steps", "final_consensus_distance",
                 "mean_consensus_distance")
STATS = ("mean", "std", "min", "max")


def group_metrics(targets: Targets | None = None) -> tuple[str, ...]:
    """The summary columns groups.csv summarises: GROUP_METRICS, then time, steps and bytes
    to each target given."""
    extra = tuple(c for c in (targets.columns() if targets else ())
                  if not c.startswith("target_"))
    return GROUP_METRICS + extra


def group_columns(groups: list[RunGroup], targets: Targets | None = None) -> list[str]:
    """groups.csv's columns: group (its name), the key columns (the --by keys, or algorithm
    plus the options that differ), n_runs, runs, then <metric>_<stat> for each metric of
    group_metrics and each stat of STATS, and n_reached_acc / n_reached_loss with targets."""
    keys: list[str] = []
    for g in groups:
        keys += [k for k in g.values if k not in keys]
    cols = ["group", *keys, "n_runs", "runs"]
    cols += [f"{m}_{st}" for m in group_metrics(targets) for st in STATS]
    if targets and targets.acc is not None:
        cols.append("n_reached_acc")
    if targets and targets.loss is not None:
        cols.append("n_reached_loss")
    return cols


def _stats(values: list) -> dict[str, float]:
    """mean, std (sample standard deviation, n - 1; NaN for one value), min, max over the
    finite values; NaN each when there is none."""
    a = np.asarray([v for v in values if v is not None], dtype=float)
    a = a[np.isfinite(a)]
    if not len(a):
        return {st: math.nan for st in STATS}
    return {"mean": float(a.mean()), "std": float(a.std(ddof=1)) if len(a) > 1 else math.nan,
            "min": float(a.min()), "max": float(a.max())}


def group_table(groups: list[RunGroup], summary: list[dict],
                targets: Targets | None = None) -> list[dict]:
    """groups.csv: one row per group (columns: group_columns) from the runs' summary rows
    (``summary`` in the order of the runs, as summarize_run returns them). A time to target
    is summarised over the runs that reached the target; n_reached_* says how many did."""
    by_run = {row["run"]: row for row in summary}
    out = []
    for g in groups:
        rows = [by_run[r.name] for r in g.runs]
        row: dict[str, Any] = {"group": g.name, **g.values, "n_runs": len(rows),
                               "runs": " ".join(r.name for r in g.runs)}
        for m in group_metrics(targets):
            for st, v in _stats([r.get(m) for r in rows]).items():
                row[f"{m}_{st}"] = v
        if targets and targets.acc is not None:
            row["n_reached_acc"] = sum(r.get("steps_to_target_acc") is not None for r in rows)
        if targets and targets.loss is not None:
            row["n_reached_loss"] = sum(r.get("steps_to_target_loss") is not None for r in rows)
        out.append(row)
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
             groups: list[RunGroup] | None = None, targets: Targets | None = None) -> list[Path]:
    """The PLOTS: one line per group (mean over its runs) with a min-max band, and the target
    accuracy / loss as a dashed horizontal line when given."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import EngFormatter

    groups = groups if groups is not None else group_runs(runs)
    by = groups[0].by if groups else None
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
        target = (targets.acc if y == "test_accuracy" else targets.loss) if targets else None
        if target is not None:
            ax.axhline(target, color="0.3", ls="--", lw=1,
                       label=f"target {'accuracy' if y == 'test_accuracy' else 'loss'} "
                             f"{target:g}")
        ax.set_xlabel(_XLABEL[x])
        ax.set_ylabel(_YLABEL[y][:-1] + ", smoothed)" if smoothed else _YLABEL[y])
        if x == "bytes_sent":
            ax.xaxis.set_major_formatter(EngFormatter(unit="B"))
        ax.set_title(f"{_YLABEL[y].split(' (')[0]} vs {_XLABEL[x].split(',')[0].split(' (')[0]}"
                     + (f"  (band: min-max over {'seeds' if by is None else 'runs'})"
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

def _predictions_rows(predictions: str | os.PathLike | Sequence[dict]) -> list[dict]:
    if isinstance(predictions, (str, os.PathLike)):
        return read_predictions(predictions)
    return [dict(r) for r in predictions]


def aggregate(run_dirs: Iterable[str | os.PathLike], out_dir: str | os.PathLike | None = None,
              *, by: Sequence[str] | None = None, target_acc: float | None = None,
              target_loss: float | None = None, target_figure: str = "mean",
              loss_window: int = 1,
              predictions: str | os.PathLike | Sequence[dict] | None = None,
              plot_measured: Sequence[str] | None = None,
              warn: Callable[[str], None] = _warn) -> dict:
    """Read the runs, compute the tables and, unless ``out_dir`` is None, write them with the
    plots into ``out_dir``: summary.csv, groups.csv, curves.csv, the PLOTS, and with
    ``predictions`` correlations.csv and one ``pred_<predictor>_vs_<figure>.png`` each.

    by: config keys to group on (group_runs). target_acc / target_figure, target_loss /
    loss_window: see Targets. predictions: a CSV path or rows (dicts) whose first columns are
    the ``by`` keys (lsgd_hpc.predictions); needs ``by``; the predictors are added to the rows
    of groups.csv. plot_measured: measured figures (group_metrics names) to plot each
    predictor against (default: predictions.default_plot_measured; a ``predicted_<figure>``
    predictor is always plotted against <figure>).

    Returns {"runs", "summary" (rows), "summary_columns", "groups" (RunGroup), "group_rows",
    "group_columns", "predictors", "correlations" (rows), "plots" (paths), "curve_rows"}.
    Raises AggregateError on bad input (nothing readable, an unknown key or figure)."""
    targets = Targets(acc=target_acc, loss=target_loss, figure=target_figure,
                      loss_window=loss_window)
    if predictions is not None and not by:
        raise AggregateError("predictions are joined on the grouping keys: give --by too")
    runs = read_runs(run_dirs, warn=warn)
    groups = group_runs(runs, by)
    summary = [summarize_run(r, targets) for r in runs]
    group_rows = group_table(groups, summary, targets)
    columns = group_columns(groups, targets)
    predictors: list[str] = []
    correlations: list[dict] = []
    figures = group_metrics(targets)
    if predictions is not None:
        try:
            predictors, group_rows = join_predictions(group_rows, _predictions_rows(predictions),
                                                      list(by), warn)
        except PredictionsError as exc:
            raise AggregateError(str(exc)) from None
        columns += predictors
        correlations = correlation_table(group_rows, predictors, figures)
    unknown = [f for f in (plot_measured or ()) if f not in figures]
    if unknown:
        raise AggregateError(f"cannot plot against {', '.join(unknown)}: measured figures are "
                             f"{', '.join(figures)}")
    result = {"runs": runs, "summary": summary, "summary_columns": summary_columns(targets),
              "groups": groups, "group_rows": group_rows, "group_columns": columns,
              "predictors": predictors, "correlations": correlations, "plots": [],
              "curve_rows": 0}
    if out_dir is None:
        return result
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise AggregateError(f"--out {out} exists and is not a directory")
    try:
        out.mkdir(parents=True, exist_ok=True)
        write_table_csv(summary, summary_columns(targets), out / "summary.csv")
        write_table_csv(group_rows, columns, out / "groups.csv")
        result["curve_rows"] = write_curves_csv(runs, out / "curves.csv")
        result["plots"] = plot_all(runs, out, groups, targets)
        if predictions is not None:
            write_table_csv(correlations, CORRELATION_COLUMNS, out / "correlations.csv")
            for p in predictors:
                against = list(plot_measured or default_plot_measured(group_rows))
                own = p[len("predicted_"):] if p.startswith("predicted_") else None
                if own in figures and own not in against:
                    against.insert(0, own)
                for f in against:
                    path = plot_predicted_vs_measured(group_rows, p, f, out)
                    if path is not None:
                        result["plots"].append(path)
    except OSError as exc:
        raise AggregateError(f"cannot write to {out}: {exc.strerror or exc}") from None
    return result


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2 (argparse prints usage too by default)
        print(f"{PROG}: error: {message}", file=sys.stderr)
        raise SystemExit(2)


def _first_paragraph_rules() -> str:
    doc = __doc__ or ""
    start = doc.find("Per-evaluation figures")
    end = doc.find("Plots:")
    return doc[start:end].strip() if start >= 0 and end > start else ""


def _keys(text: str) -> list[str]:
    keys = [k.strip() for k in text.split(",") if k.strip()]
    if not keys:
        raise argparse.ArgumentTypeError("expected KEY[,KEY...]")
    return keys


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m lsgd_hpc.aggregate",
                description="Aggregate lsgd_hpc runs into summary.csv, groups.csv, curves.csv "
                            "and plots; with --predictions, rank-correlate predictions with "
                            "the measurements (correlations.csv) and plot one against the other.",
                epilog=_first_paragraph_rules() + "\n\nPlots show the per-evaluation mean over "
                "ranks; runs differing only in seed (or, with --by, sharing the --by values) "
                "are one line (mean) with a min-max band.",
                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR",
                   help="run directory (holds metrics/rank*.h5), or a directory of runs")
    p.add_argument("--out", required=True, metavar="DIR", help="output directory")
    p.add_argument("--by", type=_keys, metavar="KEY[,KEY...]",
                   help="group runs by these config keys (e.g. algorithm,world_size) instead of "
                        "by configuration minus seed")
    p.add_argument("--target-acc", type=float, metavar="X",
                   help="time, steps and bytes to the first evaluation with test accuracy >= X "
                        "(a fraction)")
    p.add_argument("--target-figure", choices=ACCURACY_FIGURES, default="mean",
                   help="which test accuracy --target-acc is about: mean over ranks (default), "
                        "the leader figure, or the best worker")
    p.add_argument("--target-loss", type=float, metavar="Y",
                   help="time, steps and bytes to the first logged step with training loss "
                        "(mean over ranks) <= Y")
    p.add_argument("--loss-window", type=int, default=1, metavar="N",
                   help="--target-loss on the training loss averaged over the last N logged "
                        "steps (default 1: the step's own)")
    p.add_argument("--predictions", metavar="FILE.csv",
                   help="predictions to compare with the measurements: the --by key columns, "
                        "then one column per predictor; writes correlations.csv and "
                        "pred_<predictor>_vs_<figure>.png")
    p.add_argument("--plot-measured", type=_keys, metavar="FIGURE[,FIGURE...]",
                   help="measured figures to plot each predictor against (e.g. "
                        "time_to_target_loss,mean_consensus_distance; default the time to the "
                        "target loss, else accuracy, else the training time)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        res = aggregate(args.run_dirs, args.out, by=args.by, target_acc=args.target_acc,
                        target_loss=args.target_loss, target_figure=args.target_figure,
                        loss_window=args.loss_window, predictions=args.predictions,
                        plot_measured=args.plot_measured)
    except AggregateError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    extra = f", correlations.csv ({len(res['correlations'])} rows)" if args.predictions else ""
    print(f"{PROG}: {len(res['runs'])} run(s) in {len(res['groups'])} group(s) -> "
          f"{Path(args.out) / 'summary.csv'}, groups.csv, curves.csv ({res['curve_rows']} rows)"
          f"{extra}, {len(res['plots'])} plots")
    return 0


if __name__ == "__main__":
    sys.exit(main())
