"""The per-rank metrics file of a user's loop: RunMetrics (the schema's writer with the
/train and /eval bookkeeping done) and open_metrics, which creates it with the run's
attributes (docs/library.md, docs/metrics.md)."""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import math
import os
import socket
import time
from typing import Iterator, Optional, Tuple

import torch

from lsgd_hpc.comm.launcher import launch_attrs
from lsgd_hpc.runtime.metrics import (GROUPS, OPTIONAL_GROUPS, SCHEMA_VERSION, MetricsWriter,
                                     encode_config, open_rank_file, rank_file)
from lsgd_hpc.runtime.rundir import git_sha, make_run_dir

__all__ = ["RunMetrics", "open_metrics", "NODE_COLUMNS"]

#: /train's columns of the traffic inside the node of a hierarchical compressed allreduce
#: (cumulative; docs/metrics.md): written when ``method.node_stats`` is not None
NODE_COLUMNS = {"node_bytes_sent": "i8", "node_bytes_recv": "i8", "node_seconds": "f8"}

#: the schema's /train columns in the order of ``RunMetrics.log_step``'s values
_SCHEMA_TRAIN = ("step", "epoch", "wall_time", "loss", "accuracy", "lr", "comm_bytes_sent",
                 "comm_bytes_recv", "comm_seconds", "compute_seconds", "overhead_seconds",
                 "probe_seconds", "eval_seconds", "checkpoint_seconds", "metrics_seconds",
                 "training_time")


