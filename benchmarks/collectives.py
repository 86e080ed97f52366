"""Collective efficiency: lsgd_hpc broadcast and allreduce of a whole model vs raw mpi4py on numpy.

    mpirun -np 4 python benchmarks/collectives.py --out collectives.json [--quick] [--device cuda]

With --device cuda both sides move GPU memory: FlatParams on the GPU of the node-local rank,
and mpi4py's calls on a CUDA tensor of the same bytes (the MPI must be CUDA-aware).

Models: the MLP on 3x32x32 inputs (0.86 M parameters) and torchvision's ResNet-18 for 10
classes (11.2 M). lsgd_hpc moves the model's FlatParams buffer (parameters and BatchNorm
statistics) through MPICommunicator.broadcast_ and .allreduce_ (sum) with its defaults
(LSGD_HPC_COMM_VALIDATE unset) and as the trainer uses them: the buffer's shape is agreed on
once at set-up (agree_buffers), so no per-call agreement check runs;
the reference is mpi4py's Bcast / Allreduce(IN_PLACE, SUM) on a contiguous numpy float32
buffer of the same bytes. Efficiency = raw seconds / lsgd_hpc seconds (1.0: no overhead);
the figure is the lowest of the four (2 models x 2 collectives). The same with the check
off is reported beside it.
"""

from __future__ import annotations

import os
import sys

from _common import (VALIDATE_ENV, fmt_bytes, fmt_s, interleaved, median, parse_args,  # noqa: E402
                     row, spread, write_result)


def models():
    """name -> a model of about 1 M and about 11 M parameters."""
    import torchvision

    from lsgd_hpc.models.zoo import build_model
    return {"mlp (0.86 M)": lambda: build_model("mlp", 10, (3, 32, 32)),
            "resnet18 (11.2 M)": lambda: torchvision.models.resnet18(num_classes=10)}


def main(argv=None) -> int:
    args = parse_args(__doc__.splitlines()[0], argv, device=True)
    os.environ.pop(VALIDATE_ENV, None)            # lsgd_hpc as users get it
    import numpy as np
    import torch
    from mpi4py import MPI

    from lsgd_hpc.comm import FlatParams
    from lsgd_hpc.comm.mpi import MPICommunicator

    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD
    device = torch.device("cpu")
    if args.device == "cuda":
        local = comm.Split_type(MPI.COMM_TYPE_SHARED).Get_rank()
        device = torch.device("cuda", local % torch.cuda.device_count())
        torch.cuda.set_device(device)
    world = MPICommunicator()
    unchecked = MPICommunicator()
    unchecked.validate = False
    assert world.validate
    reps = 8 if args.quick else 40
    rows, result, eff = [], {}, {}
    for label, build in models().items():
        torch.manual_seed(0)
        flat = FlatParams(build().to(device))
        raw = np.random.default_rng(comm.Get_rank()).standard_normal(flat.numel).astype(np.float32)
        flat.flat.copy_(torch.from_numpy(raw))
        world.agree_buffers(flat.flat)            # what every method does at set-up
        # numpy on the CPU; on the GPU a CUDA tensor (mpi4py takes its CUDA array interface)
        ref = raw.copy() if device.type == "cpu" else torch.from_numpy(raw).to(device)
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        percall = flat.flat.clone()
        # Allreduce sums grow; the values do not matter for the timing, only the bytes.
        methods = {
            "lsgd_bcast": lambda: world.broadcast_(flat.flat, 0),
            "raw_bcast": lambda: (sync(), comm.Bcast(ref, root=0)),
            "lsgd_allreduce": lambda: world.allreduce_(flat.flat, "sum"),
            "raw_allreduce": lambda: (sync(), comm.Allreduce(MPI.IN_PLACE, ref, op=MPI.SUM)),
            "lsgd_bcast_unchecked": lambda: unchecked.broadcast_(flat.flat, 0),
            "lsgd_allreduce_unchecked": lambda: unchecked.allreduce_(flat.flat, "sum"),
            # a buffer that was never agreed on: the per-call check (one small allreduce)
            "lsgd_bcast_percall": lambda: world.broadcast_(percall, 0),
            "lsgd_allreduce_percall": lambda: world.allreduce_(percall, "sum"),
        }
        inner = 4 if flat.numel < 2_000_000 else 1
        s = interleaved(comm, methods, reps=reps, warmup=2, inner=inner,
                        budget_s=15 if args.quick else 45)
        if comm.Get_rank() == 0:
            st = {k: spread(v) for k, v in s.items()}
            m = {k: v["median"] for k, v in st.items()}
            # Paired: each repetition times every variant back to back, so the ratio within
            # a repetition cancels the slow spells of the shared machine that a ratio of two
            # medians keeps (4 ranks on 2 cores); the median over repetitions.
            def paired(raw_k: str, ours: str) -> float:
                return median([a / b for a, b in zip(s[raw_k], s[ours])])
            e = {"broadcast": paired("raw_bcast", "lsgd_bcast"),
                 "allreduce": paired("raw_allreduce", "lsgd_allreduce"),
                 "broadcast_unchecked": paired("raw_bcast", "lsgd_bcast_unchecked"),
                 "allreduce_unchecked": paired("raw_allreduce", "lsgd_allreduce_unchecked"),
                 "broadcast_percall": paired("raw_bcast", "lsgd_bcast_percall"),
                 "allreduce_percall": paired("raw_allreduce", "lsgd_allreduce_percall")}
            eff[label] = e
            result[label] = {"numel": flat.numel, "bytes": flat.nbytes, "seconds": st,
                             "samples": s, "efficiency": e}
            for op, raw_k, ours in (("broadcast", "raw_bcast", "lsgd_bcast"),
                                    ("allreduce", "raw_allreduce", "lsgd_allreduce")):
                rows.append(row(
                    f"collective_efficiency: {op} {label}",
                    f"raw mpi4py {op} on numpy / lsgd_hpc {op}_ of FlatParams "
                    f"({fmt_bytes(flat.nbytes)})",
                    f"lsgd_hpc {fmt_s(m[ours])}, raw {fmt_s(m[raw_k])}; check off: "
                    f"{fmt_s(m[ours + '_unchecked'])}, checked per call: "
                    f"{fmt_s(m[ours + '_percall'])} (median of {st[ours]['n']})",
                    e[op], "raw / lsgd_hpc seconds, median of paired ratios (target >= 0.95)"))
    if comm.Get_rank() == 0:
        lowest = min(min(e["broadcast"], e["allreduce"]) for e in eff.values())
        write_result(args.out, {
            "name": "collective_efficiency", "doc": __doc__.strip(), "np": comm.Get_size(),
            "device": args.device,
            "models": result, "efficiency": lowest, "ratio": lowest, "target": ">= 0.95",
            "lowest_unchecked": min(min(e["broadcast_unchecked"], e["allreduce_unchecked"])
                                    for e in eff.values()),
            "lowest_percall": min(min(e["broadcast_percall"], e["allreduce_percall"])
                                  for e in eff.values()),
            "rows": rows,
            "notes": ["collective_efficiency: the result's 'efficiency' is the lowest raw / "
                      "lsgd_hpc ratio over both models and both collectives (each the median "
                      "over repetitions of the ratio within one repetition), on a buffer "
                      "agreed on at set-up as the trainer's are; 'unchecked' variants run "
                      "with the agreement check off, 'percall' ones on a buffer that was never "
                      "agreed on (one small allreduce before each collective)."]})
    comm.Barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main())
