"""Experiment trackers, opt-in: rank 0 mirrors what it logs to TensorBoard, Weights & Biases
or MLflow, all without a network, each into the run directory.

    writer = lsgd_hpc.open_metrics(run_dir, comm, trackers=["tensorboard", "mlflow"])

The per-rank HDF5 files stay the record; a tracker is a mirror of rank 0's rows:

=============  ===========================================================================
/train         loss, accuracy, lr, comm_bytes_sent, training_time -> ``train/<column>``
/eval          test_loss, test_accuracy and every other column but the clocks and the
               epoch (EASGD's centre, ``val_*``, your own) -> ``eval/<column>``
/leader        rows of scope 0 (global elections): leader_rank -> ``leader/rank``
/consensus     distance -> ``consensus/distance``
``track()``    anything else, under the key given (LSGD: ``leader/score``)
=============  ===========================================================================

The row's step is the tracker's step; NaN values (a column the loop did not give) are not
sent. Where the files go: TensorBoard event files in ``RUN_DIR/tensorboard``, an offline
wandb run in ``RUN_DIR/wandb/offline-run-*`` (``wandb sync`` uploads it later), an MLflow
file store in ``RUN_DIR/mlruns`` (``MLFLOW_ALLOW_FILE_STORE=true mlflow ui
--backend-store-uri file:RUN_DIR/mlruns``).

Every tracker is one small class behind one interface (``log_scalars(step, dict)``,
``flush()``, ``close()``); the packages are optional (``pip install lsgd_hpc[trackers]``) and
imported only when a tracker is asked for: importing this module loads neither torch nor
mpi4py (the TensorBoard tracker writes with torch's ``SummaryWriter``).
"""

from __future__ import annotations

import atexit
import importlib.util
import json
import math
import os
import re
import sys
import time
from typing import Dict, Iterable, List, Mapping, Optional, Sequence

__all__ = ["TRACKERS", "Tracker", "TensorBoardTracker", "WandbTracker", "MlflowTracker",
           "Mirror", "check_trackers", "make_trackers", "open_trackers", "tracker_scalars"]

#: The trackers, by name (the CLI's ``--tracker`` choices).
TRACKERS = ("tensorboard", "wandb", "mlflow")

#: name -> (the module that must import, the pip extra of lsgd_hpc that installs it)
_PACKAGES = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb"),
             "mlflow": ("mlflow", "mlflow")}

#: /train columns mirrored
TRAIN_KEYS = ("loss", "accuracy", "lr", "comm_bytes_sent", "training_time")
#: /eval columns never mirrored (the clocks, the position): every other one is
EVAL_SKIP = ("step", "epoch", "wall_time", "training_time")


# -- which names, installed? ------------------------------------------------------------------
def _names(names) -> List[str]:
    if names is None:
        return []
    if isinstance(names, str):
        names = [names]
    return list(dict.fromkeys(names))          # in order, each once


def _installed(module: str) -> bool:
    """Whether ``module`` can be imported, without importing it (a cheap check that every
    rank, or a CLI before training, can afford); ``sys.modules[module] = None`` counts as
    missing, as the import system treats it."""
    if module in sys.modules:
        return sys.modules[module] is not None
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _missing(name: str, why: str = "is not installed") -> str:
    module, extra = _PACKAGES[name]
    return (f"tracker {name}: the {module} package {why}; "
            f"install it with: pip install lsgd_hpc[{extra}]")


def check_trackers(names: Optional[Iterable[str]]) -> Optional[str]:
    """The one-line problem with these tracker names, or None: an unknown name (naming the
    choices), or a tracker whose package is not installed (naming the pip extra). Cheap: no
    tracker package is imported. The CLI calls it before training (exit 2)."""
    names = _names(names)
    return _unknown(names) or next((_missing(n) for n in names
                                    if not _installed(_PACKAGES[n][0])), None)


def _unknown(names: List[str]) -> Optional[str]:
    unknown = [n for n in names if n not in TRACKERS]
    if unknown:
        return f"unknown tracker {unknown[0]!r}; the trackers: {', '.join(TRACKERS)}"
    return None


# -- the trackers ------------------------------------------------------------------------------
class Tracker:
    """One tracker: ``log_scalars(step, {key: value})`` as rows arrive, ``flush()`` at every
    flush of the metrics file, ``close()`` once at the end."""

    name = "tracker"

    def log_scalars(self, step: int, scalars: Mapping[str, float]) -> None:
        raise NotImplementedError

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


def _run_name(run_dir: str) -> str:
    return os.path.basename(os.path.normpath(os.path.abspath(run_dir)))


