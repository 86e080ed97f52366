"""Methods, tuned: LSGD (both leader scores) against allreduce SGD, EASGD, local SGD, DiLoCo, SlowMo.

    python results/experiments/methods.py --out results/methods [--quick]
        [--seeds N] [--steps S] [--ranks 4 8] [--tasks digits noisy] [--label-noise P]
        [--no-tune] [--grid-size N]

Methods, each at every rank count of ``--ranks`` with ``--ranks-per-node 2`` (4 ranks = 2 nodes,
8 ranks = 4 nodes; the same ``--seed`` values for every method; by default the noisy task at 4
and 8 ranks, plain digits at 4 only):

* LSGD, single leader: ``--algorithm lsgd`` with all ranks as one node, so the only leader is
  the global one; LSGD, multi-leader: node leaders and the global one; each with the paper's
  election score (recent training loss) and with ``--leader-score heldout`` (loss on a fixed
  held-out slice of the training set);
* async LSGD: ``--algorithm lsgd-async`` (multi-leader, no worker waits for another's step);
* allreduce SGD (gradient averaging every step), EASGD, local SGD, DiLoCo (SGD with momentum
  as the inner optimizer, Nesterov outer SGD), SlowMo (on local SGD).

Tuning (GRIDS): every method gets the same budget, 8 settings: the learning rate times its own
communication period and its pull strength or outer step (allreduce SGD, which has no period,
gets 4 learning rates x 2 momenta; local SGD, which has no pull, 4 learning rates x 2 periods).
Each setting trains twice, with seeds 0 and 100 (not reported seeds), on the noisy task at the
smallest rank count; the setting whose reported model has the best mean accuracy on the
validation slice (``--validation-size 200``: training samples taken out of training, their
labels as noisy as the rest) at the end is chosen, and only the chosen settings run with the reported seeds, on
every task and rank count, and are reported on the test set. ``--no-tune``: defaults instead.

Tasks. ``digits``: the embedded digits as they are; every method reaches about 95 % on it, so it
shows cost, not quality. ``noisy``: digits with ``--label-noise P`` (default 0.4: 40 % of the
training labels replaced by a uniformly drawn wrong class, fixed per seed, the test set clean).
It was chosen as the task where the leader can matter: with noisy labels each worker's
minibatch gradients disagree strongly, so workers drift apart between pulls and the averaged
model (allreduce's, EASGD's centre, local SGD's mean) and the elected leader differ; the leader
is chosen by its recent training loss on noisy labels, which is exactly the signal that could
help (a worker that fits the clean structure) or mislead (a worker that memorizes noise). The
experiment measures which happens.

Figures per task and rank count: test accuracy of the model each method reports (LSGD: the
elected global leader; EASGD: the centre; allreduce and local SGD: rank 0) against training
time, training step and bytes sent by all ranks together; line = mean over seeds, band = min-max.
Tables: ``methods_grid.csv`` (every tuning run: setting, options, validation accuracy, bytes,
which was chosen), ``methods_runs.csv`` (one row per run) and ``methods_summary.csv`` (per task,
rank count and method: the chosen setting, final accuracy of the reported model and the mean over workers, mean and standard
deviation over seeds; training time; bytes sent and received; time, steps and bytes to the
target accuracy, over the seeds that reached it). Training time is the trainer's (evaluations
excluded). Bytes are the logical payload (docs/metrics.md): a broadcast counts its payload once
as sent (at the root) and once per receiver as received, an allreduce once per rank in both,
so "bytes sent" flatters broadcast-based methods (LSGD) by up to ranks - 1 against allreduce;
the findings give both ratios.
"""

from __future__ import annotations

import argparse
import math
import shutil
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _shared import (fmt_bytes, new_figure, raw_dir, save_figure, train_many,  # noqa: E402
                     write_csv)

from lsgd_hpc.analysis import aggregate

NAME = "methods"
TITLE = "Methods, tuned: LSGD against allreduce SGD, EASGD, local SGD, DiLoCo and SlowMo"

