"""Local steps on an over-parameterized model: communication rounds and training time to a target
training loss as T grows, against the seed's predicted T*.

Task: the small MLP (``--model mlp``, 256-256, 84 k parameters) on the embedded digits (1437
training images) without weight decay: 58 parameters per training image, and it fits its
training set exactly (the training loss falls towards zero), the over-parameterized regime of
the seed (Distributed Optimization for Over-Parameterized Learning). Local SGD
(``--algorithm local-sgd``) on 4 ranks with T = 1, 2, 4, ..., T_max local steps between
averages (one allreduce of the parameters), plus one run with ``--local-steps auto``; all in one
``mpirun`` (``_shared.train_many``), the same seed and step budget for every T.

What is measured (docs/metrics.md):

* the training loss of the *averaged* model. Between averages each rank fits its own shard, so
  its minibatch loss says little about the model the ranks agree on (at large T it is near
  zero long before the average is). The loss a rank logs at step a + 1, right after the average
  of step a, is the averaged model's loss on a fresh minibatch of its shard (the forward pass
  comes before the update); the mean over ranks of those losses, over the trailing
  ceil(LOSS_STEPS / T) rounds, estimates the averaged model's training loss (at least
  ranks x batch = 128 images per estimate);
* rounds to the target: averaging rounds (the steps where ``comm_bytes_sent`` grows) up to the
  first whose estimate is at or below the target; the training time to it is
  ``/train/training_time`` at that averaging step, the slowest rank's;
* the cost ratio c = (seconds of one averaging round) / (seconds of one local step) of each
  fixed-T run: (comm_seconds / rounds) / (compute_seconds / steps), mean over ranks.

The prediction (lsgd_hpc/methods/rules/auto_period.py, docs/algorithms.md "Automatic T"): fit the
local decay of the loss between averages, with one intercept per segment (the steps between two
averages) and a common slope, pooled over the ranks and the fixed-T runs with T >= 2, up to the
step each run reached the target; then

    geometric  L ~ rho^s    ->  T* = log c / log(1/rho)     (log(1/r) with r = 1/c)
    power      L ~ s^-beta  ->  T* = c^(1/beta)            (r^(-1/beta))

with c the median measured cost ratio; ``auto_period.decide`` picks the law (the package's own
estimator, with its significance tests), ``choose_local_steps`` gives T* (clipped to T_max here,
not to one epoch as ``--local-steps auto`` clips it). The auto run's own choice is read from its
``/train`` columns local_steps, local_law, local_rate and local_cost_ratio.

    python results/experiments/local_steps.py --out results/local_steps [--quick]
        [--max-t 256] [--steps 1024] [--target-loss 0.05] [--ranks 4]
"""

from __future__ import annotations

import argparse
import math
import shutil
import sys
import time
from pathlib import Path
from typing import List, Optional

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _shared import new_figure, raw_dir, save_figure, train_many, write_csv, write_json  # noqa: E402

NAME = "local_steps"
TITLE = "Local steps: communication rounds and time to a target loss against T"

#: steps of losses behind one estimate of the averaged model's loss (at least one round)
LOSS_STEPS = 8

#: budgets: largest T, steps per run, ranks, seeds per T
FULL = {"max_t": 256, "steps": 512, "ranks": 4, "seeds": 3}
QUICK = {"max_t": 64, "steps": 256, "ranks": 4, "seeds": 1}
#: the averaged model's training loss to reach (the model interpolates: it goes far below)
TARGET_LOSS = 0.02

TRAIN_ARGS = ["--algorithm", "local-sgd", "--dataset", "digits", "--model", "mlp",
              "--weight-decay", "0", "--batch-size", "32", "--lr", "0.05", "--epochs", "100000",
              "--log-every", "1", "--flush-every", "100000", "--consensus-every", "0",
              "--stop-check-every", "10", "--collective-timeout", "120"]


def t_values(max_t: int) -> List[int]:
    """1, 2, 4, ... up to max_t."""
    return [1 << k for k in range(int(math.log2(max_t)) + 1)]


# ---------------------------------------------------------------------------- measurements

