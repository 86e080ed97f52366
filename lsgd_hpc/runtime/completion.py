"""The run's completion record, ``RUN_DIR/complete.json``: written once at the end of a run,
by rank 0 of the world that finished it (the lowest survivor after lost ranks), after the last
checkpoint and metrics flush. Its absence means the run did not finish: its ranks crashed or
were killed. ``mpirun --with-ft ulfm`` (``--on-failure shrink``) exits 0 whatever became of
the ranks, so this file, not the launcher's exit status, says whether a job did its work
(``python -m lsgd_hpc.summary RUN_DIR --check``; the SLURM templates check it).

The record (JSON object; docs/metrics.md, "The run directory")::

    status        "complete" (the step budget done) or "stopped" (stopped on purpose:
                  SIGUSR1/SIGTERM, a checkpoint, then exit; the run goes on after --resume)
    step          the last step done (the checkpoint's, for "stopped"); null when unknown
    total_steps   the step budget
    world_size    ranks at the end; initial_size: ranks at the start
    lost_ranks    the ranks lost on the way (initial numbering, sorted; [] when none)
    requeued      whether the job was requeued under SLURM (a "stopped" run)
    exit_status   the status the trainer exits with (0; 143 for a stop that was not requeued)
    wall_time     when the record was written (ISO 8601, UTC)
    seconds       the seconds this attempt ran (start to record)

Fields of your own may be added (``write_completion(..., dataset="x")``). Pure JSON and the
standard library: the offline tools (``lsgd_hpc.analysis``) read it without torch or MPI.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
from typing import Any, Optional

__all__ = ["COMPLETION_FILE", "STATUSES", "write_completion", "read_completion",
           "clear_completion", "completion_path"]

#: the record's file name in the run directory
COMPLETION_FILE = "complete.json"
#: what ``status`` may say
STATUSES = ("complete", "stopped")


def completion_path(run_dir: str | os.PathLike) -> str:
    return os.path.join(os.fspath(run_dir), COMPLETION_FILE)


def write_completion(run_dir: str | os.PathLike, comm=None, *, status: str = "complete",
                     step: Optional[int] = None, total_steps: Optional[int] = None,
                     **fields: Any) -> Optional[dict]:
    """Write ``RUN_DIR/complete.json`` atomically (a temporary file, then ``os.replace``).

    Call it at the end of the run, after the last checkpoint and ``metrics.close()``. With
    ``comm`` (what ``lsgd_hpc.init`` returns), call it on every rank: rank 0 writes and the
    others return None, and ``world_size``, ``initial_size`` and ``lost_ranks`` come from it
    unless given. ``fields``: those of the module docstring, and any of your own
    (JSON-serialisable). ``wall_time`` defaults to now. Returns the record written."""
    if status not in STATUSES:
        raise ValueError(f"write_completion: status {status!r}: one of {', '.join(STATUSES)}")
    if comm is not None and comm.rank != 0:
        return None
    record: dict[str, Any] = {"status": status,
                              "step": None if step is None else int(step),
                              "total_steps": None if total_steps is None else int(total_steps)}
    if comm is not None:
        record["world_size"] = int(comm.size)
        record["initial_size"] = int(getattr(comm, "initial_size", comm.size))
        record["lost_ranks"] = sorted(int(r) for r in getattr(comm, "lost_ranks", ()))
    record.update(fields)
    record.setdefault("lost_ranks", [])
    record["lost_ranks"] = sorted(int(r) for r in record["lost_ranks"])
    if "world_size" in record and "initial_size" not in record:
        record["initial_size"] = record["world_size"]
    record.setdefault("requeued", False)
    record.setdefault("exit_status", 0 if status == "complete" or record["requeued"] else 143)
    record.setdefault("wall_time", _dt.datetime.now(_dt.timezone.utc).isoformat())
    path = completion_path(run_dir)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as fh:
        json.dump(record, fh, indent=1, sort_keys=True)
        fh.write("\n")
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    return record


def read_completion(run_dir: str | os.PathLike) -> Optional[dict]:
    """The record of ``run_dir``, or None when there is none. A file that is not a JSON
    object (damaged) reads as ``{"status": "unreadable", "error": why}``."""
    path = completion_path(run_dir)
    try:
        with open(path) as fh:
            record = json.load(fh)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        return {"status": "unreadable", "error": f"{path}: {exc}"}
    if not isinstance(record, dict):
        return {"status": "unreadable", "error": f"{path}: not a JSON object"}
    return record


def clear_completion(run_dir: str | os.PathLike) -> bool:
    """Remove a record left by an earlier attempt (at the start of a run, so that a record
    always describes the latest one). True when there was one."""
    try:
        os.remove(completion_path(run_dir))
        return True
    except FileNotFoundError:
        return False
