"""Cost of each training method (60 synthetic steps, 4 ranks as 2 nodes): bytes/step/rank, comm share, steps/s."""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

from _common import driver_main, fmt_bytes, median, row

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))
from lsgd_hpc.testing import mpi_env, mpirun_cmd, run_group  # noqa: E402

NP = 4
RANKS_PER_NODE = 2
STEPS = 60
#: (label, extra options): the methods, in the order of the table
METHODS = [
    ("lsgd", ["--algorithm", "lsgd"]),
    ("allreduce", ["--algorithm", "allreduce"]),
    ("easgd", ["--algorithm", "easgd"]),
    ("local-sgd T=8", ["--algorithm", "local-sgd", "--local-steps", "8"]),
    ("diloco H=8", ["--algorithm", "diloco", "--local-steps", "8"]),
    ("slowmo T=8", ["--algorithm", "slowmo", "--local-steps", "8", "--slowmo-every", "48"]),
    ("gossip ring", ["--algorithm", "gossip", "--topology", "ring"]),
    ("gossip exponential", ["--algorithm", "gossip", "--topology", "exponential"]),
]
#: Common options. --epochs is raised so that --max-steps (not the 2-epoch default) ends the
#: run; evaluation only at the last step and consensus probes off (--consensus-every 0, as
#: every timing experiment), so that measurement does not weigh on steps/s.
COMMON = ["--dataset", "synthetic", "--max-steps", str(STEPS), "--epochs", "100",
          "--eval-every", str(STEPS), "--consensus-every", "0",
          "--ranks-per-node", str(RANKS_PER_NODE)]
SKIP_STEPS = 8           # start-up steps left out of steps/s
#: steps/s is timed over blocks of PERIOD steps: a multiple of every method's period
#: (LSGD tau_global 8, tau_local 4; local SGD, DiLoCo, SlowMo T=8; EASGD tau 4; gossip every
#: step; SlowMo's slow step every 48 communicates nothing and makes a few passes only)
PERIOD = 8


def _blocks(step, wall):
    """Seconds of each block of PERIOD steps (SKIP_STEPS, SKIP_STEPS + PERIOD], ..."""
    at = {int(s): float(w) for s, w in zip(step, wall)}
    edges = list(range(SKIP_STEPS, int(step[-1]) + 1, PERIOD))
    return [at[b] - at[a] for a, b in zip(edges, edges[1:]) if a in at and b in at]


def _argv(opts, run_dir):
    return [*COMMON, *opts, "--run-dir", str(run_dir)]


def read_run(run_dir: Path) -> dict:
    """Per-step costs of one run from its rank HDF5 files (averaged over ranks)."""
    import h5py
    files = sorted((run_dir / "metrics").glob("rank*.h5"))
    if len(files) != NP:
        raise RuntimeError(f"{run_dir}: {len(files)} rank files, expected {NP}")
    per_rank = []
    for f in files:
        with h5py.File(f, "r", locking=False) as h:
            t = h["train"]
            step = t["step"][:]
            last = int(step[-1])
            wall = t["wall_time"][:]
            k = int((step >= SKIP_STEPS).argmax())
            comm_s, comp_s = float(t["comm_seconds"][-1]), float(t["compute_seconds"][-1])
            per_rank.append({
                "steps": last,
                "bytes_sent_per_step": float(t["comm_bytes_sent"][-1]) / last,
                "bytes_recv_per_step": float(t["comm_bytes_recv"][-1]) / last,
                "comm_seconds": comm_s, "compute_seconds": comp_s,
                "comm_share": comm_s / (comm_s + comp_s) if comm_s + comp_s > 0 else float("nan"),
                # Median over whole periods (robust to a burst of the machine's other jobs;
                # every period holds the same communication of every method).
                "steps_per_s": PERIOD / max(median(_blocks(step, wall)), 1e-9),
                "steps_per_s_mean": (last - int(step[k])) / max(float(wall[-1] - wall[k]), 1e-9),
                "wall_time": float(wall[-1]),
            })
    out = {key: sum(r[key] for r in per_rank) / len(per_rank)
           for key in ("bytes_sent_per_step", "bytes_recv_per_step", "comm_seconds",
                       "compute_seconds", "comm_share")}
    out["steps_per_s"] = median([r["steps_per_s"] for r in per_rank])
    out["bytes_sent_per_step_max"] = max(r["bytes_sent_per_step"] for r in per_rank)
    out["bytes_sent_per_step_min"] = min(r["bytes_sent_per_step"] for r in per_rank)
    out["per_rank"] = per_rank
    return out