def averaging_steps(rank_data: dict) -> np.ndarray:
    """Steps after which this rank averaged: those where its counted bytes grew."""
    from lsgd_hpc.analysis.aggregate import col
    steps = col(rank_data, "train", "step", np.int64)
    sent = col(rank_data, "train", "comm_bytes_sent")
    grew = np.diff(np.concatenate([[0.0], sent])) > 0
    return steps[grew]


def measure_run(run_dir: Path, target: float) -> dict:
    """Rounds, steps and training time to the target loss of the averaged model; cost ratio;
    the decay segments (before the target) for the fit; the auto columns of the last row."""
    from lsgd_hpc.analysis.aggregate import col, read_run

    run = read_run(run_dir)
    ranks = [run.ranks[r] for r in sorted(run.ranks)]
    avg = averaging_steps(ranks[0])
    per_rank = []
    for d in ranks:
        steps = col(d, "train", "step", np.int64)
        per_rank.append({int(s): i for i, s in enumerate(steps)})
    # the averaged model's loss after each round, mean over ranks (rounds with a next step)
    rounds, est = [], []
    for k, a in enumerate(avg):
        rows = [idx.get(int(a) + 1) for idx in per_rank]
        if any(r is None for r in rows):
            break
        rounds.append(k + 1)
        est.append(float(np.mean([col(d, "train", "loss")[r] for d, r in zip(ranks, rows)])))
    t_now = int(np.median(np.diff(avg))) if len(avg) > 1 else 1
    window = max(1, math.ceil(LOSS_STEPS / max(t_now, 1)))
    est = np.asarray(est)
    smooth = np.array([est[max(0, i - window + 1):i + 1].mean() for i in range(len(est))])
    hit = np.flatnonzero(smooth <= target)
    res = {"rounds_to_target": math.nan, "steps_to_target": math.nan,
           "time_to_target": math.nan,
           "final_avg_loss": float(smooth[-1]) if len(smooth) else math.nan,
           "rounds": len(avg), "steps": int(col(ranks[0], "train", "step", np.int64)[-1])}
    if len(hit):
        k = int(hit[0])
        a = int(avg[k])
        res.update(rounds_to_target=k + 1, steps_to_target=a,
                   time_to_target=max(float(col(d, "train", "training_time")[idx[a]])
                                      for d, idx in zip(ranks, per_rank)))
    # cost ratio c: seconds per round over seconds per local step, mean over ranks
    ratios = []
    for d in ranks:
        comm = col(d, "train", "comm_seconds")
        comp = col(d, "train", "compute_seconds")
        n_avg, n_steps = len(averaging_steps(d)), len(comp)
        if n_avg and n_steps and comp[-1] > 0:
            ratios.append((comm[-1] / n_avg) / (comp[-1] / n_steps))
    res["cost_ratio"] = float(np.mean(ratios)) if ratios else math.nan
    res["round_seconds"] = float(np.mean([col(d, "train", "comm_seconds")[-1] for d in ranks])
                                 / max(len(avg), 1))
    res["step_seconds"] = float(np.mean([col(d, "train", "compute_seconds")[-1] for d in ranks])
                                / max(res["steps"], 1))
    # segments of local steps before the target: (step, loss) between two averages
    stop = res["steps_to_target"] if len(hit) else math.inf
    segs = []
    for d in ranks:
        steps = col(d, "train", "step", np.int64)
        loss = col(d, "train", "loss")
        bounds = [0] + [int(a) for a in avg if a <= stop]
        for lo, hi in zip(bounds[:-1], bounds[1:]):
            sel = (steps > lo) & (steps <= hi)
            segs.append(list(zip(steps[sel].tolist(), loss[sel].tolist())))
    res["segments"] = segs
    for c in ("local_steps", "local_law", "local_rate", "local_cost_ratio"):
        v = col(ranks[0], "train", c)
        res[c] = float(v[-1]) if len(v) else math.nan
    res["curve"] = (np.asarray([int(avg[r - 1]) for r in rounds]), smooth)
    return res


