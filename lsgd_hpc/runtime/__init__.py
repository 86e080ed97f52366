"""Run-time pieces for a training loop: the per-rank metrics file (metrics), checkpoints
(checkpoint), the stop-signal agreement (stopping), the collective watchdog (watchdog), the
launcher's environment (launcher), and the building blocks a user's loop calls (blocks:
open_metrics, Checkpointer, StopSignals, requeue, start_watchdog, ShardedSampler).

Names of ``blocks`` are imported on first use, so that the offline tools can read the metrics
schema (``lsgd_hpc.runtime.metrics``) without loading torch.
"""

__all__ = ["MetricsWriter", "RunMetrics", "open_metrics", "Checkpointer", "StopSignals",
           "requeue", "Watchdog", "start_watchdog", "ShardedSampler", "make_run_dir"]


def __getattr__(name):
    if name in __all__:
        from . import blocks
        return getattr(blocks, name)
    raise AttributeError(f"module 'lsgd_hpc.runtime' has no attribute {name!r}")
