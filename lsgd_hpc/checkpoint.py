"""Per-rank checkpoints written atomically, and a pointer to the latest complete set."""

from __future__ import annotations

import json
import os
from typing import Optional

import torch

__all__ = ["save_rank", "commit_set", "latest_checkpoint", "load_rank", "atomic_write"]

POINTER = "latest.json"
KEEP = 2  # complete sets kept on disk (the newest, and one before it in case it is damaged)


def _dir(run_dir: str) -> str:
    return os.path.join(run_dir, "checkpoints")


def _rank_path(run_dir: str, step: int, rank: int) -> str:
    return os.path.join(_dir(run_dir), f"step{step:09d}", f"rank{rank:05d}.pt")


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


def commit_set(run_dir: str, step: int, world_size: int) -> None:
    """Rank 0, after every rank has saved: point ``latest.json`` at this set, drop old sets."""
    folder = os.path.dirname(_rank_path(run_dir, step, 0))
    missing = [r for r in range(world_size)
               if not os.path.isfile(_rank_path(run_dir, step, r))]
    if missing:
        raise RuntimeError(f"checkpoint step {step}: ranks {missing} did not save")
    pointer = {"step": step, "world_size": world_size, "folder": os.path.basename(folder)}
    atomic_write(os.path.join(_dir(run_dir), POINTER),
                 lambda fh: fh.write(json.dumps(pointer).encode()))
    sets = sorted(d for d in os.listdir(_dir(run_dir)) if d.startswith("step"))
    for old in sets[:-KEEP]:
        old_path = os.path.join(_dir(run_dir), old)
        for name in os.listdir(old_path):
            os.remove(os.path.join(old_path, name))
        os.rmdir(old_path)


def latest_checkpoint(run_dir: str) -> Optional[dict]:
    """The pointer of the latest complete set, or None (no pointer, or its files are gone)."""
    path = os.path.join(_dir(run_dir), POINTER)
    try:
        with open(path) as fh:
            pointer = json.load(fh)
        step, world = int(pointer["step"]), int(pointer["world_size"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not all(os.path.isfile(_rank_path(run_dir, step, r)) for r in range(world)):
        return None
    return pointer


def load_rank(run_dir: str, step: int, rank: int) -> dict:
    # weights_only: a checkpoint is data, never code to run.
    return torch.load(_rank_path(run_dir, step, rank), map_location="cpu", weights_only=True)
