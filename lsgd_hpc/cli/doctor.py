"""Preflight of an allocation: run it the way the training job will run, before spending hours.

    srun --mpi=pmix python -m lsgd_hpc.doctor [--dataset cifar10 --data-dir DIR] [--device cuda]
    mpirun -np 8 python -m lsgd_hpc.doctor --run-dir runs/exp1 --json doctor.json

Every rank gathers facts about itself (host, launcher variables, GPUs, network interfaces,
data folder, run directory, Horovod); one ``allgather`` brings them together, the checks below
judge them, and a short MPI ping-pong (:mod:`lsgd_hpc.planning.netprobe`) measures latency and
bandwidth inside and between nodes. Rank 0 prints one table; every rank exits 1 when a check
failed (their names are printed) and 0 when all passed. ``--json FILE`` also writes the
table, the per-rank facts and the probe's figures (which a planner can use) on rank 0.

Checks: MPI library and launch method; world size against the launcher's (SLURM_NTASKS);
host names and the node layout; GPUs per node and CUDA-aware MPI (with --device cuda); the
network interfaces MPI is told to use; the latency/bandwidth probe; Horovod; the data folder on
every rank; free space and write access in the run directory. ``$VAR`` and ``~`` in --data-dir
and --run-dir are expanded on each rank, so node-local paths (``$TMPDIR/cifar10``) are checked
where they will be read.
"""

from __future__ import annotations

import argparse
import ctypes
import fcntl
import json
import os
import shutil
import socket
import struct
import sys
import tempfile
from dataclasses import asdict, dataclass
from typing import Dict, List, Optional, Sequence

__all__ = ["Check", "gather_local_facts", "evaluate", "format_table", "main"]

PROG = "lsgd_hpc.doctor"
EXIT_FAILED = 1
EXIT_USAGE = 2
STATUSES = ("ok", "info", "warn", "FAIL")

#: Environment variables that choose the network MPI uses (Open MPI, UCX, MPICH/libfabric).
NETWORK_ENV = ("OMPI_MCA_btl_tcp_if_include", "OMPI_MCA_btl_tcp_if_exclude",
               "OMPI_MCA_oob_tcp_if_include", "OMPI_MCA_pml", "OMPI_MCA_btl", "UCX_NET_DEVICES",
               "UCX_TLS", "FI_PROVIDER", "MPIR_CVAR_CH4_OFI_IFNAME", "NCCL_SOCKET_IFNAME")


@dataclass
class Check:
    """One row of the table: ``status`` is ok, info (nothing to judge), warn or FAIL."""

    name: str
    status: str
    detail: str


# ------------------------------------------------------------------------------ local facts

def launch_method(env: Dict[str, str]) -> str:
    """How this rank was started, read from the variables each launcher sets."""
    from lsgd_hpc.comm.launcher import launch_method as method
    return method(env)


def _ipv4_of(ifname: str) -> Optional[str]:
    """The interface's IPv4 address (Linux SIOCGIFADDR), or None when it has none."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", ifname[:15].encode()))
        except OSError:
            return None
    return socket.inet_ntoa(packed[20:24])


def network_interfaces() -> Dict[str, Optional[str]]:
    """Every interface of this host with its IPv4 address (None: up without one, or down)."""
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return {}
    return {name: _ipv4_of(name) for name in names}


def cuda_aware_mpi() -> str:
    """'yes', 'no' or 'unknown': Open MPI's MPIX_Query_cuda_support() from the loaded libmpi."""
    try:
        with open("/proc/self/maps") as fh:
            libs = sorted({line.split()[-1] for line in fh
                           if "libmpi" in line and ".so" in line.split()[-1]})
    except OSError:
        libs = []
    for path in libs:
        try:
            fn = getattr(ctypes.CDLL(path), "MPIX_Query_cuda_support")
        except (OSError, AttributeError):
            continue
        fn.restype = ctypes.c_int
        return "yes" if fn() else "no"
    return "unknown"


