"""Gossip training on every topology, 4 ranks as nodes {0,1} and {2,3}, in one MPI job.

Each rank sends its model to each out-neighbour and receives one from each in-neighbour every
step. The degrees below are worked out by hand from each graph's definition on 4 ranks, not
taken from lsgd_hpc.topology, so a graph that silently loses or duplicates an edge fails.
"""

import math
import sys

import h5py
import numpy as np
import pytest

from lsgd_hpc.topology import TOPOLOGIES
from mpi_util import REPO, run_mpi

DRIVER = str(REPO / "tests" / "parallel" / "train_driver.py")
MODEL_BYTES = 4 * (6138 + 96)   # digits_cnn: parameters + BatchNorm statistics, float32
STEPS = 6

#: out-degree of ranks 0..3 (every graph here has in-degree = out-degree at every rank)
DEGREES = {
    "complete": [3, 3, 3, 3],
    "ring": [2, 2, 2, 2],
    "torus": [2, 2, 2, 2],                 # 2 x 2 with wrap-around: each side meets one rank
    "hypercube": [2, 2, 2, 2],             # 2 dimensions
    "star": [3, 1, 1, 1],                  # centre 0
    "chain": [1, 2, 2, 1],
    "tree": [2, 2, 1, 1],                  # parent of i is (i - 1) // 2
    "exponential": [2, 2, 2, 2],           # directed: to i+1, i+2, from i-1, i-2 (mod 4)
    "exponential-undirected": [3, 3, 3, 3],  # offsets +-1, +-2 (mod 4): 3 distinct peers
    "one-peer-exponential": [1, 1, 1, 1],  # one peer per step
    "hierarchical": [2, 1, 2, 1],          # node mate, and the other node's root for roots
}


def test_every_topology_is_covered():
    assert sorted(DEGREES) == sorted(TOPOLOGIES)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("gossip")
    specs = ",".join(f"gossip@{t}" for t in DEGREES)
    run_mpi(4, [sys.executable, DRIVER, str(base / "g"), specs, "--", "--ranks-per-node", "2",
                "--max-steps", str(STEPS), "--eval-every", str(STEPS), "--consensus-every",
                "3", "--seed", "2"], timeout=600)
    out = {}
    for topo in DEGREES:
        out[topo] = []
        for r in range(4):
            with h5py.File(base / f"g-gossip-{topo}" / "metrics" / f"rank{r:05d}.h5", "r") as f:
                out[topo].append({g: {c: f[g][c][()] for c in f[g]} for g in f})
    return out


@pytest.mark.mpi
@pytest.mark.parametrize("topology", list(DEGREES))
def test_gossip_trains_on_topology(runs, topology):
    for rank, f in enumerate(runs[topology]):
        t = f["train"]
        assert list(t["step"]) == list(range(1, STEPS + 1))
        assert all(math.isfinite(v) for v in t["loss"])
        for column in ("comm_bytes_sent", "comm_bytes_recv"):
            per_step = np.diff(np.concatenate([[0], t[column]]))
            assert np.all(per_step == DEGREES[topology][rank] * MODEL_BYTES), \
                (topology, rank, column, per_step)
        # consensus distance probed every 3 steps, the same value on every rank
        assert list(f["consensus"]["step"]) == [3, 6]
        assert np.array_equal(f["consensus"]["distance"],
                              runs[topology][0]["consensus"]["distance"])
        assert np.all(f["consensus"]["distance"] > 0)
