"""Short human summary of one run: ``python -m lsgd_hpc.summary RUN_DIR``; with ``--follow``
the progress of a running one (lsgd_hpc/analysis/follow.py).

Prints where the metrics files are, one line per rank (node, final training loss, final
test accuracy, times elected global leader, bytes sent), then the final global leader
and its test accuracy and the mean test accuracy over workers. The leader rule is the one of
``lsgd_hpc.aggregate`` (EASGD: the centre; methods without elections: rank 0). A run with
workers that span ranks (--worker-ranks) shows each rank's worker and the bytes it sent
inside it; its workers are the unit of the mean and the best (one replica per worker).
A run whose compressed allreduces were hierarchical (the node_* columns of /train) shows each
rank's float32 bytes sent inside its node (node_bytes) beside bytes_sent (between nodes).
The last line says whether the run completed, from its completion record
(``RUN_DIR/complete.json``, lsgd_hpc.runtime.completion): ``completion: complete (600/600
steps)``, ``completion: stopped on purpose ...`` or ``completion: NOT COMPLETE: ...``.

``--check`` makes the exit status say it: 0 when the record says complete, 1 otherwise (a
run stopped on purpose, or one without a record: its ranks crashed or were killed), with one
line on stderr saying why. ``mpirun --with-ft ulfm`` exits 0 whatever became of the ranks;
this is the check a job script runs after it (the SLURM templates do).
"""
from __future__ import annotations

import argparse
import math
import os
import sys

import numpy as np

from lsgd_hpc.analysis.rundir import (AggregateError, Run, col, completion_state,
                                      describe_completion, read_run)
from lsgd_hpc.analysis.formatting import fmt_acc, fmt_bytes, fmt_num
from lsgd_hpc.runtime.completion import read_completion
from lsgd_hpc.analysis.tables import (eval_table, global_elections, has_node_traffic,
                                      leader_counts, leader_rule)
from lsgd_hpc.ranklists import format_ranks

PROG = "lsgd_hpc.summary"


def format_summary(run: Run) -> str:
    lines = []
    files = sorted({d["path"] for d in run.ranks.values()} | {p for p, _ in run.skipped})
    skipped = f", {len(run.skipped)} skipped" if run.skipped else ""
    lines.append(f"metrics: {run.path / 'metrics'}/rank*.h5 ({len(files)} files{skipped})")
    workers = run.has_workers
    nodes = has_node_traffic(run)      # node_*: float32 traffic inside the node (comm_*: between)
    lines.append(f"run {run.name}: algorithm {run.algorithm}, {run.world_size} ranks on "
                 f"{run.n_nodes} node(s)" + (f", {run.n_workers} workers" if workers else ""))
    counts = leader_counts(run)
    tab = eval_table(run)
    faults, lost = run.faults(), run.lost_ranks
    for ev in faults:
        if ev.get("replaced_ranks"):
            on = ev.get("replaced_nodes") or []
            lines.append(f"heal: rank(s) {format_ranks(ev['replaced_ranks'])} replaced"
                         + (f" on node(s) {', '.join(on)}" if on else "") + "; "
                         f"{ev['world_size_after']} rank(s) from step {ev['step']} (pause "
                         f"{ev['recovery_seconds']:.2f} s, {ev['replace_seconds']:.1f} s "
                         "from the loss to the replacement's first step)")
            continue
        nodes = ev.get("lost_nodes") or []
        lines.append(f"failure: rank(s) {format_ranks(ev['lost_ranks'])} lost"
                     + (f" (node(s) {', '.join(nodes)} gone)" if nodes else "") + "; "
                     f"{ev['world_size_after']} rank(s) went on from step {ev['step']} "
                     f"(wall {ev['wall_time']:.1f} s, recovery {ev['recovery_seconds']:.2f} s)")
    lines.append(f"{'rank':>5} {'node':>5}" + (f" {'worker':>6}" if workers else "")
                 + f" {'train_loss':>11} {'test_acc':>9} {'times_leader':>14} "
                 f"{'bytes_sent':>12}" + (f" {'worker_bytes':>12}" if workers else "")
                 + (f" {'node_bytes':>12}" if nodes else "")
                 + ("  status" if lost else ""))
    for r in sorted(run.ranks):
        d = run.ranks[r]
        loss = col(d, "train", "loss")
        acc = col(d, "eval", "test_accuracy")
        sent = col(d, "train", "comm_bytes_sent")
        node = d["attrs"].get("node_index", "?")
        status = ""
        if lost:
            steps = col(d, "train", "step", np.int64)
            status = (f"  lost (recovery at step {lost[r]}; rows to step "
                      f"{int(steps[-1]) if len(steps) else 0})" if r in lost else "  ok")
        inside = col(d, "train", "worker_bytes_sent")
        in_node = col(d, "train", "node_bytes_sent")
        lines.append(f"{r:>5} {node!s:>5}"
                     + (f" {d['attrs'].get('worker_index', '?')!s:>6}" if workers else "")
                     + f" {fmt_num(loss[-1] if len(loss) else math.nan):>11} "
                     f"{fmt_acc(acc[-1] if len(acc) else math.nan):>9} "
                     f"{counts.get(r, 0):>14} {fmt_bytes(sent[-1] if len(sent) else 0):>12}"
                     + (f" {fmt_bytes(inside[-1] if len(inside) else 0):>12}" if workers else "")
                     + (f" {fmt_bytes(in_node[-1] if len(in_node) else 0):>12}" if nodes else "")
                     + status)
    use = tab["complete"] if tab["complete"].any() else np.ones(len(tab["step"]), bool)
    rule = leader_rule(run)
    verdict = f"completion: {describe_completion(run.completion, run)}"
    if not use.any():
        lines.append("final global leader: none (no evaluations logged)")
        lines.append(verdict)
        return "\n".join(lines)
    step = int(tab["step"][use][-1])
    lacc = float(tab["acc_leader"][use][-1])
    if rule == "elected":
        el_steps, _ = global_elections(run)
        lr = int(tab["leader_rank"][use][-1])
        lines.append(f"final global leader: rank {lr} (elected {counts.get(lr, 0)} times, "
                     f"{len(el_steps)} global elections), test accuracy {fmt_acc(lacc)} "
                     f"at step {step}")
    elif rule == "centre":
        lines.append(f"final global leader: none ({run.algorithm or 'EASGD'} reports its "
                     f"centre model), centre test accuracy {fmt_acc(lacc)} at step {step}")
    else:
        r0 = int(tab["leader_rank"][use][-1])
        lines.append(f"final global leader: none ({run.algorithm} has no elections; rank {r0} "
                     f"reports), rank {r0} test accuracy {fmt_acc(lacc)} at step {step}")
    over = (f"{int(tab['n_workers'][use][-1])} workers ({int(tab['n_ranks'][use][-1])} ranks)"
            if workers else f"{int(tab['n_ranks'][use][-1])} ranks")
    lines.append(f"mean test accuracy: {fmt_acc(float(tab['acc_mean'][use][-1]))} over {over}, "
                 f"best worker {fmt_acc(float(tab['acc_best'][use][-1]))}")
    lines.append(verdict)
    return "\n".join(lines)


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        print(f"{PROG}: error: {message}", file=sys.stderr)
        raise SystemExit(2)