class TensorBoardTracker(Tracker):
    """Event files in ``RUN_DIR/tensorboard`` (``tensorboard --logdir RUN_DIR/tensorboard``),
    written by torch's ``SummaryWriter``; the configuration as the text summary ``config``."""

    name = "tensorboard"

    def __init__(self, run_dir: str, config: Optional[dict] = None):
        from torch.utils.tensorboard import SummaryWriter
        self.log_dir = os.path.join(run_dir, "tensorboard")
        self.writer = SummaryWriter(log_dir=self.log_dir)
        if config:
            text = json.dumps(config, indent=2, sort_keys=True, default=str)
            self.writer.add_text("config", "```\n" + text + "\n```", 0)

    def log_scalars(self, step, scalars):
        for key, value in scalars.items():
            self.writer.add_scalar(key, value, step)

    def flush(self):
        self.writer.flush()

    def close(self):
        self.writer.close()


class WandbTracker(Tracker):
    """An offline Weights & Biases run in ``RUN_DIR/wandb/offline-run-*`` (``wandb sync`` it
    from a machine with a network). Project ``$WANDB_PROJECT`` or ``lsgd_hpc``; the run is
    named after the run directory; no console capture, no system metrics.

    wandb keeps a step's values open until a later step comes, and drops values for an
    earlier step than the last one: rows of an earlier step are left out here (one warning
    says how many). Its offline file is complete when the run is finished: by ``close()``,
    or by wandb's own hook at the interpreter's exit."""

    name = "wandb"

    def __init__(self, run_dir: str, config: Optional[dict] = None):
        import wandb
        self.run = wandb.init(
            mode="offline", dir=os.path.abspath(run_dir), name=_run_name(run_dir),
            project=os.environ.get("WANDB_PROJECT") or "lsgd_hpc", config=dict(config or {}),
            reinit="create_new",
            settings=wandb.Settings(console="off", silent=True, x_disable_stats=True))
        self.last_step = -1
        self.dropped = 0

    def log_scalars(self, step, scalars):
        if step < self.last_step:
            if self.dropped == 0:
                print(f"[lsgd_hpc] tracker wandb: a row for step {step} after step "
                      f"{self.last_step}; wandb takes steps in order only, left out",
                      file=sys.stderr, flush=True)
            self.dropped += 1
            return
        self.last_step = step
        self.run.log(dict(scalars), step=int(step))

    def close(self):
        self.run.finish()


def _param_key(key: str) -> str:
    # MLflow keys: alphanumerics, underscores, dashes, periods, spaces and slashes
    return re.sub(r"[^\w\-. /]", "_", str(key))[:250]


class MlflowTracker(Tracker):
    """An MLflow run in the file store ``RUN_DIR/mlruns`` (experiment
    ``$MLFLOW_EXPERIMENT_NAME`` or ``lsgd_hpc``, the run named after the run directory, the
    configuration as its parameters). Metrics are buffered and written with ``log_batch`` at
    every flush. MLflow 3 keeps its file store only on request: ``MLFLOW_ALLOW_FILE_STORE``
    is set to true in this process unless already set, and ``MLFLOW_DISABLE_TELEMETRY``
    likewise (a compute node has no network for MLflow's usage reports)."""

    name = "mlflow"
    BATCH = 1000                        # MLflow's limit of metrics per log_batch

    def __init__(self, run_dir: str, config: Optional[dict] = None):
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
        from mlflow.entities import Metric, Param
        from mlflow.tracking import MlflowClient
        self._metric = Metric
        self.tracking_uri = "file:" + os.path.join(os.path.abspath(run_dir), "mlruns")
        self.client = MlflowClient(tracking_uri=self.tracking_uri)
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or "lsgd_hpc"
        exp = self.client.get_experiment_by_name(name)
        exp_id = exp.experiment_id if exp is not None else self.client.create_experiment(name)
        self.run_id = self.client.create_run(exp_id, run_name=_run_name(run_dir)).info.run_id
        params = [Param(_param_key(k), (v if isinstance(v, str)
                                        else json.dumps(v, default=str))[:500])
                  for k, v in sorted((config or {}).items())]
        for i in range(0, len(params), 100):          # MLflow's limit of params per batch
            self.client.log_batch(self.run_id, params=params[i:i + 100])
        self.pending: list = []

    def log_scalars(self, step, scalars):
        now = int(time.time() * 1000)
        self.pending.extend(self._metric(k, float(v), now, int(step)) for k, v in scalars.items())
        if len(self.pending) >= self.BATCH:
            self.flush()

    def flush(self):
        while self.pending:
            batch, self.pending = self.pending[:self.BATCH], self.pending[self.BATCH:]
            self.client.log_batch(self.run_id, metrics=batch)

    def close(self):
        self.flush()
        self.client.set_terminated(self.run_id, "FINISHED")