#: (label, options); ``{world}`` is replaced by the rank count (single leader = one node)
METHODS = [
    ("LSGD 1 leader", ["--algorithm", "lsgd", "--ranks-per-node", "{world}"]),
    ("LSGD multi-leader", ["--algorithm", "lsgd", "--ranks-per-node", "2"]),
    ("LSGD 1 leader, held-out score", ["--algorithm", "lsgd", "--ranks-per-node", "{world}",
                                       "--leader-score", "heldout"]),
    ("LSGD multi-leader, held-out score", ["--algorithm", "lsgd", "--ranks-per-node", "2",
                                           "--leader-score", "heldout"]),
    ("async LSGD", ["--algorithm", "lsgd-async", "--ranks-per-node", "2"]),
    ("allreduce SGD", ["--algorithm", "allreduce", "--ranks-per-node", "2"]),
    ("EASGD", ["--algorithm", "easgd", "--ranks-per-node", "2"]),
    ("local SGD", ["--algorithm", "local-sgd", "--ranks-per-node", "2"]),
    ("DiLoCo", ["--algorithm", "diloco", "--ranks-per-node", "2"]),
    ("SlowMo", ["--algorithm", "slowmo", "--slowmo-every", "40", "--ranks-per-node", "2"]),
]
LSGD_METHODS = ("LSGD 1 leader", "LSGD multi-leader", "LSGD 1 leader, held-out score",
                "LSGD multi-leader, held-out score", "async LSGD")
BASELINES = ("allreduce SGD", "EASGD", "local SGD", "DiLoCo", "SlowMo")
#: the held-out-score variant of each train-score LSGD method
HELDOUT_OF = {"LSGD 1 leader": "LSGD 1 leader, held-out score",
              "LSGD multi-leader": "LSGD multi-leader, held-out score"}


def _grid(*axes):
    """Every combination of the axes, the first axis varying slowest; an axis is a list of
    (label, options)."""
    out = [("", [])]
    for axis in axes:
        out = [(f"{a}, {b}" if a else b, oa + ob) for a, oa in out for b, ob in axis]
    return out


def _axis(name: str, option, values):
    """(label, options) per value; ``option``: one option name, or a function value -> options."""
    return [(f"{name} {v}", option(v) if callable(option) else [option, str(v)])
            for v in values]


_LR2, _LR4 = _axis("lr", "--lr", (0.05, 0.1)), _axis("lr", "--lr", (0.025, 0.05, 0.1, 0.2))
_SINGLE = _grid(_LR2, _axis("tau", lambda t: ["--tau-local", str(t), "--tau-global", str(t)],
                            (4, 20)),
                _axis("pull", lambda c: ["--pull-local", str(c), "--pull-global", str(c)],
                      (0.1, 0.3)))
_MULTI = _grid(_LR2, _axis("tau_L/tau_G", lambda t: ["--tau-local", str(t[0]), "--tau-global",
                                                     str(t[1])], ((4, 8), (10, 40))),
               _axis("pull", lambda c: ["--pull-local", str(c), "--pull-global", str(c)],
                     (0.1, 0.3)))
#: The tuning grid of every method: the learning rate times its own communication period and
#: its pull or outer step, 8 settings each (allreduce SGD, which has no period, and local SGD,
#: no pull: more learning rates instead). EASGD's alpha is given as beta = p alpha ({beta:B}).
#: Every period divides the full budget's 200 steps, so every run ends on a synchronisation.
GRIDS = {
    "LSGD 1 leader": _SINGLE,
    "LSGD multi-leader": _MULTI,
    "LSGD 1 leader, held-out score": _SINGLE,
    "LSGD multi-leader, held-out score": _MULTI,
    "async LSGD": _MULTI,
    "allreduce SGD": _grid(_LR4, _axis("momentum", "--momentum", (0.9, 0.5))),
    "EASGD": _grid(_LR2, _axis("tau", "--easgd-tau", (4, 20)),
                   _axis("beta", lambda b: ["--easgd-alpha", f"{{beta:{b}}}"], (0.9, 0.45))),
    "local SGD": _grid(_LR4, _axis("T", "--local-steps", (4, 20))),
    "DiLoCo": _grid(_LR2, _axis("H", "--local-steps", (8, 40)),
                    _axis("outer lr", "--outer-lr", (0.7, 1.0))),
    "SlowMo": _grid(_LR2, _axis("T", "--local-steps", (4, 20)),
                    _axis("beta", "--slowmo-beta", (0.5, 0.7))),
}
assert len({len(g) for g in GRIDS.values()}) == 1 and set(GRIDS) == {m for m, _ in METHODS}
#: what the grid is run on: one seed (not one of the reported seeds), this task, the smallest
#: rank count; the validation slice (training samples, noisy labels included) picks the setting
TUNE_TASK, VALIDATION_SIZE = "noisy", 200

