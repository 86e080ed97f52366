"""Experiment 4, network: time to accuracy of every method on emulated 1 and 10 Gbit/s links, beside
the scale model's prediction.

    python results/experiments/network.py --out results/network [--quick] [--seeds 0 1 2 3 4]

As root. The measurement is benchmarks/time_to_accuracy.py's (imported, not copied): 2 emulated
nodes x 2 ranks (scripts/cluster.sh: network namespaces, each node's link limited by tc tbf to
1 Gbit/s, then to 10 Gbit/s; here under a cluster name and subnet of its own, always taken
down), mlp_wide on digits, batch 32 per rank, one mpirun job per rate running every (seed,
method) training seed-major after a link probe (lsgd_hpc.planning.netprobe). Methods: sync LSGD
(tau_L 4, tau_G 8) under each leader score (--leader-score train, the trainer's default: the
loss over a worker's recent training window; and heldout: the loss on a held-out slice of the
training set, 10 % of it at most 256 samples, taken out of training; its evaluations at each
election are booked as probe time, outside the training time), async LSGD (the same periods,
train score), allreduce SGD (overlapped buckets), EASGD (tau 4), local SGD (T 8), DiLoCo (H 8,
outer Nesterov SGD lr 0.7, momentum 0.9), SlowMo (local SGD T 8, slow momentum step every 16
steps, beta 0.5, alpha 1: fairscale's every 48 would give one slow step in 60, and SlowMo's
first slow step, its momentum starting at 0, leaves the model where local SGD's average put it),
gossip on a ring, and PyTorch DDP (gloo) on the allreduce run's configuration. A finding says
so when SlowMo's curves still equal local SGD's (quick mode's 30 steps have one slow step).
Time to accuracy = the training time (wall time less evaluations and probes, slowest rank) of
the first evaluation at or above the target test accuracy, median over seeds.

Prediction (lsgd_hpc.costmodel through benchmarks/scale_model.py's fit). A method's predicted
step time at a rate is

    t_step = t_local + t_comm(method; the links probed in that job; fitted parameters)

with t_local the allreduce run's measured time per step less its communication at that rate
(compute, data, bookkeeping: one figure per rate, what ``python -m lsgd_hpc.plan --step-ms``
takes) and t_comm the alpha-beta model of the method's communication. The model's free
parameters (allreduce algorithm, overlap of the bucketed allreduce, latency scale, cost per
call) are fitted by scale_model.fit to the step times of the OTHER rate's runs (leave one rate
out), so each rate's figures are predicted, not fitted (with one rate only they are fitted on
that rate, and the table says so). DiLoCo is one allreduce of the flat vector (its
pseudo-gradient) every H steps, SlowMo local SGD's allreduce every T steps plus its slow step
(elementwise passes, no communication) every 16 (lsgd_hpc.planning.costmodel's diloco and
slowmo). The cost model has no model of async LSGD nor of DDP: async LSGD is predicted as sync
LSGD (same rounds, no overlap), DDP as allreduce SGD in DDP's gradient buckets (2 for this
model, against lsgd_hpc's 1 MiB buckets: 5). Held-out-score LSGD communicates as train-score
LSGD (the same elections and broadcasts) and is predicted by the same model. These three are
predicted only; the fit takes the other methods' points. Predicted time to accuracy = measured
steps to the target x predicted step time (median over seeds).

Findings, per rate: the order of the methods; LSGD's time to accuracy over the best
baseline's (the fastest method that is not LSGD), as a ratio, for each leader score and async
LSGD; what the held-out score changed against the train score (time to accuracy, steps to the
target, final accuracy of the leader, step time); DDP against lsgd_hpc's allreduce; the probed
link; the scale model's errors; and across the two rates, how much the slower link costs.

Outputs in --out: time_to_accuracy.csv (per rate and method: measured and predicted step time
and time to accuracy, their errors), curves.csv (accuracy against training time, every run),
fit.csv (the fitted parameters per rate), time_to_accuracy.png, accuracy_vs_time.png,
step_time_predicted.png. Every row of time_to_accuracy.csv carries rho (docs/planning.md): one
fp32 allreduce of the parameters between the nodes predicted from the rate's probed link, over
the row's step time less its communication (columns rho, rho_allreduce_s, rho_compute_s,
rho_source); ``--refresh-rho`` adds them to recorded results, training nothing. Raw runs
(HDF5): runs/results/network/.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
for _p in (REPO, REPO / "benchmarks", HERE):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))
from _shared import (LayoutError, check_layout, new_figure, raw_dir, rho_sentence,  # noqa: E402
                     save_figure, write_csv, write_json)
from _shared import add_rho as shared_add_rho  # noqa: E402

import scale_model  # noqa: E402
import time_to_accuracy as tta  # noqa: E402

NAME = "network"
TITLE = "Network: time to accuracy at 1 and 10 Gbit/s, measured and predicted"
#: the emulated cluster's name and subnet: our own, other clusters may be up
CLUSTER_NAME, CLUSTER_SUBNET = "lsgdnet", "10.79.7"
assert tta.METHODS[0][:2] == ("lsgd", "lsgd"), "time_to_accuracy's first method is sync LSGD"
_LSGD_OPTS = tta.METHODS[0][2]
#: sync LSGD under each leader score (--leader-score: the trainer's default "train", the loss
#: over its recent training window; "heldout", the loss on a held-out slice of the training set)
LSGD_TRAIN = ("lsgd train score", "lsgd", [*_LSGD_OPTS, "--leader-score", "train"])
LSGD_HELDOUT = ("lsgd held-out score", "lsgd", [*_LSGD_OPTS, "--leader-score", "heldout"])
ASYNC = ("lsgd async", "lsgd-async", ["--tau-local", "4", "--tau-global", "8"])
LSGD_LABELS = (LSGD_TRAIN[0], LSGD_HELDOUT[0], ASYNC[0])
LOCAL_SGD_LABEL, SLOWMO_LABEL = "local-sgd T=8", "slowmo T=8"
assert {LOCAL_SGD_LABEL, SLOWMO_LABEL} <= {m[0] for m in tta.METHODS}
_SLOWMO_OPTS = next(m[2] for m in tta.METHODS if m[0] == SLOWMO_LABEL)
SLOWMO_EVERY = int(_SLOWMO_OPTS[_SLOWMO_OPTS.index("--slowmo-every") + 1])
#: every method: sync LSGD (both scores), async LSGD, time_to_accuracy's baselines (allreduce,
#: EASGD, local SGD, DiLoCo, SlowMo, gossip), then DDP (tta.run adds it)
METHODS = [LSGD_TRAIN, LSGD_HELDOUT, ASYNC] + tta.METHODS[1:]
#: the cost model's method (a label of time_to_accuracy's METHODS, which scale_model models)
#: for the methods labelled here; the others are their own
MODEL_OF = {LSGD_TRAIN[0]: "lsgd", LSGD_HELDOUT[0]: "lsgd", ASYNC[0]: "lsgd",
            tta.DDP_LABEL: "allreduce"}
#: predicted, not fitted: no model of their own (async LSGD as sync LSGD, DDP as allreduce SGD
#: in DDP's buckets), or the same model as a fitted method (held-out LSGD communicates as
#: train-score LSGD: its held-out evaluations are booked as probe time, not training time)
NOT_FITTED = {LSGD_HELDOUT[0], ASYNC[0], tta.DDP_LABEL}
#: torch DDP's gradient buckets: the first one closes past 1 MiB, the others past 25 MiB
DDP_FIRST_BUCKET, DDP_BUCKET = 2 ** 20, 25 * 2 ** 20
SEEDS_FULL, SEEDS_QUICK = (0, 1, 2), (0,)
#: quick mode: fewer steps and a lower target, so that every method gets there
QUICK = dict(steps=30, target=0.85)
RATE_GBPS = {"1gbit": 1.0, "10gbit": 10.0}


def _median(xs: List[float]) -> float:
    xs = [x for x in xs if x == x]
    return float(statistics.median(xs)) if xs else math.nan


# -- prediction ---------------------------------------------------------------------------------
def _settings(results: Dict) -> Dict[str, Dict]:
    """scale_model.points_of's input: per rate, the probe and each modelled method's per-step
    costs (median over seeds)."""
    out = {}
    for rate, res in results.items():
        probe = (res.get("probe") or {}).get("probe")
        runs = {}
        for label, by_seed in res["seeds"].items():
            if label in NOT_FITTED:
                continue
            runs[MODEL_OF.get(label, label)] = {k: _median([r[k] for r in by_seed.values()])
                           for k in ("time_per_step", "compute_s_per_step", "comm_s_per_step")}
        out[rate] = {"probe": probe, "runs": runs}
    return out


def ddp_bucket_bytes(n_params: int) -> float:
    """Bytes per bucket that give the cost model DDP's number of gradient buckets,
    k = 1 + ceil((n - 1 MiB) / 25 MiB) for n bytes of gradients, as k equal buckets."""
    n = 4 * n_params
    return n / (1 + math.ceil(max(0, n - DDP_FIRST_BUCKET) / DDP_BUCKET))


def predict(results: Dict, mem_Bps: float) -> Dict[str, Dict]:
    """Per rate: the fit used (on the other rate's points) and each method's predicted step
    time."""
    settings = _settings(results)
    points = {rate: scale_model.points_of({rate: s}) for rate, s in settings.items()}
    out = {}
    for rate, pts in points.items():
        if not pts:
            continue
        others = [p for r, ps in points.items() if r != rate for p in ps]
        fitted = scale_model.fit(others or pts, mem_Bps)
        ar = next((p for p in pts if p["method"] == "allreduce"), None)
        if ar is None:
            continue
        t_local = ar["measured_compute_s"]
        coll = scale_model.cm.Collectives(fitted["allreduce"])
        step = {}
        for label in results[rate]["seeds"]:
            pt = {**ar, "method": MODEL_OF.get(label, label), "measured_compute_s": t_local}
            step[label] = t_local + scale_model.predict_point(
                pt, fitted["call_overhead_s"], coll, mem_Bps, fitted["overlap"],
                fitted["latency_scale"],
                ddp_bucket_bytes(ar["n_params"]) if label == tta.DDP_LABEL
                else scale_model.BUCKET_BYTES)
        out[rate] = {"fit": {k: fitted[k] for k in ("allreduce", "overlap", "latency_scale",
                                                     "call_overhead_s", "max_abs_error")},
                     "fitted_on": sorted(r for r in points if r != rate) or [rate],
                     "t_local_s": t_local, "step_s": step,
                     "inter": vars(ar["inter"]), "intra": vars(ar["intra"])}
    return out


# -- tables ---------------------------------------------------------------------------------------
def table_rows(results: Dict, pred: Dict) -> List[Dict]:
    rows = []
    for rate, res in results.items():
        p = pred.get(rate, {})
        for label, by_seed in res["seeds"].items():
            runs = list(by_seed.values())
            steps = [r["step_to_target"] for r in runs]
            t_meas = tta._median_time([r["time_to_target"] for r in runs])
            step_meas = _median([r["time_per_step"] for r in runs])
            step_pred = p.get("step_s", {}).get(label, math.nan)
            # predicted time to accuracy: each seed's measured steps x the predicted step time
            t_pred = tta._median_time([s * step_pred if s else math.inf for s in steps])
            rows.append({
                "rate": rate, "method": label, "seeds": len(runs),
                "reached": sum(s is not None for s in steps),
                "steps_to_target": _median([s for s in steps if s]),
                "time_to_target_s": t_meas,
                # what the method's model is (LSGD: the leader), and the mean over ranks
                "accuracy_of": runs[0].get("model", ""),
                "time_to_target_mean_over_ranks_s": tta._median_time(
                    [r.get("time_to_target_mean_over_ranks", math.inf) for r in runs]),
                "time_to_target_min_s": min(r["time_to_target"] for r in runs),
                "time_to_target_max_s": max(r["time_to_target"] for r in runs),
                "step_time_s": step_meas, "predicted_step_time_s": step_pred,
                "step_time_error": (step_pred - step_meas) / step_meas if step_meas else math.nan,
                "predicted_time_to_target_s": t_pred,
                "time_to_target_error": ((t_pred - t_meas) / t_meas if math.isfinite(t_meas)
                                         and math.isfinite(t_pred) else math.nan),
                "final_accuracy": _median([r["final_accuracy"] for r in runs]),
                "comm_s_per_step": _median([r["comm_s_per_step"] for r in runs]),
                "bytes_sent_per_step": _median([r["bytes_sent_per_step"] for r in runs]),
                "model": MODEL_OF.get(label, label),
                "fitted": label not in NOT_FITTED,
                "fitted_on": "+".join(p.get("fitted_on", [])),
            })
    return rows


def add_rho(rows: List[Dict], pred: Dict, n_params: int) -> None:
    """rho of every row (_shared.rho_fields): one fp32 allreduce of the model's ``n_params``
    parameters between the 2 nodes, predicted from the link the rate's job probed
    (``pred[rate]["inter"]``), over the row's compute seconds a step (its measured step time
    less its communication, medians over seeds)."""
    shared_add_rho(rows, n_params, lambda r: pred.get(r["rate"], {}).get("inter"),
                   lambda r: (tta.NODES, tta.RANKS_PER_NODE),
                   lambda r: r["step_time_s"] - r["comm_s_per_step"])


def rho_findings(rows: List[Dict], n_params: int) -> List[str]:
    """One sentence a rate: allreduce SGD's rho there and its parts."""
    return [rho_sentence(f"at {r['rate']}", r, n_params) for r in rows
            if r["method"] == "allreduce" and "rho" in r]


