"""One slow rank: sync LSGD vs async LSGD vs allreduce vs local SGD (digits): fast ranks' steps/s, time to a target accuracy, final accuracy.

    python benchmarks/stragglers.py --out results/stragglers.json [--quick] [--np 4 8]

For each rank count, one MPI job trains every method without a straggler; the median
seconds per step of sync LSGD there is the unit t. A second job trains every method with
the last rank sleeping (k-1) t per step (--straggler), for k = 2 and 4: that rank's steps take
about k times as long. The figure of merit is the retention: the fast ranks' steps/s with
the straggler over their steps/s without it, per method, from the same run. The sweep itself
is benchmarks/straggler_sweep.py (results/experiments/stragglers.py runs it too).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

from _common import row, write_result
from straggler_sweep import SKIP_STEPS, retention, sweep

METHODS = [
    ("sync LSGD", ["--algorithm", "lsgd"]),
    ("async LSGD", ["--algorithm", "lsgd-async"]),
    ("allreduce", ["--algorithm", "allreduce"]),
    ("local SGD T=8", ["--algorithm", "local-sgd", "--local-steps", "8"]),
]
SLOWDOWNS = (2, 4)
STEPS = 40
TARGET = 0.90
COMMON = ["--dataset", "digits", "--max-steps", str(STEPS), "--epochs", "100",
          "--eval-every", "10", "--ranks-per-node", "2", "--seed", "1"]


def run_np(np_: int, tmp: Path, timeout: float, log) -> dict:
    return sweep(np_, METHODS, SLOWDOWNS, COMMON, TARGET, tmp, timeout,
                 log=lambda m: log(f"  {m}"))


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
                r = res["runs"][f"{label} x{k}"]
                kept = retention(res["runs"], label, k)
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
            kept = {l: retention(runs, l, k) for l, _ in METHODS}
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