class RunMetrics(MetricsWriter):
    """The per-rank HDF5 metrics file of the package's schema, with the bookkeeping of the
    /train and /eval columns done for the user: ``log_step`` fills in the communication
    counters, wall time and training time; time spent inside ``measuring()`` (evaluations)
    and in checkpoints is left out of the training time.

    ``compute_seconds``, with a method attached (``open_metrics(..., method=method)``): the
    seconds of the training steps outside communication (the trainer, cli/train.py, writes
    this clock's figure; it has none of its own). A step
    is timed from the first forward of the model in training mode to the end of
    ``method.step``, less the communication inside it (``comm.stats``' seconds, overhead and
    probe seconds, and the worker's traffic) and less anything timed by ``measuring()``,
    checkpoints or flushes in between; data loading between steps is left out. A loop that
    measures compute itself adds to ``compute_seconds`` instead (``+=``): the writer's own
    clock is then no longer used."""

    def __init__(self, path: str, attrs: dict, comm, flush_every: int = 1000,
                 flush_seconds: float = 5.0, extra_columns=None, trackers=None):
        super().__init__(path, attrs, flush_every, flush_seconds, extra_columns, trackers)
        self.comm = comm
        self.t0 = time.perf_counter()
        self.elapsed0 = 0.0
        self.eval_seconds = 0.0
        self.checkpoint_seconds = 0.0
        self.metrics_seconds = 0.0
        #: compute seconds restored from a checkpoint, those measured since, and (once a
        #: loop writes compute_seconds itself) the loop's own figure
        self._compute_base = 0.0
        self._compute_measured = 0.0
        self._compute_own: Optional[float] = None
        #: the step being timed: (perf_counter, not-compute seconds) at its first forward
        self._step_start: Optional[Tuple[float, float]] = None
        self._in_measuring = False
        self._hooks: list = []
        #: the method whose extra /train columns ``log_step`` fills in (set by open_metrics)
        self.method = None
        #: the counters of the node_* columns (the float32 traffic inside the node of a
        #: hierarchical compressed allreduce, ``method.node_stats``), or None: no such columns
        self.node_stats = None
        #: whether some /train accuracy in ``rows`` is still a tensor (``log_step``)
        self._deferred = False
        #: the /train columns' appends in log_step's order (None: not looked at yet; ():
        #: rows go through ``log``)
        self._schema_appends: Optional[tuple] = None

    # -- compute time ------------------------------------------------------------------------
    @property
    def compute_seconds(self) -> float:
        """Seconds of training steps outside communication (see the class)."""
        if self._compute_own is not None:
            return self._compute_own
        return self._compute_base + self._compute_measured

    @compute_seconds.setter
    def compute_seconds(self, value: float) -> None:
        if self._compute_own is None:
            # the loop's ``compute_seconds += dt`` read the clock's figure: keep the loop's dt
            # and what was restored, not the clock's steps (counted twice otherwise)
            value = float(value) - self._compute_measured
        self._compute_own = float(value)

    def _not_compute_seconds(self) -> float:
        """Seconds so far that are no step's compute: communication (the method's, probes,
        the worker's traffic), evaluations, checkpoints, flushes."""
        s = self.comm.stats
        wstats = self.method.worker_stats if self.method is not None else None
        return (s.seconds + s.overhead_seconds + s.probe_seconds
                + (wstats.seconds if wstats is not None else 0.0)
                + self.eval_seconds + self.checkpoint_seconds + self.metrics_seconds)

    def time_steps_of(self, method) -> None:
        """Time ``method``'s steps into ``compute_seconds`` (open_metrics does it): a forward
        pre-hook on its model starts a step, the end of ``method.step`` ends it."""
        self._untime()

        def started(module, args) -> None:
            if self._step_start is None and module.training and not self._in_measuring:
                self._step_start = (time.perf_counter(), self._not_compute_seconds())

        def ended() -> None:
            if self._step_start is not None:
                t, other = self._step_start
                self._step_start = None
                self._compute_measured += max(0.0, (time.perf_counter() - t)
                                              - (self._not_compute_seconds() - other))

        self._hooks = [method.model.register_forward_pre_hook(started)]
        method.step_listeners.append(ended)
        self._hooks.append((method.step_listeners, ended))

    def _untime(self) -> None:
        for hook in self._hooks:
            if isinstance(hook, tuple):
                listeners, fn = hook
                if fn in listeners:
                    listeners.remove(fn)
            else:
                hook.remove()
        self._hooks = []
        self._step_start = None

    def close(self) -> None:
        self._untime()
        super().close()

    def log(self, group: str, **row) -> None:
        if group == "leader":
            rank_map = getattr(self.comm, "initial_ranks", None)
            if rank_map is not None and getattr(self.comm, "generation", 0):
                # after lost ranks the world is renumbered: rows keep the initial numbering
                # (the file names', and the one the readers know)
                row["leader_rank"] = rank_map[int(row["leader_rank"])]
        super().log(group, **row)

    def log_fault(self, event) -> None:
        """The /faults row of a recovery (open_metrics registers it with the comm), flushed
        at once."""
        from lsgd_hpc.ranklists import format_ranks
        def fit(text: str) -> str:        # the columns hold 256 bytes (S256)
            if len(text.encode()) <= 256:
                return text
            return text.encode()[:252].decode(errors="ignore") + ",..."
        self.log("faults", step=int(event.step), wall_time=self.wall(),
                 lost_ranks=fit(format_ranks(event.lost_ranks)),
                 n_lost=len(event.lost_ranks), world_size_after=int(event.world_size_after),
                 recovery_seconds=float(event.recovery_seconds),
                 lost_nodes=fit(",".join(event.lost_nodes)), replaced_ranks="",
                 replace_seconds=float("nan"), replaced_nodes="")
        self.flush()

    def log_heal(self, heal, step: int) -> None:
        """The /faults row of a heal (lsgd_hpc.comm.heal.HealEvent), at the end of the first
        step after it: the ranks replaced, the world size after, this rank's pause for the
        join (``recovery_seconds``: from the survivors' decision to join to the start of
        this world's first step) and ``replace_seconds``: from the loss of the ranks to the
        end of the replacements' first step. Flushed at once."""
        from lsgd_hpc.ranklists import format_ranks
        now = time.time()
        self.log("faults", step=int(step), wall_time=self.wall(), lost_ranks="", n_lost=0,
                 world_size_after=int(heal.size_after),
                 recovery_seconds=float(heal.pause_seconds), lost_nodes="",
                 replaced_ranks=format_ranks(heal.replaced),
                 replace_seconds=float(now - heal.lost_at) if heal.lost_at else float("nan"),
                 replaced_nodes=",".join(heal.nodes))
        heal.logged = True
        self.flush()

    def wall(self) -> float:
        return self.elapsed0 + time.perf_counter() - self.t0

    def training_time(self, wall: Optional[float] = None) -> float:
        wall = self.wall() if wall is None else wall
        return (wall - self.eval_seconds - self.checkpoint_seconds - self.metrics_seconds
                - self.comm.stats.probe_seconds)

    @contextlib.contextmanager
    def measuring(self) -> Iterator[None]:
        """Time inside (evaluations) is not training time."""
        t, inside = time.perf_counter(), self._in_measuring
        self._in_measuring = True
        try:
            yield
        finally:
            self._in_measuring = inside
            self.eval_seconds += time.perf_counter() - t

    def log_step(self, step: int, loss: float, accuracy=math.nan,
                 lr: float = math.nan, epoch: float = math.nan, **extra) -> None:
        """The /train row of ``step``. ``accuracy``: a number, or a tensor whose mean it is
        (the batch's per-sample hits, ``out.argmax(1) == labels``), left on its device and
        read when the rows are written (``flush``), ``column`` is read or a tracker mirrors
        the row: no device sync and no reduction per step, one per flush for all rows.
        A row of the schema's columns alone (no extra columns, trackers or node columns) is
        appended to the columns in place: no row dictionary per step."""
        s, wall = self.comm.stats, self.wall()
        if isinstance(accuracy, torch.Tensor):
            if self.trackers:            # the trackers mirror each row as it comes
                accuracy = _means([accuracy])[0]
            else:
                self._deferred = True
        else:
            accuracy = float(accuracy)
        if self.method is not None:
            # the method's own /train columns (async LSGD's staleness, local SGD's T)
            own = self.method.rule.train_columns()
            if own:
                extra = {**own, **extra}
        appends = self._schema_appends
        if appends is None:
            appends = self._schema_appends = self._appends_of_schema()
        if appends and not extra and self.node_stats is None and not self.trackers:
            for append, value in zip(appends, (
                    step, epoch, wall, float(loss), accuracy, float(lr), s.bytes_sent,
                    s.bytes_recv, s.seconds, self.compute_seconds, s.overhead_seconds,
                    s.probe_seconds, self.eval_seconds, self.checkpoint_seconds,
                    self.metrics_seconds, self.training_time(wall))):
                append(value)
            self._rows_since_flush += 1
        else:
            self._log_step_row(step, loss, accuracy, lr, epoch, wall, s, extra)
        t = time.perf_counter()
        self.maybe_flush()
        self.metrics_seconds += time.perf_counter() - t

    def _appends_of_schema(self) -> tuple:
        """The ``append`` of each /train column in the order of ``log_step``'s values
        (``_SCHEMA_TRAIN``) when /train holds the schema's columns alone and rows go through
        ``RunMetrics.log``; else () (every row through ``log``)."""
        cols = self.rows["train"]
        if set(cols) != set(_SCHEMA_TRAIN) or type(self).log is not RunMetrics.log \
                or "log" in self.__dict__:
            return ()
        return tuple(cols[c].append for c in _SCHEMA_TRAIN)

    def _log_step_row(self, step, loss, accuracy, lr, epoch, wall, s, extra) -> None:
        """``log_step``'s row through ``log`` (extra columns, trackers, node columns)."""
        if self.node_stats is not None:      # inside the node; comm_* between the nodes
            n = self.node_stats
            extra = {"node_bytes_sent": n.bytes_sent, "node_bytes_recv": n.bytes_recv,
                     "node_seconds": n.seconds, **extra}
        # columns of the user's own (open_metrics' extra_columns) not given: NaN
        extra = {**{c: math.nan for c in self.columns["train"]
                    if c not in GROUPS["train"] and c not in extra}, **extra}
        self.log("train", step=step, epoch=epoch, wall_time=wall, loss=float(loss),
                 accuracy=accuracy, lr=float(lr), comm_bytes_sent=s.bytes_sent,
                 comm_bytes_recv=s.bytes_recv, comm_seconds=s.seconds,
                 compute_seconds=self.compute_seconds, overhead_seconds=s.overhead_seconds,
                 probe_seconds=s.probe_seconds, eval_seconds=self.eval_seconds,
                 checkpoint_seconds=self.checkpoint_seconds,
                 metrics_seconds=self.metrics_seconds, training_time=self.training_time(wall),
                 **extra)

    def _materialise(self) -> None:
        """The deferred /train accuracies (``log_step``'s tensors) as numbers, in place."""
        if self._deferred:
            values = self.rows["train"]["accuracy"]
            at = [i for i, v in enumerate(values) if isinstance(v, torch.Tensor)]
            for i, v in zip(at, _means([values[i] for i in at])):
                values[i] = v
            self._deferred = False

    def flush(self) -> None:
        self._materialise()
        super().flush()

    def column(self, group: str, name: str) -> list:
        self._materialise()
        return super().column(group, name)

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
        self._load_clocks(state)

    def _load_clocks(self, state: dict) -> None:
        self.t0 = time.perf_counter()
        self.elapsed0 = float(state["wall"])
        self.eval_seconds = float(state["eval"])
        self.checkpoint_seconds = float(state["checkpoint"])
        self.metrics_seconds = float(state["metrics"])
        self._compute_base, self._compute_measured = float(state["compute"]), 0.0
        if self._compute_own is not None:
            self._compute_own = self._compute_base
        self._step_start = None

    def load_rejoined(self, state: dict, rejoin) -> None:
        """A full-size resume of a survivors' checkpoint (runtime.checkpoint.Rejoin): a
        survivor resumes its own rows; a rank that was lost keeps the rows of its file up to
        the set's step (those it flushed before it died; the steps it missed stay a gap) and
        takes the clocks of the lowest survivor's ``state``."""
        if rejoin.own:
            self.load_state_dict(state)
            return
        counts = {}
        if os.path.exists(self.path):
            with open_rank_file(self.path) as f:
                # the rows every column has (a flush cut by the kill leaves some longer)
                counts = {g: int((f[g]["step"][:min(len(d) for d in f[g].values())]
                                  <= rejoin.step).sum())
                          for g in self.rows if g in f and "step" in f[g]}
        if counts:
            self.load_existing(counts)
        self._load_clocks(state)


