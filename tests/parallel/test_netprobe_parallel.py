"""netprobe tests that hold at any world size (size 1 in the plain run, 2/4/5 under mpirun).

The probe's pairs are worked out here from the layout; its times must be real (positive,
finite) and its derived figures must follow from its own per-size times exactly.
"""

import math
import os

import pytest
from mpi4py import MPI

from lsgd_hpc.comm import NodeGroups, make_world, node_layout
from lsgd_hpc.planning.netprobe import probe_groups, probe_network

SIZES = (8, 4096, 65536)


def expected_pairs(node_of):
    members = {}
    for r, n in enumerate(node_of):
        members.setdefault(n, []).append(r)
    intra = [m[:2] for m in members.values() if len(m) >= 2]
    roots = [m[0] for m in members.values()]
    inter = [[roots[0], r] for r in roots[1:]]
    return intra, inter


def check_link(link, pairs):
    assert link["pairs"] == pairs
    times = link["one_way_s"]
    assert len(times) == len(SIZES)
    assert all(math.isfinite(t) and t > 0 for t in times), times
    assert link["latency_s"] == times[0]
    assert link["bandwidth_Bps"] == SIZES[-1] / times[-1]
    assert link["alpha_s"] >= 0 and link["beta_s_per_byte"] >= 0


@pytest.mark.parametrize("k", [1, 2, 3])
def test_probe_pairs_and_figures(k):
    comm = MPI.COMM_WORLD
    node_of = node_layout(["h"] * comm.Get_size(), k)
    result = probe_network(comm, node_of, SIZES, repeats=3)
    # one answer, the same on every rank
    assert comm.allgather(repr(result)) == [repr(result)] * comm.Get_size()
    assert result["sizes"] == list(SIZES) and result["repeats"] == 3
    assert result["n_nodes"] == max(node_of) + 1
    intra, inter = expected_pairs(node_of)
    if intra:
        check_link(result["intra"], intra)
    else:
        assert result["intra"] is None
    if inter:
        check_link(result["inter"], inter)
    else:
        assert result["inter"] is None


def test_probe_groups_uses_the_node_layout():
    if os.environ.get("LSGD_TEST_BACKEND", "mpi") != "mpi":
        pytest.skip("probe_groups needs the MPI backend's world (point-to-point messages)")
    k = int(os.environ.get("LSGD_TEST_RPN", "1"))
    world = make_world("mpi")
    groups = NodeGroups.build(world, ranks_per_node=k)
    result = probe_groups(groups, SIZES, repeats=2)
    assert result["n_nodes"] == groups.n_nodes
    intra, inter = expected_pairs(groups.node_of)
    assert (result["intra"] or {}).get("pairs", []) == intra
    assert (result["inter"] or {}).get("pairs", []) == inter
    groups.free()


@pytest.mark.parametrize("sizes,repeats", [((), 2), ((0, 8), 2), ((64, 8), 2), ((8,), 0)])
def test_probe_rejects_bad_arguments(sizes, repeats):
    comm = MPI.COMM_WORLD
    with pytest.raises(ValueError):
        probe_network(comm, [0] * comm.Get_size(), sizes, repeats)


def test_probe_rejects_a_layout_of_another_size():
    comm = MPI.COMM_WORLD
    with pytest.raises(ValueError, match="node_of"):
        probe_network(comm, [0] * (comm.Get_size() + 1))
