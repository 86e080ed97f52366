"""Checkpoint sets: each group's shared state written once, every rank's own state apart,
atomically and (by default) in the background, and a pointer to the latest complete set.

Layout (format 2)::

    RUN_DIR/checkpoints/latest.json                      a copy of the newest set's manifest
    RUN_DIR/checkpoints/stepNNNNNNNNN/manifest.json      the set is complete (written last)
    RUN_DIR/checkpoints/stepNNNNNNNNN/rankRRRRR.pt       each rank's own state
    RUN_DIR/checkpoints/stepNNNNNNNNN/shared-GROUP.pt    what a group of ranks holds alike
    RUN_DIR/checkpoints/stepNNNNNNNNN/rankRRRRR.done     the rank's files are in place

What a group holds alike comes from the methods' declarations (each rule's ``shared_state``;
lsgd_hpc/runtime/checkpoint_layout.py): the replica of allreduce SGD (model and optimizer),
DiLoCo's x_prev and outer optimizer, EASGD's centre, SlowMo's x_old and u are written once for
the whole job (``shared-world.pt``, by rank 0), the replica of a worker that spans ranks once
per worker (``shared-workerI.pt``, by its first rank); a rank's file holds the rest of its
state (its RNG streams, sampler, metrics clocks, the rule's own state) and names the shared
parts it refers to. A set of a 4-rank allreduce SGD job is about the size of a 1-rank one.
The manifest (``"format": 2``) records every file, its size, and each group's ranks.

Format 1 (what earlier versions wrote: one full file per rank, no ``format`` in the manifest)
still resumes; :func:`load_rank` reads either into one rank's whole state.

A save (:meth:`Checkpointer.save`) copies the state to host memory and returns; a thread
writes the files (temporary name, fsync, rename) and then the rank's marker. The rank that
finds every marker of the save in place commits the set: the manifest, then ``latest.json``;
so a rank killed during a write leaves the previous complete set as the newest. The next
save, ``wait()`` and the end of the process wait for the write; the next save and ``wait()``
also check, collectively, that every rank's write succeeded (and commit the set if no rank
saw it complete). ``sync=True`` (``--checkpoint-sync``) writes before ``save`` returns, and
rank 0 commits after a barrier; with ``on_failure="shrink"`` saves are synchronous (a rank
lost during one makes the survivors save again). The newest ``KEEP`` complete sets stay on
disk.

A set written by the survivors of lost ranks (``on_failure="shrink"``) also records who wrote
it: ``ranks`` (their ranks as numbered when the job started, one per file) and
``initial_size`` (that job's size). It is resumed by a job of the full size, in which the lost
ranks rejoin (see :meth:`Checkpointer.restore`).

Resuming takes the newest set that is intact: every file present (ranks' and shared), of the
size the manifest recorded, and ending in a zip end-of-central-directory record (a truncated
or half-copied file fails both). When the newest set is damaged -- a file deleted, truncated
by a full disk, ``latest.json`` itself unreadable -- :func:`latest_checkpoint` falls back to
the previous complete set, and says which newer steps it skipped. A shared file is read by
the first rank of its group and broadcast to the others.
"""

from __future__ import annotations

import atexit
import dataclasses
import io
import json
import os
import secrets
import socket
import sys
import threading
import time
from typing import Dict, List, Optional

import torch

from lsgd_hpc.comm.accounting import uncounted
from lsgd_hpc.comm.injection import injection_point
from lsgd_hpc.runtime.checkpoint_layout import host_copy, join_state, shared_parts, split_state

__all__ = ["Checkpointer", "Rejoin", "save_rank", "commit_set", "latest_checkpoint",
           "load_rank", "atomic_write", "resume_problem", "FORMAT"]

POINTER = "latest.json"
MANIFEST = "manifest.json"
#: the layout written now (1: one full file per rank, still read)
FORMAT = 2
_ZIP_END = b"PK\x05\x06"  # end-of-central-directory signature, the last record of a zip
KEEP = 2  # complete sets kept on disk (the newest, and one before it in case it is damaged)


def _dir(run_dir: str) -> str:
    return os.path.join(run_dir, "checkpoints")


def _set_name(step: int) -> str:
    return f"step{step:09d}"


