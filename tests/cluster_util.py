"""The emulated cluster of scripts/cluster.sh, seen from the tests: bring-up and tear-down for
the test session, SLURM jobs (submit, wait, read their records) and the processes on nodes.

One cluster serves the whole session. ``LSGD_CLUSTER=NAME`` (set by .ci/run) names one that
is already up: it is used and left up. Otherwise, as root, the session brings up its own
(a name and a subnet of its own, so it never meets another cluster on the machine) and takes
it down at the end; without root, or where namespaces are not permitted, the tests that need
it skip, naming what is missing.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from mpi_util import REPO, mpi_env

CLUSTER_SH = REPO / "scripts" / "cluster.sh"
USE_ENV = "LSGD_CLUSTER"
#: States a job record ends in (a requeued job's intermediate record says PENDING).
FINAL_STATES = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
                "BOOT_FAIL", "DEADLINE", "PREEMPTED")
_NO_PERMISSION = ("Operation not permitted", "Permission denied")


@dataclass
class Cluster:
    name: str
    state: Path
    nodes: list
    addrs: list
    subnet: str
    veths: list
    agent: str
    slurm: bool
    slurm_conf: str = ""
    jobcomp: Path = Path("/nonexistent")
    why_no_slurm: str = ""
    up_seconds: float = 0.0          # how long `cluster.sh up` took (0 when reused)
    extra: dict = field(default_factory=dict)

    @classmethod
    def from_env(cls, text: str, **kw) -> "Cluster":
        kv = {}
        for line in text.splitlines():
            key, _, value = line.partition("=")
            kv[key] = value.strip("'")
        slurm = kv.get("CLUSTER_SLURM") == "1"
        return cls(name=kv["CLUSTER_NAME"], state=Path(kv["CLUSTER_STATE"]),
                   nodes=kv["CLUSTER_NODES"].split(), addrs=kv["CLUSTER_ADDRS"].split(),
                   subnet=kv["CLUSTER_SUBNET"], veths=kv["CLUSTER_VETHS"].split(),
                   agent=kv["CLUSTER_AGENT"], slurm=slurm,
                   slurm_conf=kv.get("SLURM_CONF", ""),
                   jobcomp=Path(kv.get("CLUSTER_JOBCOMP", "/nonexistent")), **kw)

    # -- environment and commands -------------------------------------------------------------
    def env(self, extra: dict | None = None) -> dict:
        """A login shell's environment for this cluster: the venv first on PATH, the
        repository on PYTHONPATH, SLURM_CONF; nothing of any SLURM job this runs inside."""
        env = mpi_env()
        for key in list(env):
            if key.startswith(("SLURM_", "SRUN_", "SBATCH_", "SALLOC_", "OMPI_MCA_", "PRTE_MCA_")):
                del env[key]
        env.update({"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
                    "LSGD_PYTHON": sys.executable, "HDF5_USE_FILE_LOCKING": "FALSE"})
        if self.slurm:
            env["SLURM_CONF"] = self.slurm_conf
        # Open MPI's han collectives hang across the emulated nodes (one machine): off, as
        # `cluster.sh env` says, for mpirun inside an allocation (jobs inherit it).
        env["OMPI_MCA_coll"] = "^han,xhc,acoll"
        env.update({k: str(v) for k, v in (extra or {}).items()})
        return env

    def script(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
        return subprocess.run([str(CLUSTER_SH), *args, "--name", self.name],
                              capture_output=True, text=True, timeout=timeout)

    def mpirun_args(self, ranks_per_node: int) -> list:
        proc = self.script("mpirun-args", "--ranks-per-node", str(ranks_per_node))
        assert proc.returncode == 0, proc.stderr
        return proc.stdout.split()

    def on_node(self, node: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
        """Run a command inside a node (its network, host name and mounts)."""
        return subprocess.run([str(CLUSTER_SH), "exec", "--name", self.name, node, *args],
                              capture_output=True, text=True, timeout=timeout)

    # -- SLURM --------------------------------------------------------------------------------
    def slurm_cmd(self, *args: str, env: dict | None = None, cwd=REPO, timeout: float = 60,
                  check: bool = True) -> subprocess.CompletedProcess:
        proc = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout,
                              env=env or self.env(), cwd=cwd)
        if check:
            assert proc.returncode == 0, f"{' '.join(args)}: exit {proc.returncode}\n" \
                                         f"{proc.stdout}{proc.stderr}"
        return proc

    def sbatch(self, *args: str, env: dict | None = None, cwd=REPO) -> int:
        """Submit as a user would (from the repository by default); the job id."""
        proc = self.slurm_cmd("sbatch", "--parsable", *args, env=env, cwd=cwd)
        return int(proc.stdout.strip().split(";")[0])

    def records(self, job_id: int | None = None) -> list:
        """The job completion log (slurm.conf JobCompType=jobcomp/filetxt): one dict per
        record, in order. A requeue leaves a record (state PENDING) and the job another one
        when it ends; each array task has a record of its own (ArrayJobId, ArrayTaskId)."""
        if not self.jobcomp.exists():
            return []
        out = []
        for line in self.jobcomp.read_text().splitlines():
            rec = dict(re.findall(r"(\w+)=(\S*)", line))
            if job_id is None or rec.get("JobId") == str(job_id) or \
                    rec.get("ArrayJobId") == str(job_id):
                out.append(rec)
        return out

    def wait_end(self, job_id: int, timeout: float, tasks: int = 1) -> list:
        """Wait until the job (or ``tasks`` tasks of an array job) ended; their last records.
        Past ``timeout`` the job is cancelled and the test fails (a hang is a failure)."""
        deadline = time.monotonic() + timeout
        while True:
            done = {}
            for rec in self.records(job_id):
                if rec.get("JobState") in FINAL_STATES:
                    done[rec["JobId"]] = rec
            # Ended, and no longer completing: its processes are gone (SLURM writes the
            # record when it ends the job, while the ranks may still be checkpointing).
            if len(done) >= tasks and not self.slurm_cmd(
                    "squeue", "-h", "-j", str(job_id), check=False).stdout.strip():
                return list(done.values())
            if time.monotonic() > deadline:
                show = self.slurm_cmd("scontrol", "show", "job", str(job_id), check=False)
                self.slurm_cmd("scancel", str(job_id), check=False)
                raise AssertionError(f"job {job_id} did not end in {timeout} s (cancelled)\n"
                                     f"{show.stdout}{show.stderr}")
            time.sleep(0.5)

    def job_info(self, job_id: int) -> dict:
        proc = self.slurm_cmd("scontrol", "-o", "show", "job", str(job_id), check=False)
        return dict(re.findall(r"(\w+)=(\S*)", proc.stdout))

    # -- processes ----------------------------------------------------------------------------
    @staticmethod
    def rank_pids(job_id: int) -> dict:
        """rank -> pid of the python ranks of a job (python -m lsgd_hpc.train processes whose
        environment has this SLURM_JOB_ID), on any node: nodes share the machine's pids."""
        out = {}
        for d in Path("/proc").iterdir():
            if not d.name.isdigit():
                continue
            try:
                argv = (d / "cmdline").read_bytes().split(b"\0")
                if b"lsgd_hpc.train" not in argv or argv[0].endswith(b"bash"):
                    continue            # (a shell that starts the trainer again: not a rank)
                environ = (d / "environ").read_bytes().split(b"\0")
            except OSError:
                continue
            env = dict(e.decode(errors="replace").partition("=")[::2] for e in environ if b"=" in e)
            if env.get("SLURM_JOB_ID") != str(job_id):
                continue
            # (torchft's workers, one srun task each: their replica group's number)
            rank = env.get("OMPI_COMM_WORLD_RANK") or env.get("PMIX_RANK") or \
                env.get("REPLICA_GROUP_ID")
            if rank is not None and rank.isdigit():
                out[int(rank)] = int(d.name)
        return out