def _means(tensors: list) -> list:
    """Each tensor's mean (a boolean or integer one's as float32, as ``t.float().mean()``),
    as Python floats: one stacked reduction and one device sync per shape, device and
    dtype; the same values as the tensors' own means."""
    groups: dict = {}
    for i, t in enumerate(tensors):
        groups.setdefault((t.shape, t.device, t.dtype), []).append(i)
    out = [math.nan] * len(tensors)
    with torch.no_grad():
        for idx in groups.values():
            stacked = torch.stack([tensors[i].detach() for i in idx]).reshape(len(idx), -1)
            if not stacked.is_floating_point():
                stacked = stacked.float()
            for i, v in zip(idx, stacked.mean(1).tolist()):
                out[i] = v
    return out


def _options_of(method) -> dict:
    """The method's options as the configuration records them: what a command line could
    give (a callable such as LeaderSGD's score_fn has no record)."""
    if method is None:
        return {}
    return {"method_options": {k: v for k, v in method.options.items()
                               if method.spec.option(k).cli}}


def _library_of(comm) -> str:
    """The MPI library the ranks run on; empty under the torch backend (no MPI there)."""
    if comm.backend == "mpi" or comm.backend == "horovod":
        from lsgd_hpc.comm.mpi import mpi_library
        return mpi_library()
    return ""


def open_metrics(run_dir: str, comm, method=None, config: Optional[dict] = None,
                 flush_every: int = 1000, flush_seconds: float = 5.0,
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
    # the same arguments on every rank: every rank refuses them alike, before any collective
    extra = ({g: dict(c) for g, c in method.rule.extra_columns.items()}
             if method is not None else {})
    # the hierarchical compressed allreduce's float32 traffic inside the node (the same on
    # every rank: it follows from the node layout and the method's options)
    node_stats = getattr(method, "node_stats", None) if method is not None else None
    if node_stats is not None:
        extra.setdefault("train", {}).update(NODE_COLUMNS)
    for group, cols in (extra_columns or {}).items():
        if group not in GROUPS or group in OPTIONAL_GROUPS:
            raise ValueError(f"extra_columns: no group {group!r} (the groups: "
                             f"{', '.join(GROUPS)})")
        taken = set(cols) & (set(GROUPS[group]) | set(extra.get(group, {})))
        if taken:
            raise ValueError(f"extra_columns: /{group} already has {sorted(taken)}")
        extra.setdefault(group, {}).update(cols)
    from lsgd_hpc._version import __version__
    make_run_dir(run_dir, comm)
    shared = comm.allgather_object(
        {"git_sha": git_sha(), "start": _dt.datetime.now(_dt.timezone.utc).isoformat()}
        if comm.rank == 0 else None)[0]
    # ranks as numbered at the start of the job (after lost ranks, comm.rank is the new
    # world's; a file keeps its rank's first number)
    rank = getattr(comm, "initial_rank", comm.rank)
    attrs = {
        "schema_version": SCHEMA_VERSION, "rank": rank,
        "world_size": getattr(comm, "initial_size", comm.size),
        "local_rank": comm.local_rank, "node_index": comm.node_index, "n_nodes": comm.n_nodes,
        "hostname": socket.gethostname(),
        "algorithm": method.name if method is not None else "custom",
        "config": encode_config(dict(config or {}, **_options_of(method))),
        "lsgd_hpc_version": __version__, "git_sha": shared["git_sha"],
        "torch_version": torch.__version__, "mpi_library": _library_of(comm),
        "slurm_job_id": os.environ.get("SLURM_JOB_ID", ""), "start_time": shared["start"],
        **launch_attrs(comm.backend, dict(os.environ)),
    }
    if method is not None:
        attrs.update(method.rule.file_attrs)
    from lsgd_hpc.runtime.trackers import open_trackers
    mirror = open_trackers(trackers, run_dir, comm, json.loads(attrs["config"]))
    writer = RunMetrics(rank_file(run_dir, rank), attrs, comm, flush_every, flush_seconds,
                        extra_columns=extra, trackers=mirror)
    if method is not None:
        method.set_metrics(writer)
        writer.method = method
        writer.node_stats = node_stats
        writer.time_steps_of(method)
    ft = getattr(comm, "fault_tolerance", None)
    if ft is not None:                               # on_failure="shrink": /faults rows
        ft.listeners.append(writer.log_fault)
    error = None
    try:
        if os.path.exists(writer.path):
            # a resumed run: Checkpointer.restore keeps the rows up to its checkpoint in
            # this file (load_existing), so it is not replaced by an empty one here (without
            # a restore the first flush replaces it); only check that the folder takes a file
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
