"""Run-time building blocks for the user's own loop: metrics file, checkpoints, stop signals,
the collective watchdog and a resumable sharded sampler (docs/library.md shows each)."""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import math
import os
import socket
import subprocess
import time
from typing import Dict, Iterator, List, Optional

import torch

from lsgd_hpc.runtime import checkpoint as _ckpt
from lsgd_hpc.runtime.metrics import GROUPS, SCHEMA_VERSION, MetricsWriter, encode_config, rank_file
from lsgd_hpc.runtime.signals import StopSignals
from lsgd_hpc.runtime.watchdog import Watchdog

__all__ = ["MetricsWriter", "RunMetrics", "open_metrics", "Checkpointer", "StopSignals",
           "requeue", "scontrol_requeue", "git_sha", "Watchdog", "start_watchdog", "ShardedSampler", "make_run_dir"]


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


class RunMetrics(MetricsWriter):
    """The per-rank HDF5 metrics file of the package's schema, with the bookkeeping of the
    /train and /eval columns done for the user: ``log_step`` fills in the communication
    counters, wall time and training time; time spent inside ``measuring()`` (evaluations)
    and in checkpoints is left out of the training time."""

    def __init__(self, path: str, attrs: dict, comm, flush_every: int = 1000,
                 flush_seconds: float = 60.0, extra_columns=None, trackers=None):
        super().__init__(path, attrs, flush_every, flush_seconds, extra_columns, trackers)
        self.comm = comm
        self.t0 = time.perf_counter()
        self.elapsed0 = 0.0
        self.eval_seconds = 0.0
        self.checkpoint_seconds = 0.0
        self.metrics_seconds = 0.0
        self.compute_seconds = 0.0
        #: the method whose extra /train columns ``log_step`` fills in (set by open_metrics)
        self.method = None

    def wall(self) -> float:
        return self.elapsed0 + time.perf_counter() - self.t0

    def training_time(self, wall: Optional[float] = None) -> float:
        wall = self.wall() if wall is None else wall
        return (wall - self.eval_seconds - self.checkpoint_seconds - self.metrics_seconds
                - self.comm.stats.probe_seconds)

    @contextlib.contextmanager
    def measuring(self) -> Iterator[None]:
        """Time inside (evaluations) is not training time."""
        t = time.perf_counter()
        try:
            yield
        finally:
            self.eval_seconds += time.perf_counter() - t

    def log_step(self, step: int, loss: float, accuracy: float = math.nan,
                 lr: float = math.nan, epoch: float = math.nan, **extra) -> None:
        s, wall = self.comm.stats, self.wall()
        if self.method is not None:
            # the method's own /train columns (async LSGD's staleness, local SGD's T)
            extra = {**self.method.rule.train_columns(), **extra}
        # columns of the user's own (open_metrics' extra_columns) not given: NaN
        extra = {**{c: math.nan for c in self.columns["train"]
                    if c not in GROUPS["train"] and c not in extra}, **extra}
        self.log("train", step=step, epoch=epoch, wall_time=wall, loss=float(loss),
                 accuracy=float(accuracy), lr=float(lr), comm_bytes_sent=s.bytes_sent,
                 comm_bytes_recv=s.bytes_recv, comm_seconds=s.seconds,
                 compute_seconds=self.compute_seconds, overhead_seconds=s.overhead_seconds,
                 probe_seconds=s.probe_seconds, eval_seconds=self.eval_seconds,
                 checkpoint_seconds=self.checkpoint_seconds,
                 metrics_seconds=self.metrics_seconds, training_time=self.training_time(wall),
                 **extra)
        t = time.perf_counter()
        self.maybe_flush()
        self.metrics_seconds += time.perf_counter() - t

    def log_eval(self, step: int, test_loss: float, test_accuracy: float,
                 epoch: float = math.nan, **extra) -> None:
        wall = self.wall()
        # the method's own /eval columns (EASGD's centre figures) are NaN unless passed
        extra = {**{c: math.nan for c in self.columns["eval"]
                    if c not in GROUPS["eval"] and c not in extra}, **extra}
        self.log("eval", step=step, epoch=epoch, wall_time=wall,
                 training_time=self.training_time(wall), test_loss=float(test_loss),
                 test_accuracy=float(test_accuracy), **extra)

    def state_dict(self) -> dict:
        return {"rows": self.row_counts(), "wall": self.wall(), "eval": self.eval_seconds,
                "checkpoint": self.checkpoint_seconds, "metrics": self.metrics_seconds,
                "compute": self.compute_seconds}

    def load_state_dict(self, state: dict) -> None:
        self.load_existing(state["rows"])
        self.t0 = time.perf_counter()
        self.elapsed0 = float(state["wall"])
        self.eval_seconds = float(state["eval"])
        self.checkpoint_seconds = float(state["checkpoint"])
        self.metrics_seconds = float(state["metrics"])
        self.compute_seconds = float(state["compute"])


def git_sha() -> str:
    """The commit of this lsgd_hpc checkout, or "" (an installed copy)."""
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        out = subprocess.run(["git", "-C", here, "rev-parse", "HEAD"], capture_output=True,
                             text=True, timeout=5)
        return out.stdout.strip() if out.returncode == 0 else ""
    except (OSError, subprocess.SubprocessError):
        return ""