def run(quick: bool = False, timeout: float = 150, log=print) -> dict:
    """Train every method and read its metrics. Full mode: one `mpirun python -m
    lsgd_hpc.train` per method. Quick mode: the same command lines in one MPI job
    (benchmarks/_train_many.py calls lsgd_hpc.train.main on each), one start-up instead of six.
    """
    tmp = Path(tempfile.mkdtemp(prefix="lsgd_bench_algos_"))
    env = mpi_env()
    runs, errors = {}, {}
    launch = "one job, lsgd_hpc.train.main per method" if quick else \
        "one `mpirun python -m lsgd_hpc.train` per method"
    try:
        dirs = {label: tmp / label.replace(" ", "_").replace("=", "") for label, _ in METHODS}
        if quick:
            spec = tmp / "argvs.json"
            spec.write_text(json.dumps([_argv(o, dirs[l]) for l, o in METHODS]))
            t0 = time.perf_counter()
            p = run_group(mpirun_cmd(NP, [sys.executable, str(HERE / "_train_many.py"), str(spec)]),
                          env=env, cwd=REPO, timeout=timeout * 2)
            log(f"  algorithms_cost: all methods in one job, {time.perf_counter() - t0:.0f} s")
            if p.returncode != 0:
                why = "timed out" if p.returncode is None else f"exit {p.returncode}"
                for label, _ in METHODS:
                    if not (dirs[label] / "metrics").is_dir():
                        errors[label] = f"{why}: {(p.stderr or p.stdout)[-400:].strip()}"
        else:
            for label, opts in METHODS:
                t0 = time.perf_counter()
                p = run_group(mpirun_cmd(NP, [sys.executable, "-m", "lsgd_hpc.train",
                                              *_argv(opts, dirs[label])]),
                              env=env, cwd=REPO, timeout=timeout)
                log(f"  algorithms_cost: {label}: {time.perf_counter() - t0:.0f} s")
                if p.returncode != 0:
                    why = "timed out" if p.returncode is None else f"exit {p.returncode}"
                    errors[label] = f"{why}: {(p.stderr or p.stdout)[-400:].strip()}"
        for label, _ in METHODS:
            if label in errors:
                continue
            try:
                runs[label] = read_run(dirs[label])
            except Exception as exc:          # a missing or short file: report, go on
                errors[label] = f"{type(exc).__name__}: {exc}"
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    base = runs.get("allreduce", {}).get("bytes_sent_per_step")
    rows = []
    for label, _ in METHODS:
        if label in errors:
            rows.append(row(f"algorithms_cost: {label}", "", f"failed: {errors[label]}", None, ""))
            continue
        r = runs[label]
        spread_note = ""
        if r["bytes_sent_per_step_max"] > 1.01 * r["bytes_sent_per_step_min"]:
            spread_note = (f" (ranks {fmt_bytes(r['bytes_sent_per_step_min'])}.."
                           f"{fmt_bytes(r['bytes_sent_per_step_max'])})")
        rows.append(row(
            f"algorithms_cost: {label}",
            ("allreduce (the reference)" if label == "allreduce" else f"{label} vs allreduce")
            + ": bytes sent per step per rank; comm share; steps/s",
            f"{fmt_bytes(r['bytes_sent_per_step'])}/step{spread_note}, comm "
            f"{100 * r['comm_share']:.0f}% of step time, {r['steps_per_s']:.1f} steps/s",
            r["bytes_sent_per_step"] / base if base else None, "bytes/step / allreduce's",
            bytes_sent_per_step=r["bytes_sent_per_step"], comm_share=r["comm_share"],
            steps_per_s=r["steps_per_s"]))
    return {
        "name": "algorithms_cost", "doc": __doc__.strip(), "np": NP,
        "ranks_per_node": RANKS_PER_NODE, "steps": STEPS, "launch": launch,
        "common_options": COMMON, "methods": {l: o for l, o in METHODS},
        "runs": runs, "errors": errors, "rows": rows,
        "notes": [
            f"Each method trained {STEPS} steps on the synthetic data set (MLP, "
            f"{NP} ranks = {NP // RANKS_PER_NODE} nodes x {RANKS_PER_NODE}); {launch}; "
            f"options {' '.join(COMMON)} plus the method's own.",
            "Bytes are lsgd_hpc's logical payload (CommStats): allreduce n sent; broadcast n "
            "sent by the root only; neighbour exchange n per out-neighbour.",
            "comm share = comm_seconds / (comm_seconds + compute_seconds) from the rank files; "
            "consensus probes are off (--consensus-every 0); the stop-flag agreement is "
            "control traffic (overhead_seconds), in neither.",
            f"steps/s = {PERIOD} / median seconds of a block of {PERIOD} steps (a multiple of "
            f"every method's period) over steps {SKIP_STEPS}..{STEPS} (wall_time of /train), "
            "median over ranks; the methods run one after another on a shared machine, so "
            "steps/s is noisy; the bytes are exact.",
        ],
    }


def main(argv=None) -> int:
    return driver_main(run, __doc__, argv)


if __name__ == "__main__":
    sys.exit(main())
