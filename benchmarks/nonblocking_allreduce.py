"""Gradient buckets between nodes: non-blocking allreduce in place against out of place from a copy.

Open MPI's non-blocking allreduce (coll/libnbc) reduces through a binomial tree (the whole
buffer into one rank, then broadcast back out of it) whenever it is called with MPI_IN_PLACE,
and by reduce-scatter + allgather (each rank sends about twice its share) when it is given a
separate send buffer. lsgd_hpc's MPI backend therefore starts a large non-blocking allreduce
between hosts from a kept copy of the bucket (lsgd_hpc.comm.mpi, NB_SEND_COPY_MIN_BYTES);
on one host it stays in place, where the copy costs more than it saves.

This benchmark averages mlp_wide's 4.5 MB gradient in its 1 MB buckets (the trainer's
default --bucket-mb) on the emulated cluster (2 nodes x 2 ranks, 1 Gbit/s per node link),
all buckets in flight at once, then waited for, as at the end of backward:

  in_place      every bucket started in place (what lsgd_hpc did before)
  out_of_place  from the kept copies (what lsgd_hpc does between hosts)
  blocking      one blocking allreduce of the whole buffer (--bucket-mb 0)

interleaved, slowest rank per sample. The ratio is in_place / out_of_place seconds.

    python benchmarks/nonblocking_allreduce.py --out FILE [--quick]
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Dict, Optional

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO))
from _common import (LayoutError, check_layout, cluster_bench_main, cluster_job,  # noqa: E402
                     failed, fmt_s, interleaved, row, spread, write_result)


RATE = "1gbit"
CLUSTER = dict(name="bnbar", subnet="10.79.6")
MODEL, BUCKET_MB = "mlp_wide", 1.0
REPS = {"full": 15, "quick": 6}


def worker(out: str, quick: bool, nodes: int = 0, rate: Optional[str] = None) -> int:
    import torch
    from mpi4py import MPI

    from lsgd_hpc.comm import FlatParams, NodeGroups
    from lsgd_hpc.comm.buckets import bucket_bounds
    from lsgd_hpc.comm.mpi import MPICommunicator
    from lsgd_hpc.models.zoo import build_model
    from lsgd_hpc.planning.netprobe import probe_groups
    world = MPICommunicator(MPI.COMM_WORLD)
    # The layout and link this job claims (--nodes, --rate), from its own node grouping and
    # link probe, before anything is timed: a wrong one writes no figures.
    if nodes:
        groups = NodeGroups.build(world)
        probe = probe_groups(groups)
        error = None
        if world.rank == 0:
            try:
                check_layout("nonblocking_allreduce", groups.node_of, nodes, probe, rate)
            except LayoutError as exc:
                error = str(exc)
                write_result(out, {"layout_error": error})
        groups.free()
        if MPI.COMM_WORLD.bcast(error, root=0):
            return 3
    torch.manual_seed(0)
    flat = FlatParams(build_model(MODEL, 10, (1, 8, 8)))
    sizes = [p.numel() for p in flat.model.parameters()]
    bounds = bucket_bounds(sizes, 4, int(BUCKET_MB * 2 ** 20))
    views = [flat.grad[lo:hi] for lo, hi in bounds]
    flat.grad.normal_()
    between_hosts = world.one_host is False

    def buckets(in_place: bool):
        def go():
            world.one_host = in_place or not between_hosts
            try:
                for p in [world.iallreduce_(v, "mean", agreed=True) for v in views]:
                    p.wait()
            finally:
                world.one_host = not between_hosts
        return go

    methods = {"in_place": buckets(True), "out_of_place": buckets(False),
               "blocking": lambda: world.allreduce_(flat.grad, "mean")}
    samples = interleaved(MPI.COMM_WORLD, methods, REPS["quick" if quick else "full"],
                          warmup=2)
    if world.rank == 0:
        nbytes = flat.grad.numel() * 4
        write_result(out, {"samples": samples, "bytes": nbytes, "buckets": len(views),
                           "between_hosts": between_hosts})
    return 0


def run(quick: bool = False, timeout: float = 300, log=print, key: str = "nonblocking_allreduce"
        ) -> Dict:
    base = {"name": key, "doc": __doc__.splitlines()[0], "rate": RATE, "model": MODEL}
    res, done = cluster_job(str(Path(__file__)), key, base, CLUSTER, RATE, quick, timeout, log)
    if done:
        return done
    if not res["between_hosts"]:      # the MPI backend's own view; check_layout passed
        return failed(base, key, "layout check: the MPI backend saw one host (between_hosts "
                                 "False)")
    s = {k: spread(v) for k, v in res["samples"].items()}
    ratio = s["in_place"]["median"] / s["out_of_place"]["median"]
    return {**base, "status": "ok", "seconds": s, "bytes": res["bytes"],
            "buckets": res["buckets"], "between_hosts": res["between_hosts"],
            "rows": [row(key, f"{MODEL} gradient ({res['bytes'] / 2 ** 20:.1f} MB) in "
                         f"{res['buckets']} buckets of {BUCKET_MB:g} MB, 2 nodes x 2 ranks, "
                         f"{RATE} links: non-blocking allreduce in place vs out of place "
                         f"from a kept copy",
                         f"in place {fmt_s(s['in_place']['median'])}, out of place "
                         f"{fmt_s(s['out_of_place']['median'])}, one blocking allreduce "
                         f"{fmt_s(s['blocking']['median'])} (median of "
                         f"{s['in_place']['n']})",
                         ratio, "in place / out of place seconds")]}


def main(argv: Optional[list] = None) -> int:
    return cluster_bench_main(__doc__.splitlines()[0], run, worker, RATE, argv)


if __name__ == "__main__":
    try:
        sys.exit(main())
    except subprocess.TimeoutExpired:
        sys.exit(1)
