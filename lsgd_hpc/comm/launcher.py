"""What the launcher told this process: rank, world size, local rank, and where to rendezvous.

One place for the variables of every launcher the package runs under, read before any
communication library starts (torch and mpi4py are imported only inside the functions that
need them):

=============  =========================================================================
torchrun       ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
               ``MASTER_ADDR``, ``MASTER_PORT`` (also any launcher that sets RANK and
               WORLD_SIZE for torch's ``env://``)
mpirun         Open MPI: ``OMPI_COMM_WORLD_RANK/SIZE/LOCAL_RANK/LOCAL_SIZE``; PMIx:
               ``PMIX_RANK``; MPICH/Hydra: ``PMI_RANK``, ``PMI_SIZE``, ``MPI_LOCALRANKID``,
               ``MPI_LOCALNRANKS``
srun           ``SLURM_PROCID``, ``SLURM_NTASKS`` (``SLURM_STEP_NUM_TASKS``),
               ``SLURM_LOCALID``, ``SLURM_STEP_TASKS_PER_NODE``; the rendezvous host is the
               first host of ``SLURM_JOB_NODELIST`` (``SLURM_STEP_NODELIST``), the port
               12000 + job id % 20000 (``MASTER_ADDR``/``MASTER_PORT`` override both)
=============  =========================================================================

torchrun's variables are read first (torchrun started by srun, one per node, sees SLURM's
variables of its own one-task-per-node step), then the MPI launchers' (mpirun inside a SLURM
allocation starts its daemons with one-task srun steps, whose SLURM variables describe the
daemon, not the ranks), then SLURM's.

Rendezvous for ``--backend torch`` (:func:`torch_store`): MASTER_ADDR/MASTER_PORT when set
(torchrun sets them); under srun the derived host and port; under mpirun without MASTER_ADDR,
rank 0 opens torch's TCP store on a free port of its host and sends the host name and port to
the others over MPI.COMM_WORLD (mpi4py) -- no port can clash, nothing to configure.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

__all__ = ["LaunchInfo", "detect", "env_rank", "launched_alone", "local_rank",
           "launcher_world_size", "world_on_one_host", "launch_method", "launcher_size",
           "expand_hostlist", "slurm_master", "SLURM_PORT_BASE", "SLURM_PORT_SPAN",
           "torch_store", "RENDEZVOUS"]

SLURM_PORT_BASE = 12000
SLURM_PORT_SPAN = 20000

#: How this process joined torch.distributed's default group (set by
#: lsgd_hpc.comm.torchdist.init_torch_world): the ``launcher`` ('torchrun', 'mpirun', 'srun'
#: or '' alone) and the TCP store's ``host`` and ``port`` ('' and 0 alone). The trainer writes
#: it to its metrics files (``launcher``, ``rendezvous`` attributes, see :func:`launch_attrs`).
RENDEZVOUS: Dict[str, object] = {}


def _int(env: dict, *names: str) -> Optional[int]:
    """The first of these variables that holds a non-negative integer."""
    for name in names:
        value = env.get(name, "")
        if value.isdigit():
            return int(value)
    return None


@dataclass(frozen=True)
class LaunchInfo:
    """What one process's launcher says. ``launcher`` is 'torchrun', 'mpirun', 'srun' or None
    (started alone); a field the launcher does not give is None."""

    launcher: Optional[str]
    rank: int
    size: Optional[int]
    local_rank: Optional[int]
    local_size: Optional[int]
    master_addr: Optional[str] = None
    master_port: Optional[int] = None

    @property
    def launched(self) -> bool:
        return self.launcher is not None


def _torchrun(env: dict) -> bool:
    return env.get("RANK", "").isdigit() and env.get("WORLD_SIZE", "").isdigit()


def _mpirun(env: dict) -> bool:
    return any(env.get(v) is not None for v in ("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK",
                                                "PMIX_RANK", "PMI_RANK", "PMI_SIZE",
                                                "MPI_LOCALNRANKS", "PRTE_LAUNCHED"))


def _srun(env: dict) -> bool:
    return env.get("SLURM_STEP_ID") is not None and env.get("SLURM_PROCID", "").isdigit()


def _replica_group(env: dict) -> Optional[Tuple[int, int]]:
    """torchft's ``(REPLICA_GROUP_ID, NUM_REPLICA_GROUPS)`` when both are set: this process
    is in one of several replica groups, each started by a launcher of its own (so the
    launcher's rank and size are the group's, not the job's)."""
    rid, n = env.get("REPLICA_GROUP_ID", ""), env.get("NUM_REPLICA_GROUPS", "")
    if rid.isdigit() and n.isdigit():
        return int(rid), int(n)
    return None


def detect(env: Optional[dict] = None) -> LaunchInfo:
    """This process's launch, from ``env`` (default: os.environ)."""
    env = os.environ if env is None else env
    addr = env.get("MASTER_ADDR") or None
    port = _int(env, "MASTER_PORT")
    if _torchrun(env):
        return LaunchInfo("torchrun", int(env["RANK"]), int(env["WORLD_SIZE"]),
                          _int(env, "LOCAL_RANK"), _int(env, "LOCAL_WORLD_SIZE"), addr, port)
    if _mpirun(env):
        return LaunchInfo("mpirun",
                          _int(env, "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK") or 0,
                          _int(env, "OMPI_COMM_WORLD_SIZE", "PMI_SIZE"),
                          _int(env, "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID"),
                          _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS"), addr, port)
    if _srun(env):
        if addr is None or port is None:
            s_addr, s_port = slurm_master(env)
            addr, port = addr or s_addr, port if port is not None else s_port
        return LaunchInfo("srun", int(env["SLURM_PROCID"]),
                          _int(env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS"),
                          _int(env, "SLURM_LOCALID"), _slurm_local_size(env), addr, port)
    return LaunchInfo(None, 0, None, None, None, addr, port)


def env_rank(env: Optional[dict] = None) -> int:
    """This process's rank as its launcher set it, readable before any communication starts
    (to print a message once; with ``srun --mpi=pmi2`` under Open MPI every process is rank 0
    of an MPI world of its own, and only this tells them apart)."""
    env = os.environ if env is None else env
    info = detect(env)
    replica = _replica_group(env)
    if replica is not None:         # torchft's workers: group G's rank r is job rank G*size+r
        return replica[0] * (info.size or 1) + (info.rank if info.launcher else 0)
    if info.launcher is None:
        # SLURM_PROCID without a step id (a batch script's own shell, tests): still a rank
        return _int(env, "SLURM_PROCID") or 0
    return info.rank


def launched_alone(env: Optional[dict] = None) -> bool:
    """No launcher (torchrun, mpirun, srun) started this process: its world is itself alone."""
    env = os.environ if env is None else env
    return not (_torchrun(env) or _mpirun(env) or env.get("SLURM_STEP_ID"))


def local_rank(env: Optional[dict] = None) -> Optional[int]:
    """The node-local rank the launcher gave (torchrun's, Open MPI's, SLURM's or MPICH's)."""
    return detect(os.environ if env is None else env).local_rank


def launcher_world_size(env: dict) -> Tuple[Optional[str], Optional[int]]:
    """``(launcher, n)``: how many ranks the launcher of this process started, where it says.

    ``torchrun`` and ``mpirun`` (Open MPI's, or a Hydra mpirun) tell their ranks their count;
    inside a SLURM allocation mpirun starts its daemons with one-task ``srun`` steps, so there
    the SLURM variables describe the daemon's step, not the ranks, and are not compared. A
    process that ``srun`` started itself (a job step's task, no mpirun variables) is one of
    the step's SLURM_STEP_NUM_TASKS tasks. ``(None, None)`` when nobody says.
    """
    replica = _replica_group(env)
    if _torchrun(env):
        return "torchrun", int(env["WORLD_SIZE"]) * (replica[1] if replica else 1)
    if replica is not None:         # torchft's workers started one process each
        return None, None
    if env.get("OMPI_COMM_WORLD_SIZE", "").isdigit():
        return "mpirun", int(env["OMPI_COMM_WORLD_SIZE"])
    if env.get("MPI_LOCALNRANKS") and env.get("PMI_SIZE", "").isdigit():   # Hydra
        return "mpirun", int(env["PMI_SIZE"])
    if env.get("PRTE_LAUNCHED") or env.get("MPI_LOCALNRANKS"):
        return "mpirun", None
    if env.get("SLURM_STEP_ID") is not None:
        for var in ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS"):
            if env.get(var, "").isdigit():
                return "srun", int(env[var])
    return None, None


def launcher_size(env: dict) -> Optional[int]:
    """The rank count an MPI launcher (mpirun, mpiexec) or torchrun gave this process."""
    if _torchrun(env):
        return int(env["WORLD_SIZE"])
    return _int(env, "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")


def world_on_one_host(size: int, env: Optional[dict] = None) -> Optional[bool]:
    """Whether all ``size`` ranks of the world run on this host, from what the launcher tells
    each rank (torchrun's, Open MPI's, MPICH/Hydra's or SLURM's count of ranks on this node);
    None when none says."""
    env = os.environ if env is None else env
    names = (("LOCAL_WORLD_SIZE",) if _torchrun(env) else ()) + \
        ("OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS")
    local = _int(env, *names)
    if local is not None:
        return local == size
    if env.get("SLURM_STEP_NUM_NODES", "").isdigit():
        return int(env["SLURM_STEP_NUM_NODES"]) == 1
    return None


def launch_method(env: dict) -> str:
    """How this rank was started, in words (``lsgd_hpc.doctor``'s table)."""
    if _torchrun(env):
        return "torchrun (torch.distributed env://)"
    if env.get("SLURM_STEP_ID") is not None and env.get("SLURM_PROCID") is not None \
            and env.get("OMPI_COMM_WORLD_SIZE") is None:
        if env.get("PMIX_RANK") is not None:
            return "srun --mpi=pmix"
        if env.get("PMI_RANK") is not None:
            return "srun (PMI-2)"
        return "srun without PMI (each rank starts its own one-rank MPI job)"
    if env.get("OMPI_COMM_WORLD_SIZE") is not None:
        return "mpirun (Open MPI)" + (" inside a SLURM allocation" if env.get("SLURM_JOB_ID")
                                     else "")
    if env.get("PMI_RANK") is not None or env.get("HYDRA_CONTROL_FD") is not None:
        return "mpiexec (PMI, e.g. MPICH hydra)"
    if env.get("PMIX_RANK") is not None:
        return "a PMIx launcher"
    return "no launcher (a one-rank singleton)"


# -- SLURM ---------------------------------------------------------------------------------
def _slurm_local_size(env: dict) -> Optional[int]:
    """Tasks on this node: SLURM_STEP_TASKS_PER_NODE ('4(x2),3') at this node's index."""
    spec = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    node = _int(env, "SLURM_NODEID")
    if not spec or node is None:
        return None
    counts: List[int] = []
    for part in spec.split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not m:
            return None
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts[node] if node < len(counts) else None


def _split_top(s: str) -> List[str]:
    """Split at commas outside brackets."""
    parts, depth, cur = [], 0, ""
    for ch in s:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    if cur:
        parts.append(cur)
    return parts


def expand_hostlist(spec: str) -> List[str]:
    """SLURM's compressed host list, expanded: 'node[01-03,7],gpu2' -> node01, node02,
    node03, node7, gpu2 (zero padding kept, several bracket groups per name allowed)."""
    hosts: List[str] = []
    for item in _split_top(spec.strip()):
        item = item.strip()
        if not item:
            continue
        m = re.search(r"\[([^\]]*)\]", item)
        if not m:
            hosts.append(item)
            continue
        head, tail = item[:m.start()], item[m.end():]
        for rng in m.group(1).split(","):
            lo, _, hi = rng.partition("-")
            if not hi:
                alts = [lo]
            else:
                width = len(lo)
                alts = [str(i).zfill(width) for i in range(int(lo), int(hi) + 1)]
            for alt in alts:
                hosts.extend(expand_hostlist(head + alt + tail))
    return hosts


def _scontrol_hostnames(spec: str) -> Optional[List[str]]:
    if not shutil.which("scontrol"):
        return None
    try:
        res = subprocess.run(["scontrol", "show", "hostnames", spec], capture_output=True,
                             text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    hosts = res.stdout.split()
    return hosts if res.returncode == 0 and hosts else None


def slurm_master(env: dict, use_scontrol: bool = False) -> Tuple[Optional[str], Optional[int]]:
    """(host, port) of the rendezvous under srun: the first host of the step's (else the
    job's) node list, and 12000 + job id % 20000 (the same on every task, different for jobs
    that share a node). ``use_scontrol``: ask ``scontrol show hostnames`` first."""
    spec = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") \
        or env.get("SLURM_NODELIST")
    host = None
    if spec:
        hosts = (_scontrol_hostnames(spec) if use_scontrol else None) or expand_hostlist(spec)
        host = hosts[0] if hosts else None
    job = _int(env, "SLURM_JOB_ID", "SLURM_JOBID")
    port = SLURM_PORT_BASE + job % SLURM_PORT_SPAN if job is not None else None
    return host, port


# -- rendezvous for torch.distributed --------------------------------------------------------
def torch_store(info: LaunchInfo, env: dict, timeout_s: float = 300.0):
    """The TCP store every rank of ``info``'s world joins (torch.distributed.TCPStore), or
    None under torchrun (then ``init_process_group(init_method="env://")``).

    MASTER_ADDR/MASTER_PORT when given; under mpirun without them, rank 0's host and a free
    port, sent over MPI.COMM_WORLD.
    """
    import datetime

    import torch.distributed as dist
    from lsgd_hpc.comm.base import CommError

    timeout = datetime.timedelta(seconds=timeout_s)
    size, rank = int(info.size), info.rank
    if info.master_addr and info.master_port is not None:
        if info.launcher == "torchrun":
            attempt = env.get("TORCHELASTIC_RESTART_COUNT", "0") or "0"
            if attempt == "0":
                return None    # torch's env:// rendezvous (it reuses torchrun's agent store)
            # A group torchrun restarted (--max-restarts) meets in the same agent store as
            # the group before it: under a prefix of its own, so that no rank reads an address
            # a dead rank of the earlier attempt left there (gloo then retries a closed port
            # until it times out).
            agent = env.get("TORCHELASTIC_USE_AGENT_STORE", "") == "True"
            base = dist.TCPStore(info.master_addr, info.master_port, size,
                                 rank == 0 and not agent, timeout, wait_for_workers=False)
            return dist.PrefixStore(f"lsgd_hpc/attempt{attempt}/", base)
        return dist.TCPStore(info.master_addr, info.master_port, size, rank == 0, timeout,
                             wait_for_workers=False)
    if info.launcher == "mpirun":
        import socket

        from mpi4py import MPI
        comm = MPI.COMM_WORLD
        if comm.Get_size() != size:
            raise CommError(f"--backend torch: MPI.COMM_WORLD has {comm.Get_size()} ranks but "
                            f"mpirun started {size}: mpi4py is built against another MPI")
        store, where = None, None
        if rank == 0:
            host = info.master_addr or socket.gethostname()
            store = dist.TCPStore(host, 0, size, True, timeout, wait_for_workers=False)
            where = (host, store.port)
        host, port = comm.bcast(where, root=0)
        if store is None:
            store = dist.TCPStore(host, port, size, False, timeout)
        return store
    raise CommError("--backend torch: no rendezvous address; set MASTER_ADDR and MASTER_PORT "
                    f"(launched by {info.launcher or 'nothing'}: torchrun and srun set or "
                    "imply them, mpirun uses rank 0's host)")


def launch_attrs(backend: str, env: dict) -> dict:
    """``launcher`` (torchrun, mpirun, srun, '' alone) and, for --backend torch, the
    ``rendezvous`` host:port every rank joined (MASTER_ADDR/PORT, srun's derived ones, or
    rank 0's under mpirun)."""
    out = {"launcher": detect(env).launcher or "", "rendezvous": ""}
    if backend == "torch":
        out["launcher"] = RENDEZVOUS.get("launcher", out["launcher"])
        if RENDEZVOUS.get("host"):
            out["rendezvous"] = f"{RENDEZVOUS['host']}:{RENDEZVOUS['port']}"
    return out