def predict(runs: List[tuple], t_max: int) -> dict:
    """The seed's T* from the pooled decay of the fixed-T runs and the median cost ratio."""
    from lsgd_hpc.methods.rules.auto_period import (LAW_GEOMETRIC, LAW_NAMES, LAW_POWER,
                                                    DecayStatistics, choose_local_steps,
                                                    decay_statistics, decide)
    total = np.zeros(7)
    for T, m in runs:
        if T != "auto" and T >= 2:
            total += np.asarray(decay_statistics(m["segments"]).as_vector())
    stats = DecayStatistics.from_vector(total)
    ratios = [m["cost_ratio"] for T, m in runs if T != "auto" and math.isfinite(m["cost_ratio"])]
    c = float(np.median(ratios)) if ratios else math.nan
    d = decide(stats, c, t_max)
    rho = math.exp(stats.sxy[0] / stats.sxx[0]) if stats.sxx[0] > 0 else math.nan
    beta = -stats.sxy[1] / stats.sxx[1] if stats.sxx[1] > 0 else math.nan
    return {"cost_ratio": c, "law": LAW_NAMES.get(d.law, str(d.law)), "law_code": d.law,
            "rate": d.rate, "r2": d.r2, "reason": d.reason, "T_star": d.T,
            "rho": rho, "beta": beta,
            "T_star_geometric": choose_local_steps(LAW_GEOMETRIC, rho, c, t_max),
            "T_star_power": choose_local_steps(LAW_POWER, beta, c, t_max)}


# ---------------------------------------------------------------------------------- figures

def plot_rounds_and_time(table: List[dict], auto: Optional[dict], pred: dict,
                         target: float, path: Path) -> Path:
    fig, axes = new_figure(2, width=5.6, height=4.4)
    fixed = [r for r in table if r["T"] != "auto"]
    Ts = np.array([r["T"] for r in fixed], dtype=float)
    for ax, key, ylab in ((axes[0], "rounds_to_target", "averaging rounds to the target"),
                          (axes[1], "time_to_target", "training time to the target (s)")):
        y = np.array([r[key] for r in fixed], dtype=float)
        ok = np.isfinite(y)
        label = "local SGD, fixed T (median over seeds)"
        if key == "time_to_target" and fixed[0]["seeds"] > 1:
            lo = np.array([r["time_min"] for r in fixed], dtype=float)
            hi = np.array([r["time_max"] for r in fixed], dtype=float)
            ax.errorbar(Ts[ok], y[ok], yerr=[y[ok] - lo[ok], hi[ok] - y[ok]], fmt="o-",
                        color="tab:blue", capsize=3, label=label + ", bars: min..max")
        else:
            ax.plot(Ts[ok], y[ok], "o-", color="tab:blue", label=label)
        for T in Ts[~ok]:
            ax.axvline(T, color="tab:blue", alpha=0.25, lw=6)
        if (~ok).any():
            ax.plot([], [], color="tab:blue", alpha=0.25, lw=6, label="target not reached")
        if auto is not None and math.isfinite(auto[key]):
            ax.plot(auto["final_T"], auto[key], "*", ms=14, color="tab:green",
                    label=f"--local-steps auto (ended at T = {auto['final_T']:g})")
        for law, t_star in (("geometric", pred["T_star_geometric"]), ("power", pred["T_star_power"])):
            if not t_star:
                continue
            chosen = pred["law"].startswith(law) and pred["T_star"] == t_star
            ax.axvline(t_star, color="tab:red" if law == "geometric" else "tab:purple",
                       ls="--" if chosen else ":",
                       label=f"T* {law} law = {t_star}"
                             + (" (chosen)" if chosen else " (not chosen)" if pred["T_star"]
                                else " (fit rejected)"))
        ax.set_xscale("log", base=2)
        if key == "rounds_to_target":
            ax.set_yscale("log")
        ax.set_xlabel("T, local steps between averages (log2)")
        ax.set_ylabel(ylab)
        ax.set_title(f"{ylab.split(' (')[0].capitalize()} {target:g}, c = {pred['cost_ratio']:.2g}")
        ax.legend(loc="best", fontsize=8, framealpha=0.85)
    return save_figure(fig, path)


