"""The building blocks of a user's loop, each now in a module of its own (rundir, run_metrics,
checkpoint, preemption, watchdog, sampler); these names stay importable from here for older
callers. New code: ``from lsgd_hpc.runtime import ...`` (or ``lsgd_hpc``)."""

from lsgd_hpc.runtime.checkpoint import Checkpointer
from lsgd_hpc.runtime.metrics import MetricsWriter
from lsgd_hpc.runtime.preemption import requeue, scontrol_requeue
from lsgd_hpc.runtime.run_metrics import RunMetrics, open_metrics
from lsgd_hpc.runtime.rundir import git_sha, make_run_dir
from lsgd_hpc.runtime.sampler import ShardedSampler
from lsgd_hpc.runtime.signals import StopSignals
from lsgd_hpc.runtime.watchdog import Watchdog, start_watchdog

__all__ = ["MetricsWriter", "RunMetrics", "open_metrics", "Checkpointer", "StopSignals",
           "requeue", "scontrol_requeue", "git_sha", "Watchdog", "start_watchdog",
           "ShardedSampler", "make_run_dir"]
