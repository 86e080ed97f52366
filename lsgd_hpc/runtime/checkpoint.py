"""Per-rank checkpoints written atomically, and a pointer to the latest complete set.

Layout: ``RUN_DIR/checkpoints/stepNNNNNNNNN/rankRRRRR.pt`` (one file per rank, torch's zip
format), ``stepNNNNNNNNN/manifest.json`` (written by rank 0 once every rank has saved: step,
world size, every file's size) and ``latest.json`` (a copy of the newest manifest). The
newest ``KEEP`` complete sets stay on disk.

Resuming takes the newest set that is intact: every rank's file present, of the size the
manifest recorded, and ending in a zip end-of-central-directory record (a truncated or
half-copied file fails both). When the newest set is damaged -- a file deleted, truncated by a
full disk, ``latest.json`` itself unreadable -- :func:`latest_checkpoint` falls back to the
previous complete set, and says which newer steps it skipped.
"""

from __future__ import annotations

import json
import os
import time
from typing import Optional

import torch

__all__ = ["Checkpointer", "save_rank", "commit_set", "latest_checkpoint", "load_rank",
           "atomic_write"]

POINTER = "latest.json"
MANIFEST = "manifest.json"
_ZIP_END = b"PK\x05\x06"  # end-of-central-directory signature, the last record of a zip
KEEP = 2  # complete sets kept on disk (the newest, and one before it in case it is damaged)


def _dir(run_dir: str) -> str:
    return os.path.join(run_dir, "checkpoints")


def _set_name(step: int) -> str:
    return f"step{step:09d}"


