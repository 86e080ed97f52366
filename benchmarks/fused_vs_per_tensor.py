"""Averaging ResNet-20: one allreduce over the FlatParams buffer vs one per tensor vs copy-based fusion."""

from __future__ import annotations

import os
import sys

from _common import (VALIDATE_ENV, fmt_bytes, fmt_s, interleaved, parse_args, row, spread,
                     write_result)


def main(argv=None) -> int:
    args = parse_args(__doc__, argv)
    os.environ.setdefault(VALIDATE_ENV, "0")
    import torch
    from mpi4py import MPI

    from lsgd_hpc.comm import FlatParams
    from lsgd_hpc.comm.mpi import MPICommunicator
    from lsgd_hpc.models.zoo import build_model

    torch.set_num_threads(1)
    world = MPICommunicator()
    torch.manual_seed(world.rank)
    model = build_model("resnet20", 10, (3, 32, 32))
    flat = FlatParams(model)
    # The same bytes three ways: every tensor the flat buffer holds (parameters and
    # BatchNorm running statistics), as views of it.
    views = [flat.flat[off:off + n] for _, off, n in flat.slices]
    assert sum(v.numel() for v in views) == flat.numel

    def fused():
        world.allreduce_(flat.flat, "mean")

    def per_tensor():
        for v in views:
            world.allreduce_(v, "mean")

    def copy_fused():
        buf = torch.cat(views)
        world.allreduce_(buf, "mean")
        off = 0
        for v in views:
            n = v.numel()
            v.copy_(buf[off:off + n])
            off += n

    methods = {"fused": fused, "per_tensor": per_tensor, "copy_fused": copy_fused}
    reps = 15 if args.quick else 40
    samples = interleaved(MPI.COMM_WORLD, methods, reps=reps, warmup=3,
                          budget_s=12 if args.quick else 40)
    if world.rank == 0:
        st = {k: spread(v) for k, v in samples.items()}
        f, p, c = (st[k]["median"] for k in ("fused", "per_tensor", "copy_fused"))
        result = {
            "name": "fused_vs_per_tensor", "doc": __doc__.strip(), "np": world.size,
            "model": "resnet20", "tensors": len(views), "numel": flat.numel,
            "bytes": flat.nbytes, "validate": os.environ[VALIDATE_ENV] != "0",
            "seconds": st, "samples": samples,
            "rows": [row(
                "fused_vs_per_tensor",
                f"average ResNet-20 ({fmt_bytes(flat.nbytes)}, {len(views)} tensors): "
                "1 allreduce on FlatParams vs 1 per tensor vs torch.cat + copy back",
                f"fused {fmt_s(f)}, per-tensor {fmt_s(p)}, copy-fused {fmt_s(c)} "
                f"(median of {st['fused']['n']})",
                p / f, "per-tensor / fused",
                per_tensor_over_fused=p / f, copy_over_fused=c / f)],
            "notes": [
                f"{len(views)} tensors: {sum(1 for _ in model.parameters())} parameters and "
                f"{len(views) - sum(1 for _ in model.parameters())} floating-point BatchNorm "
                "buffers, i.e. everything FlatParams holds; every variant averages those same "
                f"{flat.numel} floats. copy-fused pays torch.cat and the copies back on top of "
                "one allreduce.",
            ],
            "extra_ratios": {"copy_fused / fused": c / f, "per_tensor / fused": p / f},
        }
        result["rows"][0]["figures"] += f"; copy-fused / fused = {c / f:.2f}x"
        write_result(args.out, result)
    world.barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main())