_CLASSES = {"tensorboard": TensorBoardTracker, "wandb": WandbTracker, "mlflow": MlflowTracker}


def make_trackers(names: Optional[Iterable[str]], run_dir: str, config: Optional[dict] = None,
                  rank: int = 0) -> List[Tracker]:
    """The trackers named, started on rank 0; every other rank gets an empty list (and only
    the names are checked there). Raises ValueError with :func:`check_trackers`' line for an
    unknown or missing one, and one line with the package's own error when it is installed
    but fails to import or to start."""
    names = _names(names)
    problem = check_trackers(names) if rank == 0 else _unknown(names)
    if problem:
        raise ValueError(problem)
    if rank != 0:
        return []
    made: List[Tracker] = []
    try:
        for n in names:
            try:
                made.append(_CLASSES[n](run_dir, config))
            except ImportError as exc:
                raise ValueError(_missing(n, f"cannot be imported ({exc})")) from exc
            except Exception as exc:
                raise ValueError(f"tracker {n}: could not start "
                                 f"({type(exc).__name__}: {' '.join(str(exc).split())[:300]})") \
                    from exc
    except ValueError:
        for t in made:
            _close_quietly(t)
        raise
    return made


def _close_quietly(tracker: Tracker) -> None:
    try:
        tracker.close()
    except Exception:
        pass


def open_trackers(names: Optional[Iterable[str]], run_dir: str, comm,
                  config: Optional[dict] = None) -> Optional["Mirror"]:
    """Collective (every rank calls it, whatever it passes): rank 0 checks and starts the
    trackers named, and every rank raises the same one-line ValueError when rank 0 could not
    (unknown name, package missing or broken, a tracker that failed to start). Returns the
    :class:`Mirror` for ``MetricsWriter(trackers=...)`` on rank 0 when trackers were named,
    else None. ``config`` goes to each tracker as the run's configuration."""
    names = _names(names)
    error, trackers = None, []
    if comm.rank == 0:
        try:
            trackers = make_trackers(names, run_dir, config, 0)
        except ValueError as exc:
            error = str(exc)
    else:
        error = _unknown(names)          # the packages matter on rank 0 only
    message = comm.agree(error)
    if message:
        for t in trackers:
            _close_quietly(t)
        raise ValueError(message)
    return Mirror(trackers) if trackers else None


# -- rows -> tracker keys ------------------------------------------------------------------------
def tracker_scalars(group: str, row: Mapping[str, object]) -> Dict[str, float]:
    """The tracker keys and values of one metrics row (see the module's table); {} for a row
    that is not mirrored (a local election)."""
    if group == "train":
        items = [(f"train/{c}", row[c]) for c in TRAIN_KEYS if c in row]
    elif group == "eval":
        items = [(f"eval/{c}", v) for c, v in row.items() if c not in EVAL_SKIP]
    elif group == "leader":
        items = [("leader/rank", row["leader_rank"])] if int(row.get("scope", 1)) == 0 else []
    elif group == "consensus":
        items = [("consensus/distance", row["distance"])]
    else:
        items = []
    return _finite(items)


def _finite(items) -> Dict[str, float]:
    out = {}
    for key, value in items:
        try:
            v = float(value)
        except (TypeError, ValueError):
            continue
        if not math.isnan(v):
            out[key] = v
    return out


class Mirror:
    """What a metrics writer feeds its trackers through: rows become tracker keys
    (:func:`tracker_scalars`), and a tracker that raises is reported once on stderr and fed
    no more (the metrics file, the record, is not affected). Closed by the writer's
    ``close()``, else at the interpreter's exit."""

    def __init__(self, trackers: Sequence[Tracker]):
        self.trackers = list(trackers)
        self.closed = False
        atexit.register(self.close)

    def __bool__(self) -> bool:
        return bool(self.trackers)

    def log_row(self, group: str, row: Mapping[str, object]) -> None:
        if self.trackers:
            self.log_scalars(int(row["step"]), tracker_scalars(group, row))

    def log_scalars(self, step: int, scalars: Mapping[str, float]) -> None:
        if scalars:
            self._each("log", lambda t: t.log_scalars(int(step), scalars))

    def flush(self) -> None:
        self._each("flush", lambda t: t.flush())

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._each("close", lambda t: t.close())
        self.trackers = []
        atexit.unregister(self.close)

    def _each(self, what: str, call) -> None:
        for t in list(self.trackers):
            try:
                call(t)
            except Exception as exc:
                self.trackers.remove(t)
                print(f"[lsgd_hpc] tracker {t.name}: {what} failed ({type(exc).__name__}: "
                      f"{' '.join(str(exc).split())[:200]}); it gets no more rows (the "
                      f"metrics files are not affected)", file=sys.stderr, flush=True)
                if what != "close":
                    _close_quietly(t)