#: task -> (extra trainer options given --label-noise P, target test accuracy, description)
TASKS = {
    "digits": (lambda p: [], 0.90, "digits"),
    "noisy": (lambda p: ["--label-noise", str(p)], 0.85, "digits, {pct:.0%} label noise"),
}

#: budgets; "tasks": rank count -> tasks run there (plain digits, which every method solves,
#: only at the smallest count: it shows cost, not quality, and 8 ranks on 2 cores are dear)
FULL = dict(seeds=3, steps=200, ranks=(4, 8), eval_every=20, grid=None, tune_seeds=(0, 100),
            tasks={4: ("digits", "noisy"), 8: ("noisy",)})
QUICK = dict(seeds=2, steps=60, ranks=(4,), eval_every=20, grid=2, tune_seeds=(0,),
             tasks={4: ("digits", "noisy")})

RUN_COLUMNS = ["task", "ranks", "nodes", "method", "seed", "final_acc_leader", "final_acc_mean",
               "training_time_s", "wall_time_s", "bytes_sent", "bytes_recv", "steps",
               "target_acc", "time_to_target_s", "steps_to_target", "bytes_to_target"]
SUMMARY_COLUMNS = ["task", "ranks", "nodes", "method", "setting", "seeds",
                   "final_acc_leader_mean", "final_acc_leader_std",
                   "final_acc_mean_mean", "final_acc_mean_std",
                   "training_time_s_mean", "training_time_s_std", "bytes_sent_mean",
                   "bytes_recv_mean",
                   "target_acc", "reached_target", "time_to_target_s_mean",
                   "steps_to_target_mean", "bytes_to_target_mean"]


def _slug(label: str) -> str:
    return label.lower().replace(" ", "-").replace("=", "")


def method_argv(opts, world: int):
    """Options with ``{world}`` -> the rank count and ``{beta:B}`` -> EASGD's alpha B / p."""
    out = []
    for o in opts:
        if o.startswith("{beta:"):
            o = f"{float(o[6:-1]) / world:.6g}"
        out.append(o.replace("{world}", str(world)))
    return out


def final_point(run, summary: dict, split: str = "test") -> dict:
    """The end of a run, from each rank's last evaluation (the trainer evaluates at a rank's last
    step). Under async LSGD ranks end at different steps, so the last evaluation that every rank
    reached (aggregate's ``final_*``) can be one interval earlier; this takes the ends instead.
    The reported model follows aggregate's rule: the last global election's winner, EASGD's
    centre, else rank 0."""
    acc, centre = f"{split}_accuracy", f"center_{split}_accuracy"
    last = {r: {c: aggregate.col(d, "eval", c)[-1] for c in (acc, centre)
                if len(aggregate.col(d, "eval", c))}
            for r, d in run.ranks.items()}
    rule = aggregate.leader_rule(run)
    if rule == "centre":
        leader = last[min(last)][centre]
    else:
        winners = aggregate.global_elections(run)[1]
        leader = last[int(winners[-1]) if rule == "elected" else 0][acc]
    return {"step": summary["steps"], "training_time": summary["training_time"],
            "bytes_sent": float(summary["total_bytes_sent"]), "acc_leader": float(leader),
            "acc_mean": statistics.fmean(float(v[acc]) for v in last.values())}


def curve_points(tab: dict, end: dict) -> dict:
    """Evaluation step (or "end") -> {step, training_time, bytes_sent, acc_leader}: the
    evaluations every rank reached, then the run's end (replacing an evaluation at its step)."""
    pts = {int(tab["step"][i]): {k: float(tab[k][i]) for k in ("step", "training_time",
                                                               "bytes_sent", "acc_leader")}
           for i in range(len(tab["step"])) if tab["complete"][i]}
    pts.pop(int(end["step"]), None)
    pts["end"] = {k: end[k] for k in ("step", "training_time", "bytes_sent", "acc_leader")}
    return pts


def to_target(points: dict, target: float):
    """(training time, step, bytes) at the first point whose reported model's test accuracy
    was >= target; Nones when there is none."""
    for p in points.values():
        if p["acc_leader"] >= target:
            return p["training_time"], int(p["step"]), p["bytes_sent"]
    return None, None, None


