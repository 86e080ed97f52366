"""One rank of the compressed-DiLoCo bytes job of tests/cluster/test_quantized_netns.py: how
many bytes each emulated node sends through its network interface while DiLoCo trains a
1M-parameter model for a few outer steps, its outer allreduce in fp32 (MPI's allreduce over
the world) and in int8 (hierarchical: node sums in float32 over shared memory, the int8
exchange between the two node roots, lsgd_hpc.comm.quantized), or in the wires named after
the width: ``KIND`` or ``KIND:TOPK`` or ``KIND:TOPK:ef`` (comm_dtype, topk, error feedback;
``int2:0.01:ef`` is DiLoCo's --comm-dtype int2 --topk 0.01 --error-feedback), each in turn.

The counters are the node's own (``/proc/self/net/dev`` of the network namespace, as
tests/netns/broadcast_bytes.py reads them); the node's lowest rank reports them. Rank 0
prints one line per wire: ``BYTES wire=NAME sent=N0,N1 counted=C`` (bytes node i sent
through its interface; C the comm_bytes_sent of all ranks together), and one line
``DIGEST wire=NAME same=BOOL`` (every rank's outer state has the same bits); NAME is the
wire as given.
"""

import hashlib
import sys

import torch
from torch import nn

import lsgd_hpc
from lsgd_hpc.methods import METHODS
from broadcast_bytes import sent_bytes      # (this folder: the script's, on sys.path)

STEPS, LOCAL_STEPS = 8, 2


def wire_options(wire: str) -> dict:
    """DiLoCo's communication options of a wire ``KIND[:TOPK[:ef]]``."""
    parts = wire.split(":")
    kind, topk, ef = parts + ["1", ""][len(parts) - 1:]
    assert ef in ("", "ef"), wire
    return dict(comm_dtype=kind, topk=float(topk), error_feedback=ef == "ef")


def main() -> None:
    width = int(sys.argv[1])
    wires = sys.argv[2:] or ["fp32", "int8"]
    torch.set_num_threads(1)
    comm = lsgd_hpc.init(backend="mpi", device="cpu")      # nodes by host name
    me = comm.rank
    for wire in wires:
        torch.manual_seed(0)
        model = nn.Linear(width, width)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        method = METHODS["diloco"](model, opt, comm, max_steps=STEPS, local_steps=LOCAL_STEPS,
                                   **wire_options(wire))
        g = torch.Generator().manual_seed(me)
        x = torch.randn(16, width, generator=g)
        comm.world.barrier()
        before, counted = sent_bytes(), comm.stats.bytes_sent
        while not method.done:
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            method.step(loss)
        method.drain()
        comm.world.barrier()
        sent, counted = sent_bytes() - before, comm.stats.bytes_sent - counted
        digest = hashlib.blake2b(method.rule.prev.data.numpy().tobytes(),
                                 digest_size=16).hexdigest()
        per_node = comm.world.allgather_object((comm.node_index, comm.local_rank, sent,
                                                counted, digest))
        method.close()
        if me == 0:
            by_node = [s for _, local, s, _, _ in sorted(per_node) if local == 0]
            total = sum(c for _, _, _, c, _ in per_node)
            print(f"BYTES wire={wire} sent={','.join(map(str, by_node))} counted={total}",
                  flush=True)
            print(f"DIGEST wire={wire} same={len({d for *_, d in per_node}) == 1}", flush=True)


if __name__ == "__main__":
    main()
