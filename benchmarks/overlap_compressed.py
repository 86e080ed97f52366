"""Streaming DiLoCo's hidden communication in int8 against fp32, at 100 Mbit/s.

The staged non-blocking compressed allreduce (lsgd_hpc.comm.quantized: quantize, a non-blocking
alltoall, requantize, a non-blocking allgather, each stage run from the step's test()) lets
Streaming DiLoCo hide its int8 fragments as it hides fp32 ones. Measured as
benchmarks/overlap.py measures the overlapping methods (the same emulated cluster, 2 nodes x
2 ranks at 100 Mbit/s per node link, ResNet-20 on synthetic 3x32x32 images, batch 32, the
same rounds and medians), for Streaming DiLoCo (H = 8, 4 fragments, alpha 0.5) in fp32 and in
int8, each with fragment_sync_delay 1 (overlap) against itself with delay 0 (blocking):

    hidden share = 1 - exposed(delay 1) / exposed(delay 0)

and the ratio reported is int8's hidden share over fp32's (target >= 0.9, for noise: int8
hides at least as much of its communication as fp32 does).

    python benchmarks/overlap_compressed.py --out FILE [--quick]   (root: the emulated cluster)
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Dict, Optional

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO))
import overlap  # noqa: E402
from _common import cluster_bench_main, cluster_job, failed, row, spread  # noqa: E402

CLUSTER = dict(name="bovq", subnet="10.79.8")
STREAM = dict(local_steps=8, fragments=4, fragment_update_alpha=0.5)
#: (name, class, options with the overlap, options without it), as overlap.PAIRS
PAIRS = [(f"streaming {dtype}", "DiLoCo",
          dict(STREAM, fragment_sync_delay=1, comm_dtype=dtype),
          dict(STREAM, fragment_sync_delay=0, comm_dtype=dtype)) for dtype in ("fp32", "int8")]


def run(quick: bool = False, timeout: float = 600, log=print,
        key: str = "overlap_compressed") -> Dict:
    base = {"name": key, "doc": __doc__.splitlines()[0], "rate": overlap.RATE,
            "model": overlap.MODEL}
    res, done = cluster_job(str(Path(__file__)), key, base, CLUSTER, overlap.RATE, quick,
                            timeout, log)
    if done:
        return done
    if "samples" not in res:
        return failed(base, key, "the worker wrote no samples")
    med = {label: {k: spread(v)["median"] for k, v in s.items()}
           for label, s in res["samples"].items()}
    shares = {}
    for name, _, _, _ in PAIRS:
        a, b = med[f"{name} overlap"], med[f"{name} blocking"]
        shares[name] = {"hidden_share": 1.0 - a["comm_s"] / b["comm_s"] if b["comm_s"] > 0
                        else float("nan"), "overlap": a, "blocking": b}
    fp32, int8 = shares["streaming fp32"], shares["streaming int8"]
    ratio = int8["hidden_share"] / fp32["hidden_share"] if fp32["hidden_share"] > 0 else None
    figures = "; ".join(
        f"{name.split()[1]}: exposed {s['overlap']['comm_s'] * 1e3:.1f} vs "
        f"{s['blocking']['comm_s'] * 1e3:.1f} ms/step (hidden {100 * s['hidden_share']:.0f} %)"
        for name, s in shares.items())
    rows = [row(key, f"Streaming DiLoCo (H 8, 4 fragments, delay 1 vs 0) int8 vs fp32, "
                     f"{overlap.MODEL} batch {overlap.BATCH}, 2 nodes x 2 ranks at "
                     f"{overlap.RATE}", figures, ratio,
                "hidden share int8 / fp32 (>= 1: int8 hides at least as much)")]
    return {**base, "status": "ok", "methods": shares, "ratio": ratio, "target": ">= 0.9",
            "steps": res["steps"], "samples": res["samples"], "rows": rows,
            "notes": ["overlap_compressed: hidden share = 1 - exposed comm (delay 1) / exposed "
                      "comm (delay 0), slowest rank, median over rounds; ratio int8 / fp32"]}


def worker(out: str, quick: bool, nodes: int, rate: str) -> int:
    """The ranks: overlap's worker, with these configurations."""
    return overlap.worker(out, quick, nodes, rate, pairs=PAIRS)


def main(argv: Optional[list] = None) -> int:
    return cluster_bench_main(__doc__.splitlines()[0], run, worker, overlap.RATE, argv)


if __name__ == "__main__":
    try:
        sys.exit(main())
    except subprocess.TimeoutExpired:
        sys.exit(1)
