"""Start real MPI jobs under a timeout: a harness for tests, benchmarks and experiments.

``run_group`` runs a command in a process group of its own and, past its timeout, ends the
whole group (mpirun, its daemons and every rank), so that a hung job fails its caller and
leaves nothing spinning; ``run_mpi`` is the test suite's ``mpirun -np N ...`` on top of it.
No torch, no mpi4py: the jobs import those, this module does not.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from lsgd_hpc.envvars import RANKS_PER_NODE

__all__ = ["SOURCE_ROOT", "mpirun_path", "mpi_env", "mpirun_cmd", "run_group", "session_pids",
           "kill_session", "rank_pids", "run_mpi"]

#: the folder this lsgd_hpc is imported from (the checkout's root): first on the jobs'
#: PYTHONPATH, so that every rank runs this copy
SOURCE_ROOT = Path(__file__).resolve().parents[1]


def mpirun_path() -> str:
    """The mpirun beside this Python (the venv's, from PyPI Open MPI) or else on PATH."""
    venv_bin = Path(sys.executable).parent
    found = shutil.which("mpirun", path=f"{venv_bin}{os.pathsep}{os.environ.get('PATH', '')}")
    if not found:
        raise RuntimeError("no mpirun on PATH or in the venv (run make test, which installs one)")
    return found


def mpi_env(extra: dict | None = None) -> dict:
    """This process's environment for an mpirun job: root allowed, one thread per rank, this
    lsgd_hpc first on PYTHONPATH, oversubscription on, ranks that wait yield their core;
    ``extra`` on top."""
    env = dict(os.environ)
    env.update({
        "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
        "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": f"{SOURCE_ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}",
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",
        # Small machines: no slot accounting, no attempt to bind cores.
        "OMPI_MCA_rmaps_base_oversubscribe": "1",
    })
    # A rank waiting in MPI yields its core: the ranks of a test job share the cores with
    # each other and with the suite's other worker, and Open MPI only yields by itself when
    # a job has more ranks than slots (2 ranks, mpirun of the parallel bodies under a loaded
    # machine: 40-42 s against 54-55 s busy-polling). Left as it is when already set.
    env.setdefault("OMPI_MCA_mpi_yield_when_idle", "1")
    env.pop(RANKS_PER_NODE.name, None)
    env.update(extra or {})
    return env


def mpirun_cmd(np_: int, args: list, mpi_args: list | None = None) -> list:
    """``mpirun --oversubscribe --bind-to none -np np_ [mpi_args] args...``."""
    return [mpirun_path(), "--oversubscribe", "--bind-to", "none", "-np", str(np_),
            *(mpi_args or []), *args]


def run_group(cmd: list, env: dict, cwd, timeout: float) -> subprocess.CompletedProcess:
    """Run ``cmd`` in its own process group; past ``timeout`` kill the whole group (mpirun,
    its daemons and every rank), so nothing is left spinning, and return returncode None."""
    p = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout)
        return subprocess.CompletedProcess(cmd, p.returncode, out, err)
    except subprocess.TimeoutExpired:
        # mpirun (prterun) first: it ends its job cleanly on SIGTERM. Ranks live in process
        # groups of their own, so then everything left in the session is killed.
        out, err = "", ""
        try:
            p.send_signal(signal.SIGTERM)
            out, err = p.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        kill_session(p.pid)
        if p.poll() is None:
            p.kill()
            out, err = p.communicate()
        return subprocess.CompletedProcess(cmd, None, out or "", err or "")


def session_pids(sid: int) -> list:
    """The processes of session ``sid`` (read from /proc)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid:   # fields after the name: state ppid pgrp session ...
            pids.append(int(entry))
    return pids


def rank_pids(sid: int) -> dict:
    """World rank -> pid of the Python ranks of the mpirun job in session ``sid`` (read from
    /proc: each rank's ``OMPI_COMM_WORLD_RANK``), to kill a rank from outside as a crash or a
    lost node would."""
    out = {}
    for pid in session_pids(sid):
        try:
            with open(f"/proc/{pid}/environ", "rb") as fh:
                env = fh.read().split(b"\0")
            exe = os.path.basename(os.readlink(f"/proc/{pid}/exe"))
        except OSError:
            continue
        if not exe.startswith("python"):
            continue
        for item in env:
            if item.startswith(b"OMPI_COMM_WORLD_RANK="):
                out[int(item.split(b"=", 1)[1])] = pid
    return out


def kill_session(sid: int) -> None:
    """SIGKILL every process of the session ``sid`` (started with start_new_session)."""
    for pid in session_pids(sid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def run_mpi(np_: int, args: list, timeout: float = 180, env: dict | None = None,
            cwd: str | os.PathLike | None = None, mpi_args: list | None = None,
            check: bool = True) -> subprocess.CompletedProcess:
    """Run ``mpirun -np np_ args...``; a hang past ``timeout`` kills the job and fails
    (AssertionError, with the job's last output), as does a non-zero exit with ``check``."""
    cmd = mpirun_cmd(np_, args, mpi_args)
    proc = run_group(cmd, env=mpi_env(env), cwd=cwd or SOURCE_ROOT, timeout=timeout)
    if proc.returncode is None:
        raise AssertionError(f"mpirun -np {np_} hung for {timeout} s: {' '.join(map(str, args))}"
                             f"\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    if check and proc.returncode != 0:
        raise AssertionError(f"mpirun -np {np_} exited {proc.returncode}\n--- stdout ---\n"
                             f"{proc.stdout[-6000:]}\n--- stderr ---\n{proc.stderr[-6000:]}")
    return proc
