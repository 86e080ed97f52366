"""The run directory: created and checked on every rank before training (make_run_dir), and
the commit of the code that ran (git_sha)."""

from __future__ import annotations

import os
import subprocess

__all__ = ["make_run_dir", "git_sha"]


def make_run_dir(run_dir: str, comm) -> str:
    """Collective: create ``run_dir`` (and its metrics/ and checkpoints/) on every rank that
    sees it; a folder that cannot be made or written stops every rank with one ValueError
    (``run dir X: <why>``), before any training."""
    error = None
    try:
        for sub in ("", "metrics", "checkpoints"):
            os.makedirs(os.path.join(run_dir, sub), exist_ok=True)
        probe = os.path.join(run_dir, "metrics", f".write-test-{comm.rank}")
        with open(probe, "wb") as fh:
            fh.write(b"x")
            fh.flush()
            os.fsync(fh.fileno())
        os.remove(probe)
    except OSError as exc:
        error = f"run dir {run_dir}: cannot create or write it ({exc.strerror or exc})"
    message = comm.agree(error)
    if message:
        raise ValueError(message)
    return run_dir


def git_sha() -> str:
    """The commit of this lsgd_hpc checkout, or "" (an installed copy)."""
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        out = subprocess.run(["git", "-C", here, "rev-parse", "HEAD"], capture_output=True,
                             text=True, timeout=5)
        return out.stdout.strip() if out.returncode == 0 else ""
    except (OSError, subprocess.SubprocessError):
        return ""