def plot_curves(curves: dict, target: float, path: Path) -> Path:
    import matplotlib.pyplot as plt
    fig, axes = new_figure(1, width=7.0, height=4.6)
    ax = axes[0]
    cmap = plt.get_cmap("viridis")
    keys = [k for k in curves if k != "auto"]
    for i, T in enumerate(keys):
        steps, loss = curves[T]
        ax.plot(steps, loss, color=cmap(i / max(1, len(keys) - 1)), label=f"T = {T}",
                marker="." if len(steps) < 20 else None)
    if "auto" in curves:
        steps, loss = curves["auto"]
        ax.plot(steps, loss, color="tab:red", ls="--", label="T auto")
    ax.axhline(target, color="k", lw=1, ls=":", label=f"target {target:g}")
    ax.set_yscale("log")
    ax.set_xlabel("training step (at each average)")
    ax.set_ylabel("training loss of the averaged model (log)")
    ax.set_title("Averaged model's training loss, local SGD on 4 ranks")
    ax.legend(loc="upper right", ncol=2, fontsize=8, framealpha=0.85)
    return save_figure(fig, path)


# ------------------------------------------------------------------------------- findings

def best_t_per_seed(per_run: List[dict]) -> List[int]:
    """Per seed, the fixed T with the least training time to the target (None: none reached)."""
    out = []
    for seed in sorted({r["seed"] for r in per_run}):
        ok = [r for r in per_run if r["seed"] == seed and r["T"] != "auto"
              and math.isfinite(r["time_to_target"])]
        out.append(min(ok, key=lambda r: r["time_to_target"])["T"] if ok else None)
    return out


def findings(table, auto, pred, target, per_run, spe) -> List[str]:
    from lsgd_hpc.methods.rules.auto_period import LAW_NAMES

    out = []
    fixed = [r for r in table if r["T"] != "auto"]
    reached = [r for r in fixed if math.isfinite(r["time_to_target"])]
    missed = [r["T"] for r in fixed if not math.isfinite(r["time_to_target"])]
    if not reached:
        return [f"No T reached the target training loss {target:g} within the budget."]
    seeds = fixed[0]["seeds"]
    med = "median of " + (f"{seeds} seeds" if seeds > 1 else "1 seed")
    r1 = next((r for r in reached if r["T"] == 1), None)
    best_t = min(reached, key=lambda r: r["time_to_target"])
    best_r = min(reached, key=lambda r: r["rounds_to_target"])
    if r1 is not None:
        out.append(f"Rounds to the averaged model's training loss {target:g} ({med}): "
                   f"{r1['rounds_to_target']:.0f} at T = 1, fewest {best_r['rounds_to_target']:.0f}"
                   f" at T = {best_r['T']} ({r1['rounds_to_target'] / best_r['rounds_to_target']:.0f}x"
                   " fewer); " + ", ".join(f"T={r['T']}: {r['rounds_to_target']:.0f}"
                                           for r in reached) + ".")
    steps = [r["steps_to_target"] for r in reached]
    out.append(f"Steps to the target ({med}): {min(steps):.0f} to {max(steps):.0f} over T = "
               f"{reached[0]['T']}..{reached[-1]['T']} (T = 1: "
               + (f"{r1['steps_to_target']:.0f}" if r1 is not None else "missed")
               + "): " + ("local steps cost the interpolating model little progress per step, "
                          "so rounds fall about as 1/T" if max(steps) <= 2 * min(steps) else
                          "large T needs markedly more steps") + ".")
    per_seed = best_t_per_seed(per_run)
    out.append(f"Measured best T by training time to the target: T = {best_t['T']} "
               f"({best_t['time_to_target']:.2f} s, {med}"
               + (f"; {r1['time_to_target']:.2f} s at T = 1" if r1 is not None else "") + ")"
               + (f"; best T of each seed: {', '.join(str(t) for t in per_seed)}"
                  if len(per_seed) > 1 else "") + ".")
    if missed:
        out.append(f"T = {', '.join(map(str, missed))} did not reach the target within "
                   f"{int(fixed[0]['steps'])} steps (in at least one seed).")
    out.append(f"Measured cost ratio c = seconds per averaging round / seconds per local step = "
               f"{pred['cost_ratio']:.3g} (median over the fixed-T runs; "
               f"{min(r['cost_ratio'] for r in fixed):.3g} at T = "
               f"{min(fixed, key=lambda r: r['cost_ratio'])['T']} to "
               f"{max(r['cost_ratio'] for r in fixed):.3g} at T = "
               f"{max(fixed, key=lambda r: r['cost_ratio'])['T']}).")
    if pred["T_star"] is None:
        out.append(f"The local-decay fit was rejected ({pred['reason']}), so the seed's rule "
                   f"gives no T* (unaccepted rho {pred['rho']:.4g}, beta {pred['beta']:.3g}).")
    else:
        ratio = best_t["T"] / pred["T_star"]
        agree = ("agrees with it within a factor 2" if 0.5 <= ratio <= 2 else
                 f"does NOT agree with it (a factor {max(ratio, 1 / ratio):.0f} apart)")
        out.append(f"Pooled local decay between averages: {pred['law']} law ({pred['reason']}; "
                   f"rho {pred['rho']:.4g} per step, beta {pred['beta']:.3g}); predicted "
                   f"T* = {pred['T_star']} (geometric law {pred['T_star_geometric']}, power law "
                   f"{pred['T_star_power']}); the measured best T = {best_t['T']} {agree}.")
    if auto is not None:
        laws = [LAW_NAMES.get(int(c), "?") if math.isfinite(c) else "?" for c in auto["law_codes"]]
        per = "; ".join(f"T = {t:g}, law {law}, rate {rate:.4g}, c {c:.3g}" for t, law, rate, c
                        in zip(auto["final_Ts"], laws, auto["rates"], auto["ratios"]))
        out.append(f"--local-steps auto ended at {per} (per seed; auto clips T to one epoch = "
                   f"{spe} steps); it reached the target "
                   + (f"in {auto['rounds_to_target']:.0f} rounds and {auto['time_to_target']:.2f} s"
                      f" ({med})." if math.isfinite(auto["time_to_target"])
                      else "not within the budget in every seed."))
    return out


