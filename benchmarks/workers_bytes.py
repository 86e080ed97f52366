"""DiLoCo between one worker per node (--worker-ranks node) against one worker per rank: the method's bytes per step (comm_bytes_sent, all ranks), counted, on 4 ranks as 2 nodes.

With one worker per node the outer allreduce runs between the nodes' first ranks only, so
its payload crosses between nodes once per node instead of once per rank: the ratio is
1 / ranks per node. The traffic inside a worker (the gradient's allreduce every step, the
outer result spread from the first rank) is counted apart (worker_bytes_sent) and stays on
the node's own link. Counted, not timed: on one host the "nodes" share memory.
"""

from __future__ import annotations

import argparse
import sys

from _common import fmt_bytes, row, write_result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--ranks-per-node", type=int, default=2)
    args = p.parse_args(argv)
    import torch
    from torch import nn

    import lsgd_hpc
    from lsgd_hpc.models.zoo import build_model

    torch.set_num_threads(1)
    comm = lsgd_hpc.init(backend="mpi", ranks_per_node=args.ranks_per_node, device="cpu")
    H, steps = 4, 8
    per_step = {}
    inside = {}
    for worker_ranks in (1, "node"):
        torch.manual_seed(0)
        model = build_model("digits_cnn", 10, (1, 8, 8))
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        sent0 = comm.stats.bytes_sent
        method = lsgd_hpc.DiLoCo(model, opt, comm, local_steps=H, worker_ranks=worker_ranks)
        inner0 = method.worker_stats.bytes_sent if method.worker_stats is not None else 0
        g = torch.Generator().manual_seed(comm.rank)
        for _ in range(steps):
            x, y = torch.randn(16, 1, 8, 8, generator=g), torch.randint(0, 10, (16,), generator=g)
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            method.step(loss)
        mine = comm.stats.bytes_sent - sent0
        mine_inside = (method.worker_stats.bytes_sent - inner0
                       if method.worker_stats is not None else 0)
        method.close()
        per_step[str(worker_ranks)] = sum(comm.allgather_object(mine)) / steps
        inside[str(worker_ranks)] = sum(comm.allgather_object(mine_inside)) / steps
    if comm.rank == 0:
        rpn = args.ranks_per_node
        ratio = per_step["node"] / per_step["1"]
        label = f"workers_bytes ({comm.size} ranks = {comm.n_nodes} nodes x {rpn})"
        write_result(args.out, {
            "name": "workers_bytes", "doc": __doc__.strip(), "np": comm.size,
            "ranks_per_node": rpn, "n_nodes": comm.n_nodes, "local_steps": H, "steps": steps,
            "method_bytes_per_step": per_step, "worker_bytes_per_step": inside,
            "expected_ratio": 1 / rpn, "ratio": ratio,
            "rows": [row(label,
                         f"DiLoCo (H {H}, digits CNN): the method's bytes per step, all ranks, "
                         "one worker per node over one worker per rank",
                         f"node workers {fmt_bytes(per_step['node'])}/step (plus "
                         f"{fmt_bytes(inside['node'])}/step inside the workers), rank workers "
                         f"{fmt_bytes(per_step['1'])}/step",
                         ratio, "node / rank workers' between-worker bytes")],
            "notes": ["Counted bytes (comm_bytes_sent), not timed; the expected ratio is 1 / "
                      "ranks per node."],
        })
    comm.barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main())
