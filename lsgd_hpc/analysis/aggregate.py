"""Offline aggregation of lsgd_hpc runs: ``python -m lsgd_hpc.aggregate RUN_DIR ... --out DIR``.

Reads every ``RUN_DIR/metrics/rank%05d.h5`` (read-only, h5py) and writes

* ``DIR/summary.csv``  one row per run (columns: ``summary_columns``);
* ``DIR/groups.csv``   one row per group of runs (columns: ``group_columns``): n_runs and the
  mean, std, min and max over its runs of the figures in ``group_metrics``;
* ``DIR/curves.csv``   tidy rows ``run, rank, step, wall_time, metric, value``;
* ``DIR/faults.csv``   only when some run lost ranks (``on_failure="shrink"``): one row per
  recovery (columns: ``FAULT_COLUMNS``); such a run's summary.csv row counts them
  (``failures``) and names the lost ranks (``lost_ranks``, initial numbering, e.g. "1,3").
  A lost rank's file holds its rows up to its last flush; from the step of its recovery on
  the run's figures wait for the survivors only (an evaluation is complete when every rank
  still training wrote it; a method without elections is reported by its lowest surviving
  rank);
  the ``complete`` column says whether the run completed its budget, from its completion
  record (``RUN_DIR/complete.json``): ``complete``, ``stopped`` (on purpose: preempted or
  signalled, a checkpoint and exit) or ``incomplete`` (no record: its ranks crashed or were
  killed); each run that did not complete gets one warning line on stderr;
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

Per-evaluation figures (one evaluation = one ``/eval`` step), over workers: a worker is a rank,
or, for a run with workers that span ranks (``--worker-ranks``; its files carry
``worker_index``), the ranks of one worker, which hold one replica (its figure is its lowest
readable rank's):

* ``mean``: mean test accuracy over the workers that evaluated at that step;
* ``best``: the maximum over those workers;
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
Bytes are the method's own traffic (between workers); a run with workers that span ranks
adds ``n_workers`` and ``total_worker_bytes_sent`` (the sum over ranks of the last
``worker_bytes_sent``: the traffic inside the workers) to summary.csv (both columns, empty
for runs without workers, whenever one of the runs has them). A run whose compressed
allreduces were hierarchical (the node_* columns of /train) adds ``total_node_bytes_sent``
(the sum over ranks of the last ``node_bytes_sent``: the float32 traffic inside the nodes;
``total_bytes_sent`` is then what crossed between them), likewise.

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
import os
import sys
from pathlib import Path
from typing import Callable, Iterable, Sequence

from lsgd_hpc.analysis.groups import (DERIVED_KEYS, GROUP_METRICS, STATS, RunGroup, config_key,
                                      group_columns, group_metrics, group_runs, group_table)
from lsgd_hpc.analysis.plots import PLOTS, band, plot_all, run_curve
from lsgd_hpc.analysis.predictions import (CORRELATION_COLUMNS, PredictionsError,
                                           correlation_table, default_plot_measured,
                                           join_predictions, plot_predicted_vs_measured,
                                           read_predictions)
from lsgd_hpc.analysis.rundir import (GROUPS, KNOWN_SCHEMA_VERSIONS, NON_CONFIG_KEYS,
                                      AggregateError, Run, canonical, col, describe_completion,
                                      expand_run_dirs, read_rank_file, read_run,
                                      run_identities)
from lsgd_hpc.analysis.rundir import read_runs as _read_runs
# Part of this module's interface: the experiments rank predictors against measurements.
from lsgd_hpc.analysis.stats import rank_correlation
from lsgd_hpc.analysis.tables import (ACCURACY_FIGURES, CURVE_COLUMNS, FAULT_COLUMNS,
                                      SUMMARY_COLUMNS, fault_rows,
                                      TARGET_ACC_COLUMNS, TARGET_LOSS_COLUMNS, Targets,
                                      consensus_figures, curve_rows, eval_table,
                                      global_elections, has_node_traffic, leader_counts,
                                      leader_rule,
                                      summarize_run, summary_columns, time_to_accuracy,
                                      time_to_loss, train_table, write_curves_csv,
                                      write_summary_csv, write_table_csv)

__all__ = ["AggregateError", "Run", "RunGroup", "Targets", "GROUPS", "KNOWN_SCHEMA_VERSIONS",
           "NON_CONFIG_KEYS", "read_rank_file", "read_run", "read_runs", "expand_run_dirs",
           "run_identities", "col", "eval_table", "train_table", "time_to_accuracy",
           "time_to_loss", "consensus_figures", "summarize_run", "group_runs", "group_table",
           "group_metrics", "rank_correlation", "aggregate", "main"]

# The tables (lsgd_hpc.analysis.tables), groups (groups) and plots (plots) this program is
# built from stay importable from here, as they were before the split.
__all__ += ["DERIVED_KEYS", "GROUP_METRICS", "STATS", "config_key", "group_columns", "PLOTS",
            "band", "plot_all", "run_curve", "canonical", "ACCURACY_FIGURES", "CURVE_COLUMNS",
            "SUMMARY_COLUMNS", "TARGET_ACC_COLUMNS", "TARGET_LOSS_COLUMNS", "curve_rows",
            "global_elections", "leader_counts", "leader_rule", "summary_columns",
            "write_curves_csv", "write_summary_csv", "write_table_csv"]

PROG = "lsgd_hpc.aggregate"


def _warn(msg: str) -> None:
    print(f"{PROG}: warning: {msg}", file=sys.stderr)


def read_runs(paths: Iterable[str | os.PathLike],
              warn: Callable[[str], None] = _warn) -> list[Run]:
    """lsgd_hpc.analysis.rundir.read_runs, warnings prefixed with this program's name by default."""
    return _read_runs(paths, warn=warn)


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
    result = _tables(read_runs(run_dirs, warn=warn), targets, by, predictions, plot_measured,
                     warn)
    if out_dir is not None:
        _write_outputs(result, Path(out_dir), targets, predictions, plot_measured)
    return result