# ------------------------------------------------------------------------------------- run

def _median(vals) -> float:
    """Median over seeds; NaN when any seed missed (a missed target is not a lucky subset)."""
    vals = [float(v) for v in vals]
    return float(np.median(vals)) if vals and all(math.isfinite(v) for v in vals) else math.nan


def summarize(T, ms: List[dict]) -> dict:
    """One row of local_steps.csv: medians over seeds, and the spread of the time."""
    row = {"T": T, "seeds": len(ms)}
    for k in ("rounds_to_target", "steps_to_target", "time_to_target", "final_avg_loss",
              "rounds", "steps", "round_seconds", "step_seconds", "cost_ratio"):
        row[k] = _median([m[k] for m in ms])
    times = [m["time_to_target"] for m in ms if math.isfinite(m["time_to_target"])]
    row["time_min"] = min(times) if times else math.nan
    row["time_max"] = max(times) if times else math.nan
    if T == "auto":
        row["final_T"] = _median([m["local_steps"] for m in ms])
        for k in ("local_steps", "local_law", "local_rate", "local_cost_ratio"):
            row[k] = " ".join(f"{m[k]:.4g}" for m in ms)       # one value per seed
        row["law_codes"] = [m["local_law"] for m in ms]
        row["rates"] = [m["local_rate"] for m in ms]
        row["ratios"] = [m["local_cost_ratio"] for m in ms]
        row["final_Ts"] = [m["local_steps"] for m in ms]
    return row


