"""Beyond spectral gap: does the effective number of neighbours order gossip topologies better
than the spectral gap?

Gossip SGD (``--algorithm gossip``) runs on each topology of TOPOLOGIES at each rank count (8
and 16 by default), with a few seeds, on the embedded digits with the small MLP (a tiny model,
so that 16 ranks fit on 2 cores). Every training of one rank count runs in one ``mpirun``
(``_shared.train_many``).

Predictors, from the topology analyser (``lsgd_hpc.topology.analyse``, docs/algorithms.md):

* spectral gap  1 - sigma_2(W),  sigma_2 = ||W - 11^T/n||_2;
* effective number of neighbours  ENN(gamma) = 1 / ((1 - gamma) tr(Sigma)/n), Sigma the
  stationary covariance of the random walk  x <- W (sqrt(gamma) x + xi).

gamma is the fraction of a worker's own deviation that survives one step of its optimisation;
it depends on the problem, not on the graph. The figures and the headline use gamma = 0.95, the
decay Vogels et al. (Beyond spectral gap, 2022) fitted for their CIFAR-10 runs (0.951); the
correlation table repeats the comparison for every gamma in GAMMAS, and the findings say
whether the ordering of the topologies by ENN changes with gamma at all.

Measured, per run (docs/metrics.md):

* consensus distance  D = (1/p) sum_i ||x_i - xbar||^2  from ``/consensus`` (every
  ``--consensus-every`` steps, after the local step and before the gossip exchange), averaged
  over the probes of the run: the quantity a better-mixing graph keeps small;
* steps to the target training loss: the first step at which the mean over ranks of the
  minibatch loss, averaged over the trailing LOSS_WINDOW steps, is at or below the target;
* training time to that step: ``/train/training_time`` at that step, the slowest rank's.

A predictor orders the topologies well if a larger predictor goes with a smaller measured value.
The table reports Spearman's rank correlation rho(predictor, measured) and its negation, the
*agreement*: +1 means the predictor orders the topologies exactly as measured (ties, e.g. the
equal gaps of torus, hypercube and exponential, share average ranks). It is computed on the
seed means, and per seed to show how robust the ordering is.

Note: at 8 and 16 ranks the torus (2 x 4 and 4 x 4, with wrap-around) is the same graph as the
hypercube (C2 x C4 = Q3, C4 x C4 = Q4), only with other rank labels, hence other data shards:
the difference between their measurements is a measure of the noise.

    python results/experiments/topologies.py --out results/topologies [--quick]
        [--ranks 8 16] [--seeds 3] [--steps 160] [--target-loss 0.1]
"""

from __future__ import annotations

import argparse
import math
import shutil
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _shared import (new_figure, raw_dir, save_figure, train_many, write_csv,  # noqa: E402
                     write_json)

NAME = "topologies"
TITLE = "Topologies: beyond the spectral gap"

TOPOLOGIES = ("ring", "star", "torus", "hypercube", "exponential", "exponential-undirected",
              "complete")
#: gammas of the effective number of neighbours in the correlation table
GAMMAS = (0.5, 0.9, 0.95, 0.99, 0.999)
#: the gamma of the figures and the headline (Vogels et al. fitted 0.951 on CIFAR-10)
GAMMA = 0.95
#: trailing window (steps) of the mean training loss that must reach the target
LOSS_WINDOW = 10

MEASURES = {"consensus_distance": "mean consensus distance D",
            "steps_to_target": "steps to the target loss",
            "time_to_target": "training time to the target loss (s)"}

#: the measures the verdict is drawn from. The training time is reported, not judged: with 8
#: or 16 ranks on a few cores it measures the scheduler at least as much as the graph.
JUDGED = ("consensus_distance", "steps_to_target")

#: budgets: (rank counts, seeds, steps per run, consensus probe every k steps)
FULL = {"ranks": (8, 16), "seeds": 3, "steps": 160, "consensus_every": 5}
QUICK = {"ranks": (8, 16), "seeds": 1, "steps": 80, "consensus_every": 10}
#: mean training loss over ranks to reach (digits with this MLP: about 0.03 after 100 steps)
TARGET_LOSS = 0.1

TRAIN_ARGS = ["--algorithm", "gossip", "--dataset", "digits", "--model", "mlp",
              "--batch-size", "32", "--lr", "0.05", "--epochs", "100000",
              "--log-every", "1", "--flush-every", "100000", "--stop-check-every", "10",
              "--collective-timeout", "120"]


