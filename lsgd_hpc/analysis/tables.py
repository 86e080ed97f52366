"""Per-run tables and figures of the aggregator: the evaluation and training tables over
ranks, the leader figure, time to a target, consensus figures, the summary.csv row, and the
CSV writers (summary.csv, curves.csv). The rules are in lsgd_hpc.analysis.aggregate's
docstring."""

from __future__ import annotations

import csv
import math
import os
import warnings
from collections import Counter
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

import numpy as np

from lsgd_hpc.analysis.rundir import AggregateError, Run, col, completion_state
from lsgd_hpc.ranklists import format_ranks

__all__ = ["SUMMARY_COLUMNS", "CURVE_COLUMNS", "FAULT_COLUMNS", "fault_rows", "write_faults_csv", "ACCURACY_FIGURES", "TARGET_ACC_COLUMNS",
           "TARGET_LOSS_COLUMNS", "Targets", "global_elections", "leader_rule", "eval_table",
           "train_table", "time_to_accuracy", "time_to_loss", "consensus_figures",
           "summarize_run", "leader_counts", "summary_columns", "write_table_csv",
           "write_summary_csv", "curve_rows", "write_curves_csv", "WORKER_COLUMNS",
           "NODE_COLUMNS", "has_node_traffic"]

SUMMARY_COLUMNS = (
    "run", "algorithm", "world_size", "n_nodes", "epochs", "seed", "wall_time", "training_time",
    "final_test_acc_leader", "final_test_acc_mean", "final_test_acc_best",
    "best_test_acc_leader", "best_test_acc_mean", "best_test_acc_best",
    "total_bytes_sent", "total_bytes_recv", "steps", "final_consensus_distance",
    "mean_consensus_distance", "failures", "lost_ranks", "complete",
)
#: faults.csv: one row per recovery from lost ranks (docs/metrics.md, /faults)
FAULT_COLUMNS = ("run", "step", "wall_time", "lost_ranks", "n_lost", "world_size_after",
                 "recovery_seconds", "lost_nodes", "replaced_ranks", "replace_seconds",
                 "replaced_nodes")
