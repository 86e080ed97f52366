"""Scale model: the cost model fitted to measured step times, its error, a prediction to 4096 ranks.

lsgd_hpc.costmodel is fitted to step times measured here (4 ranks in one namespace and on the
emulated cluster), its error is reported, and it predicts step time and communication share
from 8 to 4096 ranks for a stated GPU cluster, with a plot.

    python benchmarks/scale_model.py --out FILE [--png FILE] [--quick]
        [--model vgg16 --step-ms 40 --ranks-per-node 8 --intra-gbps 2400 --inter-gbps 200 ...]

Measured points. Per setting (4 ranks as 2 x 2 in one namespace; and, as root, 2 emulated
nodes x 2 ranks with each node link limited to 1 Gbit/s and to 10 Gbit/s by scripts/cluster.sh),
one MPI job probes the links (lsgd_hpc.netprobe: alpha and beta inside and between nodes) and
trains every method STEPS steps (mlp_wide on digits, batch 32, no consensus probes, evaluation
only at the end). From each run's /train columns: seconds per step (training time), and of
those, communication and compute seconds, over steps SKIP..STEPS-1.

Fit. A point's prediction is its measured local time per step (step time less communication:
compute, data, metrics, the trainer's bookkeeping; what the planner calls --step-ms) plus the
model's communication for that method, cluster and link figures. The model's free parameters are fitted to all points:
the allreduce algorithm of the MPI library (auto / ring / doubling / hierarchical: the one with
the smallest error) and the software cost per collective call (least squares on relative
communication error; the prediction is linear in it). The memory bandwidth of the elementwise
passes is measured on this machine. Error = |predicted - measured| / measured step time.

Prediction. The model (with the GPU cluster's own figures for links, memory, call cost,
buckets and overlap, and the fastest allreduce algorithm at each size, as NCCL picks) gives step time and communication share per method from 8 to 4096 ranks, for the model of
lsgd_hpc.models named by --model at --step-ms per step.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO))
import time_to_accuracy as tta  # noqa: E402
from _common import median, row, write_result  # noqa: E402

from lsgd_hpc.testing import mpi_env, mpirun_cmd, mpirun_path, run_group  # noqa: E402

from lsgd_hpc.methods.registry import SPECS
from lsgd_hpc.planning import costmodel as cm

STEPS = 30
TARGET_ERROR = 0.25
DEFAULT_PNG = REPO / "results" / "benchmarks" / "scale_model.png"
#: methods measured (label, --algorithm, options) and their cost-model call
METHODS = tta.METHODS
#: the GPU cluster of the prediction (command-line defaults)
GPU_DEFAULTS = dict(model="vgg16", step_ms=40.0, ranks_per_node=8, intra_gbps=2400.0,
                    intra_latency_us=2.0, inter_gbps=200.0, inter_latency_us=5.0,
                    mem_gbytes_per_s=1500.0, call_overhead_us=30.0, bucket_mb=25.0,
                    allreduce_overlap=0.5)
RANKS = [8 * 2 ** k for k in range(10)]          # 8 .. 4096
#: periods of the prediction: the LSGD reference's tau (64 local, 128 global), local SGD T=8
PREDICT = [("allreduce", "allreduce", {}),
           ("lsgd tau 64/128", "lsgd", dict(tau_local=64, tau_global=128)),
           ("easgd tau 64", "easgd", dict(easgd_tau=64)),
           ("local-sgd T=8", "local-sgd", dict(local_steps=8)),
           ("diloco H=8", "diloco", dict(local_steps=8)),
           ("slowmo T=8", "slowmo", dict(local_steps=8, slowmo_every=48)),
           ("gossip ring", "gossip", dict(topology="ring")),
           ("gossip exponential", "gossip", dict(topology="exponential"))]


#: the trainer's default gradient bucket (--bucket-mb 1): allreduce SGD's allreduces per step
BUCKET_BYTES = 2 ** 20
OVERLAPS = (0.0, 0.25, 0.5, 0.75, 1.0)
#: multipliers of the probe's latencies: ping-pong on a loaded machine measures scheduling
#: delays as latency, so the fit may take a fraction of them (1 = the probe's own)
LATENCY_SCALES = (1.0, 0.5, 0.25, 0.1, 0.03, 0.01)


def _model_call(label: str, w: cm.Workload, c: cm.Cluster, coll: cm.Collectives,
                overlap: float = 0.0, bucket_bytes: float = BUCKET_BYTES) -> cm.MethodCost:
    """The cost model of one measured method (its command-line options, by their names)."""
    alg = next(a for l, a, _ in METHODS if l == label)
    opts = next(o for l, _, o in METHODS if l == label)
    spec = SPECS[alg]
    given = {flag.lstrip("-").replace("-", "_"): value for flag, value in zip(opts[::2], opts[1::2])}
    options = {k: spec.option(k).parse(v) for k, v in given.items()
               if any(o.name == k for o in spec.options)}
    if alg == "allreduce":
        options["bucket_mb"] = bucket_bytes / 2 ** 20
    return cm.method_cost(alg, w, c, options, coll=coll, overlap=overlap)


def memory_bandwidth(nbytes: int) -> float:
    """Bytes per second of one elementwise pass (read + write) over nbytes on this CPU."""
    import torch
    x, y = torch.ones(nbytes // 4), torch.ones(nbytes // 4)
    times = []
    for _ in range(7):
        t0 = time.perf_counter()
        x.add_(y, alpha=0.5)
        times.append(time.perf_counter() - t0)
    return 2 * nbytes / median(times)


# -- measuring ------------------------------------------------------------------------------------
def _argvs(base: Path, off: List[str]) -> (Dict, List):
    dirs, argvs = {}, []
    common = tta.common_options(STEPS, STEPS)
    for label, alg, opts in METHODS:
        d = base / label.replace(" ", "_").replace("=", "")
        dirs[label] = d
        argvs.append([*common, *off, "--algorithm", alg, *opts, "--run-dir", str(d)])
    return dirs, argvs


def measure_setting(name: str, base: Path, launch: List[str], env: dict, timeout: float,
                    ranks_per_node: Optional[int], log, expect: Optional[Dict] = None) -> Dict:
    """One MPI job: probe, then every method. Returns {probe, runs, error}. ``expect``
    ({"nodes", "rate"}): the layout and link rate the setting claims, checked by the job on
    its own probe before it trains (tta.job); a wrong one is the setting's error, no runs."""
    off = tta.consensus_off()
    dirs, argvs = _argvs(base, off)
    spec, probe_out = base / "spec.json", base / "probe.json"
    base.mkdir(parents=True, exist_ok=True)
    spec.write_text(json.dumps({"argvs": argvs, "probe_out": str(probe_out),
                                "ranks_per_node": ranks_per_node,
                                "expect": {"what": f"scale_model {name}", **expect}
                                if expect else None}))
    cmd = [*launch, sys.executable, str(HERE / "time_to_accuracy.py"), "--job", str(spec)]
    t0 = time.perf_counter()
    p = run_group(cmd, env=env, cwd=REPO, timeout=timeout)
    log(f"  scale_model: {name}: {len(argvs)} runs in {time.perf_counter() - t0:.0f} s")
    out = {"probe": None, "runs": {}, "error": None}
    if p.returncode != 0:
        why = "timed out" if p.returncode is None else f"exit {p.returncode}"
        out["error"] = f"{why}: {(p.stderr or p.stdout).strip()[-400:]}"
    if probe_out.exists():
        probed = json.loads(probe_out.read_text())
        if probed.get("layout_error"):
            return {"probe": None, "runs": {}, "error": f"layout check: {probed['layout_error']}"}
        out["probe"] = probed["probe"]
    for label, d in dirs.items():
        try:
            r = tta.read_run(d, target=2.0)
            r.pop("curve", None)
            out["runs"][label] = r
        except Exception as exc:
            out["error"] = (out["error"] or "") + f" {label}: {type(exc).__name__}: {exc}"
    return out


