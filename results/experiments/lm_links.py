"""Slow links: the language model at 100 Mbit/s and 1 Gbit/s between 2 emulated nodes, with the
low-bandwidth methods (Streaming DiLoCo, int8 with error feedback, LSGD's pull delay) and workers
that span a node, against allreduce SGD and plain DiLoCo and LSGD.

    python results/experiments/lm_links.py --out results/lm_links [--quick] [--rates 100mbit 1gbit]
        [--steps S] [--lrs 0.003 0.01 0.03] [--seeds 1 2 3] [--methods LABEL ...]

As root. The workload is results/experiments/lm.py's (examples/char_lm.py: a byte-level
transformer, 0.47 M parameters, AdamW, 16 windows of 64 bytes per rank and step, the Python
standard library's sources; held-out perplexity of the reported model), on 4 ranks = 2 nodes
x 2 ranks (network namespaces with their own host names; a tc tbf limit of the rate on what
each node sends). Per rate ONE mpirun job probes the link (the layout and the rate are checked
before anything trains), warms up, then runs every training one after another.

Methods (all at H = 8 or tau_G = 16, the language-model experiment's periods):

* allreduce SGD: gradients averaged every step (buckets of 1 MB during backward);
* DiLoCo H=8: outer Nesterov SGD, lr 0.7;
* Streaming DiLoCo: the same H in 4 fragments, each fragment's allreduce started 1 step before
  its sync (tau = 1) and mixed back with alpha = 0.5;
* DiLoCo int8+EF: DiLoCo whose pseudo-gradient allreduce moves int8 with error feedback;
* DiLoCo worker=node: one DiLoCo worker per node (the node's 2 ranks average gradients every
  step over shared memory; DiLoCo runs between the 2 nodes);
* LSGD: multi-leader, tau 4 inside a node, 16 across;
* LSGD pull delay 2: the same, each leader broadcast behind 2 steps of compute;
* LSGD worker=node: one worker per node (single-leader LSGD between the nodes).

Tuning: each method at every learning rate of --lrs (AdamW's) at the first rate with seed 0,
picked by validation loss; then the reported seeds at both rates with that pick.

Bytes between nodes are measured on the wire: the rank of local rank 0 on each node reads its
namespace's eth0 transmit counter (/proc/net/dev) before and after
each training, so "bytes between nodes" is what crossed the rate-limited links (TCP and IP
headers included), summed over both nodes; the logical payload (bytes sent by all ranks, as
docs/metrics.md counts it) is reported beside it.

Outputs in --out: links_runs.csv, links_summary.csv (per rate and method), links_<rate>.png
(held-out perplexity against training time and against bytes between nodes), links.json.
Every run and summary row carries rho (docs/planning.md): one fp32 allreduce of the
parameters between the nodes, predicted from the link the rate's job probed ("predicted"),
over the run's compute seconds a step (training time less communication, / steps), in the
columns rho, rho_allreduce_s, rho_compute_s, rho_source; a finding gives allreduce SGD's.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
for _p in (REPO, REPO / "benchmarks", HERE):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))
import lm  # noqa: E402
from _shared import (RHO_COLUMNS, LayoutError, check_layout, new_figure, raw_dir,  # noqa: E402
                     rho_sentence, save_figure, write_csv, write_json)
from _shared import add_rho as shared_add_rho  # noqa: E402

NAME = "lm_links"
TITLE = "Slow links: the language model at 100 Mbit/s and 1 Gbit/s, low-bandwidth methods"
CLUSTER_NAME, CLUSTER_SUBNET = "lsgdlk", "10.79.11"
WORLD = 4
_DILOCO = ["--method", "diloco", "--local-steps", "8", "--outer-lr", "0.7"]
_LSGD = ["--method", "lsgd", "--tau-local", "4", "--tau-global", "16"]
METHODS = [
    ("allreduce SGD", ["--method", "allreduce"]),
    ("DiLoCo H=8", _DILOCO),
    ("Streaming DiLoCo P=4", [*_DILOCO, "--fragments", "4", "--fragment-sync-delay", "1",
                              "--fragment-update-alpha", "0.5"]),
    ("DiLoCo int8+EF", [*_DILOCO, "--comm-dtype", "int8", "--error-feedback"]),
    ("DiLoCo worker=node", [*_DILOCO, "--worker-ranks", "node"]),
    ("LSGD", _LSGD),
    ("LSGD pull delay 2", [*_LSGD, "--pull-delay", "2"]),
    ("LSGD worker=node", [*_LSGD, "--worker-ranks", "node"]),
]
FULL = dict(steps=144, rates=("100mbit", "1gbit"), lrs=(3e-3, 1e-2, 3e-2), seeds=(1, 2, 3))
QUICK = dict(steps=32, rates=("100mbit",), lrs=(3e-3,), seeds=(1,))
TUNE_SEED = 0
EVAL_EVERY = 16
RUN_COLUMNS = ["rate", "method", "role", "lr", "seed", "tuned_pick", "final_val_loss",
               "final_loss", "final_perplexity", "training_time_s", "comm_s", "bytes_sent",
               "link_bytes", "steps", *RHO_COLUMNS]
SUMMARY_COLUMNS = ["rate", "method", "lr", "seeds", "final_perplexity", "perplexity_std",
                   "training_time_s", "comm_s", "bytes_sent", "link_bytes",
                   "perplexity_over_allreduce", "time_over_allreduce",
                   "link_bytes_over_allreduce", *RHO_COLUMNS]
#: what rho's fp32 allreduce moves: the language model's parameters
N_PARAMS = lm.N_PARAMS


# -- the MPI job (every rank) -----------------------------------------------------------------
def _tx_bytes(iface: str = "eth0") -> int:
    """Bytes this network namespace sent on ``iface``: /proc/net/dev is the calling process's
    own namespace's (/sys/class/net would be the mount's, the host's, under nsenter)."""
    with open("/proc/net/dev") as fh:
        for line in fh:
            name, _, fields = line.partition(":")
            if name.strip() == iface:
                return int(fields.split()[8])
    raise RuntimeError(f"no {iface} in /proc/net/dev: not inside an emulated node")