def refresh_rho(out) -> List[str]:
    """rho into OUT/network.json's rows and OUT/time_to_accuracy.csv from the recorded
    numbers, training nothing (``python results/experiments/network.py --refresh-rho``);
    returns the rho findings."""
    from lsgd_hpc.planning.plan import model_facts
    out = Path(out)
    doc = json.loads((out / "network.json").read_text())
    n_params = model_facts(tta.MODEL, "digits").n_params
    add_rho(doc["rows"], doc["prediction"], n_params)
    write_json(out / "network.json", doc)
    write_csv(out / "time_to_accuracy.csv", doc["rows"])
    return rho_findings(doc["rows"], n_params)


def curve_rows(results: Dict) -> List[Dict]:
    return [{"rate": rate, "method": label, "seed": seed, "step": c["step"],
             "training_time_s": c["time"], "test_accuracy": c["accuracy"]}
            for rate, res in results.items() for label, curves in res["curves"].items()
            for seed, curve in curves.items() for c in curve]


# -- figures --------------------------------------------------------------------------------------
def _rate_title(rate: str) -> str:
    return f"{RATE_GBPS.get(rate, rate):g} Gbit/s per node link"


def plot_time_to_accuracy(rows: List[Dict], rates: List[str], target: float, n_seeds: int,
                          path: Path) -> None:
    fig, axes = new_figure(len(rates), width=6.2, height=4.6)
    for ax, rate in zip(axes, rates):
        rs = [r for r in rows if r["rate"] == rate]
        labels = [r["method"] for r in rs]
        x = list(range(len(rs)))
        top = max([v for r in rs for v in (r["time_to_target_s"], r["time_to_target_max_s"],
                                            r["predicted_time_to_target_s"])
                   if math.isfinite(v)] or [1.0]) * 1.4      # room for the legend
        for i, r in enumerate(rs):
            if math.isfinite(r["time_to_target_s"]):
                lo = r["time_to_target_s"] - r["time_to_target_min_s"]
                hi = (min(r["time_to_target_max_s"], top) - r["time_to_target_s"])
                ax.bar(i, r["time_to_target_s"], color="C0", alpha=0.75,
                       yerr=[[lo], [hi]] if n_seeds > 1 else None, capsize=3,
                       label="measured (median, seed range)" if i == 0 else None)
            else:
                ax.text(i, 0.02 * top, "not\nreached", ha="center", va="bottom", fontsize=8)
        pred = [r["predicted_time_to_target_s"] for r in rs]
        ax.plot([i for i, v in enumerate(pred) if math.isfinite(v)],
                [v for v in pred if math.isfinite(v)], "D", color="C3", ms=7,
                label="predicted (measured steps x model step time)")
        ax.set_xticks(x, labels, rotation=30, ha="right")
        ax.set_ylim(0, top)
        ax.set_ylabel(f"training time to {target:.0%} test accuracy (s)")
        ax.set_title(f"{_rate_title(rate)} (median of {n_seeds} seed{'s' * (n_seeds > 1)})")
        ax.legend(loc="upper left")
    save_figure(fig, path)