def _gpu_count() -> int:
    import torch
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _horovod_state() -> str:
    """'available', 'not installed', or 'broken: <why>' (mpi4py first, as the backend does)."""
    from mpi4py import MPI  # noqa: F401
    try:
        import horovod.torch  # noqa: F401
    except ModuleNotFoundError as exc:
        if exc.name in ("horovod", "horovod.torch"):
            return "not installed"
        return f"broken: {exc}"
    except Exception as exc:  # noqa: BLE001 - any failure to import is what we report
        return f"broken: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return "available"


def _data_state(dataset: str, data_dir: Optional[str]) -> str:
    """'' when the data set can be read on this rank, else why not (one line)."""
    from lsgd_hpc.data.errors import DataError
    from lsgd_hpc.data.loaders import check_data_dir
    try:
        check_data_dir(dataset, data_dir)
    except DataError as exc:
        return str(exc)
    return ""


def _run_dir_state(run_dir: str) -> dict:
    """Free bytes where ``run_dir`` is (or would be made) and whether a file can be written."""
    probe = os.path.abspath(run_dir)
    while not os.path.isdir(probe) and os.path.dirname(probe) != probe:
        probe = os.path.dirname(probe)
    try:
        free = shutil.disk_usage(probe).free
    except OSError:
        free = -1
    try:
        with tempfile.NamedTemporaryFile(dir=probe, prefix=".lsgd_doctor."):
            writable = True
    except OSError:
        writable = False
    return {"path": os.path.abspath(run_dir), "existing": probe, "free_bytes": free,
            "writable": writable}


def gather_local_facts(args, env: Dict[str, str]) -> dict:
    """What this rank sees of itself; plain data, so that it can be gathered and judged."""
    from lsgd_hpc.comm.launcher import launcher_size
    data_dir = os.path.expanduser(os.path.expandvars(args.data_dir)) if args.data_dir else None
    run_dir = os.path.expanduser(os.path.expandvars(args.run_dir))
    return {
        "host": socket.gethostname(),
        "launch": launch_method(env),
        "launcher_size": launcher_size(env),
        "gpus": _gpu_count(),
        "interfaces": network_interfaces(),
        "data_dir": data_dir,
        "data_error": _data_state(args.dataset, data_dir),
        "run_dir": _run_dir_state(run_dir),
        "horovod": _horovod_state(),
    }


# ----------------------------------------------------------------------------- the judging

def _ranks_text(ranks: Sequence[int]) -> str:
    return ", ".join(map(str, ranks)) if len(ranks) <= 6 else \
        f"{', '.join(map(str, ranks[:5]))} and {len(ranks) - 5} more"


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


@dataclass
class _Job:
    """What every check reads: the gathered facts (``facts[r]`` is rank r's), the options, the
    environment of rank 0, and the node layout the trainer will use."""

    facts: List[dict]
    args: argparse.Namespace
    env: Dict[str, str]
    mpi_library: str
    cuda_aware: str
    probe: Optional[dict]
    hosts: List[str]
    n_nodes: int
    members: List[List[int]]          # members[n]: the ranks of node n
    by_host: Dict[str, List[int]]     # each host's ranks, hosts in order of their first rank
    by_srun: bool                     # rank 0 was started by srun

    @classmethod
    def of(cls, facts: List[dict], args, env: Dict[str, str], mpi_library: str,
           cuda_aware: str, probe: Optional[dict]) -> "_Job":
        from lsgd_hpc.comm.groups import node_layout
        hosts = [f["host"] for f in facts]
        node_of = node_layout(hosts, args.ranks_per_node)
        n_nodes = max(node_of) + 1
        members = [[r for r in range(len(facts)) if node_of[r] == n] for n in range(n_nodes)]
        by_host: Dict[str, List[int]] = {}
        for r, h in enumerate(hosts):
            by_host.setdefault(h, []).append(r)
        return cls(facts, args, env, mpi_library, cuda_aware, probe, hosts, n_nodes, members,
                   by_host, facts[0]["launch"].startswith("srun"))

    @property
    def size(self) -> int:
        return len(self.facts)


