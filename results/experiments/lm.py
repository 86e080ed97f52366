"""Language model: held-out perplexity of a byte-level transformer against training time and bytes,
LSGD (single and multi-leader) against DiLoCo, SlowMo, local SGD and allreduce SGD, at 4 and 8
ranks on 2 emulated nodes.

    python results/experiments/lm.py --out results/lm [--quick] [--ranks 4 8] [--steps S]
        [--lrs 0.003 0.01 0.03] [--tune-every-rank] [--seeds 0 1] [--methods LABEL ...]
        [--rate 1gbit] [--eval-every 16]

As root. The workload is examples/char_lm.py (run as it is: its main() is called once per run):
a byte-level causal transformer (d_model 128, 2 layers, 4 heads, context 64, 0.47 M
parameters, 1.9 MB per model exchange) trained with AdamW (cosine schedule, warmup 20, gradient
clipping 1.0), batch 16 windows per rank, on the Python standard library's own sources; every
10th file is held out (the test text), every 10th from the 6th on is the validation text, and
the held-out loss (nats per byte; perplexity = its exp) is measured
on 64 fixed held-out windows for the model each method reports (LSGD: its elected global
leader, broadcast to every rank; the others: each worker's own model, evaluated every 16 steps,
a multiple of every averaging period below, so all workers hold the same model then).

Cluster: scripts/cluster.sh's network namespaces (2 nodes, each with its own host name and a tc
tbf limit of --rate, default 1 Gbit/s, on what it sends), without SLURM, under a name and
subnet of its own (--cluster), always taken down; 4 ranks = 2 nodes x 2 ranks, 8 ranks = 2
nodes x 4 ranks (all on this machine's cores). Per rank count, ONE mpirun job probes the links
(lsgd_hpc.planning.netprobe; the 2 nodes and the rate are checked before anything trains), runs
a short warm-up training (not reported: the first training of a process pays one-off costs)
and then every (seed, learning rate, method) training one after another, seed-major.

Methods (the same steps, data, model and learning rates for each):

* LSGD 1 leader: ``--method lsgd --ranks-per-node WORLD``: all ranks one node, so the only
  leader is the global one; every worker is pulled toward it every tau_global = 16 steps;
* LSGD multi-leader: ``--method lsgd``, nodes by host name: pulls toward the node leader every
  tau_local = 4 steps (inside a node) and toward the global leader every 16 (across the link);
* DiLoCo H=8 (outer Nesterov SGD, lr 0.7), SlowMo (T=8, slow step every 24), local SGD (T=8);
* allreduce SGD (gradients averaged every step).

Tuning: at the first rank count each method is run at every learning rate of ``--lrs`` (AdamW's;
default 3e-3, 1e-2 and 3e-2) and its run with the lowest final validation loss (64 windows of
the validation files, never trained on, not the held-out files) is picked; the
later rank counts train each method at its pick (``--tune-every-rank``: all learning rates
there too). The tuning runs use seed 0; the picks then run with the reported seeds (1, 2, 3)
at every rank count, and only those are in the summary and the figures. Full budget: 144 steps
per rank at 4 ranks, 96 at 8; --quick: 48 steps at 4 ranks, one learning rate, one seed, no
tuning (1 min).

Outputs in --out: lm_runs.csv (one row per run), lm_summary.csv (per rank count and method: the
tuned run and its comparison with the best baseline by perplexity), lm_<ranks>ranks.png
(held-out perplexity against training time and against bytes sent by all ranks, log x),
lm.json. Training time is the trainer's (evaluations excluded; the slowest rank's); comm_s the
seconds in communication calls (the rank that spent most). Bytes are the logical payload
(docs/metrics.md): a broadcast counts once as sent (at its root) and once per receiver as
received, an allreduce once per rank in both, so "bytes sent" flatters broadcast-based methods
(LSGD) against allreduce-based ones; the findings give both. Every run and summary row
carries rho (docs/planning.md): one fp32 allreduce of the parameters between the nodes
predicted from the probed link, over the compute seconds a step (training time less
communication, / steps): columns rho, rho_allreduce_s, rho_compute_s, rho_source
(``--refresh-rho`` adds them to recorded results, training nothing). Raw runs:
runs/results/lm/.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Dict, List, Optional

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
for _p in (REPO, REPO / "benchmarks", HERE):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))
from _shared import (RHO_COLUMNS, LayoutError, check_layout, new_figure, raw_dir,  # noqa: E402
                     rho_sentence, save_figure, write_csv, write_json)
from _shared import add_rho as shared_add_rho  # noqa: E402

NAME = "lm"
TITLE = "Language model: held-out perplexity against training time and bytes, 2 emulated nodes"
#: the emulated cluster's name and subnet: our own, other clusters may be up
CLUSTER_NAME, CLUSTER_SUBNET = "lsgdlm", "10.79.9"
NODES = 2
CHAR_LM = REPO / "examples" / "char_lm.py"

#: (label, char_lm options); ``{world}`` is replaced by the rank count
METHODS = [
    ("LSGD 1 leader", ["--method", "lsgd", "--tau-local", "4", "--tau-global", "16",
                       "--ranks-per-node", "{world}"]),
    ("LSGD multi-leader", ["--method", "lsgd", "--tau-local", "4", "--tau-global", "16"]),
    ("DiLoCo H=8", ["--method", "diloco", "--local-steps", "8", "--outer-lr", "0.7"]),
    ("SlowMo T=8", ["--method", "slowmo", "--local-steps", "8", "--slowmo-every", "24"]),
    ("local SGD T=8", ["--method", "local-sgd", "--local-steps", "8"]),
    ("allreduce SGD", ["--method", "allreduce"]),
]
LSGD_METHODS = ("LSGD 1 leader", "LSGD multi-leader")
#: the workload: char_lm's defaults, written out (what the docstring describes)
WORKLOAD = ["--batch-size", "16", "--context", "64", "--d-model", "128", "--layers", "2",
            "--heads", "4", "--warmup", "20", "--eval-windows", "64", "--max-bytes", "2000000"]
#: budgets: steps per rank by rank count (multiples of EVAL_EVERY), learning rates tried at the
#: first rank count (the later ones train each method's pick there), seeds
EVAL_EVERY = 16
FULL = dict(steps={4: 144, 8: 96}, ranks=(4, 8), lrs=(3e-3, 1e-2, 3e-2), seeds=(1, 2, 3))
QUICK = dict(steps={4: 48}, ranks=(4,), lrs=(3e-3,), seeds=(1,))
#: the seed of the tuning runs: not a reported one
TUNE_SEED = 0
#: the warm-up training each job starts with (not reported): the first training of a process
#: pays one-off costs (allocations, lazy initialisation) that would fall on one method only
WARMUP = ["--method", "allreduce", "--steps", "4", "--eval-every", "0"]

RUN_COLUMNS = ["ranks", "nodes", "method", "role", "lr", "lr_picked_at", "seed", "tuned_pick",
               "final_val_loss", "final_loss", "final_perplexity", "model", "training_time_s", "comm_s",
               "wall_time_s", "bytes_sent", "bytes_recv", "steps", *RHO_COLUMNS]
SUMMARY_COLUMNS = ["ranks", "method", "lrs_tried", "lr", "lr_picked_at", "seeds", "final_loss",
                   "final_perplexity", "perplexity_std", "final_val_loss", "training_time_s", "comm_s", "bytes_sent", "bytes_recv",
                   "steps", "rank_by_perplexity",
                   "best_baseline", "perplexity_minus_best_baseline",
                   "perplexity_over_best_baseline", "time_over_best_baseline",
                   "bytes_sent_over_best_baseline", "bytes_recv_over_best_baseline", *RHO_COLUMNS]


# -- the cluster ------------------------------------------------------------------------------
def cluster_available() -> Optional[str]:
    """None when the emulated cluster can be made here, else why not."""
    import time_to_accuracy as tta
    return tta.cluster_available()


@contextmanager
def emulated_cluster(rate: str, ranks_per_node: int, log=print, name: str = CLUSTER_NAME,
                     subnet: str = CLUSTER_SUBNET):
    """time_to_accuracy.emulated_cluster with ``ranks_per_node`` ranks on each of the NODES
    nodes: bring the cluster up with ``rate`` per node link, yield its mpirun options, always
    take it down."""
    import time_to_accuracy as tta
    tta._sh("down", "--name", name)          # a leftover of an interrupted run
    try:
        t0 = time.perf_counter()
        up = tta._sh("up", "--name", name, "--subnet", subnet, "--nodes", str(NODES),
                     "--rate", rate, "--no-slurm", timeout=300)
        if up.returncode != 0:
            raise RuntimeError(f"cluster.sh up failed: {(up.stderr or up.stdout).strip()[-300:]}")
        log(f"  lm: cluster {name} up at {rate} in {time.perf_counter() - t0:.1f} s")
        args = tta._sh("mpirun-args", "--name", name, "--ranks-per-node", str(ranks_per_node))
        if args.returncode != 0:
            raise RuntimeError(f"cluster.sh mpirun-args failed: {args.stderr.strip()[-300:]}")
        yield args.stdout.split()
    finally:
        down = tta._sh("down", "--name", name)
        if down.returncode != 0:
            log(f"  lm: cluster.sh down: {down.stderr.strip()[-300:]}")


# -- the MPI job (every rank) -----------------------------------------------------------------
def job(spec_path: str) -> int:
    """Probe the links (nodes by host name) and check the claimed layout and rate, then run
    examples/char_lm.py's main() once per command line of the spec."""
    import importlib.util
    spec = json.loads(Path(spec_path).read_text())
    from mpi4py import MPI
    from lsgd_hpc.comm import NodeGroups
    from lsgd_hpc.comm.mpi import MPICommunicator
    from lsgd_hpc.planning.netprobe import probe_groups
    world = MPICommunicator(MPI.COMM_WORLD)
    groups = NodeGroups.build(world, None)
    probe = probe_groups(groups)
    error = None
    if world.rank == 0:
        try:
            check_layout(spec["what"], groups.node_of, NODES, probe, spec["rate"])
        except LayoutError as exc:
            error = str(exc)
        Path(spec["probe_out"]).write_text(json.dumps({"probe": probe, "node_of":
                                                       groups.node_of, "layout_error": error},
                                                      default=float))
    error = MPI.COMM_WORLD.bcast(error, root=0)
    groups.free()
    if error:
        if world.rank == 0:
            print(f"lm: {error}", file=sys.stderr, flush=True)
        return 3
    mod_spec = importlib.util.spec_from_file_location("char_lm", CHAR_LM)
    char_lm = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(char_lm)
    for argv in spec["argvs"]:
        sys.argv = [str(CHAR_LM), *argv]
        t0 = time.perf_counter()
        char_lm.main()
        MPI.COMM_WORLD.Barrier()
        if world.rank == 0:
            print(f"lm: ran in {time.perf_counter() - t0:.1f} s: {' '.join(argv)}", flush=True)
    return 0