def measure(quick: bool, timeout: float, log) -> Dict[str, Dict]:
    tmp = Path(tempfile.mkdtemp(prefix="lsgd_bench_scale_"))
    env = mpi_env()
    settings: Dict[str, Dict] = {}
    try:
        settings["one namespace"] = measure_setting(
            "one namespace (4 ranks as 2 x 2)", tmp / "ns", mpirun_cmd(tta.NP, []), env, timeout,
            tta.RANKS_PER_NODE, log)
        why_not = tta.cluster_available()
        if why_not:
            log(f"  scale_model: emulated cluster skipped: {why_not}")
        else:
            for rate in (tta.RATES[:1] if quick else tta.RATES):
                try:
                    with tta.emulated_cluster(rate, log) as margs:
                        launch = [mpirun_path(), *margs, "-x", "PYTHONPATH", "-x",
                                  "OMP_NUM_THREADS", "-x", "PATH", "-np", str(tta.NP)]
                        settings[f"cluster {rate}"] = measure_setting(
                            f"cluster {rate}", tmp / rate, launch, env, timeout, None, log,
                            expect={"nodes": tta.NODES, "rate": rate})
                except (RuntimeError, subprocess.SubprocessError, OSError) as exc:
                    settings[f"cluster {rate}"] = {"probe": None, "runs": {}, "error": str(exc)}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return settings


# -- fitting --------------------------------------------------------------------------------------
def _link(probe_link: Optional[Dict], fallback: cm.Link) -> cm.Link:
    if not probe_link:
        return fallback
    return cm.Link(float(probe_link["alpha_s"]), float(probe_link["beta_s_per_byte"]))


def points_of(settings: Dict[str, Dict]) -> List[Dict]:
    """Every measured (setting, method) with what the model needs."""
    from lsgd_hpc.planning.plan import model_facts
    facts = model_facts(tta.MODEL, "digits")
    pts = []
    for name, s in settings.items():
        if not s.get("probe"):
            continue
        intra = _link(s["probe"].get("intra"), cm.Link(0.0, 0.0))
        inter = _link(s["probe"].get("inter"), intra)
        for label, r in s["runs"].items():
            if not all(math.isfinite(r[k]) for k in ("time_per_step", "compute_s_per_step",
                                                     "comm_s_per_step")):
                continue
            # local time: everything of a step but communication (compute, data, metrics,
            # the trainer's own bookkeeping), the planner's --step-ms
            pts.append({"setting": name, "method": label, "intra": intra, "inter": inter,
                        "n_params": facts.n_params, "n_buffers": facts.n_buffers,
                        "measured_step_s": r["time_per_step"],
                        "measured_compute_s": r["time_per_step"] - r["comm_s_per_step"],
                        "measured_compute_only_s": r["compute_s_per_step"],
                        "measured_comm_s": r["comm_s_per_step"]})
    return pts


def predict_point(pt: Dict, overhead_s: float, coll: cm.Collectives, mem_Bps: float,
                  overlap: float = 0.0, latency_scale: float = 1.0,
                  bucket_bytes: float = BUCKET_BYTES) -> float:
    """Predicted communication seconds per step of the measured point ``pt`` (allreduce SGD
    in gradient buckets of ``bucket_bytes``)."""
    intra = cm.Link(pt["intra"].alpha_s * latency_scale, pt["intra"].beta_s)
    inter = cm.Link(pt["inter"].alpha_s * latency_scale, pt["inter"].beta_s)
    c = cm.Cluster(tta.NODES, tta.RANKS_PER_NODE, intra, inter, mem_Bps=mem_Bps,
                   call_overhead_s=overhead_s, checks=True)
    w = cm.Workload(pt["n_params"], pt["n_buffers"], pt["measured_compute_s"])
    return _model_call(pt["method"], w, c, coll, overlap, bucket_bytes).comm_s


def fit(pts: List[Dict], mem_Bps: float) -> Dict:
    """Allreduce algorithm, overlap of the bucketed allreduce and a multiplier of the probe's
    latencies (the triple with the smallest largest error), and the call overhead (>= 0, least squares on the relative error, in which
    the prediction is linear: the overlap is applied afterwards, so it is left out of that
    solve); then the step-time errors of every point."""
    best = None
    grid = ((a, f, s) for a in cm.ALLREDUCE_ALGORITHMS for f in OVERLAPS for s in LATENCY_SCALES)
    for alg, overlap, scale in grid:
        coll = cm.Collectives(alg)
        base = [predict_point(p, 0.0, coll, mem_Bps, 0.0, scale) for p in pts]
        calls = [(predict_point(p, 1e-3, coll, mem_Bps, 0.0, scale) - b) / 1e-3
                 for p, b in zip(pts, base)]
        # minimise sum ((meas - base - k o) / meas)^2 over o
        num = sum(k * (p["measured_comm_s"] - b) / p["measured_step_s"] ** 2
                  for p, b, k in zip(pts, base, calls))
        den = sum(k * k / p["measured_step_s"] ** 2 for p, k in zip(pts, calls))
        o = max(0.0, num / den) if den > 0 else 0.0
        errs = []
        for p in pts:
            pred = p["measured_compute_s"] + predict_point(p, o, coll, mem_Bps, overlap, scale)
            errs.append((pred - p["measured_step_s"]) / p["measured_step_s"])
        score = max(abs(e) for e in errs) if errs else math.inf
        if best is None or score < best["max_abs_error"]:
            best = {"allreduce": alg, "overlap": overlap, "latency_scale": scale,
                    "call_overhead_s": o,
                    "max_abs_error": score,
                    "mean_abs_error": sum(abs(e) for e in errs) / len(errs),
                    "errors": errs,
                    "comm_errors": [(p["measured_compute_s"] + predict_point(
                        p, o, coll, mem_Bps, overlap, scale) - p["measured_step_s"])
                        / p["measured_comm_s"] if p["measured_comm_s"] > 0 else math.nan
                        for p in pts]}
    if best is not None:
        # the model with the probe's figures as they are: auto allreduce, no overlap, no
        # call cost, the probe's latencies
        auto = cm.Collectives("auto")
        best["unfitted_max_abs_error"] = max(
            abs(p["measured_compute_s"] + predict_point(p, 0.0, auto, mem_Bps)
                - p["measured_step_s"]) / p["measured_step_s"] for p in pts)
    return best


# -- prediction -----------------------------------------------------------------------------------
def predict(gpu: Dict, coll: cm.Collectives) -> Dict:
    from lsgd_hpc.planning.plan import model_facts
    facts = model_facts(gpu["model"])
    w = cm.Workload(facts.n_params, facts.n_buffers, gpu["step_ms"] / 1e3)
    curves = {label: {"ranks": [], "step_s": [], "comm_share": []} for label, _, _ in PREDICT}
    q = gpu["ranks_per_node"]
    for p in RANKS:
        if p % q:
            continue
        c = cm.Cluster(p // q, q, cm.Link.from_gbps(gpu["intra_gbps"], gpu["intra_latency_us"]),
                       cm.Link.from_gbps(gpu["inter_gbps"], gpu["inter_latency_us"]),
                       mem_Bps=gpu["mem_gbytes_per_s"] * 1e9,
                       call_overhead_s=gpu["call_overhead_us"] * 1e-6, checks=True)
        for label, alg, kw in PREDICT:
            opts = dict(kw, bucket_mb=gpu["bucket_mb"]) if alg == "allreduce" else kw
            r = cm.method_cost(alg, w, c, opts, coll=coll, overlap=gpu["allreduce_overlap"])
            curves[label]["ranks"].append(p)
            curves[label]["step_s"].append(r.step_s)
            curves[label]["comm_share"].append(r.comm_share)
    return {"model": facts.model, "n_params": facts.n_params, "cluster": gpu, "curves": curves}


def plot(pred: Dict, fitted: Optional[Dict], png: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    g = pred["cluster"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.8))
    for label, cur in pred["curves"].items():
        ax1.plot(cur["ranks"], [s * 1e3 for s in cur["step_s"]], marker="o", ms=3, label=label)
        ax2.plot(cur["ranks"], [100 * s for s in cur["comm_share"]], marker="o", ms=3,
                 label=label)
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set_xticks(RANKS, [str(r) for r in RANKS])
        ax.set_xlabel("ranks (GPUs), log scale")
        ax.grid(True, which="both", alpha=0.3)
    ax1.set_yscale("log")
    ax1.set_ylabel("predicted step time (ms, log scale)")
    ax2.set_ylabel("communication share of step time (%)")
    ax2.set_ylim(0, 100)
    ax1.legend(fontsize=8)
    fit_txt = (f"; model fitted here: max error {100 * fitted['max_abs_error']:.0f}%"
               if fitted else "")
    fig.suptitle(f"Scale model: {pred['model']} ({pred['n_params'] / 1e6:.2f} M parameters), "
                 f"{g['step_ms']:g} ms compute/step, {g['ranks_per_node']} GPUs/node, "
                 f"intra {g['intra_gbps']:g} Gbit/s, inter {g['inter_gbps']:g} Gbit/s"
                 f"{fit_txt}", fontsize=10)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
    plt.close(fig)


def run(quick: bool = False, timeout: float = 600, log=print, gpu: Optional[Dict] = None,
        png: Optional[Path] = None) -> Dict:
    gpu = {**GPU_DEFAULTS, **(gpu or {})}
    png = Path(png or DEFAULT_PNG)
    settings = measure(quick, timeout, log)
    errors = {k: s["error"] for k, s in settings.items() if s.get("error")}
    pts = points_of(settings)
    from lsgd_hpc.planning.plan import model_facts
    mem = memory_bandwidth(cm.Workload(model_facts(tta.MODEL, "digits").n_params, 0, 0).flat_bytes)
    fitted = fit(pts, mem) if pts else None
    # the GPU cluster's library (NCCL-like) picks its algorithm by size and topology: "auto",
    # not the algorithm fitted to Open MPI's flat collectives here
    pred = predict(gpu, cm.Collectives("auto"))
    plot(pred, fitted, png)
    rows = []
    if fitted:
        worst = max(range(len(pts)), key=lambda i: abs(fitted["errors"][i]))
        rows.append(row(
            "scale_model: fit",
            f"alpha-beta model vs {len(pts)} measured step times (methods x settings: "
            f"{', '.join(settings)})",
            f"max |error| {100 * fitted['max_abs_error']:.0f}%, mean "
            f"{100 * fitted['mean_abs_error']:.0f}%; of the communication part alone up to "
            f"{100 * max(abs(e) for e in fitted['comm_errors'] if e == e):.0f}% ("
            f"{100 * fitted['unfitted_max_abs_error']:.0f}% with the probe's figures as they are); "
            f"fitted: allreduce '{fitted['allreduce']}', overlap {fitted['overlap']:g}, latency "
            f"x{fitted['latency_scale']:g} of the probe's, call cost "
            f"{fitted['call_overhead_s'] * 1e6:.0f} us; "
            f"worst "
            f"{pts[worst]['method']} in {pts[worst]['setting']}",
            fitted["max_abs_error"], f"max |error| (target <= {TARGET_ERROR})"))
    else:
        rows.append(row("scale_model: fit", "", "no measured points", None, ""))
    picks = [8, 512, 4096]
    for label in ("allreduce", "lsgd tau 64/128", "local-sgd T=8"):
        cur = pred["curves"][label]
        fig = ", ".join(f"{p}: {cur['step_s'][cur['ranks'].index(p)] * 1e3:.1f} ms "
                        f"({100 * cur['comm_share'][cur['ranks'].index(p)]:.0f}% comm)"
                        for p in picks if p in cur["ranks"])
        rows.append(row(f"scale_model: {label}", f"predicted step time at 8 / 512 / 4096 ranks, "
                        f"{pred['model']}, {gpu['ranks_per_node']} GPUs/node", fig, None, ""))
    for k, v in errors.items():
        rows.append(row(f"scale_model: {k}", "", f"failed: {v}", None, ""))
    return {
        "name": "scale_model", "doc": __doc__.splitlines()[0], "status": "ok" if fitted else
        "failed", "png": str(png), "mem_Bps_measured": mem, "fit": fitted,
        "points": [{**{k: v for k, v in p.items() if k not in ("intra", "inter")},
                    "intra": vars(p["intra"]), "inter": vars(p["inter"]),
                    "error": fitted["errors"][i] if fitted else None}
                   for i, p in enumerate(pts)],
        "probes": {k: s.get("probe") for k, s in settings.items()},
        "prediction": pred, "errors": errors, "rows": rows,
        "ratio": fitted["max_abs_error"] if fitted else None, "target": f"<= {TARGET_ERROR}",
        "notes": [
            f"Measured: {', '.join(settings)}; {tta.MODEL} on digits, batch {tta.BATCH}, "
            f"{STEPS} steps per method, per-step costs over steps {tta.SKIP_STEPS}.."
            f"{STEPS - 1}; links from lsgd_hpc.netprobe in the same job.",
            f"Prediction: {gpu['model']} at {gpu['step_ms']:g} ms per step, {gpu['ranks_per_node']}"
            f" GPUs per node, {gpu['intra_gbps']:g} Gbit/s {gpu['intra_latency_us']:g} us inside,"
            f" {gpu['inter_gbps']:g} Gbit/s {gpu['inter_latency_us']:g} us between nodes, "
            f"{gpu['mem_gbytes_per_s']:g} GB/s memory, {gpu['call_overhead_us']:g} us per "
            f"collective call; allreduce SGD in {gpu['bucket_mb']:g} MB buckets hidden under "
            f"up to {gpu['allreduce_overlap']:g} of compute (backward); plot {png}.",
        ]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--png", default=str(DEFAULT_PNG))
    p.add_argument("--quick", action="store_true", help="the 1 Gbit/s cluster only")
    for k, v in GPU_DEFAULTS.items():
        p.add_argument(f"--{k.replace('_', '-')}", type=type(v), default=v)
    args = p.parse_args(argv)
    gpu = {k: getattr(args, k) for k in GPU_DEFAULTS}
    result = run(args.quick, gpu=gpu, png=Path(args.png))
    write_result(args.out, result)
    for r in result["rows"]:
        print(f"{r['label']}: {r['figures']}")
    return 0 if result["status"] == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
