"""Stragglers: sync against async LSGD with one slowed rank.

    python results/experiments/stragglers.py --out results/stragglers [--quick]
        [--ranks N] [--steps S] [--seeds K] [--slowdowns 2 4] [--target A]

On N ranks (default 4, 2 per node) one job trains sync LSGD (``--algorithm lsgd``) and async
LSGD (``--algorithm lsgd-async``) on digits without a straggler; sync LSGD's median seconds per
step there is the unit t. A second job trains both with the last rank sleeping (k-1) t after
each backward pass (``--straggler``), so that rank's steps take about k t, for each slowdown k.
Sync LSGD meets every rank in a collective every ``tau_local`` = 4 steps, so its fast ranks are
held to the slow rank's pace (retention about 1/k); async LSGD lets them run ahead up to
``--max-staleness`` steps past a collective the slow rank has not joined yet, and ends when all
ranks together have done the budget's total steps, so fast ranks do more of the work.

Measured (benchmarks/straggler_sweep.py, shared with ``make bench``'s stragglers benchmark):
the fast ranks' steps/s with the straggler over without it (retention), the wall time until
every fast rank's own model reached the target test accuracy, and the final test accuracy
(mean over ranks). All seeds run in the same pair of jobs (t from seed 1); the table gives
every seed, the figure the mean over seeds with min-max bars. On a machine with fewer cores than
ranks, a sleeping rank frees a core for the others, so retention can exceed 100 %.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _shared import REPO, new_figure, raw_dir, save_figure, write_csv  # noqa: E402

sys.path.append(str(REPO / "benchmarks"))
from straggler_sweep import retention, sweep  # noqa: E402

NAME = "stragglers"
TITLE = "Stragglers: sync vs async LSGD with one slowed rank"
METHODS = [("sync LSGD", ["--algorithm", "lsgd"]),
           ("async LSGD", ["--algorithm", "lsgd-async"])]
FULL = dict(ranks=4, steps=80, seeds=3, slowdowns=(2, 4))
QUICK = dict(ranks=4, steps=40, seeds=1, slowdowns=(2, 4))
TARGET = 0.90
COLUMNS = ["ranks", "slowdown", "method", "seed", "seconds_per_step_unit", "fast_steps_per_s",
           "slow_steps_per_s", "retention", "target_acc", "time_to_target_s", "final_acc",
           "wall_time_s", "total_steps"]


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return statistics.fmean(xs) if xs else None


def plot(rows: list, slowdowns, world: int, target: float, out: Path) -> str:
    """Retention and time to target against the slowdown, one line per method."""
    fig, (ax_r, ax_t) = new_figure(ncols=2, width=5.4, height=4.2)
    ks = [1, *slowdowns]
    never = []
    for i, (label, _) in enumerate(METHODS):
        for ax, key, scale in ((ax_r, "retention", 100.0), (ax_t, "time_to_target_s", 1.0)):
            xs, mean, err_lo, err_hi = [], [], [], []
            for k in ks:
                vals = [r[key] * scale for r in rows
                        if r["method"] == label and r["slowdown"] == k and r[key] is not None]
                if not vals:
                    continue
                m = statistics.fmean(vals)
                xs.append(k)
                mean.append(m)
                err_lo.append(m - min(vals))
                err_hi.append(max(vals) - m)
            ax.errorbar(xs, mean, yerr=[err_lo, err_hi], color=f"C{i}", marker="o", lw=1.8,
                        capsize=4, label=label)
            missed = [f"{k}x" for k in ks if any(
                r[key] is None for r in rows if r["method"] == label and r["slowdown"] == k)]
            if ax is ax_t and missed:
                never.append(f"{label}: not in every seed at {', '.join(missed)}")
    ax_r.plot(ks, [100.0 / k for k in ks], color="grey", ls=":", lw=1.5,
              label="100/k: waits for the slow rank")
    for ax in (ax_r, ax_t):
        ax.set_xscale("log", base=2)
        ax.set_xticks(ks)
        ax.set_xticklabels([f"{k}x" for k in ks])
        ax.set_xlabel("slowdown of the last rank (its seconds per step / t)")
    ax_r.set_ylabel("fast ranks' steps/s kept (% of no straggler)")
    ax_r.set_title(f"Throughput kept by the {world - 1} fast ranks")
    ax_t.set_ylabel(f"wall time to {target:.0%} test accuracy (s)")
    ax_t.set_title(f"Time until every fast rank reached {target:.0%}")
    ax_r.legend(loc="best")
    ax_t.legend(loc="upper left")
    ax_t.set_ylim(bottom=0)
    if never:   # runs that never reached the target have no point: say so on the panel
        ax_t.text(0.98, 0.03, "target not reached:\n" + "\n".join(never), ha="right",
                  va="bottom", transform=ax_t.transAxes, fontsize=9,
                  bbox=dict(facecolor="white", alpha=0.8, edgecolor="grey"))
    fig.suptitle(f"Stragglers on {world} ranks (digits): one rank k times slower; "
                 "mean over seeds, bars min-max", fontsize=11)
    name = "stragglers.png"
    save_figure(fig, out / name)
    return name


def findings(rows: list, slowdowns, target: float) -> list:
    out = []

    def mean_of(label, k, key):
        return _mean([r[key] for r in rows if r["method"] == label and r["slowdown"] == k])

    for k in slowdowns:
        ks, ka = mean_of("sync LSGD", k, "retention"), mean_of("async LSGD", k, "retention")
        ts, ta = (mean_of("sync LSGD", k, "time_to_target_s"),
                  mean_of("async LSGD", k, "time_to_target_s"))
        fs, fa = mean_of("sync LSGD", k, "final_acc"), mean_of("async LSGD", k, "final_acc")

        def t(x):
            return "never" if x is None else f"{x:.1f} s"
        verdict = ("async LSGD kept more of the fast ranks' throughput" if ka > ks
                   else "async LSGD did NOT keep more of the fast ranks' throughput")
        if ta is not None and (ts is None or ta < ts):
            verdict += " and reached the target sooner"
        else:
            verdict += " and did NOT reach the target sooner"
        if max(ka, ks) > 1.1:
            verdict += (" (retention above 100 %: with more ranks than cores the sleeping rank "
                        "frees CPU and stops polling in MPI, so the others run faster than in "
                        "the unslowed run; read it as 'not held back', not as a speed-up)")
        out.append(f"One rank {k}x slower: fast ranks kept {100 * ka:.0f} % of their steps/s "
                   f"under async LSGD, {100 * ks:.0f} % under sync LSGD (1/k = {100 / k:.0f} %); "
                   f"time to {target:.0%}: async {t(ta)}, sync {t(ts)}; final accuracy async "
                   f"{100 * fa:.1f} %, sync {100 * fs:.1f} %: {verdict}.")
    return out


def run(out, quick: bool = False, log=print, ranks=None, steps=None, seeds=None,
        slowdowns=None, target: float = TARGET, timeout: float = 300.0, raw=None) -> dict:
    """Run the sweep for every seed and write stragglers.csv and stragglers.png into ``out``;
    raw runs go under ``raw`` (default runs/results/stragglers/)."""
    t_start = time.perf_counter()
    budget = QUICK if quick else FULL
    world = ranks or budget["ranks"]
    steps = steps or budget["steps"]
    seeds = seeds or budget["seeds"]
    slowdowns = tuple(slowdowns or budget["slowdowns"])
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tmp = Path(raw or raw_dir(NAME))
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    common = ["--dataset", "digits", "--max-steps", str(steps), "--epochs", "1000",
              "--eval-every", "10", "--ranks-per-node", "2", "--consensus-every", "0"]
    # every seed of every method in the same pair of jobs (two start-ups in all); the unit t
    # is seed 1's sync LSGD
    variants = [(f"{label} seed {seed}", [*opts, "--seed", str(seed)])
                for seed in range(1, seeds + 1) for label, opts in METHODS]
    res = sweep(world, variants, slowdowns, common, target, tmp, timeout * seeds, log=log,
                reference=f"{METHODS[0][0]} seed 1")
    if "runs" not in res:
        raise RuntimeError(f"stragglers: {res['error']}")
    rows = []
    for seed in range(1, seeds + 1):
        for k in (1, *slowdowns):
            for label, _ in METHODS:
                v = f"{label} seed {seed}"
                r = res["runs"][f"{v} x{k}"]
                rows.append({"ranks": world, "slowdown": k, "method": label, "seed": seed,
                             "seconds_per_step_unit": res["seconds_per_step"],
                             "fast_steps_per_s": r["fast_steps_per_s"],
                             "slow_steps_per_s": r["slow_steps_per_s"],
                             "retention": retention(res["runs"], v, k),
                             "target_acc": target, "time_to_target_s": r["time_to_target"],
                             "final_acc": r["final_accuracy"], "wall_time_s": r["wall_time"],
                             "total_steps": r["total_steps"]})
    write_csv(out / "stragglers.csv", rows, COLUMNS)
    figure = plot(rows, slowdowns, world, target, out)
    return {"name": NAME, "title": TITLE, "figures": [figure], "tables": ["stragglers.csv"],
            "findings": [f"Setup: {world} ranks (2 per node), digits, {steps} steps per rank "
                         f"(async: the same total), {seeds} seed(s), the last rank slowed by "
                         f"sleeping (k-1) t per step, t = sync LSGD's (seed 1) median seconds "
                         f"per step without a straggler ({res['seconds_per_step'] * 1e3:.1f} ms "
                         f"here)."]
                        + findings(rows, slowdowns, target),
            "seconds": time.perf_counter() - t_start}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 2)[2])
    p.add_argument("--out", required=True, help="folder for stragglers.csv and stragglers.png")
    p.add_argument("--quick", action="store_true",
                   help=f"small budget: {QUICK['steps']} steps, {QUICK['seeds']} seed")
    p.add_argument("--ranks", type=int, help=f"rank count (default {FULL['ranks']})")
    p.add_argument("--steps", type=int, help=f"steps per rank (default {FULL['steps']})")
    p.add_argument("--seeds", type=int, help=f"seeds (default {FULL['seeds']})")
    p.add_argument("--slowdowns", type=int, nargs="+",
                   help=f"slowdowns k > 1 (default {' '.join(map(str, FULL['slowdowns']))})")
    p.add_argument("--target", type=float, default=TARGET,
                   help=f"target test accuracy (default {TARGET})")
    p.add_argument("--raw", metavar="DIR",
                   help=f"folder for the raw runs (default runs/results/{NAME}/)")
    args = p.parse_args(argv)
    if args.slowdowns and min(args.slowdowns) < 2:
        p.error("--slowdowns must be integers >= 2 (1 is the run without a straggler)")
    res = run(args.out, args.quick, ranks=args.ranks, steps=args.steps, seeds=args.seeds,
              slowdowns=args.slowdowns, target=args.target, raw=args.raw)
    for f in res["findings"]:
        print("-", f)
    print(f"{NAME}: {res['seconds']:.0f} s; wrote {', '.join(res['tables'] + res['figures'])} "
          f"to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