def signal_mask(pid: int, field_name: str = "SigCgt") -> int:
    """A process's mask of caught (SigCgt) or blocked (SigBlk) signals, from /proc."""
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith(field_name + ":"):
                return int(line.split()[1], 16)
    return 0


def catches(pid: int, sig: int) -> bool:
    try:
        return bool(signal_mask(pid) & (1 << (sig - 1)))
    except OSError:
        return False


def parse_time(stamp: str) -> float:
    """A SLURM time stamp (local time, second resolution) -> seconds since the epoch."""
    return time.mktime(time.strptime(stamp, "%Y-%m-%dT%H:%M:%S"))


def free_subnet() -> str:
    """An A.B.C of 10.77-79.X.0/24 that no address or route here uses (X from the pid, so
    concurrent sessions tend to pick different ones)."""
    used = subprocess.run(["ip", "-4", "addr"], capture_output=True, text=True).stdout + \
        subprocess.run(["ip", "-4", "route"], capture_output=True, text=True).stdout
    start = os.getpid() % 200
    for i in range(600):
        second, third = 77 + i // 200, 20 + (start + i) % 200
        if f"10.{second}.{third}." not in used:
            return f"10.{second}.{third}"
    raise RuntimeError("no free 10.77-79.X.0/24 subnet")