def plot_curves(results: Dict, rates: List[str], target: float, path: Path) -> None:
    fig, axes = new_figure(len(rates), width=6.2, height=4.6)
    for ax, rate in zip(axes, rates):
        curves = results[rate]["curves"]
        for i, (label, by_seed) in enumerate(curves.items()):
            model = next(iter(results[rate]["seeds"][label].values())).get("model", "")
            shown = f"{label} ({model})" if model in ("leader", "centre") else label
            for j, (seed, curve) in enumerate(sorted(by_seed.items())):
                ax.plot([c["time"] for c in curve], [100 * c["accuracy"] for c in curve],
                        color=f"C{i}", alpha=0.9 if j == 0 else 0.35, lw=1.4 if j == 0 else 0.9,
                        label=shown if j == 0 else None)
        ax.axhline(100 * target, color="k", ls="--", lw=0.8, label=f"target {target:.0%}")
        ax.set_xlabel("training time, slowest rank (s)")
        ax.set_ylabel("test accuracy of the method's model (%)")
        ax.set_ylim(max(0, 100 * target - 40), 100)
        ax.set_title(f"{_rate_title(rate)}: accuracy vs training time\n(others: mean over "
                     "ranks; faint: further seeds)")
        ax.legend(loc="lower right", ncol=2)
    save_figure(fig, path)