def job(spec_path: str) -> int:
    """lm.job's probe and trainings, plus each node's transmit counter around each training
    (written to RUN_DIR/link_bytes.json by rank 0: what crossed the links)."""
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
            check_layout(spec["what"], groups.node_of, lm.NODES, probe, spec["rate"])
        except LayoutError as exc:
            error = str(exc)
        Path(spec["probe_out"]).write_text(json.dumps({"probe": probe, "node_of":
                                                       groups.node_of, "layout_error": error},
                                                      default=float))
    error = MPI.COMM_WORLD.bcast(error, root=0)
    counting = groups.local_rank == 0          # one reader per node (its namespace)
    groups.free()
    if error:
        return 3
    mod_spec = importlib.util.spec_from_file_location("char_lm", lm.CHAR_LM)
    char_lm = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(char_lm)
    for argv in spec["argvs"]:
        sys.argv = [str(lm.CHAR_LM), *argv]
        MPI.COMM_WORLD.Barrier()
        before = _tx_bytes() if counting else 0
        char_lm.main()
        MPI.COMM_WORLD.Barrier()
        sent = MPI.COMM_WORLD.gather(_tx_bytes() - before if counting else 0, root=0)
        if world.rank == 0:
            run_dir = Path(argv[argv.index("--run-dir") + 1])
            (run_dir / "link_bytes.json").write_text(json.dumps({"link_bytes": sum(sent)}))
            print(f"links: ran {' '.join(argv)}", flush=True)
    return 0