def read_runs(dirs: dict, target: dict) -> list:
    """Rows of methods_runs.csv, each with its run's curve points, from the runs' HDF5 files."""
    rows = []
    for (task, world, label, seed), d in dirs.items():
        run = aggregate.read_run(d)
        s = aggregate.summarize_run(run)
        end = final_point(run, s)
        points = curve_points(aggregate.eval_table(run), end)
        t, st, b = to_target(points, target[task])
        rows.append({"task": task, "ranks": world, "nodes": s["n_nodes"], "method": label,
                     "seed": seed, "final_acc_leader": end["acc_leader"],
                     "final_acc_mean": end["acc_mean"],
                     "training_time_s": s["training_time"], "wall_time_s": s["wall_time"],
                     "bytes_sent": s["total_bytes_sent"],
                     # what receivers got: a broadcast counts its payload once as sent (at
                     # the root) but once per receiver here, an allreduce once per rank in both
                     "bytes_recv": s["total_bytes_recv"],
                     "steps": s["steps"],
                     "target_acc": target[task], "time_to_target_s": t, "steps_to_target": st,
                     "bytes_to_target": b, "_points": points})
    return rows


def _mean(xs):
    xs = [x for x in xs if x is not None and not (isinstance(x, float) and math.isnan(x))]
    return statistics.fmean(xs) if xs else None


def _std(xs):
    xs = [x for x in xs if x is not None]
    return statistics.stdev(xs) if len(xs) > 1 else 0.0


def summarize(rows: list) -> list:
    out = []
    keys = list(dict.fromkeys((r["task"], r["ranks"], r["method"]) for r in rows))
    for task, world, label in keys:
        rs = [r for r in rows if (r["task"], r["ranks"], r["method"]) == (task, world, label)]
        hit = [r for r in rs if r["time_to_target_s"] is not None]
        out.append({
            "task": task, "ranks": world, "nodes": rs[0]["nodes"], "method": label,
            "seeds": len(rs),
            "final_acc_leader_mean": _mean(r["final_acc_leader"] for r in rs),
            "final_acc_leader_std": _std([r["final_acc_leader"] for r in rs]),
            "final_acc_mean_mean": _mean(r["final_acc_mean"] for r in rs),
            "final_acc_mean_std": _std([r["final_acc_mean"] for r in rs]),
            "training_time_s_mean": _mean(r["training_time_s"] for r in rs),
            "training_time_s_std": _std([r["training_time_s"] for r in rs]),
            "bytes_sent_mean": _mean(float(r["bytes_sent"]) for r in rs),
            "bytes_recv_mean": _mean(float(r["bytes_recv"]) for r in rs),
            "target_acc": rs[0]["target_acc"], "reached_target": f"{len(hit)}/{len(rs)}",
            "time_to_target_s_mean": _mean(r["time_to_target_s"] for r in hit),
            "steps_to_target_mean": _mean(r["steps_to_target"] for r in hit),
            "bytes_to_target_mean": _mean(r["bytes_to_target"] for r in hit),
        })
    return out


# ------------------------------------------------------------------------------------ plots

_AXES = [("training_time", "training time (s)", False),
         ("step", "training step (per rank)", False),
         ("bytes_sent", "bytes sent, all ranks (log scale)", True)]


def seed_band(points: list, x: str, log: bool):
    """Mean over seeds of (x, reported-model accuracy) at each point (evaluation step, then the
    end) that every seed has, and the min and max accuracy there. Seeds evaluate at the same
    steps, so the points pair up; on the time and bytes axes x is the seeds' mean."""
    keys = [k for k in points[0] if all(k in p for p in points[1:])]
    xs, mean, lo, hi = [], [], [], []
    for k in keys:
        xv = statistics.fmean(p[k][x] for p in points)
        if (log and xv <= 0) or math.isnan(xv):
            continue
        ys = [p[k]["acc_leader"] for p in points]
        xs.append(xv)
        mean.append(statistics.fmean(ys))
        lo.append(min(ys))
        hi.append(max(ys))
    return xs, mean, lo, hi