def _rank_path(run_dir: str, step: int, rank: int) -> str:
    return os.path.join(_dir(run_dir), _set_name(step), f"rank{rank:05d}.pt")


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write(path: str, write) -> None:
    """``write(fh)`` into a temporary file in the same folder, fsync, rename over ``path``."""
    folder = os.path.dirname(path) or "."
    os.makedirs(folder, exist_ok=True)
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "wb") as fh:
        write(fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    _fsync_dir(folder)


def save_rank(run_dir: str, step: int, rank: int, state: dict) -> str:
    path = _rank_path(run_dir, step, rank)
    atomic_write(path, lambda fh: torch.save(state, fh))
    return path


def _write_json(path: str, obj: dict) -> None:
    atomic_write(path, lambda fh: fh.write(json.dumps(obj).encode()))


def _read_json(path: str) -> Optional[dict]:
    try:
        with open(path) as fh:
            obj = json.load(fh)
        obj["step"], obj["world_size"] = int(obj["step"]), int(obj["world_size"])
        return obj
    except (OSError, ValueError, KeyError, TypeError):
        return None


def commit_set(run_dir: str, step: int, world_size: int) -> None:
    """Rank 0, after every rank has saved: record the set's manifest, point ``latest.json``
    at it, and drop all but the newest ``KEEP`` complete sets."""
    folder = os.path.join(_dir(run_dir), _set_name(step))
    missing = [r for r in range(world_size)
               if not os.path.isfile(_rank_path(run_dir, step, r))]
    if missing:
        raise RuntimeError(f"checkpoint step {step}: ranks {missing} did not save")
    sizes = [os.path.getsize(_rank_path(run_dir, step, r)) for r in range(world_size)]
    manifest = {"step": step, "world_size": world_size, "folder": _set_name(step),
                "sizes": sizes}
    _write_json(os.path.join(folder, MANIFEST), manifest)
    _write_json(os.path.join(_dir(run_dir), POINTER), manifest)
    # Sets after this step belong to a timeline abandoned by resuming from an older set.
    complete = sorted(d for d in os.listdir(_dir(run_dir)) if d.startswith("step")
                      and d <= _set_name(step)
                      and os.path.isfile(os.path.join(_dir(run_dir), d, MANIFEST)))
    keep = set(complete[-KEEP:])
    for old in sorted(d for d in os.listdir(_dir(run_dir)) if d.startswith("step")):
        if old in keep:
            continue
        old_path = os.path.join(_dir(run_dir), old)
        for name in os.listdir(old_path):
            os.remove(os.path.join(old_path, name))
        os.rmdir(old_path)


def _intact(run_dir: str, pointer: dict) -> bool:
    """Every rank's file is there, has the recorded size, and ends like a whole zip file."""
    sizes = pointer.get("sizes")
    for r in range(pointer["world_size"]):
        path = _rank_path(run_dir, pointer["step"], r)
        try:
            size = os.path.getsize(path)
            if sizes is not None and size != int(sizes[r]):
                return False
            with open(path, "rb") as fh:
                fh.seek(max(0, size - 65557))   # the record is in the last 64 KiB + 22 bytes
                if _ZIP_END not in fh.read():
                    return False
        except (OSError, IndexError, TypeError, ValueError):
            return False
    return True


def latest_checkpoint(run_dir: str) -> Optional[dict]:
    """The newest intact complete set as ``{"step", "world_size", "folder", ...}``, or None.

    ``latest.json`` first, then every set that has a manifest, newest first. When newer sets
    were passed over as damaged, ``"skipped"`` lists their steps.
    """
    folder = _dir(run_dir)
    candidates = []
    pointer = _read_json(os.path.join(folder, POINTER))
    if pointer is not None:
        candidates.append(pointer)
    try:
        names = sorted((d for d in os.listdir(folder) if d.startswith("step")), reverse=True)
    except OSError:
        names = []
    for name in names:
        manifest = _read_json(os.path.join(folder, name, MANIFEST))
        if manifest is not None and manifest["step"] not in [c["step"] for c in candidates]:
            candidates.append(manifest)
    candidates.sort(key=lambda c: c["step"], reverse=True)
    skipped = []
    for c in candidates:
        if _intact(run_dir, c):
            out = {"step": c["step"], "world_size": c["world_size"],
                   "folder": c.get("folder", _set_name(c["step"]))}
            if skipped:
                out["skipped"] = skipped
            return out
        skipped.append(c["step"])
    return None


def load_rank(run_dir: str, step: int, rank: int) -> dict:
    # weights_only: a checkpoint is data, never code to run.
    return torch.load(_rank_path(run_dir, step, rank), map_location="cpu", weights_only=True)


# -- the building block of a user's loop ----------------------------------------------------
class Checkpointer:
    """Checkpoint and exact resume of everything named: ``Checkpointer(run_dir, comm,
    model=model, optimizer=opt, method=method, sampler=sampler, metrics=writer)``; each
    object has ``state_dict``/``load_state_dict``. One file per rank, written atomically,
    and a pointer to the newest complete set (a damaged newest set falls back to the one
    before). The RNG states are saved too, so a resumed run continues bit for bit."""

    def __init__(self, run_dir: str, comm, **objects):
        self.run_dir, self.comm, self.objects = run_dir, comm, objects
        #: steps of newer sets that restore() found damaged or incomplete and passed over
        self.skipped: list = []
        bad = [k for k, v in objects.items()
               if not (hasattr(v, "state_dict") and hasattr(v, "load_state_dict"))]
        if bad:
            raise ValueError(f"Checkpointer: {', '.join(bad)} has no state_dict/load_state_dict")

    def _label(self) -> int:
        method = self.objects.get("method")
        step = int(method.steps) if method is not None else 0
        # ranks of an asynchronous method have taken different numbers of steps
        return max(self.comm.allgather_object(step))

    def save(self) -> int:
        """Collective: save every object; returns the set's step label. With
        ``on_failure="shrink"`` a rank lost during the save makes the survivors recover and
        save again, numbered as the new world (the lowest survivor commits)."""
        ft = getattr(self.comm, "_ft", None)
        if ft is None:
            return self._save()
        return ft.transaction(self._save)

    def _save(self) -> int:
        t0 = time.perf_counter()
        state = {"objects": {k: v.state_dict() for k, v in self.objects.items()},
                 "torch_rng": torch.get_rng_state(), "comm_stats": self.comm.stats.state_dict()}
        if torch.cuda.is_available() and self.comm.device.type == "cuda":
            state["cuda_rng"] = torch.cuda.get_rng_state(self.comm.device)
        metrics = self.objects.get("metrics")
        label = self._label()
        save_rank(self.run_dir, label, self.comm.rank, state)
        if metrics is not None:
            metrics.flush()           # rows up to this step are on disk before the pointer
        self.comm.barrier()
        if self.comm.rank == 0:
            commit_set(self.run_dir, label, self.comm.size)
        self.comm.barrier()
        if metrics is not None:
            metrics.checkpoint_seconds += time.perf_counter() - t0
        return label

    def restore(self) -> Optional[int]:
        """Collective: load the newest complete set, if any; returns its step label (None:
        nothing to resume, a fresh start). Ranks that disagree on it stop with ValueError."""
        pointer = latest_checkpoint(self.run_dir)
        seen = self.comm.allgather_object(None if pointer is None else pointer["step"])
        if len(set(seen)) > 1:
            raise ValueError(f"checkpoints in {self.run_dir}: the ranks see different newest "
                             f"sets {sorted(set(map(str, seen)))}; is the folder shared?")
        if pointer is None:
            return None
        if int(pointer["world_size"]) != self.comm.size:
            raise ValueError(f"checkpoint in {self.run_dir} was written by "
                             f"{pointer['world_size']} ranks, this job has {self.comm.size}")
        self.skipped = list(pointer.get("skipped", []))
        state = load_rank(self.run_dir, int(pointer["step"]), self.comm.rank)
        missing = sorted(set(self.objects) - set(state["objects"]))
        if missing:
            raise ValueError(f"checkpoint in {self.run_dir} (step {pointer['step']}) holds no "
                             f"{', '.join(missing)} (it holds {', '.join(state['objects'])})")
        for k, v in self.objects.items():
            v.load_state_dict(state["objects"][k])
        torch.set_rng_state(state["torch_rng"])
        if "cuda_rng" in state and self.comm.device.type == "cuda":
            torch.cuda.set_rng_state(state["cuda_rng"], self.comm.device)
        self.comm.stats.load_state_dict(state["comm_stats"])
        sampler, method = self.objects.get("sampler"), self.objects.get("method")
        if sampler is not None and method is not None:
            sampler.set_step(method.steps)
        return int(pointer["step"])
