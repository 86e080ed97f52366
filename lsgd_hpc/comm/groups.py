"""Node groups: world -> node communicator (ranks of one host) -> node-roots communicator."""

from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import List, Optional, Sequence

from lsgd_hpc.comm.base import CommError, Communicator
from lsgd_hpc.envvars import RANKS_PER_NODE

__all__ = ["NodeGroups", "node_layout", "RANKS_PER_NODE_ENV"]

#: Same as --ranks-per-node: group K consecutive ranks as one node (multi-node layouts on one host).
RANKS_PER_NODE_ENV = RANKS_PER_NODE.name


def node_layout(hostnames: Sequence[str], ranks_per_node: Optional[int] = None) -> List[int]:
    """Node index of every rank: by host name (in order of first appearance), or, when
    ranks_per_node = K is given, K consecutive ranks per node (the last node may be smaller).

    Host names, not MPI's COMM_TYPE_SHARED, because the latter splits NUMA domains on some
    systems; a node here is what the cluster's scheduler calls a node.
    """
    if ranks_per_node is not None:
        if ranks_per_node < 1:
            raise CommError(f"ranks_per_node must be >= 1, got {ranks_per_node}")
        return [r // ranks_per_node for r in range(len(hostnames))]
    index: dict = {}
    return [index.setdefault(h, len(index)) for h in hostnames]


@dataclass
class NodeGroups:
    """The three communicators of the two-level (node, cluster) hierarchy, seen from one rank.

    ``roots`` exists only on node roots (local rank 0) and is None elsewhere. ``node_of`` is
    indexed by rank in ``world``; a "world rank" here is what ``world.world_ranks`` names its
    members (the job's ranks for the job's world; the representatives' ranks for the world of
    workers of lsgd_hpc.comm.workers, where member i is worker i).
    """

    world: Communicator
    node: Communicator
    roots: Optional[Communicator]
    node_of: List[int]          # node index of every member of world, by its rank in world
    hostname: str

    @classmethod
    def build(cls, world: Communicator, ranks_per_node: Optional[int] = None) -> "NodeGroups":
        if ranks_per_node is None:
            ranks_per_node = RANKS_PER_NODE.read()
        hostname = socket.gethostname()
        hosts = world.allgather_object(hostname)
        node_of = node_layout(hosts, ranks_per_node)
        me = world.rank
        node = world.split(node_of[me], key=me)
        local_rank = node.rank
        roots = world.split(0 if local_rank == 0 else -1, key=me)
        return cls(world, node, roots, node_of, hostname)

    @property
    def node_index(self) -> int:
        return self.node_of[self.world.rank]

    @property
    def n_nodes(self) -> int:
        return max(self.node_of) + 1

    @property
    def local_rank(self) -> int:
        return self.node.rank

    @property
    def local_size(self) -> int:
        return self.node.size

    @property
    def is_root(self) -> bool:
        return self.node.rank == 0

    def root_of_node(self, node_index: int) -> int:
        """World rank of a node's root (its lowest world rank)."""
        return self.world.world_ranks[self.node_of.index(node_index)]

    def broadcast_from_(self, tensor, world_root: int):
        """Broadcast ``tensor`` from world rank ``world_root`` to every rank, crossing node
        boundaries once per node: root's node -> the node roots -> inside every other node.
        """
        src_node = self.node_of[self.world.world_ranks.index(world_root)]
        in_src_node = self.node_index == src_node
        leader_is_root = self.root_of_node(src_node) == world_root
        if in_src_node and not leader_is_root:
            # Inside the leader's node every member gets it now, its root included.
            self.node.broadcast_(tensor, self.node.world_ranks.index(world_root))
        if self.roots is not None:
            # Node roots are ranked by their world rank, which orders them by node index.
            self.roots.broadcast_(tensor, src_node)
        if not in_src_node or leader_is_root:
            self.node.broadcast_(tensor, 0)
        return tensor

    def free(self) -> None:
        for c in (self.roots, self.node):
            if c is not None:
                c.free()