def plot_step_times(rows: List[Dict], rates: List[str], path: Path) -> None:
    fig, axes = new_figure(1, width=8.4, height=4.8)
    ax = axes[0]
    markers = {rate: m for rate, m in zip(rates, "os^v")}
    methods = list(dict.fromkeys(r["method"] for r in rows))
    seen = []
    for r in rows:
        if not (math.isfinite(r["step_time_s"]) and math.isfinite(r["predicted_step_time_s"])):
            continue
        i = methods.index(r["method"])
        ax.plot(1e3 * r["step_time_s"], 1e3 * r["predicted_step_time_s"], markers[r["rate"]],
                color=f"C{i}", ms=8, alpha=0.85)
        seen += [1e3 * r["step_time_s"], 1e3 * r["predicted_step_time_s"]]
    lo, lim = (0.8 * min(seen), 1.1 * max(seen)) if seen else (0.0, 1.0)
    ax.plot([lo, lim], [lo, lim], "k-", lw=0.8)
    ax.fill_between([lo, lim], [0.75 * lo, 0.75 * lim], [1.25 * lo, 1.25 * lim], color="0.85",
                    alpha=0.6)
    from matplotlib.lines import Line2D
    handles = [Line2D([], [], ls="", marker="o", color=f"C{i}", label=m)
               for i, m in enumerate(methods)]
    handles += [Line2D([], [], ls="", marker=markers[rt], color="0.3", label=_rate_title(rt))
                for rt in rates]
    handles += [Line2D([], [], color="0.85", lw=8, label="within 25 %")]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.02, 1.0))
    ax.set_xlim(lo, lim)
    ax.set_ylim(lo, lim)
    ax.set_xlabel("measured step time (ms)")
    ax.set_ylabel("predicted step time (ms)")
    ax.set_title("Step time: scale model (fitted on the other rate) vs measured")
    save_figure(fig, path)


