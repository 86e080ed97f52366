"""The emulated cluster of the cluster benchmarks (time_to_accuracy, scale_model, overlap and
the others run through _common.cluster_job): scripts/cluster.sh's network namespaces, 2 nodes
x 2 ranks, brought up at a link rate and always taken down. Imports nothing of benchmarks/, so
that _common.py and time_to_accuracy.py both import it without importing each other."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

CLUSTER = Path(__file__).resolve().parents[1] / "scripts" / "cluster.sh"
#: time_to_accuracy's (and scale_model's) cluster: a name and subnet of its own, since other
#: clusters may be up; the benchmarks run through _common.cluster_job name their own
CLUSTER_NAME = "lsgdtta"
CLUSTER_SUBNET = "10.79.3"
NODES, RANKS_PER_NODE = 2, 2
NP = NODES * RANKS_PER_NODE


def cluster_available() -> Optional[str]:
    """None when the emulated cluster can be made here, else why not."""
    if not CLUSTER.exists():
        return "scripts/cluster.sh is missing"
    if os.geteuid() != 0:
        return "needs root (network namespaces and tc)"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "needs the ip and tc commands (iproute2)"
    return None


def _sh(*args, timeout=120) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(CLUSTER), *args], capture_output=True, text=True,
                          timeout=timeout)


@contextmanager
def emulated_cluster(rate: str, log=print, name: str = CLUSTER_NAME,
                     subnet: str = CLUSTER_SUBNET):
    """Bring the cluster ``name`` up on ``subnet`` with ``rate`` per node link; yield its
    mpirun options; always take it down."""
    _sh("down", "--name", name)          # a leftover of an interrupted run
    try:
        t0 = time.perf_counter()
        up = _sh("up", "--name", name, "--subnet", subnet, "--nodes", str(NODES),
                 "--rate", rate, "--no-slurm", timeout=300)
        if up.returncode != 0:
            raise RuntimeError(f"cluster.sh up failed: {(up.stderr or up.stdout).strip()[-300:]}")
        log(f"  time_to_accuracy: cluster up at {rate} in {time.perf_counter() - t0:.1f} s")
        args = _sh("mpirun-args", "--name", name, "--ranks-per-node", str(RANKS_PER_NODE))
        if args.returncode != 0:
            raise RuntimeError(f"cluster.sh mpirun-args failed: {args.stderr.strip()[-300:]}")
        yield args.stdout.split()
    finally:
        down = _sh("down", "--name", name)
        if down.returncode != 0:
            log(f"  time_to_accuracy: cluster.sh down: {down.stderr.strip()[-300:]}")
