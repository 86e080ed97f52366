"""The route of the hierarchical broadcast, in-process (the fast set's check of the route: at 2
ranks, the parallel bodies cannot tell a flat broadcast from one through the node leaders).

Ranks are threads over communicators that move real tensors (a shared slot and a barrier per
communicator) and count bytes as ``CommStats`` does (the root sends n, every other member
receives n), per communicator. ``NodeGroups.broadcast_from_`` and ``HierarchicalBroadcast``
from every rank of 4 ranks as 2 nodes and of 5 ranks as nodes of 2, 2 and 1 must deliver the
leader's values to every rank, each receiving them once, with only the node roots talking
across nodes (one copy each) and nothing sent over the whole world: a broadcast that sends
the right values by the flat route fails here.
"""

import threading
from collections import defaultdict

import pytest
import torch

from lsgd_hpc.comm import NodeGroups
from lsgd_hpc.comm.hierarchy import HierarchicalBroadcast

N = 10               # elements broadcast (40 bytes of float32)


class _Done:
    """A request that completed when it was posted."""

    def test(self) -> bool:
        return True

    def wait(self) -> None:
        return None


class Bus:
    """What the threads share: a slot and a barrier per communicator, and the bytes each
    rank moved on each communicator."""

    def __init__(self):
        self.lock = threading.Lock()
        self.barriers, self.slots = {}, {}
        self.bytes = defaultdict(lambda: [0, 0])     # (rank, communicator) -> [sent, recv]

    def barrier(self, key, n):
        with self.lock:
            return self.barriers.setdefault(key, threading.Barrier(n, timeout=20))


class Member:
    """One rank's view of a communicator named ``name`` over world ranks ``members``."""

    def __init__(self, bus, name, members, me):
        self.bus, self.name, self.world_ranks = bus, name, list(members)
        self.key = (name, tuple(members))
        self.rank, self.size = self.world_ranks.index(me), len(members)

    def broadcast_(self, tensor, root):
        barrier = self.bus.barrier(self.key, self.size)
        me = self.world_ranks[self.rank]
        nbytes = tensor.numel() * tensor.element_size()
        if self.rank == root:
            self.bus.slots[self.key] = tensor.clone()
            self.bus.bytes[(me, self.name)][0] += nbytes
        barrier.wait()
        if self.rank != root:
            tensor.copy_(self.bus.slots[self.key])
            self.bus.bytes[(me, self.name)][1] += nbytes
        barrier.wait()
        return tensor

    def ibroadcast_(self, tensor, root):
        self.broadcast_(tensor, root)
        return _Done()


def groups_of(bus, node_of, me):
    """Rank ``me``'s NodeGroups over the bus (node_of: the node of each rank)."""
    ranks = range(len(node_of))
    mates = [r for r in ranks if node_of[r] == node_of[me]]
    roots = [r for r in ranks if r == node_of.index(node_of[r])]
    return NodeGroups(world=Member(bus, "world", ranks, me),
                      node=Member(bus, f"node{node_of[me]}", mates, me),
                      roots=Member(bus, "roots", roots, me) if me in roots else None,
                      node_of=list(node_of), hostname=f"host{node_of[me]}")


def run_ranks(node_of, body):
    """``body(groups, rank)`` on every rank at once (threads); the bus's byte counts."""
    bus = Bus()
    errors = []

    def rank(me):
        try:
            body(groups_of(bus, node_of, me), me)
        except Exception as exc:           # noqa: BLE001  (reported below)
            errors.append((me, exc))
            for b in list(bus.barriers.values()):
                b.abort()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(len(node_of))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    return bus.bytes


def blocking(groups, tensor, leader):
    groups.broadcast_from_(tensor, leader)


def non_blocking(groups, tensor, leader):
    b = HierarchicalBroadcast(groups.node, groups.roots, groups.node_of, tensor, leader)
    while not b.test():
        pass


@pytest.mark.parametrize("how", [blocking, non_blocking])
@pytest.mark.parametrize("node_of", [[0, 0, 1, 1], [0, 0, 1, 1, 2]])
def test_the_broadcast_crosses_nodes_once_through_the_node_roots(node_of, how):
    n_ranks, nbytes = len(node_of), N * 4
    roots = [node_of.index(j) for j in range(max(node_of) + 1)]
    for leader in range(n_ranks):
        got = {}

        def body(groups, me):
            t = torch.full((N,), float(me))
            how(groups, t, leader)
            got[me] = t

        moved = run_ranks(node_of, body)
        for me in range(n_ranks):
            assert torch.equal(got[me], torch.full((N,), float(leader))), (leader, me)
            on = {c: tuple(moved.get((me, c), (0, 0))) for c in
                  ("world", "roots", f"node{node_of[me]}")}
            # nothing over the whole world (the flat route)
            assert on["world"] == (0, 0), (leader, me, on)
            # every rank but the leader receives the values once
            assert sum(r for _, r in on.values()) == (0 if me == leader else nbytes), \
                (leader, me, on)
            # across nodes only the node roots, one copy each: the leader's node's root
            # sends it, every other node's root receives it
            if me in roots:
                src_root = roots[node_of[leader]]
                assert on["roots"] == ((nbytes, 0) if me == src_root else (0, nbytes)), \
                    (leader, me, on)
            else:
                assert on["roots"] == (0, 0), (leader, me, on)


def test_a_flat_broadcast_fails_the_route_check(monkeypatch):
    """The check above catches a broadcast with the right values over the flat route."""
    monkeypatch.setattr(NodeGroups, "broadcast_from_",
                        lambda self, t, root: self.world.broadcast_(t, root))
    with pytest.raises(AssertionError, match="world"):
        test_the_broadcast_crosses_nodes_once_through_the_node_roots([0, 0, 1, 1], blocking)