def _check_mpi_library(job: _Job) -> List[Check]:
    launches = sorted({f["launch"] for f in job.facts})
    return [Check("MPI library", "info", f"{job.mpi_library}; started by {', '.join(launches)}")]


def _check_world_size(job: _Job) -> List[Check]:
    """The world size against what the launcher and SLURM meant to start."""
    # Under srun the step's task count is what SLURM started; under mpirun (even inside an
    # allocation, whose batch step has its own counts) only mpirun's own count applies.
    size, env = job.size, job.env
    expected = {}
    if job.by_srun:
        for var in ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS"):
            if env.get(var, "").isdigit():
                expected[var] = int(env[var])
                break
    if job.facts[0]["launcher_size"] is not None:
        expected["launcher"] = job.facts[0]["launcher_size"]
    wrong = {k: v for k, v in expected.items() if v != size}
    if wrong:
        said = ", ".join(f"{k}={v}" for k, v in wrong.items())
        return [Check("world size", "FAIL", f"MPI world has {size} ranks but {said}: the "
                      "ranks did not join one MPI job (use srun --mpi=pmix, or the mpirun "
                      "of the MPI that mpi4py was built with)")]
    said = ", ".join(f"{k}={v}" for k, v in expected.items()) or "no launcher count"
    return [Check("world size", "ok", f"{size} ranks ({said})")]


def _check_node_layout(job: _Job) -> List[Check]:
    """The hosts and the node layout the trainer will use, against SLURM's node count."""
    args, env, by_host = job.args, job.env, job.by_host
    layout = "; ".join(f"{h}: ranks {_ranks_text(rs)}" for h, rs in by_host.items())
    how = f"--ranks-per-node {args.ranks_per_node}" if args.ranks_per_node else "host names"
    detail = f"{job.n_nodes} node(s) by {how}, {len(by_host)} host(s): {layout}"
    slurm_nodes = (env.get("SLURM_STEP_NUM_NODES") if job.by_srun else None) \
        or env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES")
    status = "ok"
    if slurm_nodes and slurm_nodes.isdigit() and int(slurm_nodes) != len(by_host):
        # srun spreads a step over its nodes; mpirun may use fewer on purpose
        status = "FAIL" if job.by_srun else "warn"
        detail += f"; SLURM allocated {slurm_nodes} node(s)"
    elif len({len(m) for m in job.members}) > 1:
        status, detail = "warn", detail + "; nodes hold different numbers of ranks"
    return [Check("node layout", status, detail)]


def _check_gpus(job: _Job) -> List[Check]:
    """GPUs per node; with --device cuda and --backend mpi, CUDA-aware MPI too."""
    facts, hosts, members = job.facts, job.hosts, job.members
    gpus_per_node = {hosts[m[0]]: facts[m[0]]["gpus"] for m in members}
    gpu_text = ", ".join(f"{h}: {g}" for h, g in gpus_per_node.items())
    if job.args.device != "cuda":
        return [Check("GPUs", "info", f"per node {gpu_text} (not used: --device cpu)")]
    no_gpu = [h for h, g in gpus_per_node.items() if g == 0]
    shared = [hosts[m[0]] for m in members if 0 < facts[m[0]]["gpus"] < len(m)]
    if no_gpu:
        rows = [Check("GPUs", "FAIL", f"--device cuda, but no GPU on {', '.join(no_gpu)}"
                      f" (per node {gpu_text})")]
    elif shared:
        rows = [Check("GPUs", "warn", f"more ranks than GPUs on {', '.join(shared)}: "
                      f"ranks share GPUs (per node {gpu_text})")]
    else:
        rows = [Check("GPUs", "ok", f"per node {gpu_text}")]
    if job.args.backend == "mpi":
        rows.append(_cuda_aware_row(job.cuda_aware))
    return rows


