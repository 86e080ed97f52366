"""Shared pieces of the torch_ft_* benchmarks: a lighthouse, replica-group workers, kills,
and reading the trainer's /train rows.

The lighthouse and the workers are started as tests/comm/test_replicas.py starts them:
``python -m lsgd_hpc.lighthouse --port 0 --failure-timeout T`` (its first stdout line is
``TORCHFT_LIGHTHOUSE=http://...``), then one process per replica group with
``REPLICA_GROUP_ID``, ``NUM_REPLICA_GROUPS`` and ``TORCHFT_LIGHTHOUSE`` in its environment,
each in a session of its own (SIGKILLed from outside by its pid).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import List, Optional, Sequence

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
PY = sys.executable


def torchft_missing() -> Optional[str]:
    """Why the torch_ft benchmarks cannot run here (one line), or None."""
    try:
        import torchft.manager  # noqa: F401
    except ImportError as exc:
        return f"torchft is not installed ({exc}; make venv installs torchft-nightly)"
    return None


def base_env(**extra) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", RUST_LOG="warn",
               PYTHONPATH=str(REPO) + (os.pathsep + os.environ["PYTHONPATH"]
                                       if os.environ.get("PYTHONPATH") else ""))
    for var in [v for v in env if v.startswith(("OMPI_", "PMIX_", "PMI_", "PRTE_", "SLURM_"))]:
        env.pop(var)                             # not under mpirun or srun
    for var in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK",
                "REPLICA_GROUP_ID", "NUM_REPLICA_GROUPS", "TORCHFT_LIGHTHOUSE"):
        env.pop(var, None)
    env.update(extra)
    return env


class Lighthouse:
    """``python -m lsgd_hpc.lighthouse`` on a free port; ``stop()`` sends SIGTERM."""

    def __init__(self, folder: Path, failure_timeout: float):
        self.log = open(folder / "lighthouse.err", "w")
        self.proc = subprocess.Popen(
            [PY, "-m", "lsgd_hpc.lighthouse", "--port", "0", "--failure-timeout",
             str(failure_timeout)], stdout=subprocess.PIPE, stderr=self.log, text=True,
            cwd=REPO, env=base_env(), start_new_session=True)
        line = self.proc.stdout.readline()
        if not line.startswith("TORCHFT_LIGHTHOUSE=http://"):
            self.stop()
            raise RuntimeError(f"the lighthouse did not start: {line!r} "
                               f"{(folder / 'lighthouse.err').read_text()[-400:]}")
        self.address = line.strip().split("=", 1)[1]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


class Workers:
    """n processes, replica groups 0..n-1 (``argv_of(r)`` each), output in folder/worker{r}.out."""

    def __init__(self, folder: Path, lighthouse: str, n: int, argv_of, cwd: Path = REPO):
        self.procs: List[subprocess.Popen] = []
        self.outs: List[Path] = []
        for r in range(n):
            out = folder / f"worker{r}.out"
            with open(out, "w") as f:
                self.procs.append(subprocess.Popen(
                    argv_of(r), stdout=f, stderr=subprocess.STDOUT, cwd=cwd,
                    env=base_env(REPLICA_GROUP_ID=str(r), NUM_REPLICA_GROUPS=str(n),
                                 TORCHFT_LIGHTHOUSE=lighthouse),
                    start_new_session=True))
            self.outs.append(out)

    def wait_for(self, r: int, pattern: str, timeout: float) -> bool:
        """Poll worker r's output for ``pattern`` (a regex, multiline); False past
        ``timeout`` or once a worker has ended."""
        deadline = time.monotonic() + timeout
        rx = re.compile(pattern, re.M)
        while time.monotonic() < deadline:
            if rx.search(self.outs[r].read_text(errors="replace")):
                return True
            if any(p.poll() is not None for p in self.procs):
                return False
            time.sleep(0.02)
        return False

    def restart(self, r: int, argv, lighthouse: str, n: int, cwd: Path = REPO) -> None:
        """Start worker r again as torchrun --max-restarts would (TORCHELASTIC_RESTART_COUNT
        1), its output appended to its file."""
        with open(self.outs[r], "a") as f:
            self.procs[r] = subprocess.Popen(
                argv, stdout=f, stderr=subprocess.STDOUT, cwd=cwd,
                env=base_env(REPLICA_GROUP_ID=str(r), NUM_REPLICA_GROUPS=str(n),
                             TORCHFT_LIGHTHOUSE=lighthouse, TORCHELASTIC_RESTART_COUNT="1"),
                start_new_session=True)

    def kill(self, r: int) -> None:
        """SIGKILL worker r from outside (its process only)."""
        self.procs[r].send_signal(signal.SIGKILL)

    def wait(self, timeout: float) -> List[Optional[int]]:
        """Every worker's exit status; those still running past ``timeout`` are killed
        (their session) and reported as None."""
        deadline = time.monotonic() + timeout
        codes: List[Optional[int]] = []
        for p in self.procs:
            try:
                codes.append(p.wait(timeout=max(0.5, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                codes.append(None)
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait()
        return codes

    def tail(self, r: int, chars: int = 400) -> str:
        text = self.outs[r].read_text(errors="replace")
        return " ".join(line for line in text.splitlines()
                        if not line.startswith("step "))[-chars:]


def train_argv(run_dir: Path, args: Sequence[str]) -> List[str]:
    return [PY, "-m", "lsgd_hpc.train", "--backend", "torch", "--run-dir", str(run_dir),
            "--consensus-every", "0", *args]


def train_rows(run_dir: Path, rank: int) -> dict:
    """/train's step and training_time (and wall_time), /faults' step and recovery_seconds
    of one rank's metrics file (docs/metrics.md)."""
    import h5py
    with h5py.File(run_dir / "metrics" / f"rank{rank:05d}.h5", "r", locking=False) as f:
        out = {c: f["train"][c][()].tolist() for c in ("step", "training_time", "wall_time")}
        if "faults" in f and len(f["faults"]["step"]):
            out["fault_steps"] = f["faults"]["step"][()].tolist()
            out["recovery_seconds"] = f["faults"]["recovery_seconds"][()].tolist()
        else:
            out["fault_steps"], out["recovery_seconds"] = [], []
    return out


def steady_steps_per_s(rows: dict, skip: int) -> float:
    """Steps per second from step ``skip`` to the last row, on the training_time clock
    (evaluations, checkpoints and metric flushes left out; start-up before ``skip``)."""
    steps, t = rows["step"], rows["training_time"]
    i = next(k for k, s in enumerate(steps) if s >= skip)
    return (steps[-1] - steps[i]) / (t[-1] - t[i])


def typical_steps_per_s(rows: dict, skip: int, block: int) -> float:
    """The median over blocks of ``block`` steps (from step ``skip`` on, training_time
    clock) of each block's steps per second: what the steady state runs at, which the other
    jobs of a shared machine disturb less than the whole span's mean (they stretch some
    blocks, not the median). ``block`` a multiple of the method's period (LSGD's tau_G)."""
    import statistics
    at = dict(zip(rows["step"], rows["training_time"]))
    rates = []
    s = skip
    while s + block <= rows["step"][-1]:
        if s in at and s + block in at:
            rates.append(block / (at[s + block] - at[s]))
        s += block
    return statistics.median(rates)