def run(out, quick: bool = False, log=print, max_t: Optional[int] = None,
        steps: Optional[int] = None, ranks: Optional[int] = None, seeds: Optional[int] = None,
        target_loss: float = TARGET_LOSS, timeout: float = 1200.0, reuse: bool = False) -> dict:
    t_start = time.perf_counter()
    budget = dict(QUICK if quick else FULL)
    for k, v in (("max_t", max_t), ("steps", steps), ("ranks", ranks), ("seeds", seeds)):
        if v is not None:
            budget[k] = int(v)
    Ts = t_values(budget["max_t"])
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    raw = raw_dir(NAME)
    labels = Ts + ["auto"]
    seed_list = list(range(budget["seeds"]))
    dirs = {(T, s): raw / f"T{T}-seed{s}" for T in labels for s in seed_list}
    if not reuse:
        for d in dirs.values():         # the trainer refuses a folder that holds a run
            shutil.rmtree(d, ignore_errors=True)
        argvs = [TRAIN_ARGS + ["--local-steps", str(T), "--seed", str(s),
                               "--max-steps", str(budget["steps"]),
                               "--eval-every", str(budget["steps"]), "--run-dir", str(dirs[T, s])]
                 for s in seed_list for T in labels]
        t0 = time.perf_counter()
        train_many(budget["ranks"], argvs, timeout=timeout, log=log)
        log(f"{NAME}: {len(argvs)} local SGD runs on {budget['ranks']} ranks in "
            f"{time.perf_counter() - t0:.0f} s")
    runs = {key: measure_run(d, target_loss) for key, d in dirs.items()}
    from lsgd_hpc.analysis.aggregate import read_run
    spe = int(read_run(dirs[1, 0]).config.get("steps_per_epoch", 0))
    pred = predict([(T, m) for (T, _), m in runs.items()], budget["max_t"])
    table = [summarize(T, [runs[T, s] for s in seed_list]) for T in labels]
    auto = table[-1]
    cols = ["T", "seeds", "rounds_to_target", "steps_to_target", "time_to_target", "time_min",
            "time_max", "final_avg_loss", "rounds", "steps", "round_seconds", "step_seconds",
            "cost_ratio", "local_steps", "local_law", "local_rate", "local_cost_ratio"]
    write_csv(out / "local_steps.csv", table, cols)
    per_run = [dict(T=T, seed=s, **{k: v for k, v in m.items() if k not in ("segments", "curve")})
               for (T, s), m in runs.items()]
    write_csv(out / "runs.csv", per_run, ["T", "seed"] + cols[2:5] + cols[7:])
    write_csv(out / "prediction.csv", [dict(pred, target_loss=target_loss,
                                            auto_T=auto["local_steps"], auto_law=auto["local_law"],
                                            auto_rate=auto["local_rate"],
                                            auto_cost_ratio=auto["local_cost_ratio"])])
    figs = [plot_rounds_and_time(table, auto, pred, target_loss, out / "rounds_and_time_vs_T.png"),
            plot_curves({T: runs[T, 0]["curve"] for T in labels}, target_loss,
                        out / "averaged_loss_curves.png")]
    res = {"name": NAME, "title": TITLE, "figures": [p.name for p in figs],
           "tables": ["local_steps.csv", "runs.csv", "prediction.csv"],
           "findings": findings(table, auto, pred, target_loss, per_run, spe),
           "budget": dict(budget, target_loss=target_loss),
           "seconds": time.perf_counter() - t_start}
    write_json(out / "result.json", res)
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="results/local_steps", help="output folder")
    p.add_argument("--quick", action="store_true", help=f"small budget {QUICK} (checks that it runs)")
    p.add_argument("--max-t", type=int, help=f"largest T, a power of two (default {FULL['max_t']})")
    p.add_argument("--steps", type=int, help=f"steps per run (default {FULL['steps']})")
    p.add_argument("--ranks", type=int, help=f"MPI ranks (default {FULL['ranks']})")
    p.add_argument("--seeds", type=int, help=f"seeds per T (default {FULL['seeds']})")
    p.add_argument("--target-loss", type=float, default=TARGET_LOSS,
                   help="target training loss of the averaged model")
    p.add_argument("--timeout", type=float, default=1200.0, help="seconds for the mpirun job")
    p.add_argument("--reuse", action="store_true",
                   help="do not train: analyse the runs already under runs/results/local_steps")
    a = p.parse_args(argv)
    res = run(a.out, a.quick, max_t=a.max_t, steps=a.steps, ranks=a.ranks, seeds=a.seeds,
              target_loss=a.target_loss, timeout=a.timeout, reuse=a.reuse)
    for f in res["findings"]:
        print("-", f)
    print(f"{NAME}: {res['seconds']:.0f} s; wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
