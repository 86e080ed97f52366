"""Per-rank checkpoints written atomically, and a pointer to the latest complete set.

Layout: ``RUN_DIR/checkpoints/stepNNNNNNNNN/rankRRRRR.pt`` (one file per rank, torch's zip
format), ``stepNNNNNNNNN/manifest.json`` (written by rank 0 once every rank has saved: step,
world size, every file's size) and ``latest.json`` (a copy of the newest manifest). The
newest ``KEEP`` complete sets stay on disk.

A set written by the survivors of lost ranks (``on_failure="shrink"``) also records who wrote
it: ``ranks`` (their ranks as numbered when the job started, one per file) and
``initial_size`` (that job's size). It is resumed by a job of the full size, in which the lost
ranks rejoin (see :meth:`Checkpointer.restore`).

Resuming takes the newest set that is intact: every rank's file present, of the size the
manifest recorded, and ending in a zip end-of-central-directory record (a truncated or
half-copied file fails both). When the newest set is damaged -- a file deleted, truncated by a
full disk, ``latest.json`` itself unreadable -- :func:`latest_checkpoint` falls back to the
previous complete set, and says which newer steps it skipped.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from typing import Optional

import torch

from lsgd_hpc.comm.injection import injection_point

__all__ = ["Checkpointer", "Rejoin", "save_rank", "commit_set", "latest_checkpoint",
           "load_rank", "atomic_write", "resume_problem"]

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


def commit_set(run_dir: str, step: int, world_size: int, ranks: Optional[list] = None,
               initial_size: Optional[int] = None) -> None:
    """Rank 0, after every rank has saved: record the set's manifest, point ``latest.json``
    at it, and drop all but the newest ``KEEP`` complete sets. ``ranks``/``initial_size``:
    a set of survivors (their initial ranks, file by file, and the job's first size)."""
    folder = os.path.join(_dir(run_dir), _set_name(step))
    missing = [r for r in range(world_size)
               if not os.path.isfile(_rank_path(run_dir, step, r))]
    if missing:
        raise RuntimeError(f"checkpoint step {step}: ranks {missing} did not save")
    sizes = [os.path.getsize(_rank_path(run_dir, step, r)) for r in range(world_size)]
    manifest = {"step": step, "world_size": world_size, "folder": _set_name(step),
                "sizes": sizes}
    if ranks is not None:
        if len(ranks) != world_size or initial_size is None:
            raise ValueError(f"checkpoint step {step}: {len(ranks)} writer ranks for "
                             f"{world_size} files, initial size {initial_size}")
        manifest.update(ranks=[int(r) for r in ranks], initial_size=int(initial_size))
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
            if c.get("ranks") is not None:          # written by the survivors of lost ranks
                out.update(ranks=[int(r) for r in c["ranks"]],
                           initial_size=int(c["initial_size"]))
            if skipped:
                out["skipped"] = skipped
            return out
        skipped.append(c["step"])
    return None


def resume_problem(run_dir: str, pointer: dict, size: int) -> Optional[str]:
    """Why a job of ``size`` ranks cannot resume the set ``pointer`` (latest_checkpoint's),
    or None. A set written by ``world_size`` ranks is resumed by that many; a set of
    survivors only by a job of the size the lost ranks' job started with (they rejoin)."""
    written = int(pointer["world_size"])
    if pointer.get("ranks") is None:
        if size == written:
            return None
        return (f"the checkpoint in {run_dir} was written by {written} ranks; this job has "
                f"{size} (resume with the same rank count)")
    full = int(pointer["initial_size"])
    if size == full:
        return None
    return (f"the checkpoint in {run_dir} was written by the {written} ranks that survived "
            f"the loss of {full - written} of {full}; resume it with {full} ranks (the lost "
            f"ranks rejoin), this job has {size}")


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
        #: after restore() of a survivors' set at full size: the ranks that rejoined
        self.rejoined: list = []
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
        ft = getattr(self.comm, "fault_tolerance", None)
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
        injection_point("save", label, self.comm)      # (testing: a rank lost mid-save)
        if metrics is not None:
            metrics.flush()           # rows up to this step are on disk before the pointer
        self.comm.barrier()
        if self.comm.rank == 0:
            # after lost ranks: who wrote which file (ranks as numbered at the start)
            full = getattr(self.comm, "initial_size", self.comm.size)
            survivors = full != self.comm.size
            commit_set(self.run_dir, label, self.comm.size,
                       ranks=list(self.comm.initial_ranks) if survivors else None,
                       initial_size=full if survivors else None)
        self.comm.barrier()
        if metrics is not None:
            metrics.checkpoint_seconds += time.perf_counter() - t0
        return label

    def restore(self) -> Optional[int]:
        """Collective: load the newest complete set, if any; returns its step label (None:
        nothing to resume, a fresh start). Ranks that disagree on it stop with ValueError.

        A set written by the survivors of lost ranks is resumed at the job's full size: a
        survivor loads its own file; a rank that was lost *rejoins*: it loads the lowest
        survivor's file, with a fresh optimizer state, and the method (when one is named)
        then gives it the parameters of its kind -- the global leader's (LeaderSGD), the
        replica with its optimizer state (AllreduceSGD), the centre (EASGD), x_prev (DiLoCo),
        x_old (SlowMo), the lowest survivor's (local SGD, gossip). ``rejoined`` lists those
        ranks afterwards. See docs/library.md, "Surviving lost ranks"."""
        pointer = latest_checkpoint(self.run_dir)
        seen = self.comm.allgather_object(None if pointer is None else pointer["step"])
        if len(set(seen)) > 1:
            raise ValueError(f"checkpoints in {self.run_dir}: the ranks see different newest "
                             f"sets {sorted(set(map(str, seen)))}; is the folder shared?")
        if pointer is None:
            return None
        problem = resume_problem(self.run_dir, pointer, self.comm.size)
        if problem:
            raise ValueError(problem)
        self.skipped = list(pointer.get("skipped", []))
        step = int(pointer["step"])
        writers = pointer.get("ranks")
        rejoin = None
        if writers is None:
            state = load_rank(self.run_dir, step, self.comm.rank)
        else:
            me = self.comm.rank
            rejoin = Rejoin(step, list(writers),
                            [r for r in range(self.comm.size) if r not in writers],
                            me in writers)
            state = load_rank(self.run_dir, step, writers.index(me) if rejoin.own else 0)
        missing = sorted(set(self.objects) - set(state["objects"]))
        if missing:
            raise ValueError(f"checkpoint in {self.run_dir} (step {pointer['step']}) holds no "
                             f"{', '.join(missing)} (it holds {', '.join(state['objects'])})")
        for k, v in self.objects.items():
            if rejoin is None:
                v.load_state_dict(state["objects"][k])
            else:
                _load_rejoined(v, state["objects"][k], rejoin)
        if rejoin is None or rejoin.own:
            torch.set_rng_state(state["torch_rng"])
            if "cuda_rng" in state and self.comm.device.type == "cuda":
                torch.cuda.set_rng_state(state["cuda_rng"], self.comm.device)
        else:                   # a stream of its own, not a copy of the survivor's
            g = torch.Generator()
            g.set_state(state["torch_rng"])
            torch.manual_seed(int(torch.randint(2 ** 62, (1,), generator=g)) + self.comm.rank)
        self.comm.stats.load_state_dict(state["comm_stats"])
        sampler, method = self.objects.get("sampler"), self.objects.get("method")
        self.rejoined = [] if rejoin is None else list(rejoin.joined)
        if rejoin is not None and method is not None:
            how = method.rejoin(rejoin)
            if self.comm.rank == 0:
                print(f"[lsgd_hpc] resumed the survivors' checkpoint of step {step} at the "
                      f"full {self.comm.size} ranks: rank(s) {_ranks(rejoin.joined)} rejoin "
                      f"with {how}", file=sys.stderr, flush=True)
        if sampler is not None and method is not None:
            sampler.set_step(method.steps)
        return step


@dataclasses.dataclass
class Rejoin:
    """A full-size resume of a set written by survivors (Checkpointer.restore): the set's
    step, the ranks that wrote it (as numbered at the start, file by file), the ranks that
    rejoin, and whether this rank wrote a file of its own (False: it rejoins)."""

    step: int
    writers: list
    joined: list
    own: bool


def _ranks(ranks) -> str:
    from lsgd_hpc.ranklists import format_ranks
    return format_ranks(ranks)


def _load_rejoined(obj, state, rejoin: Rejoin) -> None:
    """One object of a full-size resume: an object that knows (``load_rejoined``: the
    sampler, the metrics writer, the method) loads itself; otherwise a survivor loads its own
    state and a rejoining rank the lowest survivor's (an optimizer without its per-parameter
    state: a fresh momentum, the survivor's hyperparameters)."""
    loader = getattr(obj, "load_rejoined", None)
    if loader is not None:
        loader(state, rejoin)
    elif not rejoin.own and isinstance(obj, torch.optim.Optimizer):
        obj.load_state_dict(dict(state, state={}))
    else:
        obj.load_state_dict(state)