# -- the experiment ---------------------------------------------------------------------------
def _read(d: Path, rate: str, label: str, lr: float, seed: int, role: str) -> Dict:
    r = lm.read_run(d)
    link = json.loads((d / "link_bytes.json").read_text())["link_bytes"]
    return {"rate": rate, "method": label, "role": role, "lr": lr, "seed": seed,
            "tuned_pick": "", "link_bytes": int(link), **r}


def summarize(rows: List[Dict]) -> List[Dict]:
    out = []
    for rate in dict.fromkeys(r["rate"] for r in rows):
        rep = [r for r in rows if r["rate"] == rate and r["role"] == "report"]
        by = {}
        for r in rep:
            by.setdefault(r["method"], []).append(r)
        for label, rs in by.items():
            mean = lambda k: sum(r[k] for r in rs) / len(rs)  # noqa: E731
            ppl = [r["final_perplexity"] for r in rs]
            m = sum(ppl) / len(ppl)
            std = math.sqrt(sum((p - m) ** 2 for p in ppl) / (len(ppl) - 1)) if len(ppl) > 1 \
                else 0.0
            out.append({"rate": rate, "method": label, "lr": rs[0]["lr"],
                        "seeds": " ".join(str(r["seed"]) for r in rs), "final_perplexity": m,
                        "perplexity_std": std, "training_time_s": mean("training_time_s"),
                        "comm_s": mean("comm_s"), "bytes_sent": mean("bytes_sent"),
                        "link_bytes": mean("link_bytes")})
        base = next((s for s in out if s["rate"] == rate and s["method"] == "allreduce SGD"),
                    None)
        for s in out:
            if s["rate"] == rate and base:
                s["perplexity_over_allreduce"] = s["final_perplexity"] / base["final_perplexity"]
                s["time_over_allreduce"] = s["training_time_s"] / base["training_time_s"]
                s["link_bytes_over_allreduce"] = (s["link_bytes"] / base["link_bytes"]
                                                  if base["link_bytes"] else math.nan)
    return out


