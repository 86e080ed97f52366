"""torch_ft_overhead: steps per second through torchft's managed groups (``--backend torch
--on-failure shrink``, no failure) against plain torch.distributed, same method and steps.

    python benchmarks/torch_ft_overhead.py --out torch_ft_overhead.json [--quick]
    python benchmarks/run_all.py --out results/benchmarks --only torch_ft_overhead

For allreduce SGD and LSGD (digits, digits CNN, batch 32 per worker, 3 workers as nodes {0, 1}
and {2}: ``--ranks-per-node 2``, so that LSGD has a node leader and a global leader):

* **plain**: ``torchrun --standalone --nproc-per-node 3 -m lsgd_hpc.train --backend torch``
  (one gloo group, torch.distributed's);
* **managed**: a lighthouse (``python -m lsgd_hpc.lighthouse --failure-timeout 10``) and 3
  processes, each its own torchft replica group (``REPLICA_GROUP_ID``...), ``python -m
  lsgd_hpc.train --backend torch --on-failure shrink --failure-timeout 10``: every collective
  between workers through torchft's ProcessGroupGloo, the node groups through torchft's too.

Steps per second of a job = the slowest worker's median, over blocks of BLOCK steps from step
SKIP on, of the block's steps over its /train ``training_time`` (the per-rank HDF5 metrics;
start-up, the quorum and the first steps left out, and the evaluations, which run only after
the last step). The median of blocks, because the other jobs of a shared machine stretch some
blocks by 20 % and more (the whole span's mean, reported beside it, varied 76-110 steps/s
between identical jobs here at a load average of 12). Each method runs ROUNDS rounds of both
jobs back to back (order rotated per round); ``ratio`` = the lower of the two methods'
median managed / plain steps per second, target >= 0.95.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _common import driver_main, failed, row  # noqa: E402
from torch_ft_common import (PY, REPO, Lighthouse, Workers, base_env,  # noqa: E402
                             steady_steps_per_s, torchft_missing, train_argv, train_rows,
                             typical_steps_per_s)

N = 3
FAILURE_TIMEOUT = 10.0
SKIP = 40
#: steps per block of the typical rate (a multiple of LSGD's tau_G, 8 on digits)
BLOCK = 40
METHODS = ("allreduce", "lsgd")
#: (steps per job, rounds); full: 8 jobs of 12-20 s here (about 2 min)
PLAN = {"full": (400, 2), "quick": (200, 1)}
TARGET = ">= 0.95"


def _opts(method: str, steps: int):
    return ["--algorithm", method, "--ranks-per-node", "2", "--max-steps", str(steps),
            "--eval-every", str(steps)]


def _measure(run_dir: Path, steps: int) -> dict:
    """The slowest worker's steps/s: the median of its blocks ("typical") and over the whole
    steady span ("span")."""
    span, typical = [], []
    for r in range(N):
        rows = train_rows(run_dir, r)
        if rows["step"][-1] != steps:
            raise RuntimeError(f"worker {r} ended at step {rows['step'][-1]}")
        span.append(steady_steps_per_s(rows, SKIP))
        typical.append(typical_steps_per_s(rows, SKIP, BLOCK))
    return {"span": min(span), "typical": min(typical)}


def _plain(folder: Path, method: str, steps: int, timeout: float) -> dict:
    import subprocess
    run_dir = folder / "run"
    argv = train_argv(run_dir, _opts(method, steps))
    cmd = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(N),
           *argv[1:]]
    log = folder / "torchrun.out"
    with open(log, "w") as f:
        p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=REPO,
                             env=base_env(), start_new_session=True)
        try:
            code = p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            import os
            import signal
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            code = None
    if code != 0:
        raise RuntimeError(f"torchrun exit {code}: {log.read_text()[-400:]}")
    return _measure(run_dir, steps)


def _managed(folder: Path, method: str, steps: int, timeout: float) -> dict:
    run_dir = folder / "run"
    with Lighthouse(folder, FAILURE_TIMEOUT) as lh:
        w = Workers(folder, lh.address, N, lambda r: train_argv(run_dir, [
            "--on-failure", "shrink", "--failure-timeout", str(FAILURE_TIMEOUT),
            *_opts(method, steps)]))
        codes = w.wait(timeout)
    if codes != [0] * N:
        raise RuntimeError(f"managed job: exit statuses {codes}: {w.tail(0)}")
    return _measure(run_dir, steps)


SIDES = {"plain": _plain, "managed": _managed}


def run(quick: bool = False, timeout: float = 120.0, log=print, **_) -> dict:
    steps, rounds = PLAN["quick" if quick else "full"]
    base = {"name": "torch_ft_overhead", "doc": __doc__, "target": TARGET, "workers": N,
            "steps": steps, "skip": SKIP, "rounds": rounds,
            "failure_timeout_s": FAILURE_TIMEOUT}
    why = torchft_missing()
    if why:
        return {**base, "status": f"skipped: {why}",
                "rows": [row("torch_ft_overhead", "", f"skipped: {why}", None, "")]}
    samples = {m: {s: [] for s in SIDES} for m in METHODS}
    names = list(SIDES)
    with tempfile.TemporaryDirectory(prefix="lsgd_bench_torch_ft_overhead_") as tmp:
        for rnd in range(rounds):
            for method in METHODS:
                for side in names[rnd % 2:] + names[:rnd % 2]:
                    folder = Path(tmp) / f"{method}-{side}{rnd}"
                    folder.mkdir()
                    t0 = time.perf_counter()
                    try:
                        rate = SIDES[side](folder, method, steps, timeout)
                    except Exception as exc:      # noqa: BLE001 - reported, not raised
                        return failed(base, "torch_ft_overhead",
                                      f"{method} {side} round {rnd}: {exc}")
                    samples[method][side].append(rate)
                    log(f"  torch_ft_overhead: {method} {side} round {rnd}: "
                        f"{rate['typical']:.1f} steps/s (whole span {rate['span']:.1f}; job "
                        f"{time.perf_counter() - t0:.0f} s)")
    rows, ratios, span_ratios = [], {}, {}
    for method in METHODS:
        med = {side: {k: statistics.median(x[k] for x in samples[method][side])
                      for k in ("typical", "span")} for side in SIDES}
        ratios[method] = med["managed"]["typical"] / med["plain"]["typical"]
        span_ratios[method] = med["managed"]["span"] / med["plain"]["span"]
        runs = lambda s, k: ", ".join(f"{x[k]:.1f}" for x in samples[method][s])  # noqa: E731
        rows.append(row(f"torch_ft_overhead ({method})",
                        f"{method}, 3 workers, --backend torch: torchft managed groups "
                        f"(--on-failure shrink, no failure) vs plain torch.distributed "
                        f"(torchrun)",
                        f"managed {med['managed']['typical']:.1f} steps/s "
                        f"({runs('managed', 'typical')}), plain {med['plain']['typical']:.1f} "
                        f"({runs('plain', 'typical')}); whole span: managed "
                        f"{med['managed']['span']:.1f} ({runs('managed', 'span')}), plain "
                        f"{med['plain']['span']:.1f} ({runs('plain', 'span')}), ratio "
                        f"{span_ratios[method]:.3f}",
                        ratios[method], "managed / plain steps/s, higher is better",
                        managed=med["managed"], plain=med["plain"],
                        span_ratio=span_ratios[method]))
    return {**base, "status": "ok", "ratio": min(ratios.values()), "ratios": ratios,
            "span_ratios": span_ratios, "samples": samples, "rows": rows,
            "notes": [f"steps/s = the slowest worker's median over blocks of {BLOCK} steps "
                      f"(from step {SKIP}) on /train training_time; the whole span's mean "
                      f"beside it; median of {rounds} job(s) per side; ratio = the lower of "
                      f"allreduce's and LSGD's"]}


if __name__ == "__main__":
    sys.exit(driver_main(run, __doc__.splitlines()[0]))
