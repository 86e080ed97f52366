"""lsgd_hpc allreduce SGD against the allreduce SGD users run today: PyTorch DDP and Horovod.

ResNet-20 on synthetic 3x32x32 images, batch 32 per rank, SGD with momentum, 4 ranks; the
same model, data shards, ranks and network for every method. Each method runs as its own
`mpirun` job (so that one framework's threads never load another's run), the jobs are
interleaved and repeated (order rotated each round), and a job's figure is steps per
second over its steps SKIP..STEPS, timed on the slowest rank. The ratio is lsgd_hpc's
median steps/s over the best peer's.

    python benchmarks/peers.py --out peers.json [--quick] [--network 1gbit] [--torch]

Methods:
  lsgd_hpc            python -m lsgd_hpc.train --algorithm allreduce (buckets overlapped
                      with backward, the default --bucket-mb), metrics written as usual
  lsgd_hpc_no_overlap the same with --bucket-mb 0 (one allreduce after backward)
  ddp                 torch.nn.parallel.DistributedDataParallel, gloo backend (its default
                      25 MB buckets, 1 MB first bucket, overlapped with backward)
  horovod             horovod.torch.DistributedOptimizer (per-parameter allreduces started
                      from gradient hooks, fused by Horovod's background thread)
  lsgd_hpc_torch      (--torch only) lsgd_hpc as above with --backend torch: its allreduces
                      go through torch.distributed's gloo, the same library as DDP's; with
                      --torch the comparison is lsgd_hpc_torch against ddp alone (both on gloo,
                      same model, data, ranks, network, interleaved jobs of one run)

With --network RATE, the job runs on an emulated cluster (scripts/cluster.sh: 2 nodes x 2
ranks, each node's link limited to RATE), which this script brings up and always takes down.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO))
from _common import median, row, write_result  # noqa: E402

NP = 4
MODEL, BATCH, LR, SEED = "resnet20", 32, 0.05, 0
METHODS = ["lsgd_hpc", "lsgd_hpc_no_overlap", "ddp", "horovod"]
PEERS = ["ddp", "horovod"]
#: --torch (key torch_vs_ddp): lsgd_hpc on the torch backend against DDP, both on gloo
TORCH_METHODS = ["lsgd_hpc_torch", "ddp"]
TORCH_PEERS = ["ddp"]
ALL_METHODS = METHODS + ["lsgd_hpc_torch"]
#: (steps timed from SKIP to STEPS, rounds) per mode
PLAN = {"full": (10, 45, 3), "quick": (5, 25, 1)}
#: the emulated cluster of the network case
CLUSTER = dict(name="bpeers", subnet="10.79.0", nodes=2, ranks_per_node=2)
#: NAME:A.B.C in this variable: another name and subnet for that cluster (two benchmark runs
#: on one machine must not share one: `up` takes a leftover of the same name down first)
CLUSTER_ENV = "LSGD_PEERS_CLUSTER"
if os.environ.get(CLUSTER_ENV):
    CLUSTER["name"], _, CLUSTER["subnet"] = os.environ[CLUSTER_ENV].partition(":")


# ------------------------------------------------------------------------------ the jobs
def _data(rank: int, size: int):
    from lsgd_hpc.data import ShardedBatches, load_dataset
    ds = load_dataset("synthetic", None, SEED, 4096)
    return ShardedBatches(ds, rank, size, BATCH, SEED)


def _batches(sampler, steps: int):
    step, epoch = 0, 0
    while True:
        for xb, yb in sampler.batches(epoch):
            if step == steps:
                return
            step += 1
            yield step, xb, yb
        epoch += 1


def _plain_loop(model, opt, sampler, skip: int, steps: int, barrier) -> float:
    """What a user of DDP or Horovod writes: seconds of steps skip+1..steps."""
    import torch
    loss_fn = torch.nn.CrossEntropyLoss()
    model.train()
    t0 = None
    for step, xb, yb in _batches(sampler, steps):
        if step == skip + 1:
            barrier()
            t0 = time.perf_counter()
        plain_step(model, opt, loss_fn, xb, yb)
    return time.perf_counter() - t0


def plain_step(model, opt, loss_fn, xb, yb) -> float:
    """One step of a plain PyTorch training script (DDP's allreduces run inside backward);
    returns the loss, read as a training script logs it."""
    loss = loss_fn(model(xb), yb)
    opt.zero_grad()
    loss.backward()
    opt.step()
    return float(loss.detach())


def _model():
    import torch
    from lsgd_hpc.models.zoo import build_model
    torch.manual_seed(SEED)
    return build_model(MODEL, 10, (3, 32, 32))


def _sgd(params):
    import torch
    return torch.optim.SGD(params, lr=LR, momentum=0.9, weight_decay=1e-4)


@contextlib.contextmanager
def gloo_group(comm):
    """torch.distributed's gloo process group over the ranks of the mpi4py communicator
    ``comm``, destroyed on exit. The rendezvous is on rank 0's node: its host name (emulated
    nodes name each other in /etc/hosts; gloo then uses GLOO_SOCKET_IFNAME, eth0 there) or the
    loopback address when every rank shares one network (GLOO_SOCKET_IFNAME=lo)."""
    import socket

    import torch.distributed as dist
    rank, size = comm.Get_rank(), comm.Get_size()
    addr = None
    if rank == 0:
        host = "127.0.0.1" if os.environ.get("GLOO_SOCKET_IFNAME") == "lo" else socket.gethostname()
        with socket.socket() as s:
            s.bind(("", 0))
            addr = (host, s.getsockname()[1])
    host, port = comm.bcast(addr, root=0)
    dist.init_process_group("gloo", init_method=f"tcp://{host}:{port}", rank=rank,
                            world_size=size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def job_ddp(comm, skip: int, steps: int) -> float:
    from torch.nn.parallel import DistributedDataParallel as DDP
    with gloo_group(comm):
        model = DDP(_model())
        return _plain_loop(model, _sgd(model.parameters()), _data(comm.Get_rank(), comm.Get_size()),
                           skip, steps, comm.Barrier)


def job_horovod(comm, skip: int, steps: int) -> float:
    from mpi4py import MPI  # noqa: F401  (before horovod.torch: libmpi in the process)
    import horovod.torch as hvd
    hvd.init(comm=MPI.COMM_WORLD)
    model = _model()
    opt = hvd.DistributedOptimizer(_sgd(model.parameters()),
                                   named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    return _plain_loop(model, opt, _data(hvd.rank(), hvd.size()), skip, steps, comm.Barrier)


def job_lsgd_hpc(comm, skip: int, steps: int, run_dir: str, extra: List[str]) -> float:
    """The real trainer; seconds of steps skip..steps from the wall_time of its /train rows."""
    import h5py
    from lsgd_hpc.cli import train
    argv = ["--algorithm", "allreduce", "--dataset", "synthetic", "--model", MODEL,
            "--batch-size", str(BATCH), "--lr", str(LR), "--seed", str(SEED),
            "--epochs", "1000", "--max-steps", str(steps), "--eval-every", str(steps),
            "--run-dir", run_dir, *extra]
    code = train.main(argv)
    if code != 0:
        raise RuntimeError(f"lsgd_hpc.train exited {code}")
    path = Path(run_dir) / "metrics" / f"rank{comm.Get_rank():05d}.h5"
    with h5py.File(path, "r", locking=False) as f:
        at = dict(zip(f["train"]["step"][()].tolist(), f["train"]["wall_time"][()].tolist()))
    return at[steps] - at[skip]


def worker(args) -> int:
    import torch
    from mpi4py import MPI
    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD
    if args.method == "lsgd_hpc":
        seconds = job_lsgd_hpc(comm, args.skip, args.steps, args.run_dir, [])
    elif args.method == "lsgd_hpc_no_overlap":
        seconds = job_lsgd_hpc(comm, args.skip, args.steps, args.run_dir, ["--bucket-mb", "0"])
    elif args.method == "lsgd_hpc_torch":
        seconds = job_lsgd_hpc(comm, args.skip, args.steps, args.run_dir,
                               ["--backend", "torch"])
    elif args.method == "ddp":
        seconds = job_ddp(comm, args.skip, args.steps)
    elif args.method == "horovod":
        seconds = job_horovod(comm, args.skip, args.steps)
    else:
        raise SystemExit(f"unknown method {args.method}")
    slowest = comm.allreduce(seconds, op=MPI.MAX)
    if comm.Get_rank() == 0:
        write_result(args.out, {"method": args.method, "seconds": slowest,
                                "steps": args.steps - args.skip,
                                "steps_per_s": (args.steps - args.skip) / slowest})
    return 0


# ------------------------------------------------------------------------------ the driver
class Cluster:
    """The emulated cluster of the network case (scripts/cluster.sh), taken down on exit."""

    def __init__(self, rate: str, log):
        self.rate, self.log = rate, log
        self.script = REPO / "scripts" / "cluster.sh"
        self.base = ["--name", CLUSTER["name"]]

    def missing(self) -> Optional[str]:
        if not self.script.exists():
            return "scripts/cluster.sh is not in this checkout"
        if os.geteuid() != 0:
            return "the emulated cluster needs root (network namespaces)"
        return None

    def __enter__(self) -> "Cluster":
        subprocess.run(["bash", str(self.script), "down", *self.base], capture_output=True,
                       timeout=120)                  # a leftover of an interrupted run
        p = subprocess.run(["bash", str(self.script), "up", *self.base,
                            "--nodes", str(CLUSTER["nodes"]), "--rate", self.rate,
                            "--subnet", CLUSTER["subnet"], "--no-slurm"],
                           capture_output=True, text=True, timeout=600)
        if p.returncode != 0:
            raise RuntimeError(f"cluster.sh up failed: {p.stderr.strip()[-400:]}")
        args = subprocess.run(["bash", str(self.script), "mpirun-args", *self.base,
                               "--ranks-per-node", str(CLUSTER["ranks_per_node"])],
                              capture_output=True, text=True, timeout=60, check=True)
        self.mpirun_args = args.stdout.split()
        return self

    def __exit__(self, *exc) -> None:
        p = subprocess.run(["bash", str(self.script), "down", *self.base], capture_output=True,
                           text=True, timeout=300)
        if p.returncode != 0:
            self.log(f"  peers: cluster.sh down failed: {p.stderr.strip()[-300:]}")


def _horovod_missing() -> Optional[str]:
    from lsgd_hpc.testing import mpi_env
    p = subprocess.run([sys.executable, "-c", "import mpi4py.MPI, horovod.torch"],
                       env=mpi_env(), capture_output=True, text=True, timeout=120)
    return None if p.returncode == 0 else "horovod.torch does not import (run `make horovod`)"


def _launch(method: str, skip: int, steps: int, tmp: Path, mpi_args: List[str],
            extra_env: Dict[str, str], timeout: float) -> dict:
    from lsgd_hpc.testing import mpi_env, mpirun_cmd, run_group
    out = tmp / f"{method}-{time.monotonic_ns()}.json"
    run_dir = tmp / f"run-{out.stem}"
    cmd = mpirun_cmd(NP, [sys.executable, str(Path(__file__).resolve()), "--worker", method,
                          "--skip", str(skip), "--steps", str(steps), "--out", str(out),
                          "--run-dir", str(run_dir)], mpi_args)
    p = run_group(cmd, env=mpi_env(extra_env), cwd=REPO, timeout=timeout)
    shutil.rmtree(run_dir, ignore_errors=True)
    if p.returncode is None:
        return {"error": f"timed out after {timeout:.0f} s"}
    if p.returncode != 0 or not out.exists():
        tail = (p.stderr or p.stdout or "").strip().splitlines()[-3:]
        return {"error": f"exit {p.returncode}: {' / '.join(tail)[-300:]}"}
    return json.loads(out.read_text())


def _check_cluster(tmp: Path, mpi_args: List[str], extra_env: Dict[str, str], rate: str,
                   timeout: float) -> Optional[str]:
    """Probe the emulated cluster with the benchmark's mpirun options; why its layout or link
    rate is not the claimed one (None when it is)."""
    from _common import LayoutError, check_layout
    from lsgd_hpc.testing import mpi_env, mpirun_cmd, run_group
    out = tmp / "probe.json"
    cmd = mpirun_cmd(NP, [sys.executable, str(HERE / "_common.py"), "--probe", str(out)],
                     mpi_args)
    p = run_group(cmd, env=mpi_env(extra_env), cwd=REPO, timeout=timeout)
    if p.returncode != 0 or not out.exists():
        tail = " / ".join((p.stderr or p.stdout or "").strip().splitlines()[-3:])
        return f"the link probe failed (exit {p.returncode}): {tail[-300:]}"
    got = json.loads(out.read_text())
    try:
        check_layout(f"peers {rate}", got["node_of"], CLUSTER["nodes"], got["probe"], rate)
    except LayoutError as exc:
        return str(exc)
    return None


def measure(quick: bool, timeout: float, log, network: Optional[str],
            rounds: Optional[int] = None, torch_backend: bool = False) -> dict:
    skip, steps, planned = PLAN["quick" if quick else "full"]
    rounds = min(rounds, planned) if rounds else planned
    methods = list(TORCH_METHODS if torch_backend else METHODS)
    main_method, peer_names = (("lsgd_hpc_torch", TORCH_PEERS) if torch_backend
                               else ("lsgd_hpc", PEERS))
    missing = {}
    why = _horovod_missing() if "horovod" in methods else None
    if why:
        missing["horovod"] = why
        methods.remove("horovod")
    cluster = None
    where = "one network namespace (shared memory and loopback)"
    if network:
        cluster = Cluster(network, log)
        why = cluster.missing()
        if why:
            return {"skipped": why}
        where = (f"emulated cluster: {CLUSTER['nodes']} nodes x {CLUSTER['ranks_per_node']} "
                 f"ranks, each node's link limited to {network} (tc tbf)")
    samples: Dict[str, List[float]] = {m: [] for m in methods}
    errors: Dict[str, str] = {}
    tmp = Path(tempfile.mkdtemp(prefix="lsgd_bench_peers_"))
    try:
        with cluster or contextlib.nullcontext():
            # gloo's interface: the nodes' eth0 on the cluster, loopback otherwise
            env = {"GLOO_SOCKET_IFNAME": "eth0" if cluster else "lo"}
            mpi_args = []
            if cluster:
                mpi_args = list(cluster.mpirun_args)
                for var in ("PYTHONPATH", "OMP_NUM_THREADS", "GLOO_SOCKET_IFNAME"):
                    mpi_args += ["-x", var]       # to the ranks on every emulated node
            if cluster:
                # The layout and link rate the figures claim, probed with these mpirun options
                # before anything is timed: a wrong one fails the benchmark, no figures.
                error = _check_cluster(tmp, mpi_args, env, network, timeout)
                if error:
                    return {"layout_error": error, "where": where}
            for r in range(rounds):
                order = methods[r % len(methods):] + methods[:r % len(methods)]
                for m in order:
                    if m in errors:
                        continue
                    t0 = time.perf_counter()
                    res = _launch(m, skip, steps, tmp, mpi_args, env, timeout)
                    if "error" in res:
                        errors[m] = res["error"]
                        log(f"  peers: {m} failed: {res['error']}")
                        continue
                    samples[m].append(res["steps_per_s"])
                    log(f"  peers{' ' + network if network else ''}: round {r + 1}/{rounds} "
                        f"{m}: {res['steps_per_s']:.2f} steps/s "
                        f"(job {time.perf_counter() - t0:.0f} s)")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    med = {m: median(s) for m, s in samples.items() if s}
    peers = {m: v for m, v in med.items() if m in peer_names}
    best = max(peers, key=peers.get) if peers else None
    ratio = med[main_method] / peers[best] if best and main_method in med else None
    return {"where": where, "skip": skip, "steps": steps, "rounds": rounds,
            "steps_per_s": med, "samples": samples, "errors": errors, "missing": missing,
            "best_peer": best, "ratio": ratio,
            "overlap_gain": (med["lsgd_hpc"] / med["lsgd_hpc_no_overlap"]
                             if {"lsgd_hpc", "lsgd_hpc_no_overlap"} <= set(med) else None)}


def run(quick: bool = False, timeout: float = 240, log=print, network: Optional[str] = None,
        key: str = "peers", rounds: Optional[int] = None, torch_backend: bool = False) -> dict:
    """Driver entry for run_all: every method, interleaved, ``rounds`` times (at most the
    mode's plan). ``torch_backend``: lsgd_hpc --backend torch against DDP (both gloo)."""
    res = measure(quick, timeout, log, network, rounds, torch_backend)
    label = key
    if torch_backend:
        compared = "lsgd_hpc --backend torch allreduce / DDP, both gloo (steps/s)"
        main_method = "lsgd_hpc_torch"
    else:
        compared = "lsgd_hpc / best of DDP, Horovod (steps/s)"
        main_method = "lsgd_hpc"
    if "layout_error" in res:
        msg = f"layout check: {res['layout_error']}"
        return {"name": "peers", "doc": __doc__.strip(), "status": f"failed: {msg}",
                "ratio": None, "rows": [row(label, compared, f"failed: {msg}", None, "")]}
    if "skipped" in res:
        return {"name": "peers", "doc": __doc__.strip(), "status": f"skipped: {res['skipped']}",
                "skipped": res["skipped"], "ratio": None,
                "rows": [row(label, compared, f"skipped: {res['skipped']}", None, "")]}
    med = res["steps_per_s"]
    figures = ", ".join(f"{m} {med[m]:.2f}" for m in ALL_METHODS if m in med)
    figures += f" steps/s (median of {res['rounds']})"
    for m, e in {**res["errors"], **res["missing"]}.items():
        figures += f"; {m}: {e}"
    status = "ok" if not res["errors"] else "failed: " + "; ".join(
        f"{m}: {e}" for m, e in res["errors"].items())
    notes = [
        f"{label}: {res['where']}; ResNet-20, synthetic 3x32x32, batch {BATCH}/rank, {NP} "
        f"ranks; steps {res['skip']}..{res['steps']} of each job timed on its slowest rank; "
        "jobs interleaved, order rotated every round.",
    ]
    if res.get("overlap_gain"):
        notes.append(f"{label}: overlap gain (lsgd_hpc / lsgd_hpc_no_overlap) "
                     f"{res['overlap_gain']:.3f}x")
    return {"name": "peers", "doc": __doc__.strip(), "status": status, **res,
            "target": ">= 1.0",
            "rows": [row(label, f"{main_method} allreduce / best peer ({res['best_peer']}) in "
                                f"steps/s; {res['where']}", figures, res["ratio"],
                         f"{main_method} / best peer steps/s", steps_per_s=med)],
            "notes": notes}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--network", help="link rate of the emulated cluster, e.g. 1gbit")
    p.add_argument("--torch", action="store_true",
                   help="lsgd_hpc --backend torch against DDP (both gloo)")
    p.add_argument("--worker", choices=ALL_METHODS, dest="method", help=argparse.SUPPRESS)
    p.add_argument("--skip", type=int, help=argparse.SUPPRESS)
    p.add_argument("--steps", type=int, help=argparse.SUPPRESS)
    p.add_argument("--run-dir", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.method:
        return worker(args)
    result = run(args.quick, network=args.network, torch_backend=args.torch,
                 key="torch_vs_ddp" if args.torch else "peers")
    write_result(args.out, result)
    print(result["rows"][0]["figures"], "ratio", result.get("ratio"))
    return 0 if result["status"] in ("ok",) or result["status"].startswith("skipped") else 1


if __name__ == "__main__":
    sys.exit(main())