def add_rho(rows: List[Dict], summary: List[Dict], probes: Dict) -> None:
    """rho of every run and summary row (_shared.rho_fields): the fp32 allreduce of the
    model between the 2 nodes predicted from the link that rate's job probed, over the run's
    compute seconds a step (training time less communication, / steps; a summary row: the
    mean over its seeds)."""
    def link(role):
        return lambda r: ((probes.get(f"{r['rate']} {role or r['role']}") or {}).get("probe")
                          or {}).get("inter")

    def compute(r):
        return (r["training_time_s"] - r["comm_s"]) / r["steps"]

    layout = lambda r: (lm.NODES, WORLD // lm.NODES)  # noqa: E731
    shared_add_rho(rows, N_PARAMS, link(None), layout, compute)
    for s in summary:
        rs = [r for r in rows if (r["rate"], r["method"], r["role"]) == (s["rate"], s["method"],
                                                                         "report")]
        if rs:
            mean = sum(map(compute, rs)) / len(rs)
            shared_add_rho([s], N_PARAMS, link("report"), layout, lambda _: mean)


def rho_findings(summary: List[Dict]) -> List[str]:
    """One sentence a rate: allreduce SGD's rho there and its parts."""
    return [rho_sentence(f"at {s['rate']}", s, N_PARAMS) for s in summary
            if s["method"] == "allreduce SGD" and "rho" in s]


def plot(rows: List[Dict], rate: str, out: Path) -> str:
    fig, (ax_t, ax_b) = new_figure(2, width=6.5, height=4.8)
    labels = list(dict.fromkeys(r["method"] for r in rows))
    cmap = __import__("matplotlib").colormaps["tab10"]
    for i, label in enumerate(labels):
        rs = [r for r in rows if r["method"] == label and r["rate"] == rate
              and r["role"] == "report"]
        for j, r in enumerate(rs):
            curve = r["curve"]
            t = [c["training_time"] for c in curve]
            frac = [c["bytes_sent"] / max(r["bytes_sent"], 1) for c in curve]
            b = [f * r["link_bytes"] / 1e6 for f in frac]   # the wire bytes, spread like payload
            p = [math.exp(c["loss"]) for c in curve]
            kw = dict(color=cmap(i % 10), alpha=0.85, label=label if j == 0 else None)
            ax_t.plot(t, p, **kw)
            ax_b.plot(b, p, **kw)
    ax_t.set_xlabel("training time (s)")
    ax_b.set_xlabel("bytes between the nodes (MB, measured on the links; log)")
    ax_b.set_xscale("log")
    # the first evaluation (an untrained model, perplexity ~ 200-300) would flatten the rest:
    # the axis starts under the best final perplexity and ends at 3x the worst one
    finals = [r["final_perplexity"] for r in rows if r["rate"] == rate
              and r["role"] == "report" and math.isfinite(r["final_perplexity"])]
    for ax in (ax_t, ax_b):
        ax.set_ylabel("held-out perplexity (per byte; log)")
        ax.set_yscale("log")
        if finals:
            ax.set_ylim(0.9 * min(finals), 3.0 * max(finals))
        ax.grid(alpha=0.3, which="both")
    ax_t.set_title(f"{WORLD} ranks, 2 nodes, {rate} links: vs training time")
    ax_b.set_title("vs bytes between the nodes")
    ax_b.legend(fontsize=8, loc="upper right")
    name = f"links_{rate}.png"
    save_figure(fig, out / name)
    return name


def loss_at(curve: List[Dict], t: float) -> float:
    """The held-out loss of an evaluation curve at training time ``t``: linear between two
    evaluations, the last one past the end."""
    pts = [(c["training_time"], c["loss"]) for c in curve]
    if not pts:
        return math.nan
    if t <= pts[0][0]:
        return pts[0][1]
    for (t0, l0), (t1, l1) in zip(pts, pts[1:]):
        if t0 <= t <= t1:
            return l0 + (l1 - l0) * (t - t0) / (t1 - t0) if t1 > t0 else l1
    return pts[-1][1]


def time_to(curve: List[Dict], loss: float) -> Optional[float]:
    """The first training time at which the curve reaches ``loss`` (linear between two
    evaluations), or None."""
    pts = [(c["training_time"], c["loss"]) for c in curve]
    for (t0, l0), (t1, l1) in zip(pts, pts[1:]):
        if l1 <= loss:
            return t0 + (t1 - t0) * (l0 - loss) / (l0 - l1) if l0 > loss else t0
    return None


def equal_time(rows: List[Dict], summary: List[Dict]) -> List[str]:
    """Per rate: every method's perplexity at the training time the fastest method ended
    (mean over seeds), and how long allreduce SGD took to reach each method's final
    perplexity (the same seeds)."""
    out = []
    for rate in dict.fromkeys(s["rate"] for s in summary):
        ss = [s for s in summary if s["rate"] == rate]
        t_end = min(s["training_time_s"] for s in ss)
        rep = [r for r in rows if r["rate"] == rate and r["role"] == "report" and r.get("curve")]
        at = {}
        for s in ss:
            rs = [r for r in rep if r["method"] == s["method"]]
            if rs:
                at[s["method"]] = sum(math.exp(loss_at(r["curve"], t_end)) for r in rs) / len(rs)
        if not at:
            continue
        order = sorted(at, key=at.get)
        win, second = order[0], (order[1] if len(order) > 1 else None)
        line = (f"At {rate}, at equal training time ({t_end:.1f} s, when the fastest method "
                f"ended): {win} leads with perplexity {at[win]:.2f}")
        if second:
            line += f", {100 * (at[second] / at[win] - 1):.1f} % below {second} ({at[second]:.2f})"
        line += ". Per method: " + "; ".join(f"{m} {at[m]:.2f}" for m in order) + "."
        out.append(line)
        ar = [r for r in rep if r["method"] == "allreduce SGD"]
        if ar:
            reach = []
            for s in sorted(ss, key=lambda s: s["final_perplexity"]):
                if s["method"] == "allreduce SGD":
                    continue
                ts = [time_to(r["curve"], math.log(s["final_perplexity"])) for r in ar]
                mean = (sum(ts) / len(ts)) if all(t is not None for t in ts) else None
                reach.append(f"{s['method']}'s {s['final_perplexity']:.2f} (reached at "
                             f"{s['training_time_s']:.1f} s) in "
                             + (f"{mean:.1f} s" if mean is not None else "n/a"))
            out.append(f"At {rate}, allreduce SGD reaches " + "; ".join(reach) + ".")
    return out


def findings(summary: List[Dict]) -> List[str]:
    out = []
    for rate in dict.fromkeys(s["rate"] for s in summary):
        ss = sorted((s for s in summary if s["rate"] == rate),
                    key=lambda s: s["final_perplexity"])
        fastest = min(ss, key=lambda s: s["training_time_s"])
        best = ss[0]
        out.append(
            f"At {rate}: best perplexity {best['method']} {best['final_perplexity']:.2f} "
            f"(± {best['perplexity_std']:.2f}); shortest training time {fastest['method']} "
            f"{fastest['training_time_s']:.1f} s. Per method (perplexity, training time, MB "
            "between the nodes): " + "; ".join(
                f"{s['method']} {s['final_perplexity']:.2f}, {s['training_time_s']:.1f} s, "
                f"{s['link_bytes'] / 1e6:.1f} MB" for s in ss))
    return out


def run(out, quick: bool = False, log=print, rates=None, steps=None, lrs=None, seeds=None,
        methods=None, raw=None, timeout_per_run: float = 300.0,
        cluster=(CLUSTER_NAME, CLUSTER_SUBNET), eval_every: Optional[int] = None) -> Dict:
    t0 = time.perf_counter()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    budget = QUICK if quick else FULL
    rates = tuple(rates or budget["rates"])
    lrs = tuple(lrs or budget["lrs"])
    seeds = tuple(budget["seeds"] if seeds is None else seeds)
    n = int(steps or budget["steps"])
    chosen = [(m, o) for m, o in METHODS if not methods or m in methods]
    base = {"name": NAME, "title": TITLE, "quick": quick, "figures": [], "tables": [],
            "findings": []}
    why_not = lm.cluster_available()
    if why_not:
        return {**base, "status": f"skipped: {why_not}",
                "findings": [f"not run: the emulated cluster is not available here: {why_not}"],
                "seconds": time.perf_counter() - t0}
    raw = Path(raw or raw_dir(NAME))
    rows, errors, picks, probes = [], {}, {}, {}
    jobs = ([(rates[0], "tune")] if len(lrs) > 1 else []) + [(r, "report") for r in rates]
    for rate, role in jobs:
        dirs, argvs = {}, []
        for seed in ((TUNE_SEED,) if role == "tune" else seeds):
            for lr in lrs:
                for label, opts in chosen:
                    if role == "report" and picks.get(label, lrs[0]) != lr:
                        continue
                    d = raw / rate / f"{lm._slug(label)}-lr{lr:g}-seed{seed}"
                    shutil.rmtree(d, ignore_errors=True)
                    dirs[(label, lr, seed)] = d
                    argvs.append([*opts, *lm.WORKLOAD, "--lr", f"{lr:g}", "--steps", str(n),
                                  "--eval-every", str(eval_every or min(EVAL_EVERY, n)),
                                  "--seed", str(seed),
                                  "--run-dir", str(d)])
        res = _train(rate, argvs, n, raw, timeout_per_run, log, cluster)
        if res.get("layout"):
            return {**base, "status": f"failed: {res['error']}",
                    "findings": [f"not plotted: {res['error']}"],
                    "seconds": time.perf_counter() - t0}
        probes[f"{rate} {role}"] = res["probe"]
        if res["error"]:
            errors[f"{rate} ({role})"] = res["error"]
        for (label, lr, seed), d in dirs.items():
            try:
                rows.append(_read(d, rate, label, lr, seed, role))
            except Exception as exc:
                errors[f"{rate} {label} lr {lr:g} seed {seed}"] = f"{type(exc).__name__}: {exc}"
        if role == "tune":
            tune = [dict(r, ranks=WORLD) for r in rows if r["role"] == "tune"]
            picks = {m: lr for (_, m), lr in lm.pick_lrs(tune).items()}
            for r, t in zip([r for r in rows if r["role"] == "tune"], tune):
                r["tuned_pick"] = t["tuned_pick"]
    if not rows:
        return {**base, "status": "failed", "findings": [f"error: {k}: {v}"
                                                         for k, v in errors.items()],
                "seconds": time.perf_counter() - t0}
    summary = summarize(rows)
    add_rho(rows, summary, probes)
    write_csv(out / "links_runs.csv", rows, RUN_COLUMNS)
    write_csv(out / "links_summary.csv", summary, SUMMARY_COLUMNS)
    figures = [plot(rows, rate, out) for rate in rates
               if any(r["rate"] == rate and r["role"] == "report" for r in rows)]
    found = _all_findings(rows, summary, n, rates, lrs, seeds)
    found += [f"error in {k}: {v}" for k, v in errors.items()]
    seconds = time.perf_counter() - t0
    write_json(out / "links.json", {"summary": summary, "runs": rows, "probes": probes,
                                    "errors": errors, "picks": picks, "seconds": seconds})
    return {**base, "status": "ok" if not errors else "ok (with errors)", "figures": figures,
            "tables": ["links_summary.csv", "links_runs.csv"], "findings": found,
            "seconds": seconds}


def _all_findings(rows, summary, n, rates, lrs, seeds) -> List[str]:
    return [f"Setup: examples/char_lm.py (0.47 M parameters), {n} steps per rank, {WORLD} "
            f"ranks on 2 emulated nodes, rates {', '.join(rates)}; learning rates "
            f"{', '.join(f'{lr:g}' for lr in lrs)} tuned at {rates[0]} (seed {TUNE_SEED}), "
            f"reported seeds {', '.join(map(str, seeds))}; bytes between nodes measured on "
            "the links."] + findings(summary) + rho_findings(summary) + equal_time(rows, summary)


def refresh(out) -> Dict:
    """The tables, figures and findings again from OUT/links.json, training nothing (after a
    change to how they are computed): ``python results/run_all.py --refresh lm_links``."""
    out = Path(out)
    doc = json.loads((out / "links.json").read_text())
    rows = doc["runs"]
    summary = summarize(rows)
    add_rho(rows, summary, doc.get("probes", {}))
    rates = list(dict.fromkeys(r["rate"] for r in rows if r["role"] == "report"))
    lrs = sorted({r["lr"] for r in rows if r["role"] == "tune"}) or \
        sorted({r["lr"] for r in rows})
    seeds = sorted({r["seed"] for r in rows if r["role"] == "report"})
    write_csv(out / "links_runs.csv", rows, RUN_COLUMNS)
    write_csv(out / "links_summary.csv", summary, SUMMARY_COLUMNS)
    write_json(out / "links.json", {**doc, "summary": summary, "runs": rows})
    figures = [plot(rows, rate, out) for rate in rates]
    found = _all_findings(rows, summary, rows[0]["steps"], rates, lrs, seeds)
    found += [f"error in {k}: {v}" for k, v in doc.get("errors", {}).items()]
    return {"figures": figures, "tables": ["links_summary.csv", "links_runs.csv"],
            "findings": found}


def _train(rate: str, argvs: List[List[str]], steps: int, raw: Path, timeout_per_run: float,
           log, cluster) -> Dict:
    from lsgd_hpc.testing import mpi_env, mpirun_path, run_group
    env = mpi_env({})
    env.pop("LSGD_HPC_RANKS_PER_NODE", None)
    warm = raw / rate / "warmup"
    shutil.rmtree(warm, ignore_errors=True)
    spec = raw / f"{rate}.json"
    probe_out = spec.with_suffix(".probe.json")
    probe_out.unlink(missing_ok=True)
    spec.parent.mkdir(parents=True, exist_ok=True)
    spec.write_text(json.dumps({"argvs": [[*lm.WARMUP, *lm.WORKLOAD, "--run-dir", str(warm)],
                                          *argvs],
                                "probe_out": str(probe_out), "rate": rate,
                                "what": f"links {WORLD} ranks at {rate}"}))
    try:
        with lm.emulated_cluster(rate, WORLD // lm.NODES, log, *cluster) as margs:
            cmd = [mpirun_path(), *margs, "-x", "PYTHONPATH", "-x", "OMP_NUM_THREADS",
                   "-x", "PATH", "-x", "PYTHONUNBUFFERED", "-np", str(WORLD),
                   sys.executable, str(Path(__file__)), "--job", str(spec)]
            t1 = time.perf_counter()
            p = run_group(cmd, env=env, cwd=REPO, timeout=timeout_per_run * (len(argvs) + 1))
            log(f"links: {len(argvs)} trainings of {steps} steps at {rate} in "
                f"{time.perf_counter() - t1:.0f} s")
    except Exception as exc:
        return {"probe": None, "error": f"{type(exc).__name__}: {exc}"}
    probe = json.loads(probe_out.read_text()) if probe_out.exists() else None
    if probe and probe.get("layout_error"):
        return {"probe": probe, "error": f"layout check: {probe['layout_error']}",
                "layout": True}
    if p.returncode != 0:
        why = "timed out" if p.returncode is None else f"exit {p.returncode}"
        return {"probe": probe, "error": f"{why}: {(p.stderr or p.stdout).strip()[-600:]}"}
    return {"probe": probe, "error": None}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(REPO / "results" / NAME))
    p.add_argument("--quick", action="store_true",
                   help="32 steps at 100 Mbit/s only, one learning rate, one seed")
    p.add_argument("--rates", nargs="+", help="link rates, the first one tunes (default "
                                              "100mbit 1gbit)")
    p.add_argument("--steps", type=int, help=f"steps per rank (default {FULL['steps']})")
    p.add_argument("--lrs", type=float, nargs="+", help="AdamW learning rates tried")
    p.add_argument("--seeds", type=int, nargs="+", help="reported seeds (default 1 2 3)")
    p.add_argument("--methods", nargs="+", metavar="LABEL",
                   help="subset of: " + ", ".join(f"'{m}'" for m, _ in METHODS))
    p.add_argument("--raw", metavar="DIR", help=f"raw runs (default runs/results/{NAME}/)")
    p.add_argument("--cluster", nargs=2, metavar=("NAME", "SUBNET"),
                   default=[CLUSTER_NAME, CLUSTER_SUBNET],
                   help=f"emulated cluster's name and subnet (default {CLUSTER_NAME} "
                        f"{CLUSTER_SUBNET})")
    p.add_argument("--eval-every", type=int, help=f"steps between evaluations (default "
                                                  f"{EVAL_EVERY})")
    p.add_argument("--job", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.job:
        return job(args.job)
    res = run(args.out, args.quick, rates=args.rates, steps=args.steps, lrs=args.lrs,
              seeds=args.seeds, methods=args.methods, raw=args.raw,
              cluster=tuple(args.cluster), eval_every=args.eval_every)
    for f in res["findings"]:
        print("-", f)
    print(f"{res['seconds']:.0f} s; tables {res['tables']}; figures {res['figures']}")
    return 0 if res["status"].startswith("ok") else 1


if __name__ == "__main__":
    sys.exit(main())