# ------------------------------------------------------------------------------ predictors

def predictors(topology: str, n: int, gammas: Sequence[float] = GAMMAS) -> dict:
    """The analyser's numbers for one topology: gap, ENN per gamma, degree, diameter."""
    from lsgd_hpc.topology import analyse

    a = analyse(topology, n, gammas)
    row = {"topology": topology, "ranks": n, "layout": a["layout"],
           "degree_mean": a["degree"]["mean"], "diameter": a["diameter"],
           "directed": a["directed"], "spectral_gap": a["spectral_gap"]}
    for g in gammas:
        row[enn_column(g)] = a["effective_neighbors"][str(float(g))]
    return row


def enn_column(gamma: float) -> str:
    return f"enn_{gamma:g}"


# ---------------------------------------------------------------------------- measurements

def measure_run(run_dir: Path, target: float) -> dict:
    """Consensus distance, steps and training time to the target loss of one gossip run: the
    aggregator's figures (lsgd_hpc.aggregate: consensus_figures, and time_to_loss over a
    trailing LOSS_WINDOW, the slowest rank's training time)."""
    from lsgd_hpc.analysis.aggregate import (col, consensus_figures, read_run, time_to_loss,
                                             train_table)

    run = read_run(run_dir)
    r0 = run.ranks[min(run.ranks)]
    reached = time_to_loss(run, target, LOSS_WINDOW)
    loss = train_table(run)["loss_mean"]
    return {"consensus_distance": consensus_figures(run)[1],
            "steps_to_target": math.nan if reached["step"] is None else float(reached["step"]),
            "time_to_target": math.nan if reached["time"] is None else reached["time"],
            "final_loss": float(np.mean(loss[-LOSS_WINDOW:])) if len(loss) else math.nan,
            "consensus_curve": (col(r0, "consensus", "step", np.int64),
                                col(r0, "consensus", "distance"))}


# ------------------------------------------------------------------------------- the sweep

def run_dir_of(raw: Path, n: int, topology: str, seed: int) -> Path:
    return raw / f"n{n}" / f"{topology}-seed{seed}"


def train_all(raw: Path, ranks: Sequence[int], seeds: int, steps: int, consensus_every: int,
              timeout: float, log=print) -> None:
    for n in ranks:
        argvs = []
        for seed in range(seeds):
            for topo in TOPOLOGIES:
                # the trainer refuses a folder that already holds a run
                shutil.rmtree(run_dir_of(raw, n, topo, seed), ignore_errors=True)
                argvs.append(TRAIN_ARGS + [
                    "--topology", topo, "--seed", str(seed), "--max-steps", str(steps),
                    "--eval-every", str(steps), "--consensus-every", str(consensus_every),
                    "--run-dir", str(run_dir_of(raw, n, topo, seed))])
        t0 = time.perf_counter()
        train_many(n, argvs, timeout=timeout, log=log)
        log(f"{NAME}: {len(argvs)} gossip runs on {n} ranks in {time.perf_counter() - t0:.0f} s")


def agreement(pred: Sequence[float], measured: Sequence[float]) -> float:
    """-rho_Spearman(predictor, measured): +1 when a larger predictor always means a smaller
    measured value (the predictor orders the topologies as measured)."""
    from lsgd_hpc.analysis.aggregate import rank_correlation

    rho = rank_correlation(pred, measured, "spearman")
    return -rho if math.isfinite(rho) else math.nan


def correlation_rows(table: List[dict], per_seed: Dict[int, List[dict]],
                     ranks: Sequence[int]) -> List[dict]:
    """One row per (rank count or 'all', measure, predictor): rho, agreement, per-seed range."""
    from lsgd_hpc.analysis.aggregate import rank_correlation

    rows = []
    scopes = [(str(n), [n]) for n in ranks] + ([("all", list(ranks))] if len(ranks) > 1 else [])
    preds = ["spectral_gap"] + [enn_column(g) for g in GAMMAS]
    for scope, ns in scopes:
        sel = [r for r in table if r["ranks"] in ns]
        for measure in MEASURES:
            for pred in preds:
                x = [r[pred] for r in sel]
                rho = rank_correlation(x, [r[measure] for r in sel], "spearman")
                seeds = [agreement([r[pred] for r in rows_s if r["ranks"] in ns],
                                   [r[measure] for r in rows_s if r["ranks"] in ns])
                         for rows_s in per_seed.values()]
                seeds = [s for s in seeds if math.isfinite(s)]
                rows.append({"ranks": scope, "measure": measure, "predictor": pred,
                             "points": sum(math.isfinite(r[measure]) for r in sel),
                             "spearman": rho, "agreement": -rho if math.isfinite(rho) else math.nan,
                             "agreement_seed_min": min(seeds) if seeds else math.nan,
                             "agreement_seed_max": max(seeds) if seeds else math.nan,
                             "seeds": len(seeds)})
    return rows