# -- reading runs -----------------------------------------------------------------------------
def read_run(d: Path) -> Dict:
    """Final held-out loss of the reported model, training time, bytes, and the curve
    (every evaluation: step, training time, bytes sent by all ranks, loss)."""
    from lsgd_hpc.analysis import aggregate
    run = aggregate.read_run(d)
    s = aggregate.summarize_run(run)
    tab = aggregate.eval_table(run)
    # Every rank evaluates the reported model (LSGD: the leader's, broadcast) or, for the
    # others, its own at a step where all workers hold the same model: the mean over ranks.
    curve = [{"step": int(tab["step"][i]), "training_time": float(tab["training_time"][i]),
              "bytes_sent": float(tab["bytes_sent"][i]), "loss": float(tab["loss_mean"][i])}
             for i in range(len(tab["step"])) if tab["complete"][i]]
    spread = max((float(aggregate.col(r, "eval", "test_loss")[-1]) for r in run.ranks.values()),
                 default=math.nan) - min((float(aggregate.col(r, "eval", "test_loss")[-1])
                                          for r in run.ranks.values()), default=math.nan)
    last = curve[-1] if curve else {"loss": math.nan}
    vals = [float(aggregate.col(r, "eval", "val_loss")[-1]) for r in run.ranks.values()
            if len(aggregate.col(r, "eval", "val_loss"))]
    val_loss = sum(vals) / len(vals) if vals else math.nan
    # seconds in communication calls, the rank that spent most
    comm = max((float(aggregate.col(r, "train", "comm_seconds")[-1]) for r in run.ranks.values()
                if len(aggregate.col(r, "train", "comm_seconds"))), default=math.nan)
    return {"nodes": s["n_nodes"], "final_loss": last["loss"], "comm_s": comm,
            "final_val_loss": val_loss,
            "final_perplexity": math.exp(last["loss"]) if last["loss"] == last["loss"]
            else math.nan, "training_time_s": s["training_time"], "wall_time_s": s["wall_time"],
            "bytes_sent": int(s["total_bytes_sent"]), "bytes_recv": int(s["total_bytes_recv"]),
            "steps": int(s["steps"]), "final_loss_spread_over_ranks": spread, "curve": curve}