def _cuda_aware_row(cuda_aware: str) -> Check:
    status = {"yes": "ok", "no": "FAIL", "unknown": "warn"}[cuda_aware]
    return Check("CUDA-aware MPI", status, {
        "yes": "MPIX_Query_cuda_support() = 1",
        "no": "MPIX_Query_cuda_support() = 0: --device cuda with --backend mpi needs an "
              "MPI built with CUDA (Open MPI with UCX and CUDA)",
        "unknown": "this MPI library cannot say (no MPIX_Query_cuda_support); a GPU "
                   "buffer handed to an MPI without CUDA support crashes"}[cuda_aware])


def _check_network(job: _Job) -> List[Check]:
    """The network interfaces MPI is told to use, and what each node has."""
    facts, env, by_host = job.facts, job.env, job.by_host
    told = {k: env[k] for k in NETWORK_ENV if env.get(k)}
    per_node = []
    missing = []
    for host, ranks in by_host.items():
        f = facts[ranks[0]]
        ifs = {n: a for n, a in f["interfaces"].items() if n != "lo"}
        per_node.append(f"{f['host']}: " + (", ".join(f"{n} {a}" if a else n
                                                      for n, a in ifs.items()) or "none"))
        for key in ("OMPI_MCA_btl_tcp_if_include", "OMPI_MCA_oob_tcp_if_include",
                    "NCCL_SOCKET_IFNAME", "MPIR_CVAR_CH4_OFI_IFNAME"):
            for name in filter(None, told.get(key, "").split(",")):
                if "/" not in name and name not in f["interfaces"]:
                    missing.append(f"{key}={name} not on {f['host']}")
    detail = ("MPI told: " + ", ".join(f"{k}={v}" for k, v in told.items()) if told
              else "MPI chooses (no interface variables set)") + "; " + "; ".join(per_node)
    if missing:
        return [Check("network interfaces", "FAIL", "; ".join(missing) + "; " + detail)]
    if len(by_host) > 1 and any(not any(a for n, a in facts[rs[0]]["interfaces"].items()
                                        if n != "lo") for rs in by_host.values()):
        return [Check("network interfaces", "warn", "a node has no IPv4 address besides "
                      "loopback (fine for InfiniBand verbs, not for TCP); " + detail)]
    return [Check("network interfaces", "info", detail)]


def _check_probe(job: _Job) -> List[Check]:
    """The latency/bandwidth probe's figures (measured before the judging)."""
    if job.probe is None:
        return [Check("latency/bandwidth", "info", "not measured (--no-probe)")]
    parts = []
    for key, label in (("intra", "inside nodes"), ("inter", "between nodes")):
        link = job.probe.get(key)
        if link:
            parts.append(f"{label} {link['latency_s'] * 1e6:.1f} us, "
                         f"{link['bandwidth_Bps'] / 1e9:.2f} GB/s")
    return [Check("latency/bandwidth", "info",
                  "; ".join(parts) or "one rank: nothing to measure")]


def _check_horovod(job: _Job) -> List[Check]:
    """Horovod on every rank: a failure with --backend horovod, else a warning or a note."""
    facts, backend = job.facts, job.args.backend
    states = {f["horovod"] for f in facts}
    broken = [r for r, f in enumerate(facts) if f["horovod"].startswith("broken")]
    absent = [r for r, f in enumerate(facts) if f["horovod"] == "not installed"]
    if broken:
        return [Check("Horovod", "FAIL" if backend == "horovod" else "warn",
                      f"ranks {_ranks_text(broken)}: {facts[broken[0]]['horovod']}")]
    if absent:
        return [Check("Horovod", "FAIL" if backend == "horovod" else "info",
                      f"not installed on ranks {_ranks_text(absent)} (make horovod)"
                      if len(absent) < job.size else "not installed (make horovod)")]
    return [Check("Horovod", "ok", "horovod.torch imports on every rank"
                  if states == {"available"} else ", ".join(sorted(states)))]


