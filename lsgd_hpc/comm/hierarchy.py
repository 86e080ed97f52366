"""A broadcast through the node hierarchy that never blocks: its stages posted one by one."""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch

from lsgd_hpc.comm.base import Communicator

__all__ = ["HierarchicalBroadcast", "broadcast_stages"]


def broadcast_stages(node: Communicator, roots: Optional[Communicator], node_of: Sequence[int],
                     world_root: int, world_ranks: Optional[Sequence[int]] = None
                     ) -> List[Tuple[Communicator, int]]:
    """This rank's part of a broadcast from world rank ``world_root`` that crosses node
    boundaries once per node (as ``NodeGroups.broadcast_from_``): (communicator, root) in
    order. Inside the root's node first when the root is not its node's root; then over the
    node roots; then inside every other node (and the root's own when it is its node's root).
    ``world_ranks``: the world rank of each index of ``node_of`` (``groups.world.world_ranks``;
    default: the index itself, as for the job's world; the world of workers names its members
    by their first ranks).
    """
    ranks = list(world_ranks) if world_ranks is not None else range(len(node_of))
    me = node.world_ranks[node.rank]
    src_node = node_of[ranks.index(world_root)]
    in_src_node = node_of[ranks.index(me)] == src_node
    leader_is_root = ranks[node_of.index(src_node)] == world_root
    stages = []
    if in_src_node and not leader_is_root:
        stages.append((node, node.world_ranks.index(world_root)))
    if roots is not None:
        # node roots are ranked by their world rank, which orders them by node index
        stages.append((roots, src_node))
    if not in_src_node or leader_is_root:
        stages.append((node, 0))
    return stages


class HierarchicalBroadcast:
    """Broadcast ``tensor`` from world rank ``world_root`` to every rank, crossing node
    boundaries once per node, without blocking: a stage that forwards data is posted once
    the stage that brought the data here has completed. :meth:`test` (call it now and then,
    e.g. once per step: MPI progresses non-blocking collectives inside MPI calls) posts the
    next stage when it can and says whether all are done; :meth:`wait` completes the rest.

    ``node`` and ``roots`` should be communicators of their own (``dup()``) so that these
    stages, posted at different moments on different ranks, never interleave with other
    collectives. The bytes of each stage are counted as its communicator counts a
    broadcast; the seconds spent waiting are communication time.
    """

    def __init__(self, node: Communicator, roots: Optional[Communicator],
                 node_of: Sequence[int], tensor: torch.Tensor, world_root: int,
                 world_ranks: Optional[Sequence[int]] = None):
        self.tensor = tensor
        self._stages = broadcast_stages(node, roots, node_of, world_root, world_ranks)
        self._next = 0
        self._current = None
        self._post()

    def _post(self) -> None:
        if self._next < len(self._stages):
            comm, root = self._stages[self._next]
            self._next += 1
            self._current = comm.ibroadcast_(self.tensor, root)
        else:
            self._current = None

    @property
    def done(self) -> bool:
        return self._current is None

    def test(self) -> bool:
        """Progress: post every stage whose data has arrived; True once all completed."""
        while self._current is not None and self._current.test():
            self._post()
        return self._current is None

    def wait(self) -> torch.Tensor:
        """Complete every stage left (blocking); returns the tensor."""
        while self._current is not None:
            self._current.wait()
            self._post()
        return self.tensor