# -- findings -------------------------------------------------------------------------------------
def _fmt_t(s: float) -> str:
    return "not reached" if not math.isfinite(s) else f"{s:.2f} s"


def _ratio(a: float, b: float) -> float:
    return a / b if math.isfinite(a) and math.isfinite(b) and b > 0 else math.nan


def _fmt_ratio(x: float) -> str:
    return "n/a (not reached)" if not math.isfinite(x) else f"{x:.2f}"


def _lsgd_findings(rs: Dict[str, Dict], rate: str) -> List[str]:
    """LSGD (each leader score, and async) against the best baseline at one rate, as the ratio
    of the times to accuracy; and what the held-out leader score changed against the train
    score (time, steps, final accuracy of the leader, step time)."""
    out = []
    base = [r for m, r in rs.items() if m not in LSGD_LABELS]
    best = min(base, key=lambda r: r["time_to_target_s"]) if base else None
    lsgds = [rs[m] for m in LSGD_LABELS if m in rs]
    if best and lsgds:
        bt = best["time_to_target_s"]
        parts = []
        for r in lsgds:
            t = r["time_to_target_s"]
            ratio = _ratio(t, bt)
            verdict = ("faster" if ratio < 1 else "NOT faster" if ratio >= 1
                       else "target not reached" if not math.isfinite(t)
                       else "faster: no baseline reached the target")
            part = (f"{r['method']} {_fmt_t(r['time_to_target_s'])}, ratio "
                    f"{_fmt_ratio(ratio)} ({verdict}")
            if r["accuracy_of"] == "leader" and math.isfinite(
                    r["time_to_target_mean_over_ranks_s"]):
                part += (f"; by the mean over its ranks instead of its leader "
                         f"{_fmt_t(r['time_to_target_mean_over_ranks_s'])}")
            sent = r["bytes_sent_per_step"] / max(best["bytes_sent_per_step"], 1)
            parts.append(part + f"; {sent:.2f}x its bytes per step)")
        out.append(f"{_rate_title(rate)}: LSGD's time to accuracy / the best baseline's "
                   f"({best['method']}, {_fmt_t(bt)}): " + "; ".join(parts) + ".")
    tr, ho = rs.get(LSGD_TRAIN[0]), rs.get(LSGD_HELDOUT[0])
    if tr and ho:
        steps = (f"{ho['steps_to_target']:.0f} vs {tr['steps_to_target']:.0f}"
                 if math.isfinite(ho["steps_to_target"]) and math.isfinite(tr["steps_to_target"])
                 else f"{ho['steps_to_target']} vs {tr['steps_to_target']}")
        out.append(
            f"{_rate_title(rate)}: the held-out leader score against the train score: time to "
            f"accuracy {_fmt_t(ho['time_to_target_s'])} vs {_fmt_t(tr['time_to_target_s'])} "
            f"(ratio {_fmt_ratio(_ratio(ho['time_to_target_s'], tr['time_to_target_s']))}), "
            f"reached by {ho['reached']} vs {tr['reached']} of {tr['seeds']} seeds, steps to "
            f"target {steps} (median), final accuracy of the leader "
            f"{100 * ho['final_accuracy']:.1f} vs {100 * tr['final_accuracy']:.1f} %, step "
            f"time {1e3 * ho['step_time_s']:.0f} vs {1e3 * tr['step_time_s']:.0f} ms (its "
            f"held-out evaluations at each election are probe time, outside the training "
            f"time).")
    return out