def _check_data(job: _Job) -> List[Check]:
    """The data folder, on every rank (a built-in data set has none)."""
    facts, dataset = job.facts, job.args.dataset
    bad = [r for r, f in enumerate(facts) if f["data_error"]]
    if dataset not in ("cifar10", "imagefolder"):
        return [Check("data folder", "ok", f"{dataset} is built in: nothing to stage")]
    if bad:
        where = ", ".join(sorted({job.hosts[r] for r in bad}))
        return [Check("data folder", "FAIL", f"ranks {_ranks_text(bad)} on {where}: "
                      f"{facts[bad[0]]['data_error']}")]
    dirs = sorted({f["data_dir"] for f in facts})
    return [Check("data folder", "ok", f"{dataset} readable on every rank in {', '.join(dirs)}")]


def _check_run_dir(job: _Job) -> List[Check]:
    """The run directory: free space and a test write, on every rank."""
    facts, min_free_gb = job.facts, job.args.min_free_gb
    need = min_free_gb * 1e9
    low = [r for r, f in enumerate(facts) if 0 <= f["run_dir"]["free_bytes"] < need]
    unknown = [r for r, f in enumerate(facts) if f["run_dir"]["free_bytes"] < 0]
    ro = [r for r, f in enumerate(facts) if not f["run_dir"]["writable"]]
    least = min(facts, key=lambda f: f["run_dir"]["free_bytes"])["run_dir"]
    detail = f"{least['path']}: {_gib(max(least['free_bytes'], 0))} free where least " \
             f"(on {least['existing']}), need {min_free_gb:g} GB"
    problems = []
    if low:
        problems.append(f"too little space for ranks {_ranks_text(low)}")
    if unknown:
        problems.append(f"free space unknown for ranks {_ranks_text(unknown)}")
    if ro:
        problems.append(f"cannot write a file there on ranks {_ranks_text(ro)}")
    return [Check("run directory", "FAIL" if problems else "ok", "; ".join(problems + [detail]))]


#: The checks, in the order of the table's rows; each gives one row (GPUs: two with the MPI
#: backend and --device cuda, the second for CUDA-aware MPI).
CHECKS = (_check_mpi_library, _check_world_size, _check_node_layout, _check_gpus,
          _check_network, _check_probe, _check_horovod, _check_data, _check_run_dir)


def evaluate(facts: List[dict], args, env: Dict[str, str], mpi_library: str,
             cuda_aware: str, probe: Optional[dict]) -> List[Check]:
    """The table's rows from every rank's facts (facts[r] is rank r's), one check of CHECKS
    after the other; no MPI here."""
    job = _Job.of(facts, args, env, mpi_library, cuda_aware, probe)
    rows: List[Check] = []
    for check in CHECKS:
        rows.extend(check(job))
    return rows


def format_table(rows: List[Check], width: int = 100) -> str:
    """A fixed-width table: name, status, then the detail wrapped under its column."""
    import textwrap
    name_w = max(len(r.name) for r in rows)
    lead = name_w + 2 + 6 + 2
    out = [f"{'check':<{name_w}}  {'status':<6}  detail", "-" * width]
    for r in rows:
        lines = textwrap.wrap(r.detail, max(20, width - lead)) or [""]
        out.append(f"{r.name:<{name_w}}  {r.status:<6}  {lines[0]}")
        out.extend(" " * lead + ln for ln in lines[1:])
    return "\n".join(out)


# ----------------------------------------------------------------------------- command line

class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2; printed once, by rank 0 only
        from lsgd_hpc.comm.launcher import env_rank as _env_rank
        if _env_rank() == 0:
            print(f"{PROG}: error: {' '.join(message.split())}", file=sys.stderr, flush=True)
        raise SystemExit(EXIT_USAGE)


