"""Start real MPI jobs from the test suite: mpirun under a timeout, so a hang fails the test."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def mpirun_path() -> str:
    venv_bin = Path(sys.executable).parent
    found = shutil.which("mpirun", path=f"{venv_bin}{os.pathsep}{os.environ.get('PATH', '')}")
    if not found:
        raise RuntimeError("no mpirun on PATH or in the venv (run make test, which installs one)")
    return found


def mpi_env(extra: dict | None = None) -> dict:
    env = dict(os.environ)
    env.update({
        "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
        "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": f"{REPO}{os.pathsep}{env.get('PYTHONPATH', '')}",
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",
        # Small machines: no slot accounting, no attempt to bind cores.
        "OMPI_MCA_rmaps_base_oversubscribe": "1",
    })
    env.pop("LSGD_HPC_RANKS_PER_NODE", None)
    env.update(extra or {})
    return env


def mpirun_cmd(np_: int, args: list, mpi_args: list | None = None) -> list:
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
    """Run ``mpirun -np np_ args...``; a hang past ``timeout`` kills the job and fails."""
    cmd = mpirun_cmd(np_, args, mpi_args)
    proc = run_group(cmd, env=mpi_env(env), cwd=cwd or REPO, timeout=timeout)
    if proc.returncode is None:
        raise AssertionError(f"mpirun -np {np_} hung for {timeout} s: {' '.join(map(str, args))}"
                             f"\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    if check and proc.returncode != 0:
        raise AssertionError(f"mpirun -np {np_} exited {proc.returncode}\n--- stdout ---\n"
                             f"{proc.stdout[-6000:]}\n--- stderr ---\n{proc.stderr[-6000:]}")
    return proc


def horovod_available() -> bool:
    """True when ``horovod.torch`` imports; False only when Horovod is not installed.

    mpi4py is imported first, as the Horovod backend does (Horovod must initialise over the
    MPI that mpi4py set up). Any other failure -- a broken build, an import-order problem, a
    missing symbol -- is raised, so that it fails loudly instead of skipping the backend's tests.
    """
    from mpi4py import MPI  # noqa: F401
    try:
        import horovod.torch  # noqa: F401
    except ModuleNotFoundError as exc:
        if exc.name in ("horovod", "horovod.torch"):
            return False
        raise
    return True