def _rank_path(run_dir: str, step: int, rank: int) -> str:
    return os.path.join(_dir(run_dir), _set_name(step), f"rank{rank:05d}.pt")


def _shared_name(group: str) -> str:
    return f"shared-{group}.pt"


def _shared_path(run_dir: str, step: int, group: str) -> str:
    return os.path.join(_dir(run_dir), _set_name(step), _shared_name(group))


def _marker_path(run_dir: str, step: int, rank: int) -> str:
    return os.path.join(_dir(run_dir), _set_name(step), f"rank{rank:05d}.done")


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


def atomic_write(path: str, write, before_rename=None) -> None:
    """``write(fh)`` into a temporary file in the same folder, fsync, rename over ``path``
    (``before_rename()``, if given, runs between the two: the testing hook of a rank killed
    in the middle of its save). The temporary name is unique per host, process and thread."""
    folder = os.path.dirname(path) or "."
    os.makedirs(folder, exist_ok=True)
    tmp = f"{path}.tmp.{socket.gethostname()}.{os.getpid()}.{threading.get_ident()}"
    with open(tmp, "wb") as fh:
        write(fh)
        fh.flush()
        os.fsync(fh.fileno())
    if before_rename is not None:
        before_rename()
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
               initial_size: Optional[int] = None, shared: Optional[Dict[str, list]] = None,
               keep: tuple = ()) -> None:
    """After every rank has saved: record the set's manifest, point ``latest.json`` at it,
    and drop all but the newest ``KEEP`` complete sets. ``ranks``/``initial_size``: a set of
    survivors (their initial ranks, file by file, and the job's first size). ``shared``:
    format 2, the shared files' groups and their ranks (``{group: [ranks]}``; None: format
    1). ``keep``: steps whose folders stay whatever their age (a set being written)."""
    missing = [r for r in range(world_size)
               if not os.path.isfile(_rank_path(run_dir, step, r))]
    if missing:
        raise RuntimeError(f"checkpoint step {step}: ranks {missing} did not save")
    sizes = [os.path.getsize(_rank_path(run_dir, step, r)) for r in range(world_size)]
    manifest = {"step": step, "world_size": world_size, "folder": _set_name(step),
                "sizes": sizes}
    if shared is not None:
        entries = {}
        for group, members in sorted(shared.items()):
            path = _shared_path(run_dir, step, group)
            if not os.path.isfile(path):
                raise RuntimeError(f"checkpoint step {step}: rank {members[0]} did not save "
                                   f"the shared state of {group}")
            entries[group] = {"file": _shared_name(group), "ranks": [int(r) for r in members],
                              "size": os.path.getsize(path)}
        manifest.update(format=FORMAT, shared=entries)
    if ranks is not None:
        if len(ranks) != world_size or initial_size is None:
            raise ValueError(f"checkpoint step {step}: {len(ranks)} writer ranks for "
                             f"{world_size} files, initial size {initial_size}")
        manifest.update(ranks=[int(r) for r in ranks], initial_size=int(initial_size))
    _write_json(os.path.join(_dir(run_dir), _set_name(step), MANIFEST), manifest)
    _write_json(os.path.join(_dir(run_dir), POINTER), manifest)
    _prune(run_dir, step, keep)


def _prune(run_dir: str, step: int, keep: tuple) -> None:
    """All but the newest ``KEEP`` complete sets up to ``step`` go; sets after it belong to a
    timeline abandoned by resuming from an older set. (Two ranks may prune at once.)"""
    folder = _dir(run_dir)
    complete = sorted(d for d in os.listdir(folder) if d.startswith("step")
                      and d <= _set_name(step)
                      and os.path.isfile(os.path.join(folder, d, MANIFEST)))
    kept = set(complete[-KEEP:]) | {_set_name(s) for s in keep}
    for old in sorted(d for d in os.listdir(folder) if d.startswith("step")):
        if old in kept:
            continue
        old_path = os.path.join(folder, old)
        try:
            names = os.listdir(old_path)
        except OSError:
            continue
        for name in names:
            try:
                os.remove(os.path.join(old_path, name))
            except OSError:
                pass
        try:
            os.rmdir(old_path)
        except OSError:
            pass