def _missing_requirements() -> str:
    if os.geteuid() != 0:
        return (f"not root (euid {os.geteuid()}): the emulated cluster (network namespaces, "
                "SLURM daemons) needs root")
    missing = [b for b in ("ip", "tc", "unshare", "nsenter", "bash") if shutil.which(b) is None]
    if missing:
        return f"no {', '.join(missing)} on PATH (Debian: apt-get install iproute2 util-linux)"
    return ""


@contextlib.contextmanager
def session_cluster():
    """The session's cluster: the one named by $LSGD_CLUSTER, else one brought up here (and
    taken down at the end), else pytest.skip naming what is missing."""
    name = os.environ.get(USE_ENV)
    if name:
        proc = subprocess.run([str(CLUSTER_SH), "env", "--name", name], capture_output=True,
                              text=True, timeout=60)
        if proc.returncode != 0:
            raise RuntimeError(f"{USE_ENV}={name}, but no such cluster is up: {proc.stderr}")
        status = subprocess.run([str(CLUSTER_SH), "status", "--name", name],
                                capture_output=True, text=True, timeout=60)
        if status.returncode != 0:
            raise RuntimeError(f"cluster {name} is not healthy:\n{status.stdout}{status.stderr}")
        yield Cluster.from_env(proc.stdout)
        return
    why = _missing_requirements()
    if why:
        pytest.skip(why)
    name = f"t{os.getpid() % 100000}"
    up = [str(CLUSTER_SH), "up", "--name", name, "--subnet", free_subnet(), "--nodes", "2"]
    t0 = time.monotonic()
    proc = subprocess.run(up, capture_output=True, text=True, timeout=900)
    why_no_slurm = ""
    if proc.returncode != 0:
        if any(s in proc.stderr for s in _NO_PERMISSION):
            pytest.skip(f"scripts/cluster.sh up not permitted here: {proc.stderr.strip()}")
        # No SLURM (packages not installable, say): the namespaces alone still serve.
        why_no_slurm = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else \
            f"scripts/cluster.sh up exited {proc.returncode}"
        t0 = time.monotonic()
        proc = subprocess.run(up + ["--no-slurm"], capture_output=True, text=True, timeout=300)
        if proc.returncode != 0:
            raise RuntimeError(f"scripts/cluster.sh up --no-slurm failed:\n{proc.stderr}")
    took = time.monotonic() - t0
    try:
        env = subprocess.run([str(CLUSTER_SH), "env", "--name", name], capture_output=True,
                             text=True, timeout=60, check=True).stdout
        cl = Cluster.from_env(env, why_no_slurm=why_no_slurm, up_seconds=took)
        print(f"\n[cluster] {name} up in {took:.1f} s", file=sys.stderr)
        yield cl
    finally:
        subprocess.run([str(CLUSTER_SH), "down", "--name", name], capture_output=True,
                       text=True, timeout=300)


def kill_quietly(pid: int, sig: int = signal.SIGKILL) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass
