"""Allreduce SGD's gradient in int8 + EF and top-k 1 % int2 + EF vs fp32: bytes/step, steps to 93 %.

    python benchmarks/compressed_allreduce.py --out FILE [--quick]

One mpirun job of 4 ranks grouped as 2 nodes of 2 (``--ranks-per-node 2``; the compressed
allreduce is then hierarchical: float32 inside the node, compressed between the 2 node roots)
trains, one after another (seed-major), allreduce SGD on the trainer's default data set
(digits) with the model of benchmarks/time_to_accuracy.py (mlp_wide, 1.13 M parameters,
batch 32 per rank, the trainer's learning rate and momentum), its gradient averaged

* in fp32 (the baseline),
* in int8 with error feedback (``--comm-dtype int8 --error-feedback``),
* as the top-k 1 % of every chunk of 4096 with int2 values and error feedback
  (``--topk 0.01 --comm-dtype int2 --error-feedback``),

in buckets of 1 MB started during backward (the default). Test accuracy (the mean over the
ranks, which hold identical replicas) every EVAL_EVERY steps; a run's steps to the target
are those of its first evaluation at or above TARGET (93 %).

Bytes per step: the busiest rank's comm_bytes_sent per step (over the run less its first
SKIP_STEPS steps). That is what one node sends over its link: fp32's flat allreduce counts
4 n on every rank (and the emulated cluster measured about that per node link,
docs/algorithms.md "Hierarchical allreduce"); the compressed one counts its exchange on the
node roots only. The total over all ranks is reported too.

Time: priced, not emulated (the emulated 1 Gbit/s cluster needs root and network
namespaces; this benchmark runs in ``make bench`` anywhere). A step costs its measured
training seconds on this machine (slowest rank: compute, and the communication over shared
memory with the codec's work included) plus what a 1 Gbit/s link between the two nodes adds
for the bytes crossing it (lsgd_hpc.planning.costmodel's link, alpha 5 us): 2 alpha per
bucket and the bytes above at 1 Gbit/s. Time to 93 % = steps to 93 % x that.

Ratios (compressed / fp32, median over seeds): bytes per step (target <= 0.3) and steps to
93 % (target <= 1.1) for each compressor; the time ratio is informational.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Dict, List, Optional

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO))
from _common import fmt_bytes, row, write_result  # noqa: E402

from lsgd_hpc.testing import mpi_env, mpirun_cmd, run_group  # noqa: E402

NP, RANKS_PER_NODE = 4, 2
TARGET = 0.93
MODEL, BATCH = "mlp_wide", 32
#: full: three seeds of 120 steps (top-k needs about 75 to reach the target); quick: one
SEEDS, QUICK_SEEDS = (0, 1, 2), (0,)
MAX_STEPS, QUICK_STEPS = 120, 100
EVAL_EVERY = 2
SKIP_STEPS = 4
#: the link between the two nodes that the time is priced at
LINK_GBPS, LINK_LATENCY_US = 1.0, 5.0
BUCKET_MB = 1.0
BASELINE = "fp32"
#: (label, trainer options)
VARIANTS = [
    ("fp32", []),
    ("int8 + EF", ["--comm-dtype", "int8", "--error-feedback"]),
    ("top-k 1 % int2 + EF", ["--topk", "0.01", "--comm-dtype", "int2", "--error-feedback"]),
]
BYTES_TARGET, STEPS_TARGET = "<= 0.3", "<= 1.1"


def argv(opts: List[str], seed: int, steps: int, model: str, run_dir: Path) -> List[str]:
    return ["--algorithm", "allreduce", "--ranks-per-node", str(RANKS_PER_NODE),
            "--model", model, "--batch-size", str(BATCH), "--max-steps", str(steps),
            "--epochs", "100", "--eval-every", str(EVAL_EVERY), "--seed", str(seed),
            "--consensus-every", "0", "--bucket-mb", str(BUCKET_MB), *opts,
            "--run-dir", str(run_dir)]


def read_run(run_dir: Path, target: float = TARGET) -> Dict:
    """Steps to ``target``, bytes per step (busiest rank, and all ranks), seconds per step
    (slowest rank's training time) and the model size of one run."""
    import h5py
    files = sorted((run_dir / "metrics").glob("rank*.h5"))
    if len(files) != NP:
        raise RuntimeError(f"{run_dir}: {len(files)} rank files, expected {NP}")
    sent, seconds, accs, nodes = [], [], [], []
    for f in files:
        with h5py.File(f, "r", locking=False) as h:
            t, e = h["train"], h["eval"]
            step = t["step"][:].tolist()
            a = min(SKIP_STEPS, len(step) - 2)
            b = len(step) - 2                   # (the last row may hold the final evaluation)
            span = step[b] - step[a]
            sent.append(float(t["comm_bytes_sent"][b] - t["comm_bytes_sent"][a]) / span)
            clock = t["training_time"] if "training_time" in t else t["wall_time"]
            seconds.append(float(clock[b] - clock[a]) / span)
            accs.append(dict(zip(e["step"][:].tolist(), e["test_accuracy"][:].tolist())))
            nodes.append(int(h.attrs["node_index"]))
    common = sorted(set.intersection(*(set(a) for a in accs)))
    curve = [(s, statistics.fmean(a[s] for a in accs)) for s in common]
    hit = next((s for s, acc in curve if acc >= target), None)
    return {"steps_to_target": hit, "final_accuracy": curve[-1][1] if curve else math.nan,
            "bytes_per_step": max(sent), "bytes_per_step_all_ranks": sum(sent),
            "seconds_per_step": max(seconds), "node_of": nodes, "curve": curve}


def link_seconds(bytes_per_step: float, n_params: int) -> float:
    """What the 1 Gbit/s link adds to a step: 2 alpha per bucket, the bytes at its rate."""
    from lsgd_hpc.planning import costmodel as cm
    link = cm.Link.from_gbps(LINK_GBPS, LINK_LATENCY_US)
    buckets = max(1, math.ceil(4 * n_params / (BUCKET_MB * 2 ** 20)))
    return 2 * buckets * link.alpha_s + bytes_per_step * link.beta_s


def _n_params(model: str) -> int:
    from lsgd_hpc.models.zoo import build_model, count_parameters
    return count_parameters(build_model(model, 10, (1, 8, 8)))


def _median(xs: List[Optional[float]]) -> float:
    """Median, a missing value (the target not reached) counting as infinite."""
    vals = sorted(math.inf if x is None else float(x) for x in xs)
    return float(statistics.median(vals)) if vals else math.nan


def run(quick: bool = False, timeout: float = 600, log=print, steps: Optional[int] = None,
        model: str = MODEL, seeds=None) -> Dict:
    seeds = tuple(seeds or (QUICK_SEEDS if quick else SEEDS))
    steps = steps or (QUICK_STEPS if quick else MAX_STEPS)
    base = {"name": "compressed_allreduce", "doc": __doc__.splitlines()[0], "model": model,
            "batch": BATCH, "np": NP, "ranks_per_node": RANKS_PER_NODE, "seeds": list(seeds),
            "max_steps": steps, "eval_every": EVAL_EVERY, "target_accuracy": TARGET,
            "link_gbps": LINK_GBPS, "time_source": "priced: measured step seconds + bytes at "
            f"{LINK_GBPS:g} Gbit/s between the 2 nodes (lsgd_hpc.planning.costmodel link)"}
    with tempfile.TemporaryDirectory(prefix="lsgd_bench_compressed_allreduce_") as tmp:
        tmp = Path(tmp)
        jobs = [(label, seed, tmp / f"{i}_s{seed}") for seed in seeds
                for i, (label, _) in enumerate(VARIANTS)]
        opts = dict(VARIANTS)
        spec = tmp / "argv.json"
        spec.write_text(json.dumps([argv(opts[label], seed, steps, model, d)
                                    for label, seed, d in jobs]))
        log(f"  compressed_allreduce: {len(jobs)} trainings of {steps} steps ({model})")
        cmd = mpirun_cmd(NP, [sys.executable, str(HERE / "_train_many.py"), str(spec)])
        env = mpi_env({})
        env.pop("LSGD_HPC_RANKS_PER_NODE", None)
        p = run_group(cmd, env=env, cwd=REPO, timeout=timeout)
        if p.returncode != 0:
            why = "timed out" if p.returncode is None else f"exit {p.returncode}"
            tail = (p.stderr or p.stdout or "").strip()[-400:]
            return {**base, "status": f"failed: {why}: {tail}",
                    "rows": [row("compressed_allreduce", "", f"failed: {why}", None, "")]}
        runs = {label: [] for label, _ in VARIANTS}
        for label, seed, d in jobs:
            r = read_run(d)
            r["seed"] = seed
            runs[label].append(r)
    return summarise(base, runs, _n_params(model))


def summarise(base: Dict, runs: Dict[str, List[Dict]], n_params: int) -> Dict:
    """Per variant: medians over seeds of steps to the target, bytes per step and priced
    time; the ratios to fp32 and the targets."""
    per = {}
    for label, rs in runs.items():
        for r in rs:
            r["link_s_per_step"] = link_seconds(r["bytes_per_step"], n_params)
            r["priced_s_per_step"] = r["seconds_per_step"] + r["link_s_per_step"]
            hit = r["steps_to_target"]
            r["priced_time_to_target_s"] = None if hit is None else hit * r["priced_s_per_step"]
            r.pop("curve", None)
        per[label] = {
            "steps_to_target": _median([r["steps_to_target"] for r in rs]),
            "bytes_per_step": _median([r["bytes_per_step"] for r in rs]),
            "bytes_per_step_all_ranks": _median([r["bytes_per_step_all_ranks"] for r in rs]),
            "priced_time_to_target_s": _median([r["priced_time_to_target_s"] for r in rs]),
            "priced_s_per_step": _median([r["priced_s_per_step"] for r in rs]),
            "final_accuracy": _median([r["final_accuracy"] for r in rs]),
            "runs": rs}
    fp32 = per[BASELINE]

    def ratio(label, key):
        a, b = per[label][key], fp32[key]
        return a / b if b and math.isfinite(b) and b > 0 else None

    ratios, rows, extra = {}, [], {}
    for label, _ in VARIANTS:
        v = per[label]
        steps = v["steps_to_target"]
        st = "not reached" if math.isinf(steps) else f"{steps:.0f}"
        figures = (f"{fmt_bytes(v['bytes_per_step'])}/step between nodes "
                   f"({fmt_bytes(v['bytes_per_step_all_ranks'])} all ranks); "
                   f"steps to {TARGET:.0%}: {st}; priced time to it "
                   f"{v['priced_time_to_target_s']:.2f} s; final {v['final_accuracy']:.1%}")
        if label == BASELINE:
            rows.append(row(f"compressed_allreduce {label}", "the baseline", figures, None, ""))
            continue
        r = {"bytes": ratio(label, "bytes_per_step"),
             "bytes_all_ranks": ratio(label, "bytes_per_step_all_ranks"),
             "steps": ratio(label, "steps_to_target"),
             "time": ratio(label, "priced_time_to_target_s")}
        ratios[label] = r
        key = "int8" if label.startswith("int8") else "topk"
        extra[f"compressed_allreduce_{key}_bytes"] = {"value": r["bytes"], "target": BYTES_TARGET}
        extra[f"compressed_allreduce_{key}_steps"] = {"value": r["steps"], "target": STEPS_TARGET}
        steps_r = "-" if r["steps"] is None or math.isinf(r["steps"]) else f"{r['steps']:.2f}x"
        time_r = "-" if r["time"] is None or math.isinf(r["time"]) else f"{r['time']:.2f}x"
        rows.append(row(f"compressed_allreduce {label}", "against fp32",
                        f"{figures}; steps {steps_r}, priced time {time_r}", r["bytes"],
                        "bytes per step between nodes, / fp32's (<= 0.3)"))
    n_seeds = len(next(iter(runs.values())))
    notes = [f"compressed_allreduce: allreduce SGD, {base['model']} on digits, batch "
             f"{base['batch']}, 4 ranks as 2 nodes; median over {n_seeds} seed(s); time priced "
             f"at {LINK_GBPS:g} Gbit/s between the nodes (measured step seconds + the bytes "
             "crossing the link), not emulated"]
    int8 = ratios.get("int8 + EF", {})
    return {**base, "status": "ok", "n_params": n_params, "variants": per, "ratios": ratios,
            "ratio": int8.get("bytes"), "target": BYTES_TARGET, "extra_targets": extra,
            "rows": rows, "notes": notes}


def main(argv_: Optional[list] = None) -> int:
    import argparse
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="JSON file to write")
    p.add_argument("--quick", action="store_true", help="one seed, fewer steps")
    p.add_argument("--steps", type=int, default=None, help="step budget of every run")
    p.add_argument("--model", default=MODEL, help=f"model (default {MODEL})")
    p.add_argument("--seeds", type=int, nargs="*", default=None, help="seeds")
    args = p.parse_args(argv_)
    res = run(args.quick, steps=args.steps, model=args.model, seeds=args.seeds)
    write_result(args.out, res)
    for r in res["rows"]:
        print(f"{r['label']}: {r['figures']}  ratio {r['ratio']}")
    return 0 if res["status"] == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