def findings(rows: List[Dict], rates: List[str], target: float, n_seeds: int,
             pred: Dict) -> List[str]:
    out = []
    for rate in rates:
        rs = {r["method"]: r for r in rows if r["rate"] == rate}
        if not rs:
            continue
        order = sorted(rs.values(), key=lambda r: r["time_to_target_s"])
        fastest = order[0]
        out.append(f"{_rate_title(rate)}: fastest to {target:.0%} is {fastest['method']} "
                   f"({_fmt_t(fastest['time_to_target_s'])}, median of {n_seeds}); order: "
                   + ", ".join(f"{r['method']} {_fmt_t(r['time_to_target_s'])}" for r in order)
                   + ".")
        out += _lsgd_findings(rs, rate)
        if "ddp" in rs and "allreduce" in rs:
            d, a = rs["ddp"], rs["allreduce"]
            out.append(f"{_rate_title(rate)}: lsgd_hpc allreduce / DDP step time "
                       f"{a['step_time_s'] / d['step_time_s']:.2f} ({1e3 * a['step_time_s']:.0f}"
                       f" vs {1e3 * d['step_time_s']:.0f} ms), time to accuracy "
                       f"{_fmt_t(a['time_to_target_s'])} vs {_fmt_t(d['time_to_target_s'])}.")
        link = pred.get(rate, {}).get("inter")
        if link and link["beta_s"] > 0:
            out.append(f"{_rate_title(rate)}: the probe in the same job measured the link "
                       f"between nodes at {8e-9 / link['beta_s']:.2f} Gbit/s and "
                       f"{1e6 * link['alpha_s']:.0f} us latency (the model's inputs).")
        errs = [(abs(r["step_time_error"]), r["method"]) for r in rs.values()
                if math.isfinite(r["step_time_error"])]
        terrs = [abs(r["time_to_target_error"]) for r in rs.values()
                 if math.isfinite(r["time_to_target_error"])]
        if errs:
            worst = max(errs)
            within = sum(e <= 0.25 for e, _ in errs)
            fitted_on = next(iter(rs.values()))["fitted_on"]
            how = ("fitted on the same rate (in-sample)" if fitted_on == rate else
                   f"fitted on {fitted_on} only (out of sample)")
            out.append(f"{_rate_title(rate)}: scale model ({how}): step time error median "
                       f"{100 * _median([e for e, _ in errs]):.0f} %, worst "
                       f"{100 * worst[0]:.0f} % ({worst[1]}); {within} of {len(errs)} methods "
                       f"within 25 %; time-to-accuracy error median "
                       f"{100 * _median(terrs):.0f} %.")
    if len(rates) == 2:
        a, b = rates
        ra = {r["method"]: r for r in rows if r["rate"] == a}
        rb = {r["method"]: r for r in rows if r["rate"] == b}
        slow = [(ra[m]["time_to_target_s"] / rb[m]["time_to_target_s"], m) for m in ra
                if m in rb and math.isfinite(ra[m]["time_to_target_s"])
                and math.isfinite(rb[m]["time_to_target_s"])]
        if slow:
            slow.sort()
            out.append(f"Going from {_rate_title(b)} to {_rate_title(a)} multiplies the time to "
                       f"accuracy by {slow[0][0]:.2f} ({slow[0][1]}, least hit) to "
                       f"{slow[-1][0]:.2f} ({slow[-1][1]}, most hit).")
    return out


