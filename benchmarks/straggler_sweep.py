"""One slow rank, measured: the sweep that benchmarks/stragglers.py and results/experiments/stragglers.py share.

For a rank count n, one MPI job trains every method without a straggler; the median seconds
per step of the reference method (sync LSGD) there is the unit t. A second job trains every
method with the last rank sleeping (k-1) t per step (--straggler), for each slowdown k: that
rank's steps take about k times as long. The figure of merit is the retention: the fast ranks'
steps/s with the straggler over their steps/s without it, per method, from the same run.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Optional, Sequence, Tuple

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
from lsgd_hpc.testing import mpi_env, mpirun_cmd, run_group  # noqa: E402

__all__ = ["SKIP_STEPS", "slug", "read_run", "sweep", "retention"]

SKIP_STEPS = 5                  # start-up steps left out of steps/s


def slug(label: str) -> str:
    return label.lower().replace(" ", "-").replace("=", "")


def read_run(run_dir: Path, np_: int, slow_rank: Optional[int], target: float,
             skip: int = SKIP_STEPS) -> dict:
    """A run's figures: fast ranks' median steps/s (after step ``skip``), the slow rank's,
    the mean final test accuracy over ranks, and the time to ``target``: the wall time at which
    every fast rank's own model had reached it (None: one never did)."""
    import h5py
    per_rank = []
    for r in range(np_):
        with h5py.File(run_dir / "metrics" / f"rank{r:05d}.h5", "r", locking=False) as h:
            step, wall = h["train"]["step"][:], h["train"]["wall_time"][:]
            k = int((step >= skip).argmax())
            ev = {c: h["eval"][c][:] for c in ("wall_time", "test_accuracy")}
            hit = [float(w) for w, a in zip(ev["wall_time"], ev["test_accuracy"]) if a >= target]
            per_rank.append({
                "steps": int(step[-1]),
                "steps_per_s": (int(step[-1]) - int(step[k])) / max(float(wall[-1] - wall[k]),
                                                                    1e-9),
                "wall_time": float(wall[-1]),
                "final_accuracy": float(ev["test_accuracy"][-1]),
                "time_to_target": hit[0] if hit else None,
            })
    fast = [p for r, p in enumerate(per_rank) if r != slow_rank]
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
    """Every command line of ``argvs`` in one mpirun (benchmarks/_train_many.py); '' or why not."""
    spec = tmp / f"{name}.json"
    spec.write_text(json.dumps([list(map(str, a)) for a in argvs]))
    p = run_group(mpirun_cmd(np_, [sys.executable, str(HERE / "_train_many.py"), str(spec)]),
                  env=mpi_env(), cwd=REPO, timeout=timeout)
    if p.returncode != 0:
        why = "timed out" if p.returncode is None else f"exit {p.returncode}"
        return f"{why}: {(p.stderr or p.stdout)[-400:].strip()}"
    return ""


def sweep(np_: int, methods: Sequence[Tuple[str, Sequence[str]]], slowdowns: Sequence[int],
          common: Sequence[str], target: float, tmp: Path, timeout: float,
          log: Callable[[str], None] = print, reference: str = "sync LSGD") -> dict:
    """Run ``methods`` (label, trainer options) on ``np_`` ranks without a straggler, then with
    the last rank slowed k times for each k of ``slowdowns``; run directories go under ``tmp``.
    Returns {"seconds_per_step": t, "slow_rank", "runs": {"<label> x<k>": read_run(...)}}
    (k = 1: no straggler), or {"error": ...} when a job failed."""
    slow = np_ - 1
    base_dirs = {l: tmp / f"np{np_}-none-{slug(l)}" for l, _ in methods}
    t0 = time.perf_counter()
    err = _job(np_, [[*common, *o, "--run-dir", str(base_dirs[l])] for l, o in methods],
               tmp, timeout, f"np{np_}-none")
    log(f"stragglers: {np_} ranks, no straggler: {time.perf_counter() - t0:.0f} s")
    if err:
        return {"error": err}
    runs = {(l, 1): read_run(base_dirs[l], np_, None, target) for l, _ in methods}
    t_step = 1.0 / runs[(reference, 1)]["fast_steps_per_s"]
    argvs, dirs = [], {}
    for k in slowdowns:
        for label, opts in methods:
            dirs[(label, k)] = d = tmp / f"np{np_}-x{k}-{slug(label)}"
            argvs.append([*common, *opts, "--run-dir", str(d),
                          "--straggler", f"{slow}:{(k - 1) * t_step:.4f}"])
    t0 = time.perf_counter()
    err = _job(np_, argvs, tmp, timeout * len(slowdowns), f"np{np_}-slow")
    log(f"stragglers: {np_} ranks, straggler {' and '.join(f'{k}x' for k in slowdowns)}: "
        f"{time.perf_counter() - t0:.0f} s")
    if err:
        return {"error": err, "seconds_per_step": t_step}
    for key, d in dirs.items():
        runs[key] = read_run(d, np_, slow, target)
    return {"seconds_per_step": t_step, "slow_rank": slow,
            "runs": {f"{l} x{k}": v for (l, k), v in runs.items()}}


def retention(runs: dict, label: str, k: int) -> float:
    """Fast ranks' steps/s with a k-times slower rank over their steps/s without one."""
    return runs[f"{label} x{k}"]["fast_steps_per_s"] / runs[f"{label} x1"]["fast_steps_per_s"]