def main(argv: list[str] | None = None) -> int:
    p = _Parser(prog="python -m lsgd_hpc.summary",
                description="Print a short summary of one lsgd_hpc run, or with --follow the "
                            "progress of a running one, one line per interval.")
    p.add_argument("run_dir", metavar="RUN_DIR")
    p.add_argument("--follow", action="store_true",
                   help="follow a running job: one progress line per --interval until the run "
                        "ends (exit 0), Ctrl-C (exit 0) or --timeout (exit 1); the rule that "
                        "says a run ended is in docs/metrics.md")
    p.add_argument("--interval", type=float, default=None, metavar="SECONDS",
                   help="with --follow: seconds between lines; default: 10")
    p.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                   help="with --follow: stop when no file of the run changed for this long; "
                        "default: none")
    p.add_argument("--check", action="store_true",
                   help="exit 0 when the run's completion record (RUN_DIR/complete.json) says "
                        "it completed its step budget, else 1 with one line on stderr saying "
                        "why (stopped on purpose, or no record: ranks crashed or were killed)")
    args = p.parse_args(argv)
    if args.check and args.follow:
        p.error("--check goes without --follow")
    if not args.follow and (args.interval is not None or args.timeout is not None):
        p.error("--interval and --timeout go with --follow")
    if args.follow:
        for name in ("interval", "timeout"):
            v = getattr(args, name)
            if v is not None and not (v > 0 and math.isfinite(v)):
                p.error(f"--{name}: must be a positive number of seconds, got {v:g}")
        from lsgd_hpc.analysis.follow import follow
        try:
            return follow(args.run_dir, interval=args.interval or 10.0, timeout=args.timeout,
                          prog=PROG)
        except KeyboardInterrupt:
            return 0
    if args.check:
        return check(args.run_dir)
    try:
        run = read_run(args.run_dir,
                       warn=lambda msg: print(f"{PROG}: warning: {msg}", file=sys.stderr))
    except AggregateError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    print(format_summary(run))
    return 0


def check(run_dir: str) -> int:
    """``--check``: the summary (or, without readable metrics, the completion line alone),
    then exit 0 when the record says complete, else 1 and one line on stderr."""
    record = read_completion(run_dir) if os.path.isdir(run_dir) else None
    run = None
    if os.path.isdir(run_dir):
        try:
            run = read_run(run_dir,
                           warn=lambda msg: print(f"{PROG}: warning: {msg}", file=sys.stderr))
        except AggregateError as exc:
            print(f"metrics: {exc}")
    if run is not None:
        print(format_summary(run))
    else:
        print(f"completion: {describe_completion(record)}")
    state = completion_state(record)
    if state == "complete":
        return 0
    if not os.path.isdir(run_dir):
        why = f"no run directory {run_dir} (the run never started)"
    elif state == "stopped":
        why = f"{run_dir}: not complete: {describe_completion(record, run)}"
    else:
        why = f"{run_dir}: {describe_completion(record, run)}"
    print(f"{PROG}: error: {why}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
