"""Non-root leader broadcast: NodeGroups.broadcast_from_ vs a flat world broadcast (inter-node bytes, seconds)."""

from __future__ import annotations

import argparse
import os
import sys

from _common import VALIDATE_ENV, fmt_bytes, fmt_s, interleaved, row, spread, write_result


def _copies(b: int, nbytes: int) -> str:
    k = b / nbytes
    return f"{k:.0f} cop{'y' if round(k) == 1 else 'ies'}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", required=True)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--ranks-per-node", type=int, default=2)
    args = p.parse_args(argv)
    os.environ.setdefault(VALIDATE_ENV, "0")
    import torch
    from mpi4py import MPI

    from lsgd_hpc.comm import CommStats, FlatParams, NodeGroups
    from lsgd_hpc.comm.mpi import MPICommunicator
    from lsgd_hpc.models.zoo import build_model

    torch.set_num_threads(1)
    world = MPICommunicator()
    groups = NodeGroups.build(world, args.ranks_per_node)
    # Separate counters for the node-roots communicator: its traffic is exactly what
    # crosses node boundaries in the hierarchical broadcast.
    if groups.roots is not None:
        groups.roots.stats = CommStats()
    numel = FlatParams(build_model("resnet20", 10, (3, 32, 32))).numel   # a model-sized buffer
    buf = torch.zeros(numel, dtype=torch.float32)
    nbytes = buf.numel() * buf.element_size()
    # The leader: the last rank, a non-root member of the last node (local rank 1).
    leader = world.size - 1
    assert groups.root_of_node(groups.node_of[leader]) != leader, "leader must not be a node root"
    if world.rank == leader:
        buf.fill_(1.0)
    leader_node = groups.node_of[leader]
    remote_rank = groups.node_of[world.rank] != leader_node

    # --- bytes: one counted call of each, from the communicators' own statistics --------
    def counted(fn):
        s0 = world.stats.snapshot()
        r0 = groups.roots.stats.snapshot() if groups.roots is not None else None
        fn()
        s1 = world.stats
        roots_recv = (groups.roots.stats.bytes_recv - r0.bytes_recv) if r0 is not None else 0
        return s1.bytes_recv - s0.bytes_recv, roots_recv

    hier = lambda: groups.broadcast_from_(buf, leader)  # noqa: E731
    flat = lambda: world.broadcast_(buf, leader)        # noqa: E731
    recv_flat, _ = counted(flat)
    recv_hier_world, recv_hier_roots = counted(hier)
    # Inter-node bytes: flat = what ranks outside the leader's node receive (each gets its
    # copy from the world broadcast); hierarchical = what the node-roots communicator moves.
    inter_flat = MPI.COMM_WORLD.allreduce(recv_flat if remote_rank else 0)
    inter_hier = MPI.COMM_WORLD.allreduce(recv_hier_roots)
    total_flat = MPI.COMM_WORLD.allreduce(recv_flat)
    # (the roots communicator counts apart from the world's statistics: add it back)
    total_hier = MPI.COMM_WORLD.allreduce(recv_hier_world + recv_hier_roots)
    ok = bool(torch.all(buf == 1.0))
    all_ok = MPI.COMM_WORLD.allreduce(int(ok), op=MPI.MIN) == 1

    reps = 15 if args.quick else 40
    samples = interleaved(MPI.COMM_WORLD, {"hierarchical": hier, "flat": flat}, reps=reps,
                          warmup=3, budget_s=8 if args.quick else 20)
    if world.rank == 0:
        st = {k: spread(v) for k, v in samples.items()}
        th, tf = st["hierarchical"]["median"], st["flat"]["median"]
        n_nodes, rpn = groups.n_nodes, args.ranks_per_node
        remote_ranks = sum(1 for n in groups.node_of if n != leader_node)
        label = f"hierarchical_broadcast ({world.size} ranks = {n_nodes} nodes x {rpn})"
        result = {
            "name": "hierarchical_broadcast", "doc": __doc__.strip(), "np": world.size,
            "ranks_per_node": rpn, "n_nodes": n_nodes, "leader": leader, "bytes": nbytes,
            "validate": os.environ[VALIDATE_ENV] != "0", "correct": all_ok,
            "inter_node_bytes": {"flat": inter_flat, "hierarchical": inter_hier},
            "expected_inter_node_bytes": {"flat": remote_ranks * nbytes,
                                          "hierarchical": (n_nodes - 1) * nbytes},
            "total_bytes_received": {"flat": total_flat, "hierarchical": total_hier},
            "seconds": st, "samples": samples,
            "rows": [
                row(label + ": bytes",
                    f"{fmt_bytes(nbytes)} (ResNet-20) from non-root leader {leader}: bytes "
                    "received across node boundaries (per-communicator stats)",
                    f"hierarchical {fmt_bytes(inter_hier)} ({_copies(inter_hier, nbytes)}, 1 per "
                    f"remote node), flat {fmt_bytes(inter_flat)} "
                    f"({_copies(inter_flat, nbytes)}, 1 per remote rank)",
                    inter_flat / inter_hier if inter_hier else None,
                    "flat / hierarchical inter-node bytes"),
                row(label + ": time",
                    "same broadcasts, seconds (one host: no slow link between 'nodes')",
                    f"hierarchical {fmt_s(th)}, flat {fmt_s(tf)} "
                    f"(median of {st['flat']['n']})",
                    th / tf, "hierarchical / flat seconds"),
            ],
            "notes": [
                "Inter-node bytes are counted, not timed: on one host "
                "the 'nodes' share memory, and the hierarchical broadcast's three steps "
                "(inside the leader's node, across node roots, inside the other nodes) versus "
                "one flat MPI_Bcast (whose algorithm Open MPI picks by size) say more about "
                "oversubscribed scheduling than about a network.",
            ],
        }
        if not all_ok:
            result["rows"][0]["figures"] += " -- WRONG RESULT on some rank"
        write_result(args.out, result)
    groups.free()
    world.barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main())