def plot(rows: list, task: str, world: int, desc: str, out: Path) -> str:
    """One figure of three panels (training time, step, bytes) for a task and rank count."""
    from matplotlib.ticker import EngFormatter

    fig, axes = new_figure(ncols=3, width=5.0, height=4.6)
    plotted = {x: False for x, _, _ in _AXES}
    for i, (label, _) in enumerate(METHODS):
        rs = [r for r in rows if (r["task"], r["ranks"], r["method"]) == (task, world, label)]
        if not rs:
            continue
        style = dict(color=f"C{i}", lw=1.8, marker="o", ms=3,
                     ls="-" if label in LSGD_METHODS else "--")
        for ax, (x, _, log) in zip(axes, _AXES):
            xs, mean, lo, hi = seed_band([r["_points"] for r in rs], x, log)
            plotted[x] |= bool(xs)
            ax.plot(xs, mean, label=label, **style)
            ax.fill_between(xs, lo, hi, color=style["color"], alpha=0.15, lw=0)
    for ax, (x, xlabel, log) in zip(axes, _AXES):
        ax.set_xlabel(xlabel)
        ax.set_ylabel("test accuracy of the reported model")
        if log and plotted[x]:        # (a log axis without data cannot draw its ticks)
            ax.set_xscale("log")
            ax.xaxis.set_major_formatter(EngFormatter(unit="B"))
    accs = [p["acc_leader"] for r in rows if (r["task"], r["ranks"]) == (task, world)
            for p in r["_points"].values()]
    for ax in axes:
        ax.set_ylim(max(0.0, min(min(accs, default=0.0), 0.5) - 0.02), 1.0)
    axes[1].legend(loc="lower right")
    fig.suptitle(f"{desc}, {world} ranks ({world // 2} nodes x 2): test accuracy of the model "
                 f"each method reports\n(LSGD: elected leader, EASGD: centre, others: rank 0); "
                 f"line: mean over {len({r['seed'] for r in rows})} seeds, band: min-max",
                 fontsize=11)
    name = f"methods_{task}_{world}ranks.png"
    save_figure(fig, out / name)
    return name


# --------------------------------------------------------------------------------- findings

def _pct(x) -> str:
    return "n/a" if x is None else f"{100 * x:.1f} %"


def _bytes(x) -> str:
    return "n/a" if x is None else fmt_bytes(x)


def findings(summary: list, descs: dict) -> list:
    """Sentences computed from the summary. "Equal" accuracy: the means differ by less than
    the larger of the two standard deviations over seeds (at least 0.5 points)."""
    out = []
    by = {(s["task"], s["ranks"], s["method"]): s for s in summary}
    for task, world in dict.fromkeys((s["task"], s["ranks"]) for s in summary):
        base = [by[(task, world, m)] for m in BASELINES if (task, world, m) in by]
        if not base:
            continue
        best = max(base, key=lambda s: s["final_acc_leader_mean"])
        ar = by.get((task, world, "allreduce SGD"))
        for m in LSGD_METHODS:
            s = by.get((task, world, m))
            if s is None:
                continue
            parts = []
            for ref in [best] + ([ar] if ar is not None and ar is not best else []):
                tol = max(s["final_acc_leader_std"], ref["final_acc_leader_std"], 0.005)
                diff = s["final_acc_leader_mean"] - ref["final_acc_leader_mean"]
                acc = ("better" if diff > tol else "equal" if diff >= -tol else "worse")
                ratio = s["bytes_sent_mean"] / ref["bytes_sent_mean"] if ref["bytes_sent_mean"] \
                    else math.inf
                verdict = "yes" if acc != "worse" and ratio < 1 else "no"
                recv = s["bytes_recv_mean"] / ref["bytes_recv_mean"] if ref["bytes_recv_mean"] \
                    else math.inf
                parts.append(f"vs {ref['method']} ({_pct(ref['final_acc_leader_mean'])}, "
                             f"{_bytes(ref['bytes_sent_mean'])}): accuracy {acc} "
                             f"({100 * diff:+.1f} points), bytes sent x{ratio:.2f} (received "
                             f"x{recv:.2f}) -> {verdict}")
            out.append(f"{descs[task]}, {world} ranks: {m} reached "
                       f"{_pct(s['final_acc_leader_mean'])} +- "
                       f"{100 * s['final_acc_leader_std']:.1f} with "
                       f"{_bytes(s['bytes_sent_mean'])}; equal or better accuracy with fewer "
                       f"bytes? " + "; ".join(parts) + ".")
        hit = [s for s in summary if (s["task"], s["ranks"]) == (task, world)
               and s["reached_target"].split("/")[0] == s["reached_target"].split("/")[1]]
        target = _pct(summary[0]["target_acc"] if not hit else hit[0]["target_acc"])
        if hit:
            cheapest = min(hit, key=lambda s: s["bytes_to_target_mean"])
            fastest = min(hit, key=lambda s: s["time_to_target_s_mean"])
            out.append(f"{descs[task]}, {world} ranks: of the methods whose reported model "
                       f"reached {target} in every seed, {cheapest['method']} needed the fewest "
                       f"bytes ({_bytes(cheapest['bytes_to_target_mean'])}) and "
                       f"{fastest['method']} the least training time "
                       f"({fastest['time_to_target_s_mean']:.2f} s); "
                       f"never or not in every seed: "
                       + (", ".join(f"{s['method']} ({s['reached_target']})" for s in summary
                                    if (s["task"], s["ranks"]) == (task, world) and s not in hit)
                          or "none") + ".")
        else:
            out.append(f"{descs[task]}, {world} ranks: no method's reported model reached "
                       f"{target} in every seed.")
    return out


