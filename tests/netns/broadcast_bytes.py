"""One rank of the broadcast-bytes job of tests/cluster/test_netns.py: how many bytes each emulated
node sends through its network interface during broadcasts from every rank in turn,
hierarchical (NodeGroups.broadcast_from_) and flat (one MPI broadcast over the world).

The counters are the node's own: ``/proc/self/net/dev`` shows the network namespace of the
reading process, whose one outside link is ``eth0``. Every rank of a node reads the same
counters; the node's lowest rank reports them. Rank 0 prints one line per method:
``BYTES method=NAME sent=N0,N1,...`` (bytes node i sent during that method's broadcasts).
"""

import sys

import torch

from lsgd_hpc.comm import NodeGroups, make_world

INTERFACE = "eth0"


def sent_bytes() -> int:
    """Bytes this process's network namespace sent through INTERFACE so far."""
    with open("/proc/self/net/dev") as fh:
        for line in fh:
            name, _, counters = line.partition(":")
            if name.strip() == INTERFACE:
                return int(counters.split()[8])      # receive: 8 fields, then transmit bytes
    raise RuntimeError(f"no {INTERFACE} in /proc/self/net/dev: not inside an emulated node")


def main() -> None:
    numel = int(sys.argv[1])
    world = make_world("mpi")
    groups = NodeGroups.build(world)               # by host name: one group per namespace
    me, n = world.rank, world.size
    broadcasts = {"hierarchical": groups.broadcast_from_,
                  "flat": lambda t, leader: world.broadcast_(t, leader)}
    for method, broadcast in broadcasts.items():
        world.barrier()
        before = sent_bytes()
        for leader in range(n):
            t = torch.full((numel,), float(me), dtype=torch.float32)
            broadcast(t, leader)
            assert bool(torch.all(t == float(leader))), (method, leader, me)
        world.barrier()
        sent = sent_bytes() - before
        per_node = world.allgather_object((groups.node_index, groups.local_rank, sent))
        if me == 0:
            by_node = [s for _, local, s in sorted(per_node) if local == 0]
            print(f"BYTES method={method} sent={','.join(map(str, by_node))}", flush=True)
    groups.free()


if __name__ == "__main__":
    main()