def pick_lrs(tune_rows: List[Dict]) -> Dict:
    """(rank count, method) -> the learning rate whose tuning run(s) ended with the lowest
    validation loss (validation windows: other files than the reported held-out ones); marks
    the tuning rows' ``tuned_pick``."""
    by: Dict = {}
    for r in tune_rows:
        by.setdefault((r["ranks"], r["method"]), {}).setdefault(r["lr"], []).append(r)
    picks = {}
    for key, by_lr in by.items():
        picks[key] = min(by_lr, key=lambda lr: sum(r["final_val_loss"] for r in by_lr[lr])
                         / len(by_lr[lr]))
        for lr, rs in by_lr.items():
            for r in rs:
                r["tuned_pick"] = int(lr == picks[key])
    return picks


#: parameters of examples/char_lm.py at WORKLOAD's sizes (d_model 128, 2 layers, 4 heads,
#: context 64): what rho's fp32 allreduce moves
N_PARAMS = 470_784


def add_rho(rows: List[Dict], summary: List[Dict], probes: Dict) -> None:
    """rho of every run and summary row (_shared.rho_fields): one fp32 allreduce of the
    model between the 2 nodes, predicted from the link the job of that rank count probed,
    over the compute seconds of one step (training time less communication, / steps; a
    summary row: its means)."""
    def link(r):
        probe = probes.get(str(r["ranks"])) or probes.get(r["ranks"]) or {}
        return (probe.get("probe") or {}).get("inter")

    shared_add_rho([*rows, *summary], N_PARAMS, link, lambda r: (NODES, r["ranks"] // NODES),
                   lambda r: (r["training_time_s"] - r["comm_s"]) / r["steps"])


def rho_findings(summary: List[Dict]) -> List[str]:
    """One sentence a rank count: allreduce SGD's rho there and its parts."""
    return [rho_sentence(f"at {s['ranks']} ranks ({NODES} nodes)", s, N_PARAMS)
            for s in summary if s["method"] == "allreduce SGD" and "rho" in s]


def refresh_rho(out) -> List[str]:
    """rho into OUT/lm.json, lm_runs.csv and lm_summary.csv from the recorded numbers,
    training nothing (``python results/experiments/lm.py --refresh-rho``); returns the rho
    findings."""
    out = Path(out)
    doc = json.loads((out / "lm.json").read_text())
    add_rho(doc["runs"], doc["summary"], doc["probes"])
    write_json(out / "lm.json", doc)
    write_csv(out / "lm_runs.csv", doc["runs"], RUN_COLUMNS + ["final_loss_spread_over_ranks"])
    write_csv(out / "lm_summary.csv", doc["summary"], SUMMARY_COLUMNS)
    return rho_findings(doc["summary"])


def summarize(rows: List[Dict]) -> List[Dict]:
    """Per rank count and method: the reported runs (the picked learning rate, every reported
    seed; mean and standard deviation over seeds), then their comparison with the best
    baseline. Tuning runs (role "tune") only say which learning rates were tried."""
    out = []
    report = [r for r in rows if r.get("role", "report") == "report"]
    tried: Dict = {}
    for r in rows:
        if r.get("role") == "tune":
            tried.setdefault(r["method"], set()).add(r["lr"])
    for world in sorted({r["ranks"] for r in report}):
        per: Dict = {}
        for r in report:
            if r["ranks"] == world:
                per.setdefault(r["method"], []).append(r)
        tuned = {}
        for m, rs in per.items():
            def mean(k):
                return sum(r[k] for r in rs) / len(rs)
            ppl = [r["final_perplexity"] for r in rs]
            std = (math.sqrt(sum((x - mean("final_perplexity")) ** 2 for x in ppl)
                             / (len(ppl) - 1)) if len(ppl) > 1 else 0.0)
            tuned[m] = {"ranks": world, "method": m,
                        "lrs_tried": " ".join(f"{lr:g}" for lr in sorted(
                            tried.get(m, {rs[0]["lr"]}))), "lr": rs[0]["lr"],
                        "final_loss": mean("final_loss"), "final_perplexity": mean(
                            "final_perplexity"), "perplexity_std": std,
                        "final_val_loss": mean("final_val_loss"),
                        "training_time_s": mean("training_time_s"),
                        "comm_s": mean("comm_s"), "lr_picked_at": rs[0]["lr_picked_at"],
                        "bytes_sent": mean("bytes_sent"), "bytes_recv": mean("bytes_recv"),
                        "steps": rs[0]["steps"], "seeds": len(rs)}
        order = sorted(tuned.values(), key=lambda t: t["final_perplexity"])
        base = [t for t in order if t["method"] not in LSGD_METHODS]
        best = base[0] if base else None
        for i, t in enumerate(order):
            t["rank_by_perplexity"] = i + 1
            if best is not None:
                t.update(best_baseline=best["method"],
                         perplexity_minus_best_baseline=t["final_perplexity"]
                         - best["final_perplexity"],
                         perplexity_over_best_baseline=t["final_perplexity"]
                         / best["final_perplexity"],
                         time_over_best_baseline=t["training_time_s"] / best["training_time_s"],
                         bytes_sent_over_best_baseline=t["bytes_sent"] / max(best["bytes_sent"], 1),
                         bytes_recv_over_best_baseline=t["bytes_recv"] / max(best["bytes_recv"], 1))
        out += [tuned[m] for m, _ in METHODS if m in tuned]
    return out


# -- figures ----------------------------------------------------------------------------------
def plot(rows: List[Dict], summary: List[Dict], world: int, rate: str, out: Path) -> str:
    fig, (ax_t, ax_b) = new_figure(2, width=6.0, height=4.4)
    labels = [m for m, _ in METHODS]
    picks = {(s["method"], s["lr"]) for s in summary if s["ranks"] == world}
    for r in rows:
        if r["ranks"] != world:
            continue
        i = labels.index(r["method"])
        pick = (r["method"], r["lr"]) in picks
        pts = [p for p in r["curve"] if p["step"] > 0]
        kw = dict(color=f"C{i}", lw=1.6 if pick else 0.8, alpha=0.95 if pick else 0.35,
                  ls="-" if pick else "--", marker="o" if pick else None, ms=3)
        lab = f"{r['method']} (lr {r['lr']:g})" if pick and r["seed"] == min(
            x["seed"] for x in rows if x["ranks"] == world) else None
        ppl = [math.exp(p["loss"]) for p in pts]
        ax_t.plot([p["training_time"] for p in pts], ppl, label=lab, **kw)
        ax_b.plot([p["bytes_sent"] for p in pts], ppl, label=lab, **kw)
    from matplotlib.ticker import FuncFormatter
    for ax in (ax_t, ax_b):
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.set_ylabel("held-out perplexity (per byte)")
    ax_t.set_xlabel("training time, slowest rank (s)")
    ax_b.set_xlabel("bytes sent by all ranks (logical payload)")
    ax_b.set_xscale("log")
    ax_t.set_title(f"{world} ranks (2 nodes x {world // NODES}), {rate} links: vs time")
    ax_b.set_title(f"{world} ranks: vs bytes sent\n(each method at its tuned lr, one line per "
                   "seed)")
    ax_t.legend(loc="upper right")
    name = f"lm_{world}ranks.png"
    save_figure(fig, out / name)
    return name


# -- findings ---------------------------------------------------------------------------------
def _gb(x: float) -> str:
    return f"{x / 1e9:.2f} GB" if x >= 1e8 else f"{x / 1e6:.1f} MB"


def _ppl_at(curve: List[Dict], t: float) -> float:
    """Perplexity of the last evaluation at or before training time t (nan if none)."""
    pts = [p for p in curve if p["training_time"] <= t * (1 + 1e-9)]
    return math.exp(pts[-1]["loss"]) if pts else math.nan


def findings(rows: List[Dict], summary: List[Dict], n_seeds: int, n_lrs: int) -> List[str]:
    out = []
    # the same method at two learning rates costs the same: how far apart their times are is
    # the timing noise of this machine (it is shared)
    noise = []
    for r in rows:
        twins = [x for x in rows if x["ranks"] == r["ranks"] and x["method"] == r["method"]
                 and x["seed"] == r["seed"] and x["lr"] > r["lr"]]
        noise += [abs(x["training_time_s"] - r["training_time_s"])
                  / (0.5 * (x["training_time_s"] + r["training_time_s"])) for x in twins]
    noise_med = sorted(noise)[len(noise) // 2] if noise else 0.0
    for world in sorted({s["ranks"] for s in summary}):
        ss = sorted((s for s in summary if s["ranks"] == world),
                    key=lambda s: s["final_perplexity"])
        if not ss:
            continue
        win = ss[0]
        out.append(f"{world} ranks: lowest held-out perplexity: {win['method']} "
                   f"{win['final_perplexity']:.2f} ({win['training_time_s']:.1f} s, "
                   f"{_gb(win['bytes_sent'])} sent); order: "
                   + ", ".join(f"{s['method']} {s['final_perplexity']:.2f} "
                               f"({s['training_time_s']:.0f} s, {_gb(s['bytes_sent'])})"
                               for s in ss) + ".")
        dl = next((s for s in ss if s["method"].startswith("DiLoCo")), None)
        if dl:
            h = int(dl["method"].split("H=")[1]) if "H=" in dl["method"] else 0
            outer = f" after {dl['steps'] // h} outer steps" if h else ""
            out.append(f"{world} ranks: DiLoCo is #{dl['rank_by_perplexity']} of {len(ss)} by "
                       f"perplexity{outer} ({dl['final_perplexity']:.2f} vs the winner's "
                       f"{win['final_perplexity']:.2f}) and sent "
                       f"{dl['bytes_sent'] / max(min(s['bytes_sent'] for s in ss), 1):.2f}x the "
                       f"bytes of the method that sent fewest.")
        ar = next((s for s in ss if s["method"] == "allreduce SGD"), None)
        if ar and ar["training_time_s"] > 0 and ar["comm_s"] == ar["comm_s"]:
            share = ar["comm_s"] / ar["training_time_s"]
            out.append(f"{world} ranks: allreduce SGD spent {100 * share:.0f} % of its training "
                       f"time in communication ({ar['comm_s']:.1f} of "
                       f"{ar['training_time_s']:.1f} s): the link is "
                       + ("the main cost here, the regime DiLoCo is designed for."
                          if share >= 0.5 else "not the main cost here (compute is), so this "
                          "is not the bandwidth-starved regime DiLoCo is designed for."))
        # who is ahead at the same training time: that of the fastest tuned run
        tuned_curves = {s["method"]: next(r["curve"] for r in rows if r["ranks"] == world
                                          and r["method"] == s["method"] and r["lr"] == s["lr"]
                                          and r.get("role", "report") == "report")
                        for s in ss}
        t_min = min(c[-1]["training_time"] for c in tuned_curves.values() if c)
        at = sorted(((_ppl_at(c, t_min), m) for m, c in tuned_curves.items()),
                    key=lambda x: (math.isnan(x[0]), x[0]))
        out.append(f"{world} ranks: at {t_min:.1f} s of training (the fastest run's end; the last "
                   f"evaluation before it, first seed): " + ", ".join(
                       f"{m} {p:.2f}" for p, m in at if p == p) + ".")
        for s in ss:
            if s["method"] not in LSGD_METHODS or "best_baseline" not in s:
                continue
            d = s["perplexity_minus_best_baseline"]
            verdict = "wins" if d < 0 else "loses" if d > 0 else "ties"
            tr, br = s["time_over_best_baseline"], s["bytes_sent_over_best_baseline"]
            out.append(
                f"{world} ranks: {s['method']} {verdict} against the best tuned baseline "
                f"({s['best_baseline']}) on perplexity by {abs(d):.2f} "
                f"({100 * (s['perplexity_over_best_baseline'] - 1):+.1f} %: "
                f"{s['final_perplexity']:.2f} vs {s['final_perplexity'] - d:.2f}); "
                + (f"its training time is within the timing noise ({tr:.2f}x)"
                   if abs(tr - 1) <= noise_med else
                   f"it is {'faster' if tr < 1 else 'slower'} ({tr:.2f}x the training time)")
                + " and it sends "
                f"{'fewer' if br < 1 else 'more'} bytes ({br:.2f}x sent, "
                f"{s['bytes_recv_over_best_baseline']:.2f}x received).")
    spread = [r["final_loss_spread_over_ranks"] for r in rows
              if r["method"] not in LSGD_METHODS and r["final_loss_spread_over_ranks"] == r[
                  "final_loss_spread_over_ranks"]]
    if spread and max(spread) > 1e-4:
        out.append(f"Note: a baseline's ranks ended with held-out losses up to {max(spread):.2g} "
                   "nats apart (not one model at the end); the table takes their mean.")
    tuned = [s for s in summary if len(s["lrs_tried"].split()) > 1]
    if tuned:
        grid = sorted(float(x) for x in tuned[0]["lrs_tried"].split())
        for edge, word in ((grid[-1], "largest"), (grid[0], "smallest")):
            at = [s["method"] for s in tuned if s["lr"] == edge]
            if len(at) == len(tuned):
                out.append(f"Every method's pick is the {word} learning rate tried ({edge:g}): "
                           "the grid's edge, so each might do better beyond it.")
            elif at:
                out.append(f"Picked at the {word} learning rate tried ({edge:g}), the grid's "
                           f"edge: {', '.join(at)}.")
    if noise:
        out.append(f"Timing noise: the same method's runs at different learning rates (same "
                   f"work and traffic) differ in training time by {100 * min(noise):.0f}-"
                   f"{100 * max(noise):.0f} % (median {100 * sorted(noise)[len(noise) // 2]:.0f}"
                   f" %); time ratios within that are not differences.")
    out.append(f"Caveats: {n_seeds} reported seed{'s' * (n_seeds > 1)} per method; "
               + (f"{n_lrs} learning rates per method, one tuning run each (seed {TUNE_SEED}, "
                  "not reported, at the first rank count), the pick made on validation "
                  "windows (other source files than the held-out ones reported)"
                  if n_lrs > 1 else
                  "one learning rate for every method, no tuning")
               + "; ranks "
               "share this machine's cores, so compute is slow and the link's share of the "
               "step time (comm_s in the tables) is smaller than on real nodes.")
    return out


# -- the experiment ---------------------------------------------------------------------------
def _slug(label: str) -> str:
    return label.lower().replace(" ", "-").replace("=", "")


def _steps_for(steps, budget, world: int) -> int:
    if steps:
        return int(steps)
    table = budget["steps"]
    return int(table.get(world, table[max(table)]))


def _train(world: int, argvs: List[List[str]], steps: int, rate: str, raw: Path, cluster,
           timeout_per_run: float, log) -> Dict:
    """One mpirun job on the emulated cluster: the probe, a warm-up, then every command line
    of ``argvs``. Returns {"probe": ..., "error": None or why}."""
    from lsgd_hpc.testing import mpi_env, mpirun_path, run_group
    env = mpi_env({"LSGD_HPC_RANKS_PER_NODE": ""})
    env.pop("LSGD_HPC_RANKS_PER_NODE", None)
    warm = raw / f"np{world}" / "warmup"
    shutil.rmtree(warm, ignore_errors=True)
    spec = raw / f"np{world}.json"
    probe_out = spec.with_suffix(".probe.json")
    probe_out.unlink(missing_ok=True)
    spec.parent.mkdir(parents=True, exist_ok=True)
    spec.write_text(json.dumps({"argvs": [[*WARMUP, *WORKLOAD, "--run-dir", str(warm)], *argvs],
                                "probe_out": str(probe_out), "rate": rate,
                                "what": f"lm {world} ranks at {rate}"}))
    try:
        with emulated_cluster(rate, world // NODES, log, *cluster) as margs:
            cmd = [mpirun_path(), *margs, "-x", "PYTHONPATH", "-x", "OMP_NUM_THREADS",
                   "-x", "PATH", "-x", "PYTHONUNBUFFERED", "-np", str(world),
                   sys.executable, str(Path(__file__)), "--job", str(spec)]
            t1 = time.perf_counter()
            p = run_group(cmd, env=env, cwd=REPO, timeout=timeout_per_run * (len(argvs) + 1))
            log(f"lm: {len(argvs)} trainings of {steps} steps on {world} ranks in "
                f"{time.perf_counter() - t1:.0f} s (with start-up, probe and warm-up)")
            for line in (p.stdout or "").splitlines():
                if line.startswith("lm: ran"):
                    log(f"  {line[:60]} ... {line.split('--run-dir')[-1].strip()}")
    except (RuntimeError, subprocess.SubprocessError, OSError) as exc:
        return {"probe": None, "error": str(exc)}
    probe = json.loads(probe_out.read_text()) if probe_out.exists() else None
    if probe and probe.get("layout_error"):
        return {"probe": probe, "error": f"layout check: {probe['layout_error']}",
                "layout": True}
    if p.returncode != 0:
        why = "timed out" if p.returncode is None else f"exit {p.returncode}"
        return {"probe": probe, "error": f"{why}: {(p.stderr or p.stdout).strip()[-600:]}"}
    return {"probe": probe, "error": None}


def _read(dirs: Dict, rows: List[Dict], errors: Dict, picked_at: Dict,
          role: str = "report") -> None:
    for (world, label, lr, seed), d in dirs.items():
        if any(r["ranks"] == world and r["method"] == label and r["lr"] == lr
               and r["seed"] == seed and r["role"] == role for r in rows):
            continue
        try:
            r = read_run(d)
        except Exception as exc:           # a missing or cut run: report it, go on
            errors[f"{world} ranks {label} lr {lr:g} seed {seed}"] = \
                f"{type(exc).__name__}: {exc}"
            continue
        # the node index every rank's file recorded: 2 nodes, except for LSGD 1 leader,
        # which groups all ranks as one node on purpose (the probe checked the 2 hosts)
        if label != "LSGD 1 leader" and r["nodes"] != NODES:
            errors[f"{world} ranks {label}"] = f"ran on {r['nodes']} node(s), not {NODES}"
            continue
        rows.append({"ranks": world, "method": label, "role": role, "lr": lr, "seed": seed,
                     "tuned_pick": "", "lr_picked_at": picked_at.get(world, world),
                     "model": "leader" if label in LSGD_METHODS else "own (all agree)", **r})


def run(out, quick: bool = False, log=print, ranks=None, steps=None, lrs=None, seeds=None,
        methods=None, rate: str = "1gbit", eval_every: Optional[int] = None, raw=None,
        timeout_per_run: float = 240.0, cluster=(CLUSTER_NAME, CLUSTER_SUBNET),
        tune_every_rank: bool = False) -> Dict:
    """Train every method at every rank count on the emulated cluster, read the runs, write the
    tables and figures. Learning rates: all of ``lrs`` at the first rank count; the later
    ones train each method's pick there (all of them with ``tune_every_rank``)."""
    t0 = time.perf_counter()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    budget = QUICK if quick else FULL
    ranks = tuple(ranks or budget["ranks"])
    lrs = tuple(lrs or budget["lrs"])
    seeds = tuple(budget["seeds"] if seeds is None else seeds)
    chosen = [(m, o) for m, o in METHODS if not methods or m in methods]
    base = {"name": NAME, "title": TITLE, "quick": quick, "figures": [], "tables": [],
            "findings": []}
    why_not = cluster_available()
    if why_not:
        return {**base, "status": f"skipped: {why_not}",
                "findings": [f"not run: the emulated cluster is not available here: {why_not}"],
                "seconds": time.perf_counter() - t0}
    bad = [w for w in ranks if w % NODES]
    if bad:
        raise ValueError(f"rank counts must be multiples of {NODES} (nodes): {bad}")
    raw = Path(raw or raw_dir(NAME))
    errors, probes, rows, picked_at, steps_of = {}, {}, [], {}, {}
    picks: Dict = {}
    # the jobs: tuning (seed TUNE_SEED, every learning rate) at the first rank count, or at
    # every one with tune_every_rank, then the reported seeds at each method's pick
    jobs = []
    for i, world in enumerate(ranks):
        if len(lrs) > 1 and (i == 0 or tune_every_rank):
            jobs.append((world, "tune"))
        jobs.append((world, "report"))
    for world, role in jobs:
        n = steps_of[world] = _steps_for(steps, budget, world)
        ev = int(eval_every or min(EVAL_EVERY, n))
        tuned_at = world if (world, chosen[0][0]) in picks or tune_every_rank else ranks[0]
        if role == "report":
            picked_at[world] = tuned_at
        dirs, argvs = {}, []
        for seed in ((TUNE_SEED,) if role == "tune" else seeds):
            for lr in lrs:
                for label, opts in chosen:
                    if role == "report" and picks.get((tuned_at, label), lrs[0]) != lr:
                        continue
                    d = raw / f"np{world}" / f"{_slug(label)}-lr{lr:g}-seed{seed}"
                    shutil.rmtree(d, ignore_errors=True)
                    dirs[(world, label, lr, seed)] = d
                    argvs.append([*(o.replace("{world}", str(world)) for o in opts), *WORKLOAD,
                                  "--lr", f"{lr:g}", "--steps", str(n),
                                  "--eval-every", str(ev), "--seed", str(seed),
                                  "--run-dir", str(d)])
        res = _train(world, argvs, n, rate, raw, cluster, timeout_per_run, log)
        if res.get("layout"):
            return {**base, "status": f"failed: {res['error']}",
                    "findings": [f"not plotted: {res['error']}"],
                    "seconds": time.perf_counter() - t0}
        probes[world] = res["probe"]
        if res["error"]:
            errors[f"{world} ranks ({role})"] = res["error"]
        _read(dirs, rows, errors, picked_at, role)
        if role == "tune":
            picks.update(pick_lrs([r for r in rows if r["role"] == "tune"
                                   and r["ranks"] == world]))
    if not rows:
        return {**base, "status": "failed", "findings": [f"error: {k}: {v}"
                                                         for k, v in errors.items()],
                "seconds": time.perf_counter() - t0}
    summary = summarize(rows)
    add_rho(rows, summary, probes)
    write_csv(out / "lm_runs.csv", rows, RUN_COLUMNS + ["final_loss_spread_over_ranks"])
    write_csv(out / "lm_summary.csv", summary, SUMMARY_COLUMNS)
    worlds = sorted({r["ranks"] for r in rows if r["role"] == "report"})
    figures = [plot([r for r in rows if r["role"] == "report"], summary, w, rate, out)
               for w in worlds]
    link = []
    for w, pr in probes.items():
        inter = ((pr or {}).get("probe") or {}).get("inter") or {}
        beta = float(inter.get("beta_s_per_byte") or 0)
        if beta > 0:
            link.append(f"{w} ranks {8e-9 / beta:.2f} Gbit/s")
    found = [f"Setup: byte-level transformer (examples/char_lm.py, 0.47 M parameters), "
             f"steps per rank {', '.join(f'{steps_of[w]} at {w} ranks' for w in worlds)} "
             f"(16 windows x 64 bytes each), evaluation every "
             f"{int(eval_every or EVAL_EVERY)} steps; "
             f"2 emulated nodes with {rate} per node link (probed between nodes: "
             f"{', '.join(link) or 'n/a'}); ranks {', '.join(map(str, worlds))}; "
             f"learning rates {', '.join(f'{lr:g}' for lr in lrs)} per method at "
             + ("every rank count" if tune_every_rank or len(worlds) == 1 else
                f"{worlds[0]} ranks, each method's pick there at the others")
             + (f" (tuning runs: seed {TUNE_SEED})" if len(lrs) > 1 else "")
             + "; reported seeds "
             f"{', '.join(map(str, seeds))}; perplexity = exp(held-out loss per byte) of the "
             "reported model (LSGD: the elected leader) at the end."]
    found += findings(rows, summary, len(seeds), len(lrs)) + rho_findings(summary)
    found += [f"error in {k}: {v}" for k, v in errors.items()]
    seconds = time.perf_counter() - t0
    write_json(out / "lm.json", {"summary": summary, "runs": rows, "probes": probes,
                                 "errors": errors, "seconds": seconds,
                                 "cluster": {"nodes": NODES, "rate": rate}})
    return {**base, "status": "ok" if not errors else "ok (with errors)", "figures": figures,
            "tables": ["lm_summary.csv", "lm_runs.csv"], "findings": found, "seconds": seconds}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(REPO / "results" / NAME))
    p.add_argument("--quick", action="store_true",
                   help="small budget: 48 steps at 4 ranks only, one learning rate (3e-3)")
    p.add_argument("--ranks", type=int, nargs="+",
                   help="rank counts, multiples of 2 (default 4 8: 2 nodes x 2 and x 4)")
    p.add_argument("--steps", type=int, help="steps per rank at every rank count (default "
                                              "144 at 4 ranks, 96 at 8)")
    p.add_argument("--lrs", type=float, nargs="+",
                   help="AdamW learning rates tried per method (default 0.003 0.01 0.03)")
    p.add_argument("--seeds", type=int, nargs="+",
                   help="reported seeds (default 1 2 3; the tuning runs use seed "
                        f"{TUNE_SEED})")
    p.add_argument("--methods", nargs="+", metavar="LABEL",
                   help="subset of: " + ", ".join(f"'{m}'" for m, _ in METHODS))
    p.add_argument("--eval-every", type=int,
                   help=f"steps between evaluations (default {EVAL_EVERY})")
    p.add_argument("--rate", default="1gbit", help="tc rate of each node's link (default 1gbit)")
    p.add_argument("--raw", metavar="DIR", help=f"raw runs (default runs/results/{NAME}/)")
    p.add_argument("--cluster", nargs=2, metavar=("NAME", "SUBNET"),
                   default=[CLUSTER_NAME, CLUSTER_SUBNET],
                   help=f"emulated cluster's name and subnet (default {CLUSTER_NAME} "
                        f"{CLUSTER_SUBNET}; another may be up beside it)")
    p.add_argument("--tune-every-rank", action="store_true",
                   help="try every learning rate at every rank count (default: at the first; "
                        "the others train each method's pick there)")
    p.add_argument("--refresh-rho", action="store_true",
                   help="add rho to OUT's recorded tables, training nothing")
    p.add_argument("--job", help=argparse.SUPPRESS)     # the MPI job itself (every rank)
    args = p.parse_args(argv)
    if args.job:
        return job(args.job)
    if args.refresh_rho:
        for line in refresh_rho(args.out):
            print("-", line)
        return 0
    if args.methods:
        unknown = set(args.methods) - {m for m, _ in METHODS}
        if unknown:
            p.error(f"unknown methods {sorted(unknown)}")
    res = run(args.out, args.quick, ranks=args.ranks, steps=args.steps, lrs=args.lrs,
              seeds=args.seeds, methods=args.methods, rate=args.rate,
              eval_every=args.eval_every, raw=args.raw, cluster=tuple(args.cluster),
              tune_every_rank=args.tune_every_rank)
    for f in res["findings"]:
        print("-", f)
    print(f"{res['seconds']:.0f} s; tables {res['tables']}; figures {res['figures']}")
    return 0 if res["status"].startswith("ok") else 1


if __name__ == "__main__":
    sys.exit(main())