# ------------------------------------------------------------------------------------- run

def _common(task: str, label_noise: float, steps: int, eval_every: int, seed: int, d) -> list:
    return ["--dataset", "digits", *TASKS[task][0](label_noise), "--seed", seed,
            "--epochs", 1000, "--max-steps", steps, "--eval-every", eval_every,
            "--consensus-every", 0, "--validation-size", VALIDATION_SIZE, "--run-dir", d]


def tune(labels, world: int, steps: int, eval_every: int, label_noise: float, raw: Path,
         per_method=None, timeout_per_run: float = 60.0, log=print, tune_seeds=(0,)):
    """Run every method's grid (or its first ``per_method`` settings, spread over the grid) on
    the tuning task with each of ``tune_seeds`` (not reported seeds) at ``world`` ranks, in one
    mpirun job. Returns (rows of methods_grid.csv, one per setting, method -> the chosen
    (setting, options)): the setting whose reported model has the best validation accuracy at
    the end, mean over the tuning seeds, ties to fewer bytes."""
    dirs, argvs = {}, []
    for label in labels:
        grid = GRIDS[label]
        if per_method and per_method < len(grid):
            grid = [grid[round(i * (len(grid) - 1) / (per_method - 1))] if per_method > 1
                    else grid[0] for i in range(per_method)]
        for i, (setting, opts) in enumerate(grid):
            for seed in tune_seeds:
                d = raw / f"grid-np{world}" / f"{_slug(label)}-{i}-seed{seed}"
                shutil.rmtree(d, ignore_errors=True)
                dirs.setdefault((label, setting), ([], opts))[0].append((seed, d))
                argvs.append([*_common(TUNE_TASK, label_noise, steps, eval_every, seed, d),
                              *method_argv(dict(METHODS)[label] + opts, world)])
    t0 = time.perf_counter()
    train_many(world, argvs, timeout=timeout_per_run * len(argvs), log=log)
    log(f"methods: tuning grid, {len(argvs)} trainings on {world} ranks in "
        f"{time.perf_counter() - t0:.0f} s")
    rows, chosen = [], {}
    for (label, setting), (runs, opts) in dirs.items():
        ends, sums = [], []
        for _, d in runs:
            run_ = aggregate.read_run(d)
            sums.append(aggregate.summarize_run(run_))
            ends.append(final_point(run_, sums[-1], "val"))
        rows.append({"method": label, "setting": setting, "options": " ".join(opts),
                     "task": TUNE_TASK, "ranks": world,
                     "seeds": " ".join(str(seed) for seed, _ in runs), "steps": sums[0]["steps"],
                     "val_acc_leader": statistics.fmean(e["acc_leader"] for e in ends),
                     "val_acc_leader_per_seed": " ".join(f"{e['acc_leader']:.4f}"
                                                         for e in ends),
                     "val_acc_mean": statistics.fmean(e["acc_mean"] for e in ends),
                     "training_time_s": statistics.fmean(x["training_time"] for x in sums),
                     "bytes_sent": statistics.fmean(float(x["total_bytes_sent"])
                                                    for x in sums), "chosen": ""})
    for label in labels:
        mine = [r for r in rows if r["method"] == label]
        best = max(mine, key=lambda r: (round(r["val_acc_leader"], 6), -float(r["bytes_sent"])))
        best["chosen"] = "yes"
        chosen[label] = (best["setting"], dirs[(label, best["setting"])][1])
    return rows, chosen


