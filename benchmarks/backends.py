"""MPI vs Horovod backend: median allreduce time of a 1M-float tensor and of a ResNet-20 flat buffer."""

from __future__ import annotations

import os
import sys

from _common import (VALIDATE_ENV, fmt_bytes, fmt_s, interleaved, parse_args, row, spread,
                     write_result)


def _skip(args, rank: int, reason: str) -> int:
    if rank == 0:
        write_result(args.out, {
            "name": "backends", "doc": __doc__.strip(), "skipped": reason,
            "rows": [row("backends", "MPI vs Horovod allreduce", f"skipped: {reason}", None, "")]})
    return 0


def main(argv=None) -> int:
    args = parse_args(__doc__, argv)
    os.environ.setdefault(VALIDATE_ENV, "0")
    import torch
    from mpi4py import MPI

    from lsgd_hpc.comm import CommError, FlatParams
    from lsgd_hpc.comm.horovod import horovod_available
    from lsgd_hpc.comm.mpi import MPICommunicator
    from lsgd_hpc.models.zoo import build_model

    torch.set_num_threads(1)
    rank = MPI.COMM_WORLD.Get_rank()
    if not horovod_available():
        return _skip(args, rank, "horovod.torch is not importable (run `make horovod`)")
    from lsgd_hpc.comm.horovod import HorovodCommunicator
    try:
        hvd = HorovodCommunicator()
    except CommError as exc:
        return _skip(args, rank, f"Horovod does not start: {exc}")
    mpi = MPICommunicator()
    hvd.validate = mpi.validate = os.environ[VALIDATE_ENV] != "0"

    torch.manual_seed(rank)
    resnet = FlatParams(build_model("resnet20", 10, (3, 32, 32))).flat
    tensors = {"1M floats": torch.randn(1 << 20), "ResNet-20 flat": resnet}
    reps = 10 if args.quick else 30
    rows, seconds, samples = [], {}, {}
    for label, t in tensors.items():
        a, b = t.clone(), t.clone()
        s = interleaved(MPI.COMM_WORLD,
                        {"mpi": lambda: mpi.allreduce_(a, "mean"),
                         "horovod": lambda: hvd.allreduce_(b, "mean")},
                        reps=reps, warmup=3, budget_s=8 if args.quick else 20)
        # Same inputs, same sums (both are MPI_Allreduce underneath): results must agree.
        same = bool(torch.equal(a, b))
        same = MPI.COMM_WORLD.allreduce(int(same), op=MPI.MIN) == 1
        if rank == 0:
            st = {k: spread(v) for k, v in s.items()}
            tm, th = st["mpi"]["median"], st["horovod"]["median"]
            seconds[label], samples[label] = st, s
            nbytes = t.numel() * t.element_size()
            rows.append(row(
                f"backends: {label}",
                f"allreduce (mean) of {label} ({fmt_bytes(nbytes)}): MPI backend vs Horovod "
                "backend",
                f"MPI {fmt_s(tm)}, Horovod {fmt_s(th)} (median of {st['mpi']['n']})"
                + ("" if same else " -- RESULTS DIFFER"),
                th / tm, "Horovod / MPI seconds", identical_results=same))
    if rank == 0:
        import horovod
        write_result(args.out, {"name": "backends", "doc": __doc__.strip(),
                                "np": mpi.size, "horovod_version": horovod.__version__,
                                "validate": mpi.validate, "seconds": seconds,
                                "samples": samples, "rows": rows,
                                "horovod_env": {k: v for k, v in os.environ.items()
                                                if k.startswith("HOROVOD_")},
                                "notes": [
                                    "Both backends reduce with the same MPI_Allreduce (results "
                                    "checked identical); Horovod adds its background thread and "
                                    "negotiation cycle per operation, which on 2 cores shared "
                                    "by 4 ranks also costs CPU time.",
                                ]})
    mpi.barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main())