#: summary.csv's columns for runs with workers that span ranks (--worker-ranks), after
#: SUMMARY_COLUMNS: the workers, and the traffic inside them (total_bytes_sent stays the
#: method's own, between workers)
WORKER_COLUMNS = ("n_workers", "total_worker_bytes_sent")
#: summary.csv's column for runs whose compressed allreduces were hierarchical (node_* columns
#: in /train), after WORKER_COLUMNS: the float32 traffic inside the nodes (total_bytes_sent
#: stays what crossed between the nodes)
NODE_COLUMNS = ("total_node_bytes_sent",)
CURVE_COLUMNS = ("run", "rank", "step", "wall_time", "metric", "value")


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
    n_ranks, n_workers (workers among them), complete (every readable rank evaluated),
    wall_time and training_time (max over ranks; NaN where the files have no training time),
    bytes_sent (total over readable ranks of the cumulative counter at that step),
    acc_mean, acc_best, acc_leader, leader_rank (-1 for the centre), loss_mean.

    The unit is the worker: with workers that span ranks (--worker-ranks) the ranks of a
    worker hold one replica, so acc_mean, acc_best and loss_mean are over workers (each
    worker's figure is its lowest readable rank's); without, every rank is a worker."""
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
    worker_of = run.worker_of
    rule = leader_rule(run)
    el_steps, el_leader = global_elections(run)
    bytes_cols = {r: (col(d, "train", "step", np.int64), col(d, "train", "comm_bytes_sent"))
                  for r, d in run.ranks.items()}
    rows: dict[str, list] = {k: [] for k in (
        "step", "n_ranks", "n_workers", "complete", "wall_time", "training_time",
        "bytes_sent", "acc_mean",
        "acc_best",
        "acc_leader", "leader_rank", "loss_mean")}
    for s in all_steps:
        have = {r: m[s] for r, m in per_rank.items() if s in m}
        workers: dict[int, tuple] = {}        # worker -> its lowest readable rank's figures
        for r in sorted(have):
            workers.setdefault(worker_of[r], have[r])
        accs = np.array([v[0] for v in workers.values()])
        alive = run.alive(s)
        if rule == "centre":
            lr = -1
            lacc = centre.get(s, np.nan)
        else:
            lr = alive[0] if alive else 0        # rank 0, or the lowest survivor once it is lost
            if rule == "elected":
                lr = int(_value_at(el_steps, el_leader, s, default=0))
            lacc = have[lr][0] if lr in have else np.nan
        total_bytes = 0.0
        for r, (st, b) in bytes_cols.items():
            n = min(len(st), len(b))
            total_bytes += float(_value_at(st[:n], b[:n], s, default=0.0))
        rows["step"].append(s)
        rows["n_ranks"].append(len(have))
        rows["n_workers"].append(len(workers))
        rows["complete"].append(set(alive) <= set(have))   # every rank still training
        rows["wall_time"].append(_nanmax(np.array([v[2] for v in have.values()])))
        rows["training_time"].append(_nanmax(np.array([v[3] for v in have.values()])))
        rows["bytes_sent"].append(total_bytes)
        rows["acc_mean"].append(float(np.mean(accs)))
        rows["acc_best"].append(float(np.max(accs)))
        rows["acc_leader"].append(float(lacc))
        rows["leader_rank"].append(lr)
        rows["loss_mean"].append(float(np.mean([v[1] for v in workers.values()])))
    dtypes = {"step": np.int64, "n_ranks": np.int64, "n_workers": np.int64, "complete": bool,
              "leader_rank": np.int64}
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
    if not run.gaps:
        common = sorted(set.intersection(*(set(st.tolist()) for st, _ in per_rank))) \
            if per_rank else []
    else:
        # a rank lost at step k (on_failure="shrink") is not waited for from k on, nor
        # until its replacement took over (on_failure="heal")
        ranks = list(run.ranks)
        have = [set(st.tolist()) for st, _ in per_rank]
        common = sorted(s for s in set().union(*have)
                        if all(s in h for r, h in zip(ranks, have) if r in run.alive(s)))
    grid = np.asarray(common, dtype=np.int64)
    picked = []
    for steps, cols in per_rank:
        first = {int(s): i for i, s in reversed(list(enumerate(steps)))}  # first row of a step
        idx = np.asarray([first.get(int(s), -1) for s in grid], dtype=np.int64)
        row = {k: np.where(idx >= 0, v[np.maximum(idx, 0)] if len(v) else np.nan, np.nan)
               for k, v in cols.items()}
        if (idx < 0).any():               # a lost rank: its counter stays where it stopped
            sent = cols["comm_bytes_sent"]
            row["comm_bytes_sent"] = np.where(idx >= 0, row["comm_bytes_sent"],
                                              sent[-1] if len(sent) else 0.0)
        picked.append(row)
    if not picked:
        e = np.zeros(0)
        return {"step": grid, "loss_mean": e, "training_time": e, "wall_time": e,
                "bytes_sent": e}
    stack = {k: np.vstack([p[k] for p in picked]) for k in picked[0]}
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)     # all-NaN columns of lost ranks
        if not run.gaps:
            return {"step": grid, "loss_mean": stack["loss"].mean(0),
                    "training_time": np.max(stack["training_time"], 0),
                    "wall_time": np.max(stack["wall_time"], 0),
                    "bytes_sent": stack["comm_bytes_sent"].sum(0)}
        return {"step": grid, "loss_mean": np.nanmean(stack["loss"], 0),
                "training_time": np.nanmax(stack["training_time"], 0),
                "wall_time": np.nanmax(stack["wall_time"], 0),
                "bytes_sent": np.nansum(stack["comm_bytes_sent"], 0)}


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
    """The summary.csv row of a run (the rules: lsgd_hpc.analysis.aggregate's docstring)."""
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
    if run.has_workers:
        row["n_workers"] = run.n_workers
        inside = [_last(col(d, "train", "worker_bytes_sent", np.int64))
                  for d in run.ranks.values()]
        row["total_worker_bytes_sent"] = int(sum(int(b) for b in inside if b is not None))
    if has_node_traffic(run):
        inside = [_last(col(d, "train", "node_bytes_sent", np.int64))
                  for d in run.ranks.values()]
        row["total_node_bytes_sent"] = int(sum(int(b) for b in inside if b is not None))
    row["final_consensus_distance"], row["mean_consensus_distance"] = consensus_figures(run)
    row["failures"] = len([ev for ev in run.faults() if ev["lost_ranks"]])
    row["lost_ranks"] = format_ranks(run.lost_ranks)
    # complete / stopped (on purpose) / incomplete: the run's completion record
    row["complete"] = completion_state(run.completion)
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


def summary_columns(targets: Targets | None = None, workers: bool = False,
                    nodes: bool = False) -> tuple[str, ...]:
    """summary.csv's columns: SUMMARY_COLUMNS, then (``workers``: some run has workers that
    span ranks) WORKER_COLUMNS, then (``nodes``: some run has node_* columns,
    has_node_traffic) NODE_COLUMNS, then the target columns of the targets given."""
    return (SUMMARY_COLUMNS + (WORKER_COLUMNS if workers else ())
            + (NODE_COLUMNS if nodes else ()) + (targets.columns() if targets else ()))


def has_node_traffic(run: Run) -> bool:
    """Whether the run's files have the node_* columns of /train: the float32 traffic inside
    the node of hierarchical compressed allreduces (docs/metrics.md)."""
    return any("node_bytes_sent" in d.get("train", {}) for d in run.ranks.values())


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
    write_table_csv(rows, summary_columns(targets, any(r.has_workers for r in runs),
                                          any(has_node_traffic(r) for r in runs)), path)
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
                                    ("worker_bytes_sent", "worker_bytes_sent", np.int64),
                                    ("node_bytes_sent", "node_bytes_sent", np.int64),
                                    ("training_time", "training_time", float)):
            if name in ("worker_bytes_sent", "node_bytes_sent") and \
                    name not in d.get("train", {}):
                continue
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


def fault_rows(runs: list[Run]) -> list[dict]:
    """faults.csv's rows: every run's recoveries from lost ranks (lost_ranks as '1,3',
    lost_nodes and replaced_nodes as 'nodeA,nodeB')."""
    lists = ("lost_ranks", "lost_nodes", "replaced_ranks", "replaced_nodes")
    return [{"run": run.name, **{k: v for k, v in ev.items() if k not in lists},
             "lost_ranks": format_ranks(ev["lost_ranks"]),
             "lost_nodes": ",".join(ev.get("lost_nodes") or []),
             "replaced_ranks": format_ranks(ev.get("replaced_ranks") or []),
             "replaced_nodes": ",".join(ev.get("replaced_nodes") or [])}
            for run in runs for ev in run.faults()]


def write_faults_csv(runs: list[Run], path: str | os.PathLike) -> int:
    rows = fault_rows(runs)
    write_table_csv(rows, FAULT_COLUMNS, path)
    return len(rows)