GRID_COLUMNS = ["method", "setting", "options", "task", "ranks", "seeds", "steps",
                "val_acc_leader", "val_acc_leader_per_seed", "val_acc_mean", "training_time_s",
                "bytes_sent", "chosen"]


def run(out, quick: bool = False, log=print, seeds=None, steps=None, ranks=None, tasks=None,
        methods=None, label_noise: float = 0.4, eval_every=None,
        timeout_per_run: float = 60.0, raw=None, tune_grid: bool = True,
        grid_size=None) -> dict:
    """Tune every method on its grid (unless ``tune_grid`` is False: defaults), then train
    every (rank count, task, method, seed) with the chosen setting, read the runs, write
    tables and figures. ``methods``: labels of METHODS to run (default all); other arguments
    default to the full or quick budget; raw runs go under ``raw`` (default
    runs/results/methods/)."""
    t_start = time.perf_counter()
    budget = QUICK if quick else FULL
    seeds = seeds or budget["seeds"]
    steps = steps or budget["steps"]
    ranks = tuple(ranks or budget["ranks"])
    plan = {w: tuple(tasks or budget["tasks"].get(w, TASKS)) for w in ranks}
    tasks = tuple(dict.fromkeys(t for w in ranks for t in plan[w]))
    eval_every = eval_every or budget["eval_every"]
    grid_size = grid_size or budget["grid"]
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    raw = Path(raw or raw_dir(NAME))
    descs = {t: TASKS[t][2].format(pct=label_noise) for t in tasks}
    descs.setdefault(TUNE_TASK, TASKS[TUNE_TASK][2].format(pct=label_noise))
    target = {t: TASKS[t][1] for t in tasks}
    labels = [m for m, _ in METHODS if not methods or m in methods]
    tables, grid_rows = [], []
    if tune_grid:
        grid_rows, chosen = tune(labels, min(ranks), steps, eval_every, label_noise, raw,
                                 grid_size, timeout_per_run, log, budget["tune_seeds"])
        write_csv(out / "methods_grid.csv", grid_rows, GRID_COLUMNS)
        tables.append("methods_grid.csv")
    else:
        chosen = {label: ("defaults", []) for label in labels}
    dirs = {}
    for world in ranks:
        argvs = []
        for task in plan[world]:
            for label in labels:
                for seed in range(1, seeds + 1):
                    d = raw / f"np{world}" / task / f"{_slug(label)}-seed{seed}"
                    shutil.rmtree(d, ignore_errors=True)
                    dirs[(task, world, label, seed)] = d
                    argvs.append([*_common(task, label_noise, steps, eval_every, seed, d),
                                  *method_argv(dict(METHODS)[label] + chosen[label][1],
                                               world)])
        t0 = time.perf_counter()
        train_many(world, argvs, timeout=timeout_per_run * len(argvs), log=log)
        log(f"methods: {len(argvs)} trainings on {world} ranks in "
            f"{time.perf_counter() - t0:.0f} s")
    rows = read_runs(dirs, target)
    summary = summarize(rows)
    for srow in summary:
        srow["setting"] = chosen[srow["method"]][0]
    write_csv(out / "methods_runs.csv", rows, RUN_COLUMNS)
    write_csv(out / "methods_summary.csv", summary, SUMMARY_COLUMNS)
    tables = ["methods_summary.csv", "methods_runs.csv"] + tables
    figures = [plot(rows, task, world, descs[task], out)
               for world in ranks for task in plan[world]]
    setup = (f"Setup: {seeds} seeds, {steps} steps per rank, batch 32 per rank, digits CNN, "
             f"2 ranks per node, {VALIDATION_SIZE} training samples held out for validation "
             f"in every run; tasks: " + "; ".join(f"{w} ranks: {', '.join(plan[w])}"
                                                 for w in ranks)
             + "; targets: " + ", ".join(f"{descs[t]} {_pct(target[t])}" for t in tasks)
             + "; accuracy = the reported model (LSGD leader, EASGD centre, else rank 0) at "
               "the last evaluation.")
    tuning = []
    if tune_grid:
        n = len({r["setting"] for r in grid_rows if r["method"] == labels[0]})
        tseeds = budget["tune_seeds"]
        tuning = [f"Tuning: {n} settings per method (methods_grid.csv), each trained with "
                  f"seed{'s' * (len(tseeds) > 1)} {' and '.join(map(str, tseeds))} (not "
                  f"reported seeds) on {descs[TUNE_TASK]} at "
                  f"{min(ranks)} ranks; the setting whose reported model had the best "
                  f"validation accuracy at the end (mean over those seeds) was then run with {'seeds 1-' + str(seeds) if seeds > 1 else 'seed 1'} on every "
                  f"task and rank count. Chosen: " + "; ".join(
                      f"{m}: {chosen[m][0]} (validation "
                      f"{_pct(next(r['val_acc_leader'] for r in grid_rows if r['method'] == m and r['chosen']))})"
                      for m in labels) + "."]
    return {"name": NAME, "title": TITLE, "figures": figures, "tables": tables,
            "findings": [setup] + tuning + findings(summary, descs) + leader_score_findings(
                summary, descs),
            "seconds": time.perf_counter() - t_start}