def _library_of(comm) -> str:
    if comm.backend == "mpi" or comm.backend == "horovod":
        from lsgd_hpc.comm.mpi import mpi_library
        return mpi_library()
    return f"torch.distributed {torch.__version__}"


def open_metrics(run_dir: str, comm, method=None, config: Optional[dict] = None,
                 flush_every: int = 1000, flush_seconds: float = 60.0,
                 extra_columns: Optional[dict] = None, trackers=None) -> RunMetrics:
    """Collective: this rank's ``RUN_DIR/metrics/rankNNNNN.h5`` with the schema's file
    attributes (``lsgd_hpc.aggregate`` and ``lsgd_hpc.summary`` read it). ``method``: its
    name and extra columns go into the file (pass the writer back to it as ``metrics=``
    via ``method.log = writer.log``, or build the method with ``metrics=``); ``config``:
    any JSON-able dict recorded as the run's configuration; ``extra_columns``: columns of
    your own, ``{group: {column: numpy dtype string}}`` (e.g. ``{"eval": {"val_loss": "f8"}}``),
    given as keyword arguments of ``log_step``/``log_eval`` (an /eval column not given is NaN).
    A name of the schema's own or of the method's is refused (ValueError). ``trackers``:
    e.g. ``["tensorboard", "wandb", "mlflow"]``, rank 0 mirrors its rows to them
    (lsgd_hpc/runtime/trackers.py; an unknown or missing one: ValueError on every rank)."""
    from lsgd_hpc.runtime.metrics import GROUPS
    # the same arguments on every rank: every rank refuses them alike, before any collective
    extra = ({g: dict(c) for g, c in method.rule.extra_columns.items()}
             if method is not None else {})
    for group, cols in (extra_columns or {}).items():
        if group not in GROUPS:
            raise ValueError(f"extra_columns: no group {group!r} (the groups: "
                             f"{', '.join(GROUPS)})")
        taken = set(cols) & (set(GROUPS[group]) | set(extra.get(group, {})))
        if taken:
            raise ValueError(f"extra_columns: /{group} already has {sorted(taken)}")
        extra.setdefault(group, {}).update(cols)
    from lsgd_hpc import __version__
    make_run_dir(run_dir, comm)
    shared = comm.allgather_object(
        {"git_sha": git_sha(), "start": _dt.datetime.now(_dt.timezone.utc).isoformat()}
        if comm.rank == 0 else None)[0]
    attrs = {
        "schema_version": SCHEMA_VERSION, "rank": comm.rank, "world_size": comm.size,
        "local_rank": comm.local_rank, "node_index": comm.node_index, "n_nodes": comm.n_nodes,
        "hostname": socket.gethostname(),
        "algorithm": method.name if method is not None else "custom",
        "config": encode_config(dict(config or {},
                                     **({"method_options": method.options} if method else {}))),
        "lsgd_hpc_version": __version__, "git_sha": shared["git_sha"],
        "torch_version": torch.__version__, "mpi_library": _library_of(comm),
        "slurm_job_id": os.environ.get("SLURM_JOB_ID", ""), "start_time": shared["start"],
    }
    if method is not None:
        attrs.update(method.rule.file_attrs)
    from lsgd_hpc.runtime.trackers import open_trackers
    mirror = open_trackers(trackers, run_dir, comm, json.loads(attrs["config"]))
    writer = RunMetrics(rank_file(run_dir, comm.rank), attrs, comm, flush_every, flush_seconds,
                        extra_columns=extra, trackers=mirror)
    if method is not None:
        method.set_metrics(writer)
        writer.method = method
    error = None
    try:
        if os.path.exists(writer.path):
            # a resumed run: Checkpointer.restore takes the rows up to its checkpoint back
            # from this file, so it is not replaced by an empty one here (the first flush
            # replaces it); only check that the folder takes a file
            _probe_write(writer.path + ".tmp")
        else:
            writer.flush()
    except OSError as exc:
        error = f"metrics file {writer.path}: {exc.strerror or exc}"
    message = comm.agree(error)
    if message:
        writer.close_trackers()
        raise ValueError(message)
    return writer


def _probe_write(path: str) -> None:
    with open(path, "wb") as fh:
        fh.write(b"x")
    os.remove(path)




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


def start_watchdog(comm, run_dir: str, timeout: float = 300.0, metrics=None) -> Watchdog:
    """Start the collective watchdog: a collective that waits longer than ``timeout`` seconds
    aborts the job with a report (in ``run_dir``) of the ranks that did not arrive; the
    metrics are flushed first. ``watchdog.stop()`` at the end."""
    on_stall = (lambda report: metrics.flush()) if metrics is not None else None
    return Watchdog(timeout, run_dir, comm.rank, abort=lambda: comm.world.abort(1),
                    on_stall=on_stall).start()


class Checkpointer:
    """Checkpoint and exact resume of everything named: ``Checkpointer(run_dir, comm,
    model=model, optimizer=opt, method=method, sampler=sampler, metrics=writer)``; each
    object has ``state_dict``/``load_state_dict``. One file per rank, written atomically,
    and a pointer to the newest complete set (a damaged newest set falls back to the one
    before). The RNG states are saved too, so a resumed run continues bit for bit."""

    def __init__(self, run_dir: str, comm, **objects):
        self.run_dir, self.comm, self.objects = run_dir, comm, objects
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
        """Collective: save every object; returns the set's step label."""
        t0 = time.perf_counter()
        state = {"objects": {k: v.state_dict() for k, v in self.objects.items()},
                 "torch_rng": torch.get_rng_state(), "comm_stats": self.comm.stats.state_dict()}
        if torch.cuda.is_available() and self.comm.device.type == "cuda":
            state["cuda_rng"] = torch.cuda.get_rng_state(self.comm.device)
        metrics = self.objects.get("metrics")
        label = self._label()
        _ckpt.save_rank(self.run_dir, label, self.comm.rank, state)
        if metrics is not None:
            metrics.flush()           # rows up to this step are on disk before the pointer
        self.comm.barrier()
        if self.comm.rank == 0:
            _ckpt.commit_set(self.run_dir, label, self.comm.size)
        self.comm.barrier()
        if metrics is not None:
            metrics.checkpoint_seconds += time.perf_counter() - t0
        return label

    def restore(self) -> Optional[int]:
        """Collective: load the newest complete set, if any; returns its step label (None:
        nothing to resume, a fresh start). Ranks that disagree on it stop with ValueError."""
        pointer = _ckpt.latest_checkpoint(self.run_dir)
        seen = self.comm.allgather_object(None if pointer is None else pointer["step"])
        if len(set(seen)) > 1:
            raise ValueError(f"checkpoints in {self.run_dir}: the ranks see different newest "
                             f"sets {sorted(set(map(str, seen)))}; is the folder shared?")
        if pointer is None:
            return None
        if int(pointer["world_size"]) != self.comm.size:
            raise ValueError(f"checkpoint in {self.run_dir} was written by "
                             f"{pointer['world_size']} ranks, this job has {self.comm.size}")
        state = _ckpt.load_rank(self.run_dir, int(pointer["step"]), self.comm.rank)
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


class ShardedSampler(torch.utils.data.Sampler):
    """This rank's batches of every epoch, deterministic and resumable; use it as a torch
    ``DataLoader``'s ``batch_sampler``.

    Epoch e: one permutation of the ``num_samples`` indices from a generator seeded by
    (seed, e), the same on every rank, padded by wrapping to a multiple of the world size;
    rank r takes ``perm[r::size]``, cut into ``batch_size`` batches (the short tail dropped,
    so every rank takes ``steps_per_epoch`` steps per epoch). The position is the global
    step: ``set_step(k)`` makes the next iteration start at batch k (the Checkpointer does it
    on resume), and an iteration runs to the end of that epoch, then moves to the next."""

    def __init__(self, num_samples: int, comm, batch_size: int, seed: int = 0,
                 shuffle: bool = True):
        for name, v, low in (("num_samples", num_samples, 1), ("batch_size", batch_size, 1)):
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {v!r}")
        self.n, self.rank, self.size = num_samples, comm.rank, comm.size
        self.batch_size, self.seed, self.shuffle = batch_size, int(seed), bool(shuffle)
        self.per_rank = -(-num_samples // self.size)
        self.steps_per_epoch = self.per_rank // batch_size
        if self.steps_per_epoch == 0:
            raise ValueError(f"batch_size {batch_size} is larger than the {self.per_rank} "
                             f"samples each of the {self.size} ranks gets")
        self.step = 0

    def __len__(self) -> int:
        return self.steps_per_epoch - self.step % self.steps_per_epoch

    def set_step(self, step: int) -> None:
        self.step = int(step)

    @property
    def epoch(self) -> int:
        return self.step // self.steps_per_epoch

    def indices(self, epoch: int) -> torch.Tensor:
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            perm = torch.randperm(self.n, generator=g)
        else:
            perm = torch.arange(self.n)
        total = self.per_rank * self.size
        if total > self.n:
            perm = torch.cat([perm, perm.repeat(-(-total // self.n))[:total - self.n]])
        return perm[self.rank:total:self.size]

    def __iter__(self) -> Iterator[List[int]]:
        epoch, start = divmod(self.step, self.steps_per_epoch)
        idx = self.indices(epoch)
        b = self.batch_size
        for i in range(start, self.steps_per_epoch):
            yield idx[i * b:(i + 1) * b].tolist()
        self.step = (epoch + 1) * self.steps_per_epoch

    def state_dict(self) -> Dict[str, int]:
        return {"n": self.n, "size": self.size, "batch_size": self.batch_size,
                "seed": self.seed, "shuffle": int(self.shuffle)}

    def load_state_dict(self, state: Dict[str, int]) -> None:
        mine = self.state_dict()
        if state != mine:
            diff = ", ".join(f"{k} {state.get(k)} -> {mine[k]}" for k in mine
                             if state.get(k) != mine[k])
            raise ValueError(f"ShardedSampler: the checkpoint's sharding differs ({diff})")