def _tables(runs: list[Run], targets: Targets, by: Sequence[str] | None,
            predictions: str | os.PathLike | Sequence[dict] | None,
            plot_measured: Sequence[str] | None, warn: Callable[[str], None]) -> dict:
    """aggregate's result before anything is written (``plots`` empty, ``curve_rows`` 0):
    the runs' summary rows (a warning for each run that did not complete its budget), the
    groups' rows with the predictors joined on, and the correlations."""
    groups = group_runs(runs, by)
    summary = [summarize_run(r, targets) for r in runs]
    for run, row in zip(runs, summary):       # its figures are of part of its budget
        if row["complete"] != "complete":
            warn(f"run {run.name} did not complete its budget: "
                 f"{describe_completion(run.completion, run)}")
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
    with_workers = any(r.has_workers for r in runs)
    with_nodes = any(has_node_traffic(r) for r in runs)
    return {"runs": runs, "summary": summary,
            "summary_columns": summary_columns(targets, with_workers, with_nodes),
            "groups": groups, "group_rows": group_rows, "group_columns": columns,
            "predictors": predictors, "correlations": correlations, "plots": [],
            "curve_rows": 0, "faults": fault_rows(runs)}


def _write_outputs(result: dict, out: Path, targets: Targets,
                   predictions: str | os.PathLike | Sequence[dict] | None,
                   plot_measured: Sequence[str] | None) -> None:
    """Write ``result``'s tables and plots into ``out`` (made if need be); fills in
    ``result["curve_rows"]`` and ``result["plots"]``."""
    if out.exists() and not out.is_dir():
        raise AggregateError(f"--out {out} exists and is not a directory")
    try:
        out.mkdir(parents=True, exist_ok=True)
        write_table_csv(result["summary"], result["summary_columns"], out / "summary.csv")
        write_table_csv(result["group_rows"], result["group_columns"], out / "groups.csv")
        result["curve_rows"] = write_curves_csv(result["runs"], out / "curves.csv")
        if result["faults"]:                 # runs that lost ranks (on_failure="shrink")
            write_table_csv(result["faults"], FAULT_COLUMNS, out / "faults.csv")
        result["plots"] = plot_all(result["runs"], out, result["groups"], targets)
        if predictions is not None:
            write_table_csv(result["correlations"], CORRELATION_COLUMNS, out / "correlations.csv")
            result["plots"].extend(_prediction_plots(result["group_rows"], result["predictors"],
                                                     group_metrics(targets), plot_measured, out))
    except OSError as exc:
        raise AggregateError(f"cannot write to {out}: {exc.strerror or exc}") from None


def _prediction_plots(group_rows: list[dict], predictors: list[str], figures: Sequence[str],
                      plot_measured: Sequence[str] | None, out: Path) -> list:
    """One ``pred_<predictor>_vs_<figure>.png`` per predictor and measured figure to plot it
    against (``plot_measured``, or the default ones; a ``predicted_<figure>`` predictor is
    always plotted against <figure>); the paths of those written."""
    paths = []
    for p in predictors:
        against = list(plot_measured or default_plot_measured(group_rows))
        own = p[len("predicted_"):] if p.startswith("predicted_") else None
        if own in figures and own not in against:
            against.insert(0, own)
        for f in against:
            path = plot_predicted_vs_measured(group_rows, p, f, out)
            if path is not None:
                paths.append(path)
    return paths


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
    if res["faults"]:
        hit = sorted({f["run"] for f in res["faults"]})
        extra += (f", faults.csv ({len(res['faults'])} recoveries from lost ranks in "
                  f"{len(hit)} run(s): {', '.join(hit[:5])}{' ...' if len(hit) > 5 else ''})")
    print(f"{PROG}: {len(res['runs'])} run(s) in {len(res['groups'])} group(s) -> "
          f"{Path(args.out) / 'summary.csv'}, groups.csv, curves.csv ({res['curve_rows']} rows)"
          f"{extra}, {len(res['plots'])} plots")
    return 0


if __name__ == "__main__":
    sys.exit(main())
