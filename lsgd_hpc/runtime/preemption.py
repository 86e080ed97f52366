"""Preemption under SLURM: requeue the job after the checkpoint of an agreed stop, so that it
comes back with the same id and resumes."""

from __future__ import annotations

import os
import subprocess

from lsgd_hpc.runtime.signals import StopSignals

__all__ = ["requeue", "scontrol_requeue"]


def requeue(comm, stop: StopSignals) -> bool:
    """Collective, after the checkpoint of an agreed stop: under SLURM, when any rank got the
    time-limit warning, rank 0 runs ``scontrol requeue $SLURM_JOB_ID`` (the job comes back
    with the same id and resumes). True on every rank when the job was requeued."""
    warned = comm.any_true(stop.warned)
    ok = False
    job = os.environ.get("SLURM_JOB_ID")
    if comm.rank == 0 and warned and job:
        ok = scontrol_requeue(job)
    return bool(comm.allgather_object(ok)[0])


def scontrol_requeue(job: str) -> bool:
    """``scontrol requeue JOB`` (the job comes back with the same id and resumes from its
    checkpoint); says what happened in one line. True when SLURM took it."""
    try:
        res = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True,
                             timeout=60)
    except (OSError, subprocess.SubprocessError) as exc:
        print(f"[lsgd_hpc] scontrol requeue {job} failed: {exc}", flush=True)
        return False
    if res.returncode < 0:
        # A requeue makes SLURM end the job's steps at once, and scontrol runs inside this
        # step: the requeue's own signal can end it before it returns.
        print(f"[lsgd_hpc] scontrol requeue {job}: sent; SLURM ended this step (signal "
              f"{-res.returncode}) before scontrol returned, as it does when it requeues "
              "the job", flush=True)
        return True
    print(f"[lsgd_hpc] scontrol requeue {job}: "
          f"{'ok' if res.returncode == 0 else res.stderr.strip()}", flush=True)
    return res.returncode == 0