# ---------------------------------------------------------------------------------- figures

_MARKERS = dict(zip(TOPOLOGIES, "o*sDv^P"))
_COLORS = {8: "tab:blue", 16: "tab:red"}


def plot_vs_predictor(table: List[dict], per_seed: Dict[int, List[dict]], pred: str,
                      short: str, xlabel: str, target: float, path: Path) -> Path:
    """Two panels: mean consensus distance and steps to the target loss against a predictor,
    one marker per topology, one colour per rank count, bars from the lowest to the highest
    seed."""
    fig, axes = new_figure(2, width=5.6, height=4.6)
    for ax, measure in zip(axes, ("consensus_distance", "steps_to_target")):
        for r in table:
            seeds = [s[measure] for rows in per_seed.values() for s in rows
                     if s["ranks"] == r["ranks"] and s["topology"] == r["topology"]
                     and math.isfinite(s[measure])]
            y = r[measure]
            if not math.isfinite(y):
                continue
            err = [[y - min(seeds)], [max(seeds) - y]] if len(seeds) > 1 else None
            ax.errorbar(r[pred], y, yerr=err, marker=_MARKERS[r["topology"]], ms=8,
                        color=_COLORS.get(r["ranks"], "k"), capsize=3, ls="none", alpha=0.85)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(MEASURES[measure] + (" (param. units², log)" if measure ==
                                           "consensus_distance" else " (steps)"))
        if measure == "consensus_distance":
            ax.set_yscale("log")
        ax.set_title(f"Consensus distance vs {short}" if measure == "consensus_distance"
                     else f"Steps to training loss {target:g} vs {short}")
    _legend(fig, axes[1], sorted({r["ranks"] for r in table}))
    return save_figure(fig, path)


def _legend(fig, ax, ranks) -> None:
    from matplotlib.lines import Line2D
    handles = [Line2D([], [], marker=_MARKERS[t], color="0.3", ls="none", ms=8, label=t)
               for t in TOPOLOGIES]
    handles += [Line2D([], [], marker="s", color=_COLORS.get(n, "k"), ls="none", ms=8,
                       label=f"{n} ranks") for n in ranks]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.02, 1.0), framealpha=0.85)


def plot_consensus_curves(curves: Dict[tuple, list], ranks: Sequence[int], path: Path) -> Path:
    """Consensus distance against step, per topology (mean over seeds), one panel per n."""
    import matplotlib.pyplot as plt
    fig, axes = new_figure(len(ranks), width=5.6, height=4.4)
    colors = plt.get_cmap("tab10").colors
    for ax, n in zip(axes, ranks):
        for k, topo in enumerate(TOPOLOGIES):
            cs = curves.get((n, topo), [])
            if not cs:
                continue
            length = min(len(s) for s, _ in cs)
            steps = cs[0][0][:length]
            d = np.mean([dist[:length] for _, dist in cs], axis=0)
            ok = d > 0
            ax.plot(steps[ok], d[ok], color=colors[k], label=topo,
                    ls="--" if topo == "hypercube" else "-")
        ax.set_yscale("log")
        ax.set_xlabel("training step")
        ax.set_ylabel("consensus distance D (param. units², log)")
        ax.set_title(f"Consensus distance, gossip SGD on {n} ranks")
    axes[-1].legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), framealpha=0.85,
                    title="topology (mean of seeds)")
    return save_figure(fig, path)


# ------------------------------------------------------------------------------- findings

def _corr(rows, scope, measure, pred):
    for r in rows:
        if r["ranks"] == scope and r["measure"] == measure and r["predictor"] == pred:
            return r
    return None


def findings(table, corr, ranks, seeds, target) -> List[str]:
    out = []
    enn = enn_column(GAMMA)
    scopes = [str(n) for n in ranks] + (["all"] if len(ranks) > 1 else [])
    for scope in scopes:
        where = f"{scope} ranks" if scope != "all" else f"{' and '.join(map(str, ranks))} ranks pooled"
        parts, verdicts = [], []
        for measure in MEASURES:
            e, g = _corr(corr, scope, measure, enn), _corr(corr, scope, measure, "spectral_gap")
            if e is None or not (math.isfinite(e["agreement"]) and math.isfinite(g["agreement"])):
                parts.append(f"{MEASURES[measure]}: not enough topologies reached it")
                continue
            spread = ""
            if e["seeds"] > 1:
                spread = (f" (per seed ENN {e['agreement_seed_min']:+.2f}..{e['agreement_seed_max']:+.2f},"
                          f" gap {g['agreement_seed_min']:+.2f}..{g['agreement_seed_max']:+.2f})")
            parts.append(f"{MEASURES[measure]}: ENN {e['agreement']:+.2f} vs gap "
                         f"{g['agreement']:+.2f}{spread}")
            if measure in JUDGED:
                d = e["agreement"] - g["agreement"]
                verdicts.append("ENN" if d > 0.05 else "gap" if d < -0.05 else "tie")
        verdict = ("ENN orders the topologies better than the spectral gap on both the "
                   "consensus distance and the steps to the target"
                   if len(verdicts) == 2 and all(v == "ENN" for v in verdicts) else
                   "the spectral gap orders them better on both the consensus distance and the "
                   "steps to the target"
                   if len(verdicts) == 2 and all(v == "gap" for v in verdicts) else
                   "neither predictor is better on both ("
                   + ", ".join(f"{m}: {v}" for m, v in zip(JUDGED, verdicts)) + ")")
        out.append(f"{where}: agreement of the predictor's ordering with the measured one "
                   f"(-Spearman, +1 = same order; ENN at gamma {GAMMA}) - " + "; ".join(parts)
                   + f". So {verdict}.")
    # does gamma matter?
    for n in ranks:
        from lsgd_hpc.analysis.aggregate import rank_correlation
        sel = [r for r in table if r["ranks"] == n]
        ref = [round(r[enn_column(GAMMA)], 9) for r in sel]    # torus = hypercube: a tie
        same = all(rank_correlation(ref, [round(r[enn_column(g)], 9) for r in sel]) > 1 - 1e-9
                   for g in GAMMAS)
        out.append(f"{n} ranks: the ordering of the topologies by ENN is "
                   + ("the same for every gamma in " + ", ".join(map(str, GAMMAS))
                      + " (the choice of gamma does not change the rank correlation)" if same else
                      "different between gammas (see correlations.csv for each)") + ".")
    # torus = hypercube: the noise floor
    for n in ranks:
        t = next((r for r in table if r["ranks"] == n and r["topology"] == "torus"), None)
        h = next((r for r in table if r["ranks"] == n and r["topology"] == "hypercube"), None)
        if t and h and t["consensus_distance"] > 0 and h["consensus_distance"] > 0:
            rel = abs(t["consensus_distance"] - h["consensus_distance"]) / min(
                t["consensus_distance"], h["consensus_distance"])
            out.append(f"{n} ranks: torus and hypercube are the same graph (other rank labels); "
                       f"their mean consensus distances differ by {100 * rel:.0f} % "
                       f"({t['consensus_distance']:.3g} vs {h['consensus_distance']:.3g}), "
                       "the run-to-run noise of this measurement"
                       + (f" with {seeds} seed(s)" if seeds else "") + ".")
    missed = [f"{r['topology']}@{r['ranks']}" for r in table if not math.isfinite(r["steps_to_target"])]
    if missed:
        out.append(f"Did not reach the target loss {target:g} within the budget: {', '.join(missed)}.")
    return out


# ------------------------------------------------------------------------------------- run

def run(out, quick: bool = False, log=print, ranks: Optional[Sequence[int]] = None,
        seeds: Optional[int] = None, steps: Optional[int] = None,
        consensus_every: Optional[int] = None, target_loss: float = TARGET_LOSS,
        timeout: float = 1200.0, reuse: bool = False) -> dict:
    t_start = time.perf_counter()
    budget = dict(QUICK if quick else FULL)
    for k, v in (("ranks", ranks), ("seeds", seeds), ("steps", steps),
                 ("consensus_every", consensus_every)):
        if v is not None:
            budget[k] = v
    ranks = tuple(int(n) for n in budget["ranks"])
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    raw = raw_dir(NAME)
    if not reuse:
        train_all(raw, ranks, budget["seeds"], budget["steps"], budget["consensus_every"],
                  timeout, log)

    table, per_seed, curves = [], {s: [] for s in range(budget["seeds"])}, {}
    for n in ranks:
        for topo in TOPOLOGIES:
            pred = predictors(topo, n)
            ms = []
            for seed in range(budget["seeds"]):
                m = measure_run(run_dir_of(raw, n, topo, seed), target_loss)
                curves.setdefault((n, topo), []).append(m.pop("consensus_curve"))
                per_seed[seed].append(dict(pred, seed=seed, **m))
                ms.append(m)
            row = dict(pred)
            for k in ("consensus_distance", "steps_to_target", "time_to_target", "final_loss"):
                vals = [m[k] for m in ms]
                # a seed that missed the target makes the mean undefined (not a lucky subset)
                row[k] = float(np.mean(vals))
            row["seeds"] = len(ms)
            table.append(row)

    cols = (["topology", "ranks", "layout", "degree_mean", "diameter", "directed", "spectral_gap"]
            + [enn_column(g) for g in GAMMAS]
            + ["consensus_distance", "steps_to_target", "time_to_target", "final_loss", "seeds"])
    write_csv(out / "topologies.csv", table, cols)
    write_csv(out / "runs.csv", [r for rows in per_seed.values() for r in rows],
              [c for c in cols if c != "seeds"] + ["seed"])
    corr = correlation_rows(table, per_seed, ranks)
    write_csv(out / "correlations.csv", corr)
    figs = [
        plot_vs_predictor(table, per_seed, "spectral_gap", "spectral gap",
                          "spectral gap 1 - sigma_2 (dimensionless)", target_loss,
                          out / "measured_vs_spectral_gap.png"),
        plot_vs_predictor(table, per_seed, enn_column(GAMMA), f"ENN (gamma {GAMMA})",
                          f"effective number of neighbours at gamma {GAMMA} (ranks)", target_loss,
                          out / "measured_vs_enn.png"),
        plot_consensus_curves(curves, ranks, out / "consensus_over_steps.png"),
    ]
    res = {"name": NAME, "title": TITLE,
           "figures": [p.name for p in figs],
           "tables": ["topologies.csv", "correlations.csv", "runs.csv"],
           "findings": findings(table, corr, ranks, budget["seeds"], target_loss),
           "budget": dict(budget, ranks=list(ranks), target_loss=target_loss, gamma=GAMMA),
           "seconds": time.perf_counter() - t_start}
    write_json(out / "result.json", res)
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="results/topologies", help="output folder")
    p.add_argument("--quick", action="store_true", help=f"small budget {QUICK} (checks that it runs)")
    p.add_argument("--ranks", type=int, nargs="+", help=f"rank counts (default {FULL['ranks']})")
    p.add_argument("--seeds", type=int, help=f"seeds per topology (default {FULL['seeds']})")
    p.add_argument("--steps", type=int, help=f"steps per run (default {FULL['steps']})")
    p.add_argument("--consensus-every", type=int,
                   help=f"steps between consensus probes (default {FULL['consensus_every']})")
    p.add_argument("--target-loss", type=float, default=TARGET_LOSS,
                   help=f"target training loss (mean over ranks, trailing {LOSS_WINDOW} steps)")
    p.add_argument("--timeout", type=float, default=1200.0, help="seconds per mpirun job")
    p.add_argument("--reuse", action="store_true",
                   help="do not train: analyse the runs already under runs/results/topologies")
    a = p.parse_args(argv)
    res = run(a.out, a.quick, ranks=a.ranks, seeds=a.seeds, steps=a.steps,
              consensus_every=a.consensus_every, target_loss=a.target_loss, timeout=a.timeout,
              reuse=a.reuse)
    for f in res["findings"]:
        print("-", f)
    print(f"{NAME}: {res['seconds']:.0f} s; wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