def slowmo_as_local_sgd(results: Dict, rates: List[str]) -> List[str]:
    """A finding where SlowMo's accuracy curves equal local SGD's at the same T (every seed):
    its slow step starts from u = 0, and with alpha 1 the first one leaves the model where
    local SGD's average put it (x_old - alpha gamma (x_old - x) / gamma = x), so a run with
    one slow step is local SGD up to rounding, and only the timing tells them apart."""
    out = []
    for rate in rates:
        curves = results[rate]["curves"]
        a, b = curves.get(SLOWMO_LABEL), curves.get(LOCAL_SGD_LABEL)
        if not a or not b or set(a) != set(b):
            continue
        same = all([(c["step"], round(c["accuracy"], 6)) for c in a[s]]
                   == [(c["step"], round(c["accuracy"], 6)) for c in b[s]] for s in a)
        if same:
            out.append(f"{_rate_title(rate)}: {SLOWMO_LABEL}'s accuracy curves are "
                       f"{LOCAL_SGD_LABEL}'s in every seed (the first slow step, at step "
                       f"{SLOWMO_EVERY}, starts from u = 0 and with alpha 1 leaves the averaged "
                       f"model as it is): its time to accuracy differs from local SGD's by step "
                       f"time only.")
    return out


# -- the experiment -------------------------------------------------------------------------------
def run(out, quick: bool = False, log=print, seeds: Optional[List[int]] = None,
        timeout: float = 600) -> Dict:
    t0 = time.perf_counter()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    seeds = list(seeds or (SEEDS_QUICK if quick else SEEDS_FULL))
    raw = raw_dir(NAME)
    shutil.rmtree(raw, ignore_errors=True)
    steps, target = (QUICK["steps"], QUICK["target"]) if quick else (tta.MAX_STEPS, tta.TARGET)
    res = tta.run(quick, timeout, log, methods=METHODS, ddp=True, name=CLUSTER_NAME,
                  subnet=CLUSTER_SUBNET, keep=raw, seeds=seeds, steps=steps, target=target)
    base = {"name": NAME, "title": TITLE, "quick": quick, "figures": [], "tables": [],
            "findings": [], "status": res["status"]}
    if res["status"].startswith("skipped") or not res.get("results"):
        base["findings"] = [f"not run: {res['status']}; {res.get('errors', '')}"]
        base["seconds"] = time.perf_counter() - t0
        return base
    results = res["results"]
    rates = [r for r in tta.RATES if r in results]
    # Every figure below claims 2 nodes and the rate: check both on what each rate's job
    # measured (tta checked them in the job; this is the experiment's own guard).
    try:
        for rate in rates:
            probed = results[rate].get("probe") or {}
            check_layout(f"network {rate}", probed.get("node_of") or [], tta.NODES,
                         probed.get("probe"), rate)
    except LayoutError as exc:
        base["status"] = f"failed: layout check: {exc}"
        base["findings"] = [f"not plotted: {exc}"]
        base["seconds"] = time.perf_counter() - t0
        return base
    from lsgd_hpc.planning.plan import model_facts
    mem = scale_model.memory_bandwidth(
        scale_model.cm.Workload(model_facts(tta.MODEL, "digits").n_params, 0, 0).flat_bytes)
    pred = predict(results, mem)
    rows = table_rows(results, pred)
    n_params = model_facts(tta.MODEL, "digits").n_params
    add_rho(rows, pred, n_params)
    tables = [write_csv(out / "time_to_accuracy.csv", rows).name,
              write_csv(out / "curves.csv", curve_rows(results)).name,
              write_csv(out / "fit.csv", [{"rate": r, "fitted_on": "+".join(p["fitted_on"]),
                                           "t_local_ms": 1e3 * p["t_local_s"],
                                           "inter_gbps": 8e-9 / p["inter"]["beta_s"]
                                           if p["inter"]["beta_s"] else math.inf,
                                           "inter_latency_us": 1e6 * p["inter"]["alpha_s"],
                                           **p["fit"]} for r, p in pred.items()]).name]
    figures = []
    plot_time_to_accuracy(rows, rates, target, len(seeds), out / "time_to_accuracy.png")
    plot_curves(results, rates, target, out / "accuracy_vs_time.png")
    plot_step_times(rows, rates, out / "step_time_predicted.png")
    figures = ["time_to_accuracy.png", "accuracy_vs_time.png", "step_time_predicted.png"]
    found = (findings(rows, rates, target, len(seeds), pred) + rho_findings(rows, n_params)
             + slowmo_as_local_sgd(results, rates))
    for k, v in res.get("errors", {}).items():
        found.append(f"error in {k}: {v}")
    seconds = time.perf_counter() - t0
    write_json(out / "network.json", {"rows": rows, "prediction": pred, "errors":
                                       res.get("errors", {}), "notes": res.get("notes"),
                                       "gpu_cases": res.get("gpu_cases"), "seconds": seconds})
    return {**base, "figures": figures, "tables": tables, "findings": found,
            "seconds": seconds}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(REPO / "results" / NAME))
    p.add_argument("--quick", action="store_true",
                   help=f"one seed, {QUICK['steps']} steps, target {QUICK['target']:.0%}".replace("%", "%%"))
    p.add_argument("--seeds", type=int, nargs="+", help="seeds (default 0 1 2; quick: 0)")
    p.add_argument("--timeout", type=float, default=600, help="seconds per link rate's job")
    p.add_argument("--refresh-rho", action="store_true",
                   help="add rho to OUT's recorded tables, training nothing")
    args = p.parse_args(argv)
    if args.refresh_rho:
        for line in refresh_rho(args.out):
            print("-", line)
        return 0
    res = run(args.out, args.quick, seeds=args.seeds, timeout=args.timeout)
    for f in res["findings"]:
        print("-", f)
    print(f"{res['seconds']:.0f} s; tables {res['tables']}; figures {res['figures']}")
    return 0 if res["status"].startswith("ok") else 1


if __name__ == "__main__":
    sys.exit(main())