def _files_of(run_dir: str, pointer: dict) -> list:
    """(path, recorded size or None) of every file of a set."""
    sizes = pointer.get("sizes")
    files = [(_rank_path(run_dir, pointer["step"], r), None if sizes is None else int(sizes[r]))
             for r in range(pointer["world_size"])]
    folder = os.path.join(_dir(run_dir), _set_name(pointer["step"]))
    for entry in (pointer.get("shared") or {}).values():
        files.append((os.path.join(folder, os.path.basename(entry["file"])), int(entry["size"])))
    return files


def _intact(run_dir: str, pointer: dict) -> bool:
    """Every file of the set is there, has the recorded size, and ends like a whole zip."""
    try:
        files = _files_of(run_dir, pointer)
        for path, recorded in files:
            size = os.path.getsize(path)
            if recorded is not None and size != recorded:
                return False
            with open(path, "rb") as fh:
                fh.seek(max(0, size - 65557))   # the record is in the last 64 KiB + 22 bytes
                if _ZIP_END not in fh.read():
                    return False
    except (OSError, IndexError, TypeError, ValueError, KeyError, AttributeError):
        return False
    return True


def latest_checkpoint(run_dir: str) -> Optional[dict]:
    """The newest intact complete set as ``{"step", "world_size", "folder", ...}``, or None.

    ``latest.json`` first, then every set that has a manifest, newest first. When newer sets
    were passed over as damaged, ``"skipped"`` lists their steps. A set of format 2 also has
    ``"format"`` and ``"shared"`` (its shared files: ``{group: {"file", "ranks", "size"}}``).
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
            if c.get("shared") is not None:
                out.update(format=int(c.get("format", FORMAT)), shared=c["shared"])
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


def _resumed_shrunk(pointer: dict, comm, current: List[int]) -> bool:
    """Whether ``comm`` is the world of the job that wrote ``pointer``'s set less ranks it
    has lost since (a failure during the restore, or between a heal's join and its first
    step): it then resumes the set with the ranks it has, as a shrink would have gone on."""
    full = int(pointer.get("initial_size") or pointer["world_size"])
    writers = pointer.get("ranks") or list(range(int(pointer["world_size"])))
    return (bool(getattr(comm, "lost_ranks", ())) and len(current) < full
            and getattr(comm, "initial_size", comm.size) == full
            and bool(set(current) & set(writers)))


def _load(path: str):
    # weights_only: a checkpoint is data, never code to run.
    return torch.load(path, map_location="cpu", weights_only=True)


def load_rank(run_dir: str, step: int, rank: int) -> dict:
    """The whole state rank ``rank`` saved at ``step``: its file, with the shared parts it
    refers to read from their files (format 2), or its file alone (format 1). Local: every
    caller reads the shared files itself (Checkpointer.restore reads each once per group)."""
    state = _load(_rank_path(run_dir, step, rank))
    groups = sorted({g for g, _ in state.get("shared_parts") or []})
    return join_state(state, {g: _load(_shared_path(run_dir, step, g)) for g in groups})


# -- writing one rank's part of a set ------------------------------------------------------
class _Write:
    """One rank's part of one set: its state copied to host memory (``live``: the objects'
    state_dicts, views of live tensors), then written: the shared files it writes (its
    groups' first rank), its own file, and (asynchronous saves) its marker; the rank that
    then finds every marker of the save (``token``) in place commits the set. ``layout``:
    ``{group: ranks}`` of the set's shared files; ``commit``: commit_set's world_size, ranks
    and initial_size; ``pool``: host buffers to copy into (checkpoint_layout.host_copy)."""

    def __init__(self, run_dir: str, step: int, rank: int, live: dict, parts: list,
                 layout: dict, token: str, commit: dict, comm, pool: Optional[dict] = None):
        self.run_dir, self.step, self.rank, self.comm = run_dir, step, rank, comm
        self.live, self.parts, self.layout, self.token = live, parts, layout, token
        self.commit, self.pool = commit, pool
        self.own: Optional[dict] = None
        self.shared: Optional[dict] = None
        #: set once the state is copied (the step may go on) and once this rank's metrics
        #: rows up to the checkpoint are on disk (the set may be committed)
        self.copied, self.flushed = threading.Event(), threading.Event()
        self.flush_failed = False
        self.error: Optional[str] = None
        self.committed = False
        self.thread: Optional[threading.Thread] = None

    def copy(self) -> None:
        """The host copy, split into this rank's own state and the shared files it writes."""
        try:
            own, shared = split_state(host_copy(self.live, self.pool), self.parts,
                                      list(self.layout))
            self.own = own
            self.shared = {g: shared.get(g, {}) for g, ranks in self.layout.items()
                           if ranks[0] == self.rank}
        finally:
            self.live = None
            self.copied.set()

    def files(self) -> None:
        for group, parts in self.shared.items():
            atomic_write(_shared_path(self.run_dir, self.step, group),
                         lambda fh, p=parts: torch.save(p, fh))
        # (testing: a rank killed in the middle of its save, its file not in place)
        atomic_write(_rank_path(self.run_dir, self.step, self.rank),
                     lambda fh: torch.save(self.own, fh),
                     before_rename=lambda: injection_point("save", self.step, self.comm))
        self.own = self.shared = None                       # the host copy is released

    def commit_now(self, keep: tuple = ()) -> None:
        commit_set(self.run_dir, self.step, shared=self.layout, keep=keep, **self.commit)

    def _run(self) -> None:
        try:
            self.copy()
            self.files()
            self.flushed.wait()
            if self.flush_failed:
                raise RuntimeError("the metrics rows up to the checkpoint were not flushed")
            atomic_write(_marker_path(self.run_dir, self.step, self.rank),
                         lambda fh: fh.write(self.token.encode()))
            if self._complete():
                self.commit_now()
                self.committed = True
        except BaseException as exc:                        # noqa: BLE001 - reported later
            self.error = f"{type(exc).__name__}: {exc}"

    def _complete(self) -> bool:
        """Every rank's marker of this save is in place (a marker of an earlier, abandoned
        write of the same step has another token)."""
        for r in range(self.commit["world_size"]):
            try:
                with open(_marker_path(self.run_dir, self.step, r)) as fh:
                    if fh.read() != self.token:
                        return False
            except OSError:
                return False
        return True

    def start(self) -> None:
        self.thread = threading.Thread(target=self._run, daemon=False,
                                       name=f"lsgd_hpc checkpoint {self.step}")
        _WRITES.add(self)
        self.thread.start()

    def join(self) -> dict:
        """Wait for the write; its outcome (picklable: every rank shows it to the others)."""
        if not self.flushed.is_set():        # (the save never got to its flush)
            self.flush_failed = True
            self.flushed.set()
        if self.thread is not None:
            self.thread.join()
        _WRITES.discard(self)
        return {"step": self.step, "error": self.error, "committed": self.committed}


#: writes in flight in this process: the exit waits for them (os._exit paths too)
_WRITES: set = set()


@atexit.register
def _finish_writes() -> None:
    for job in list(_WRITES):
        job.join()


# -- the building block of a user's loop ----------------------------------------------------
class Checkpointer:
    """Checkpoint and exact resume of everything named: ``Checkpointer(run_dir, comm,
    model=model, optimizer=opt, method=method, sampler=sampler, metrics=writer)``; each
    object has ``state_dict``/``load_state_dict``. What a method declares shared is written
    once per group, each rank's own state in a file of its own, atomically, with a pointer to
    the newest complete set (a damaged newest set falls back to the one before). The RNG
    states are saved too, so a resumed run continues bit for bit.

    ``save()`` is asynchronous unless ``sync=True``: it returns once the state is copied to
    host memory and a thread writes it; the next ``save()``, ``wait()`` and ``restore()``
    wait for that write (collectively: a rank whose write failed raises there on every rank),
    and so does the end of the process. Call ``wait()`` before anything that needs the set on
    disk (requeue, the end of the run)."""

    def __init__(self, run_dir: str, comm, *, sync: bool = False, **objects):
        self.run_dir, self.comm, self.objects = run_dir, comm, objects
        #: write before save() returns (--checkpoint-sync)
        self.sync = bool(sync)
        #: steps of newer sets that restore() found damaged or incomplete and passed over
        self.skipped: list = []
        #: after restore() of a survivors' set at full size: the ranks that rejoined
        self.rejoined: list = []
        self._pending: Optional[_Write] = None
        #: host buffers of the last copy, written again by the next (checkpoint_layout)
        self._pool: dict = {}
        bad = [k for k, v in objects.items()
               if not (hasattr(v, "state_dict") and hasattr(v, "load_state_dict"))]
        if bad:
            raise ValueError(f"Checkpointer: {', '.join(bad)} has no state_dict/load_state_dict")

    def save(self) -> int:
        """Collective: save every object; returns the set's step label. With
        ``on_failure="shrink"`` (synchronous) a rank lost during the save makes the survivors
        recover and save again, numbered as the new world (the lowest survivor commits)."""
        ft = getattr(self.comm, "fault_tolerance", None)
        if ft is None:
            return self._save(self.sync)
        return ft.transaction(lambda: self._save(True))

    def _live_state(self) -> dict:
        """Every object's state and the RNG streams (tensors: views of the live ones)."""
        state = {"objects": {k: v.state_dict() for k, v in self.objects.items()},
                 "torch_rng": torch.get_rng_state(), "comm_stats": self.comm.stats.state_dict()}
        if torch.cuda.is_available() and self.comm.device.type == "cuda":
            state["cuda_rng"] = torch.cuda.get_rng_state(self.comm.device)
        return state

    def _commit_args(self) -> dict:
        # after lost ranks: who wrote which file (ranks as numbered at the start)
        full = getattr(self.comm, "initial_size", self.comm.size)
        survivors = full != self.comm.size
        return {"world_size": self.comm.size,
                "ranks": list(self.comm.initial_ranks) if survivors else None,
                "initial_size": full if survivors else None}

    def _save(self, sync: bool) -> int:
        t0 = time.perf_counter()
        previous, outcome = self._pending, self._join()
        live = self._live_state()
        parts = shared_parts(self.objects)
        method = self.objects.get("method")
        step = int(method.steps) if method is not None else 0
        # one allgather: the label (ranks of an asynchronous method have taken different
        # numbers of steps), the groups, the previous write's outcome, the save's token
        table = self.comm.allgather_object((step, sorted({g for g, _ in parts}), outcome,
                                            secrets.token_hex(8)))
        label = max(t[0] for t in table)
        self._settle(previous, [t[2] for t in table], keep=(label,))
        layout: Dict[str, list] = {}
        for r, (_, groups, _, _) in enumerate(table):
            for g in groups:
                layout.setdefault(g, []).append(r)
        layout = {g: ranks for g, ranks in layout.items() if len(ranks) > 1}
        job = _Write(self.run_dir, label, self.comm.rank, live, parts, layout, table[0][3],
                     self._commit_args(), self.comm, self._pool)
        metrics = self.objects.get("metrics")
        if sync:
            self._write_now(job, metrics)
        else:
            job.flush_failed = True   # (until the flush below returns)
            job.start()               # the host copy, then the files, in the background
            try:
                if metrics is not None:
                    metrics.flush()   # rows up to this step are on disk before the pointer
                job.flush_failed = False
            finally:
                job.flushed.set()
                job.copied.wait()     # the step goes on once the state is copied
            self._pending = job
        if metrics is not None:
            metrics.checkpoint_seconds += time.perf_counter() - t0
        return label

    def _write_now(self, job: _Write, metrics) -> None:
        """A synchronous save: this rank's files, the metrics flushed, then rank 0 commits."""
        job.copy()
        job.files()
        if metrics is not None:
            metrics.flush()           # rows up to this step are on disk before the pointer
        self.comm.barrier()
        if self.comm.rank == 0:
            job.commit_now()
        self.comm.barrier()

    def _join(self) -> Optional[dict]:
        """This rank's write in flight, waited for: its outcome (None: there was none)."""
        job = self._pending
        if job is None:
            return None
        self._pending = None
        return job.join()

    def _settle(self, job: Optional[_Write], outcomes: list, keep: tuple = ()) -> None:
        """Collective (every rank passes every rank's outcome of the same write): raise on
        every rank when one could not write; commit the set when no rank found it complete
        (a shared file system that showed a rank the markers late)."""
        done = [o for o in outcomes if o is not None]
        if not done or job is None:
            return
        bad = [(r, o["error"]) for r, o in enumerate(outcomes) if o and o["error"]]
        if bad:
            raise RuntimeError(f"checkpoint step {done[0]['step']}: rank {bad[0][0]} could not "
                               f"write its files ({bad[0][1]}); the set was not committed, the "
                               "previous complete one is the newest")
        if any(o["committed"] for o in done):
            return
        if self.comm.rank == 0:
            job.commit_now(keep=keep)
        self.comm.barrier()

    def wait(self) -> None:
        """Collective: wait for the asynchronous write in flight, if any, and make sure its
        set is committed (RuntimeError on every rank when a rank's write failed). The
        trainer calls it at the end of the run and before a requeue."""
        if self._pending is None:       # (the same on every rank: they all saved alike)
            return
        t0 = time.perf_counter()
        job, outcome = self._pending, self._join()
        self._settle(job, self.comm.allgather_object(outcome))
        metrics = self.objects.get("metrics")
        if metrics is not None:
            metrics.checkpoint_seconds += time.perf_counter() - t0

    #: the same as :meth:`wait`
    close = wait

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is None:
            self.wait()
        return False

    # -- resume ----------------------------------------------------------------------------
    def restore(self) -> Optional[int]:
        """Collective: load the newest complete set, if any; returns its step label (None:
        nothing to resume, a fresh start). Ranks that disagree on it stop with ValueError.
        A shared file (format 2) is read by the first rank of its group and broadcast.

        A set written by the survivors of lost ranks is resumed at the job's full size: a
        survivor loads its own file; a rank that was lost *rejoins*: it loads the lowest
        survivor's file, with a fresh optimizer state, and the method (when one is named)
        then gives it the parameters of its kind -- the global leader's (LeaderSGD), the
        replica with its optimizer state (AllreduceSGD), the centre (EASGD), x_prev (DiLoCo),
        x_old (SlowMo), the lowest survivor's (local SGD, gossip). ``rejoined`` lists those
        ranks afterwards. See docs/library.md, "Surviving lost ranks".

        With ``on_failure="shrink"`` or ``"heal"`` the restore is a transaction: a rank lost
        during it (a replacement that dies right after a heal's join, say) makes the
        survivors recover and restore again in the smaller world, each from its own file
        where it wrote one (the set is then resumed by the job's ranks less those it lost)."""
        self.wait()
        for job in [j for j in list(_WRITES) if j.run_dir == self.run_dir]:
            job.join()                # another Checkpointer of this process on the folder
        ft = getattr(self.comm, "fault_tolerance", None)
        if ft is None:
            return self._restore()
        return ft.transaction(self._restore)

    def _restore(self) -> Optional[int]:
        pointer = latest_checkpoint(self.run_dir)
        seen = self.comm.allgather_object(None if pointer is None else pointer["step"])
        if len(set(seen)) > 1:
            raise ValueError(f"checkpoints in {self.run_dir}: the ranks see different newest "
                             f"sets {sorted(set(map(str, seen)))}; is the folder shared?")
        if pointer is None:
            return None
        from lsgd_hpc.comm.injection import replacement_dies_here
        replacement_dies_here("resume", getattr(self.comm, "initial_rank", self.comm.rank))
        current = list(getattr(self.comm, "initial_ranks", range(self.comm.size)))
        problem = (None if _resumed_shrunk(pointer, self.comm, current)
                   else resume_problem(self.run_dir, pointer, self.comm.size))
        if problem:
            raise ValueError(problem)
        self.skipped = list(pointer.get("skipped", []))
        step = int(pointer["step"])
        writers = pointer.get("ranks")
        if writers is None and len(current) != int(pointer["world_size"]):
            writers = list(range(int(pointer["world_size"])))   # a full set, ranks lost since
        rejoin, sources = None, list(range(self.comm.size))
        if writers is not None:
            me = self.comm.rank
            rejoin = Rejoin(step, list(writers),
                            [r for r, i in enumerate(current) if i not in writers],
                            current[me] in writers)
            # a rank that rejoins loads the lowest survivor's file
            sources = [writers.index(i) if i in writers else 0 for i in current]
        state = self._read_set(pointer, sources)
        missing = sorted(set(self.objects) - set(state["objects"]))
        if missing:
            raise ValueError(f"checkpoint in {self.run_dir} (step {pointer['step']}) holds no "
                             f"{', '.join(missing)} (it holds {', '.join(state['objects'])})")
        self._load_objects(state, rejoin)
        return step

    def _read_set(self, pointer: dict, sources: List[int]) -> dict:
        """Collective: this rank's whole state from the set ``pointer``, its own file being
        rank ``sources[rank]``'s; each shared file read once per group and broadcast."""
        step = int(pointer["step"])
        own = _load(_rank_path(self.run_dir, step, sources[self.comm.rank]))
        shared = pointer.get("shared") or {}
        got = _fetch_shared(self.comm.world, self.run_dir, step, shared, sources) if shared \
            else {}
        return join_state(own, got)

    def _load_objects(self, state: dict, rejoin: Optional["Rejoin"]) -> None:
        """Every named object, the RNG streams and the counters from ``state``."""
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
        # the ranks that rejoined, as numbered at the start (at full size: their ranks)
        initial = list(getattr(self.comm, "initial_ranks", range(self.comm.size)))
        self.rejoined = [] if rejoin is None else [initial[r] for r in rejoin.joined]
        if rejoin is not None and method is not None:
            how = method.rejoin(rejoin)
            full = getattr(self.comm, "initial_size", self.comm.size)
            if self.comm.rank == 0 and self.comm.size == full:
                print(f"[lsgd_hpc] resumed the survivors' checkpoint of step {rejoin.step} at "
                      f"the full {self.comm.size} ranks: rank(s) {_ranks(self.rejoined)} "
                      f"rejoin with {how}", file=sys.stderr, flush=True)
            elif self.comm.rank == 0:           # ranks were lost during this restore
                print(f"[lsgd_hpc] resumed the checkpoint of step {rejoin.step} with the "
                      f"{self.comm.size} of {full} ranks left (rank(s) "
                      f"{_ranks(self.comm.lost_ranks)} lost since it was written)"
                      + (f": rank(s) {_ranks(self.rejoined)} rejoin with {how}"
                         if self.rejoined else ""),
                      file=sys.stderr, flush=True)
        if sampler is not None and method is not None:
            sampler.set_step(method.steps)


def _levels(readers: Dict[str, list]) -> List[list]:
    """The groups in rounds whose groups share no rank (one communicator split per round)."""
    levels: List[list] = []
    for g in sorted(readers):
        for level in levels:
            if all(not set(readers[g]) & set(readers[h]) for h in level):
                level.append(g)
                break
        else:
            levels.append([g])
    return levels


def _fetch_shared(world, run_dir: str, step: int, shared: dict, sources: List[int]) -> dict:
    """Collective over ``world``: ``{group: parts}`` of every shared file this rank's own file
    (rank ``sources[rank]``'s) refers to; each file is read by the lowest rank that needs it
    and broadcast to the others that do (the group's ranks: a worker's, or every rank)."""
    me, size = world.rank, world.size
    readers = {}
    for g, entry in sorted(shared.items()):
        members = {int(r) for r in entry["ranks"]}
        need = [r for r in range(size) if sources[r] in members]
        if need:
            readers[g] = need
    out = {}
    folder = os.path.join(_dir(run_dir), _set_name(step))
    with uncounted(world):
        for level in _levels(readers):
            mine = [g for g in level if me in readers[g]]
            if len(level) == 1 and len(readers[level[0]]) == size:
                sub = world
            else:
                sub = world.split(level.index(mine[0]) if mine else -1, key=me)
            if not mine or sub is None:
                continue
            g = mine[0]
            path = os.path.join(folder, os.path.basename(shared[g]["file"]))
            data = _broadcast_file(sub, path if me == readers[g][0] else None)
            out[g] = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    return out


def _broadcast_file(comm, path: Optional[str]) -> bytes:
    """Collective over ``comm``: the bytes of the file its rank 0 reads (``path``; None on
    the others). ValueError on every rank when it cannot be read."""
    n = torch.tensor([-1], dtype=torch.int64)
    buf = None
    if path is not None:
        try:
            size = os.path.getsize(path)
            buf = torch.empty(size, dtype=torch.uint8)
            with open(path, "rb") as fh:
                if fh.readinto(memoryview(buf.numpy())) == size:
                    n[0] = size
        except OSError:
            pass
    comm.broadcast_(n, 0)
    if int(n.item()) < 0:
        raise ValueError(f"checkpoint: the first rank of a group could not read "
                         f"{path or 'its shared file'}")
    if buf is None:
        buf = torch.empty(int(n.item()), dtype=torch.uint8)
    comm.broadcast_(buf, 0)
    return buf.numpy().tobytes()


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
