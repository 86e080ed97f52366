"""The training methods: one public class per method over the user's model and optimizer
(api), each over its update rule (rules/, one small module per method), and each described
once by its spec (registry: options, defaults, checks, cost), which the CLI, the planner and
the docs read.

``lsgd_hpc.methods.registry`` and ``lsgd_hpc.methods.spec`` import without torch; the classes
(and METHODS) are imported on first use.
"""

__all__ = ["Method", "LeaderSGD", "AsyncLeaderSGD", "AllreduceSGD", "EASGD", "LocalSGD",
           "DiLoCo", "SlowMo", "GossipSGD", "METHODS", "method_class"]


def __getattr__(name):
    if name in __all__:
        from . import api
        return getattr(api, name)
    raise AttributeError(f"module 'lsgd_hpc.methods' has no attribute {name!r}")
