"""lsgd_hpc: Leader SGD and baselines for distributed training on MPI clusters.

The public API (docs/library.md)::

    import lsgd_hpc
    comm = lsgd_hpc.init(backend="mpi")
    method = lsgd_hpc.LeaderSGD(model, optimizer, comm, tau_local=4, tau_global=16)
    ...
    loss.backward()
    method.step(loss)                  # in place of optimizer.step()

Names are imported on first use, so ``import lsgd_hpc`` (and the offline tools,
``python -m lsgd_hpc.aggregate``) load neither torch nor mpi4py.
"""

from lsgd_hpc._exports import lazy_getattr as _lazy_getattr, listed_dir as _listed_dir
from lsgd_hpc._version import __version__

#: public name -> module that defines it
_EXPORTS = {
    "init": "session", "Comm": "session", "ON_FAILURE": "session",
    "exit_as_interpreter": "session",
    "ProcessFailure": "comm.failures", "UnrecoverableFailure": "comm.failures",
    "Method": "methods", "METHODS": "methods", "method_class": "methods",
    "LeaderSGD": "methods", "AsyncLeaderSGD": "methods", "AllreduceSGD": "methods",
    "EASGD": "methods", "LocalSGD": "methods", "GossipSGD": "methods",
    "DiLoCo": "methods", "SlowMo": "methods", "DATASETS": "data.specs",
    "MetricsWriter": "runtime", "open_metrics": "runtime", "Checkpointer": "runtime",
    "StopSignals": "runtime", "Watchdog": "runtime", "ShardedSampler": "data.sampler",
    "requeue": "runtime", "start_watchdog": "runtime", "RunMetrics": "runtime",
    "make_run_dir": "runtime", "write_completion": "runtime", "read_completion": "runtime",
    "check_config": "cli.preflight",
}

__all__ = ["__version__", *_EXPORTS]

__getattr__ = _lazy_getattr(globals(), _EXPORTS)
__dir__ = _listed_dir(globals())
del _lazy_getattr, _listed_dir