def leader_score_findings(summary: list, descs: dict) -> list:
    """What --leader-score heldout changed against the train score, per task and rank count."""
    by = {(s["task"], s["ranks"], s["method"]): s for s in summary}
    out = []
    for (task, world, m), s in by.items():
        h = by.get((task, world, HELDOUT_OF.get(m)))
        if h is None:
            continue
        diff = h["final_acc_leader_mean"] - s["final_acc_leader_mean"]
        tol = max(s["final_acc_leader_std"], h["final_acc_leader_std"], 0.005)
        verdict = "better" if diff > tol else "worse" if diff < -tol else "no different"
        out.append(f"{descs[task]}, {world} ranks: the held-out leader score made {m}'s "
                   f"reported model {verdict} ({_pct(s['final_acc_leader_mean'])} -> "
                   f"{_pct(h['final_acc_leader_mean'])}, {100 * diff:+.1f} points; the mean "
                   f"over workers {_pct(s['final_acc_mean_mean'])} -> "
                   f"{_pct(h['final_acc_mean_mean'])}).")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 2)[2])
    p.add_argument("--out", required=True, help="folder for the CSV tables and PNG figures")
    p.add_argument("--quick", action="store_true",
                   help=f"small budget: {QUICK['seeds']} seeds, {QUICK['steps']} steps, "
                        f"ranks {' '.join(map(str, QUICK['ranks']))}")
    p.add_argument("--seeds", type=int, help=f"seeds per method (default {FULL['seeds']})")
    p.add_argument("--steps", type=int, help=f"steps per rank (default {FULL['steps']})")
    p.add_argument("--ranks", type=int, nargs="+",
                   help="rank counts, 2 ranks per node (default "
                        f"{' '.join(map(str, FULL['ranks']))})")
    p.add_argument("--tasks", nargs="+", choices=list(TASKS),
                   help="tasks at every rank count (default: digits and noisy at 4 ranks, "
                        "noisy at 8)")
    p.add_argument("--methods", nargs="+", metavar="LABEL",
                   help="subset of: " + ", ".join(f"'{m}'" for m, _ in METHODS))
    p.add_argument("--label-noise", type=float, default=0.4,
                   help="label noise of the noisy task (default 0.4)")
    p.add_argument("--eval-every", type=int, help=f"steps between evaluations "
                                                  f"(default {FULL['eval_every']})")
    p.add_argument("--no-tune", action="store_true",
                   help="skip the tuning grids: every method with its defaults")
    p.add_argument("--grid-size", type=int, metavar="N",
                   help="settings per method from its grid, spread over it (default: all "
                        f"{len(GRIDS['EASGD'])}; --quick: {QUICK['grid']})")
    p.add_argument("--raw", metavar="DIR",
                   help=f"folder for the raw runs (default runs/results/{NAME}/)")
    args = p.parse_args(argv)
    if args.methods and set(args.methods) - {m for m, _ in METHODS}:
        p.error(f"unknown --methods {sorted(set(args.methods) - {m for m, _ in METHODS})}")
    res = run(args.out, args.quick, seeds=args.seeds, steps=args.steps, ranks=args.ranks,
              tasks=args.tasks, methods=args.methods, label_noise=args.label_noise,
              eval_every=args.eval_every, raw=args.raw, tune_grid=not args.no_tune,
              grid_size=args.grid_size)
    for f in res["findings"]:
        print("-", f)
    print(f"{NAME}: {res['seconds']:.0f} s; wrote {', '.join(res['tables'] + res['figures'])} "
          f"to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
