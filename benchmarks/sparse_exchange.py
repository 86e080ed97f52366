"""Sparse exchange: how the ranks' top-k records are combined, at 2 and at 16 ranks.

The top-k allreduce (``--topk F``, lsgd_hpc.comm.sparse) leaves every rank with a message of
the same size whose indices differ from rank to rank. Every rank must end with the same
bits. Four ways to combine p such messages of an n-element vector (n = 2^21, 8.4 MB in
fp32; top-k 1 % of every 4096-element chunk, int2 values with a scale per chunk), each timed
from the encoded messages to the mean on every rank:

  allgather     what lsgd_hpc does: one allgather of every rank's records; every rank adds
                the p records in rank order (float32 scatter-adds). Equal bits by
                construction: every rank adds the same bytes in the same order.
  gather_dense  the records gathered to rank 0, added there, the dense fp32 mean broadcast.
                Equal bits (one rank computes); the broadcast is 4 n bytes.
  gather_union  the records gathered to rank 0, added there; the union of their indices and
                the summed fp32 values broadcast (union size first, then the pairs). Equal
                bits; what is broadcast grows with the overlap of the ranks' choices.
  dense_allreduce  every rank writes its selection into a dense fp32 vector; one MPI_SUM
                allreduce. 4 n bytes each way, and MPI does not promise the same bits on
                every rank (the benchmark checks what it got).

Bytes per rank are the logical payloads (docs/metrics.md's convention): what a rank sends
and receives in the exchange, the largest over the ranks. Time: the slowest rank's seconds,
median of interleaved repetitions (benchmarks/_common.interleaved). ``ratio`` = allgather
seconds / the fastest other bit-identical scheme's (below 1: the allgather is the cheaper).
On one machine every "link" is shared memory, and 16 ranks on 2 cores are oversubscribed:
the seconds say how the schemes scale with p on one host, the bytes what they would put on
a network.

    mpirun -np P python benchmarks/sparse_exchange.py --out FILE [--quick]
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
from _common import fmt_bytes, fmt_s, interleaved, parse_args, row, spread, write_result  # noqa: E402,E501

N = 1 << 21
TOPK, KIND = 0.01, "int2"


def main(argv=None) -> int:
    args = parse_args(__doc__, argv)
    import numpy as np
    import torch
    from mpi4py import MPI

    from lsgd_hpc.comm.sparse import (decode, encode, reduce_records, select, sent_vector,
                                      sparse_layout)

    comm = MPI.COMM_WORLD
    rank, p = comm.Get_rank(), comm.Get_size()
    torch.manual_seed(1000 + rank)
    lay = sparse_layout(N, TOPK, KIND)
    w = torch.randn(N)
    send = torch.zeros(lay.m * lay.record, dtype=torch.uint8)
    idx, values = select(w, lay)
    encode(idx, values, lay, send)
    mine = sent_vector(*decode(send, lay), lay)            # what this rank contributes
    every = torch.zeros(p, lay.m * lay.record, dtype=torch.uint8)
    dense = torch.zeros(N, dtype=torch.float32)
    out = {}
    nbytes = {}                                              # scheme -> [sent, received]

    def allgather():
        comm.Allgather(send.numpy(), every.numpy())
        out["allgather"] = reduce_records(every, lay, p).div_(p)

    nbytes["allgather"] = [lay.counted, (p - 1) * lay.counted]

    def gather_dense():
        comm.Gather(send.numpy(), every.numpy() if rank == 0 else None, root=0)
        if rank == 0:
            dense.copy_(reduce_records(every, lay, p).div_(p))
        comm.Bcast(dense.numpy(), root=0)
        out["gather_dense"] = dense.clone()

    nbytes["gather_dense"] = [max(lay.counted, 4 * N * (1 if p > 1 else 0)),
                              max((p - 1) * lay.counted, 4 * N)]
    union_n = np.zeros(1, dtype=np.int64)
    union_buf = {}

    def gather_union():
        comm.Gather(send.numpy(), every.numpy() if rank == 0 else None, root=0)
        if rank == 0:
            total = reduce_records(every, lay, p).div_(p)
            seen = torch.zeros(N, dtype=torch.bool)
            for r in range(p):
                ri, _ = decode(every[r], lay)
                base = (torch.arange(lay.m) * lay.c).unsqueeze(1)
                flat = (ri + base).reshape(-1)
                seen[flat[flat < N]] = True
            at = seen.nonzero().reshape(-1).to(torch.int32)
            union_n[0] = at.numel()
        comm.Bcast(union_n, root=0)
        k = int(union_n[0])
        if k not in union_buf:
            union_buf[k] = (torch.zeros(k, dtype=torch.int32), torch.zeros(k))
        ui, uv = union_buf[k]
        if rank == 0:
            ui.copy_(at)
            uv.copy_(total[at.long()])
        comm.Bcast(ui.numpy(), root=0)
        comm.Bcast(uv.numpy(), root=0)
        res = torch.zeros(N)
        res[ui.long()] = uv
        out["gather_union"] = res
        out["union_n"] = k

    summed = torch.zeros(N)

    def dense_allreduce():
        comm.Allreduce(mine.numpy(), summed.numpy(), op=MPI.SUM)
        out["dense_allreduce"] = summed.div(p)

    nbytes["dense_allreduce"] = [4 * N, 4 * N]
    schemes = {"allgather": allgather, "gather_dense": gather_dense,
               "gather_union": gather_union, "dense_allreduce": dense_allreduce}
    reps = 8 if args.quick else 30
    samples = interleaved(comm, schemes, reps=reps, warmup=2, budget_s=20 if args.quick else 90)
    # the union's broadcast: 8 bytes a pair (int32 index, fp32 value) plus its length
    u = out["union_n"]
    nbytes["gather_union"] = [max(lay.counted, 8 + 8 * u), max((p - 1) * lay.counted, 8 + 8 * u)]

    # equal bits on every rank? and equal to the allgather's result?
    def digest(t):
        return hashlib.sha1(t.numpy().tobytes()).hexdigest()
    same = {}
    for k in schemes:
        mine_d = digest(out[k])
        ds = comm.allgather(mine_d)
        same[k] = len(set(ds)) == 1
    agree = {k: bool(torch.allclose(out[k], out["allgather"], rtol=0, atol=1e-6))
             for k in schemes}
    if rank == 0:
        st = {k: spread(v) for k, v in samples.items()}
        med = {k: st[k]["median"] for k in schemes}
        exact = [k for k in ("gather_dense", "gather_union") if same[k]]
        best = min(exact, key=lambda k: med[k]) if exact else None
        figures = "; ".join(
            f"{k} {fmt_s(med[k])} (sends {fmt_bytes(nbytes[k][0])}, receives "
            f"{fmt_bytes(nbytes[k][1])}{'' if same[k] else ', bits differ between ranks'})"
            for k in schemes)
        result = {
            "name": "sparse_exchange", "doc": __doc__.strip(), "np": p, "n": N,
            "topk": TOPK, "kind": KIND, "record_bytes": lay.counted, "union": u,
            "seconds": st, "samples": samples, "bytes": nbytes, "same_bits": same,
            "equal_to_allgather": agree,
            "ratio": med["allgather"] / med[best] if best else None,
            "rows": [row(
                f"sparse_exchange: {p} ranks",
                f"combining {p} ranks' top-k 1 % int2 messages of {N:,} elements "
                "(allgather + rank-order sum, what lsgd_hpc does, vs gather to rank 0 + "
                "broadcast of the dense mean or of the union's pairs, vs a dense fp32 "
                "allreduce of the selections)",
                f"{figures}; union {u:,} of {lay.m * lay.k * p:,} selected entries",
                med["allgather"] / med[best] if best else None,
                f"allgather / {best} seconds" if best else "n/a")],
            "notes": [
                f"sparse_exchange at {p} ranks: one message is {fmt_bytes(lay.counted)} "
                f"({lay.m} chunks of {lay.c}, {lay.k} entries each, int2 values, int16 "
                "indices, one scale a chunk); the dense fp32 vector is "
                f"{fmt_bytes(4 * N)}.",
            ],
        }
        write_result(args.out, result)
    comm.Barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main())
