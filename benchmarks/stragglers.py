"""One slow rank: sync LSGD vs async LSGD vs allreduce vs local SGD (digits): fast ranks' steps/s, time to a target accuracy, final accuracy.

    python benchmarks/stragglers.py --out results/stragglers.json [--quick] [--np 4 8]

For each rank count, one MPI job trains every method without a straggler; the median
seconds per step of sync LSGD there is the unit t. A second job trains every method with
the last rank sleeping (k-1) t per step (--straggler), for k = 2 and 4: that rank's steps take
about k times as long. The figure of merit is the retention: the fast ranks' steps/s with
the straggler over their steps/s without it, per method, from the same run.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from _common import row, write_result

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO / "tests"))
from mpi_util import mpi_env, mpirun_cmd, run_group  # noqa: E402

METHODS = [
    ("sync LSGD", ["--algorithm", "lsgd"]),
    ("async LSGD", ["--algorithm", "lsgd-async"]),
    ("allreduce", ["--algorithm", "allreduce"]),
    ("local SGD T=8", ["--algorithm", "local-sgd", "--local-steps", "8"]),
]
SLOWDOWNS = (2, 4)
STEPS = 40
TARGET = 0.90
SKIP_STEPS = 5                  # start-up steps left out of steps/s
COMMON = ["--dataset", "digits", "--max-steps", str(STEPS), "--epochs", "100",
          "--eval-every", "10", "--ranks-per-node", "2", "--seed", "1"]


def _slug(label: str) -> str:
    return label.lower().replace(" ", "-").replace("=", "")


def read_run(run_dir: Path, np_: int, slow_rank) -> dict:
    import h5py
    per_rank = []
    for r in range(np_):
        with h5py.File(run_dir / "metrics" / f"rank{r:05d}.h5", "r", locking=False) as h:
            step, wall = h["train"]["step"][:], h["train"]["wall_time"][:]
            k = int((step >= SKIP_STEPS).argmax())
            ev = {c: h["eval"][c][:] for c in ("wall_time", "test_accuracy")}
            hit = [float(w) for w, a in zip(ev["wall_time"], ev["test_accuracy"]) if a >= TARGET]
            per_rank.append({
                "steps": int(step[-1]),
                "steps_per_s": (int(step[-1]) - int(step[k])) / max(float(wall[-1] - wall[k]),
                                                                    1e-9),
                "wall_time": float(wall[-1]),
                "final_accuracy": float(ev["test_accuracy"][-1]),
                "time_to_target": hit[0] if hit else None,
            })
    fast = [p for r, p in enumerate(per_rank) if r != slow_rank]
    # time to target: when every fast rank's own model had reached it (None: one never did)
    ttt = [p["time_to_target"] for p in fast]
    return {
        "fast_steps_per_s": statistics.median(p["steps_per_s"] for p in fast),
        "slow_steps_per_s": per_rank[slow_rank]["steps_per_s"] if slow_rank is not None else None,
        "final_accuracy": statistics.mean(p["final_accuracy"] for p in per_rank),
        "time_to_target": max(ttt) if all(t is not None for t in ttt) else None,
        "wall_time": max(p["wall_time"] for p in per_rank),
        "total_steps": sum(p["steps"] for p in per_rank),
        "per_rank": per_rank,
    }


def _job(np_: int, argvs: list, tmp: Path, timeout: float, name: str) -> str:
    spec = tmp / f"{name}.json"
    spec.write_text(json.dumps(argvs))
    p = run_group(mpirun_cmd(np_, [sys.executable, str(HERE / "_train_many.py"), str(spec)]),
                  env=mpi_env(), cwd=REPO, timeout=timeout)
    if p.returncode != 0:
        why = "timed out" if p.returncode is None else f"exit {p.returncode}"
        return f"{why}: {(p.stderr or p.stdout)[-400:].strip()}"
    return ""


def run_np(np_: int, tmp: Path, timeout: float, log) -> dict:
    slow = np_ - 1
    base_dirs = {l: tmp / f"np{np_}-none-{_slug(l)}" for l, _ in METHODS}
    t0 = time.perf_counter()
    err = _job(np_, [[*COMMON, *o, "--run-dir", str(base_dirs[l])] for l, o in METHODS],
               tmp, timeout, f"np{np_}-none")
    log(f"  stragglers: {np_} ranks, no straggler: {time.perf_counter() - t0:.0f} s")
    if err:
        return {"error": err}
    runs = {(l, 1): read_run(base_dirs[l], np_, None) for l, _ in METHODS}
    t_step = 1.0 / runs[("sync LSGD", 1)]["fast_steps_per_s"]
    argvs, dirs = [], {}
    for k in SLOWDOWNS:
        for label, opts in METHODS:
            dirs[(label, k)] = d = tmp / f"np{np_}-x{k}-{_slug(label)}"
            argvs.append([*COMMON, *opts, "--run-dir", str(d),
                          "--straggler", f"{slow}:{(k - 1) * t_step:.4f}"])
    t0 = time.perf_counter()
    err = _job(np_, argvs, tmp, timeout * 2, f"np{np_}-slow")
    log(f"  stragglers: {np_} ranks, straggler 2x and 4x: {time.perf_counter() - t0:.0f} s")
    if err:
        return {"error": err, "seconds_per_step": t_step}
    for key, d in dirs.items():
        runs[key] = read_run(d, np_, slow)
    return {"seconds_per_step": t_step, "slow_rank": slow,
            "runs": {f"{l} x{k}": v for (l, k), v in runs.items()}}


def _fmt_t(t) -> str:
    return "never" if t is None else f"{t:.1f} s"


def table(results: dict) -> str:
    lines = ["| ranks | slowdown | method | fast ranks steps/s | kept vs no straggler | "
             "time to 90% | final acc | wall |", "|---|---|---|---|---|---|---|---|"]
    for np_, res in results.items():
        if "runs" not in res:
            lines.append(f"| {np_} | - | - | failed: {res.get('error', '')[:80]} | | | | |")
            continue
        for k in (1, *SLOWDOWNS):
            for label, _ in METHODS:
                r, base = res["runs"][f"{label} x{k}"], res["runs"][f"{label} x1"]
                kept = r["fast_steps_per_s"] / base["fast_steps_per_s"]
                lines.append(f"| {np_} | {'none' if k == 1 else f'{k}x'} | {label} | "
                             f"{r['fast_steps_per_s']:.1f} | "
                             f"{'-' if k == 1 else f'{100 * kept:.0f}%'} | "
                             f"{_fmt_t(r['time_to_target'])} | {r['final_accuracy']:.3f} | "
                             f"{r['wall_time']:.1f} s |")
    return "\n".join(lines)


def run(quick: bool = False, timeout: float = 600, log=print, nps=None) -> dict:
    nps = nps or ((4,) if quick else (4, 8))
    tmp = Path(tempfile.mkdtemp(prefix="lsgd_bench_stragglers_"))
    results = {}
    try:
        for np_ in nps:
            results[np_] = run_np(np_, tmp, timeout, log)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    rows = []
    for np_, res in results.items():
        if "runs" not in res:
            rows.append(row(f"stragglers ({np_} ranks)", "", f"failed: {res['error']}", None, ""))
            continue
        runs = res["runs"]
        for k in SLOWDOWNS:
            kept = {l: runs[f"{l} x{k}"]["fast_steps_per_s"] / runs[f"{l} x1"]["fast_steps_per_s"]
                    for l, _ in METHODS}
            a, s = runs[f"async LSGD x{k}"], runs[f"sync LSGD x{k}"]
            rows.append(row(
                f"stragglers: {np_} ranks, one {k}x slower",
                "async vs sync LSGD: fast ranks' steps/s kept (slowed / unslowed run)",
                ", ".join(f"{l} {100 * v:.0f}%" for l, v in kept.items())
                + f"; time to {TARGET:.0%}: async {_fmt_t(a['time_to_target'])}, sync "
                  f"{_fmt_t(s['time_to_target'])}; final acc async {a['final_accuracy']:.3f}, "
                  f"sync {s['final_accuracy']:.3f}",
                kept["async LSGD"] / kept["sync LSGD"], "kept (async) / kept (sync)",
                kept=kept))
    return {
        "name": "stragglers", "doc": __doc__.strip(), "steps": STEPS, "target": TARGET,
        "common_options": COMMON, "methods": dict(METHODS), "slowdowns": list(SLOWDOWNS),
        "results": {str(k): v for k, v in results.items()}, "rows": rows,
        "table_markdown": table(results),
        "notes": [
            f"digits, {STEPS} steps per rank (async LSGD: the same total work, {STEPS} x ranks "
            "steps over all ranks, so its fast ranks take more), 2 ranks per node, the last "
            "rank slowed by sleeping (k-1) t per step, t = sync LSGD's median seconds per step "
            "without a straggler in the same run.",
            "fast ranks' steps/s: median over the other ranks of (steps after step "
            f"{SKIP_STEPS}) / seconds; time to {TARGET:.0%}: wall time when every fast rank's "
            "own test accuracy had reached it; final acc: mean over all ranks.",
            "On an oversubscribed machine a sleeping rank frees a core for the others, so a "
            "method that does not wait for it can run faster than without it (kept > 100%).",
        ],
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="JSON file")
    p.add_argument("--quick", action="store_true", help="4 ranks only")
    p.add_argument("--np", type=int, nargs="*", help="rank counts (default 4 8; quick: 4)")
    args = p.parse_args(argv)
    result = run(args.quick, nps=tuple(args.np) if args.np else None)
    write_result(args.out, result)
    Path(args.out).with_suffix(".md").write_text(result["table_markdown"] + "\n")
    print(result["table_markdown"])
    return 0 if all("runs" in v for v in result["results"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
