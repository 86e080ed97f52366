"""One rank of the two-namespace job started by tests/cluster/test_netns.py.

Nodes are found by host name only (no --ranks-per-node, no LSGD_HPC_RANKS_PER_NODE): ranks 0, 1
run in namespace/host "nodeA", ranks 2, 3 in "nodeB". Checks the grouping and that the two-level
collectives cross the (real, TCP) link between the namespaces. Prints one marker line per rank.
"""

import os
import socket
import sys

import torch

from lsgd_hpc.comm import make_world
from lsgd_hpc.comm.groups import RANKS_PER_NODE_ENV, NodeGroups


def main() -> None:
    expected = sys.argv[1].split(",")  # host name of every world rank: nodeA,nodeA,nodeB,...
    assert RANKS_PER_NODE_ENV not in os.environ, \
        f"{RANKS_PER_NODE_ENV}={os.environ[RANKS_PER_NODE_ENV]!r} reached the ranks"

    world = make_world("mpi")
    me, n = world.rank, world.size
    assert n == len(expected), (n, expected)

    groups = NodeGroups.build(world)           # no ranks_per_node: by host name
    hosts = world.allgather_object(socket.gethostname())
    assert hosts == expected, f"host names {hosts}, expected {expected}"
    assert groups.hostname == expected[me], (groups.hostname, expected[me])

    names = list(dict.fromkeys(expected))
    node_of = [names.index(h) for h in expected]
    assert groups.node_of == node_of, (groups.node_of, node_of)
    assert groups.n_nodes == len(names), groups.n_nodes
    members = [r for r in range(n) if node_of[r] == node_of[me]]
    assert list(groups.node.world_ranks) == members, (groups.node.world_ranks, members)
    assert groups.local_size == len(members) and groups.local_rank == members.index(me)
    roots = [node_of.index(i) for i in range(len(names))]
    assert (groups.roots is not None) == (me in roots), (me, roots, groups.roots)
    if groups.roots is not None:
        assert list(groups.roots.world_ranks) == roots, (groups.roots.world_ranks, roots)

    # Hierarchical broadcast from every rank in turn (node roots and non-roots as leaders).
    for leader in range(n):
        t = torch.full((1000,), float(me * 10 + 1), dtype=torch.float32)
        groups.broadcast_from_(t, leader)
        want = float(leader * 10 + 1)
        assert torch.all(t == want), f"broadcast from {leader}: rank {me} has {t[:3].tolist()}"

    # Allreduce on the node communicator sums the node's ranks only.
    t = torch.tensor([float(me + 1)], dtype=torch.float64)
    groups.node.allreduce_(t, "sum")
    want = float(sum(r + 1 for r in members))
    assert t.item() == want, f"node allreduce on rank {me}: {t.item()} != {want}"

    # And the world sees everyone (the cross-namespace link carries this too).
    t = torch.tensor([float(me + 1)], dtype=torch.float64)
    world.allreduce_(t, "sum")
    assert t.item() == n * (n + 1) / 2, t.item()

    world.barrier()
    groups.free()
    print(f"NETNS-OK rank={me} host={groups.hostname} node={groups.node_index} "
          f"local={groups.local_rank}/{groups.local_size}", flush=True)


if __name__ == "__main__":
    main()
