"""Run-time pieces for a training loop: the run directory (rundir), the per-rank metrics file
(metrics: the schema and writer; run_metrics: open_metrics and RunMetrics), checkpoints
(checkpoint: the files and the Checkpointer), stop signals (signals) and their agreement
(stopping), SLURM requeue (preemption), the collective watchdog (watchdog), a resumable
sharded sampler (ShardedSampler, from lsgd_hpc.data.sampler) and the run's completion record, RUN_DIR/complete.json
(completion). The launcher's environment and the collective monitor belong to the
communication layer (lsgd_hpc.comm.launcher, lsgd_hpc.comm.monitor).

Names are imported on first use, so that the offline tools can read the metrics schema
(``lsgd_hpc.runtime.metrics``) and the completion record (``lsgd_hpc.runtime.completion``)
without loading torch.
"""

from lsgd_hpc._exports import lazy_getattr as _lazy_getattr

#: public name -> module that defines it (relative: of this package)
_EXPORTS = {
    "MetricsWriter": "metrics", "RunMetrics": "run_metrics", "open_metrics": "run_metrics",
    "Checkpointer": "checkpoint", "StopSignals": "signals", "requeue": "preemption",
    "Watchdog": "watchdog", "start_watchdog": "watchdog", "ShardedSampler": "lsgd_hpc.data.sampler",
    "make_run_dir": "rundir", "write_completion": "completion",
    "read_completion": "completion",
}

__all__ = ["MetricsWriter", "RunMetrics", "open_metrics", "Checkpointer", "StopSignals",
           "requeue", "Watchdog", "start_watchdog", "ShardedSampler", "make_run_dir",
           "write_completion", "read_completion"]

__getattr__ = _lazy_getattr(globals(), _EXPORTS)
del _lazy_getattr