def _parser() -> argparse.ArgumentParser:
    from lsgd_hpc.data.loaders import DATASETS
    p = _Parser(prog=f"python -m {PROG}",
                description="Preflight checks of an allocation; run it under srun or mpirun "
                            "exactly as the training job will run.")
    p.add_argument("--dataset", choices=DATASETS, default="digits",
                   help="data set the job will train on (default: %(default)s)")
    p.add_argument("--data-dir", metavar="DIR",
                   help="staged data folder, checked on every rank; $VAR expands per rank")
    p.add_argument("--run-dir", metavar="DIR", default="runs",
                   help="where the job will write (default: %(default)s); $VAR expands per rank")
    p.add_argument("--min-free-gb", type=float, default=1.0, metavar="GB",
                   help="free space the run directory needs (default: %(default)s)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cuda also checks GPUs per node and CUDA-aware MPI "
                        "(default: %(default)s)")
    p.add_argument("--backend", choices=("mpi", "horovod"), default="mpi",
                   help="horovod makes a missing Horovod a failure (default: %(default)s)")
    p.add_argument("--ranks-per-node", type=int, metavar="K",
                   help="group K consecutive ranks as one node (default: by host name)")
    p.add_argument("--no-probe", action="store_true",
                   help="skip the latency/bandwidth ping-pong")
    p.add_argument("--probe-repeats", type=int, default=5, metavar="N",
                   help="round trips per message size in the probe (default: %(default)s)")
    p.add_argument("--json", metavar="FILE",
                   help="also write the checks, per-rank facts and probe figures (rank 0)")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = _parser()
    args = p.parse_args(argv)
    if args.min_free_gb < 0:
        p.error("--min-free-gb must be >= 0")
    if args.ranks_per_node is not None and args.ranks_per_node < 1:
        p.error("--ranks-per-node must be >= 1")
    if args.probe_repeats < 1:
        p.error("--probe-repeats must be >= 1")

    from mpi4py import MPI  # MPI_Init here, after the arguments are known to be good

    comm = MPI.COMM_WORLD
    try:
        return _run(comm, args)
    except Exception:  # noqa: BLE001 - a bug here must not leave the other ranks waiting
        import traceback
        print(f"{PROG}: rank {comm.Get_rank()}: unexpected error", file=sys.stderr)
        traceback.print_exc()
        sys.stderr.flush()
        comm.Abort(EXIT_FAILED)
        return EXIT_FAILED


def _run(comm, args) -> int:
    """Gather, probe, judge, print on rank 0; the exit status, the same on every rank."""
    from lsgd_hpc.comm.groups import node_layout
    from lsgd_hpc.comm.mpi import mpi_library
    from lsgd_hpc.planning.netprobe import DEFAULT_SIZES, probe_network

    env = dict(os.environ)
    facts = comm.allgather(gather_local_facts(args, env))
    probe = None
    if not args.no_probe:
        node_of = node_layout([f["host"] for f in facts], args.ranks_per_node)
        probe = probe_network(comm, node_of, DEFAULT_SIZES, args.probe_repeats)
    status = 0
    if comm.Get_rank() == 0:
        library = mpi_library().split(", package:")[0]
        rows = evaluate(facts, args, env, library, cuda_aware_mpi(), probe)
        failed = [r.name for r in rows if r.status == "FAIL"]
        print(f"lsgd_hpc doctor: {comm.Get_size()} rank(s)")
        print(format_table(rows))
        if args.json:
            with open(args.json, "w") as fh:
                json.dump({"checks": [asdict(r) for r in rows], "facts": facts,
                           "probe": probe, "failed": failed}, fh, indent=1)
        if failed:
            print(f"{PROG}: {len(failed)} check(s) failed: {', '.join(failed)}", flush=True)
            status = EXIT_FAILED
        else:
            print(f"{PROG}: all checks passed", flush=True)
    return comm.bcast(status, root=0)

if __name__ == "__main__":
    raise SystemExit(main())
