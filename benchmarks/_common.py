"""Shared pieces of the benchmarks: argument parsing, interleaved timing with medians, result files."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Callable, Dict, List, Optional

#: Benchmarks time the collectives themselves: the agreement check that precedes every
#: collective of lsgd_hpc.comm (a 48-byte allreduce) is switched off unless asked for.
VALIDATE_ENV = "LSGD_HPC_COMM_VALIDATE"


def parse_args(description: str, argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--out", required=True, help="JSON file that rank 0 writes")
    p.add_argument("--quick", action="store_true", help="fewer repetitions")
    return p.parse_args(argv)


def median(xs) -> float:
    return float(statistics.median(xs)) if len(xs) else float("nan")


def interleaved(comm, methods: Dict[str, Callable[[], None]], reps: int, warmup: int = 3,
                inner: int = 1, budget_s: Optional[float] = None) -> Dict[str, List[float]]:
    """Time each method ``reps`` times, alternating methods (order rotated each repetition)
    so that a slow spell of the shared machine hits all of them alike.

    ``comm`` is an mpi4py communicator. Every timing starts after a barrier; one sample is
    the slowest rank's seconds for ``inner`` back-to-back calls, divided by ``inner``.
    With ``budget_s``, rank 0 stops the loop early (same decision on every rank) once that
    many seconds have gone, keeping at least 5 repetitions. Returns name -> samples (on
    rank 0; other ranks get an empty dict).
    """
    names = list(methods)
    for _ in range(warmup):
        for n in names:
            methods[n]()
    comm.Barrier()
    mine: Dict[str, List[float]] = {n: [] for n in names}
    t_start = time.perf_counter()
    for r in range(reps):
        order = names[r % len(names):] + names[:r % len(names)]
        for n in order:
            comm.Barrier()
            t0 = time.perf_counter()
            for _ in range(inner):
                methods[n]()
            mine[n].append((time.perf_counter() - t0) / inner)
        if budget_s is not None and r + 1 >= 5:
            stop = comm.bcast(time.perf_counter() - t_start > budget_s, root=0)
            if stop:
                break
    everyone = comm.gather(mine, root=0)
    if comm.Get_rank() != 0:
        return {}
    return {n: [max(rank[n][i] for rank in everyone) for i in range(len(mine[n]))]
            for n in names}


def spread(samples: List[float]) -> Dict[str, float]:
    """Median and quartiles of a list of samples (seconds)."""
    if not samples:
        return {"median": float("nan"), "q1": float("nan"), "q3": float("nan"), "n": 0}
    qs = statistics.quantiles(samples, n=4) if len(samples) >= 2 else [samples[0]] * 3
    return {"median": median(samples), "q1": float(qs[0]), "q3": float(qs[2]),
            "n": len(samples)}


def fmt_s(seconds: float) -> str:
    """Seconds in a readable unit."""
    if seconds != seconds:
        return "n/a"
    if seconds < 1e-3:
        return f"{seconds * 1e6:.0f} us"
    if seconds < 1:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds:.2f} s"


def fmt_bytes(n: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def write_result(path: str, result: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        json.dump(result, fh, indent=2, sort_keys=True, default=str)
    os.replace(tmp, path)


def row(label: str, compared: str, figures: str, ratio: Optional[float], ratio_label: str,
        **data) -> dict:
    """One line of the results table (run_all renders it); ``data`` holds the raw numbers."""
    return {"label": label, "compared": compared, "figures": figures, "ratio": ratio,
            "ratio_label": ratio_label, "data": data}
