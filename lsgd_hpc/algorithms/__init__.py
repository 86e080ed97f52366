"""Training methods, one small module each, over the communication interface."""

from .allreduce import AllreduceSGD
from .base import Algorithm, uncounted
from .diloco import DiLoCo
from .easgd import EASGD
from .gossip import GossipSGD
from .local_sgd import LocalSGD
from .lsgd import LeaderSGD
from .lsgd_async import AsyncLeaderSGD
from .slowmo import SlowMo

__all__ = ["Algorithm", "AllreduceSGD", "AsyncLeaderSGD", "DiLoCo", "EASGD", "GossipSGD",
           "LeaderSGD", "LocalSGD", "SlowMo", "build_algorithm", "uncounted"]


def build_algorithm(cfg, groups, flat, log, steps_per_epoch: int, optimizer=None,
                    score_fn=None) -> Algorithm:
    """The method that ``cfg.algorithm`` names, configured from the resolved options.

    ``optimizer``: the workers' optimizer (SlowMo reads its learning rate). ``score_fn``:
    LSGD's election score when --leader-score is not the training window (see LeaderSGD)."""
    if cfg.algorithm == "lsgd":
        return LeaderSGD(groups, flat, cfg.tau_local, cfg.tau_global, cfg.pull_local,
                         cfg.pull_global, cfg.leader_window, log=log,
                         pull_every_step=cfg.lsgd_pull_every_step, bn=cfg.lsgd_bn,
                         score_fn=score_fn)
    if cfg.algorithm == "lsgd-async":
        staleness = cfg.max_staleness if cfg.max_staleness is not None else cfg.tau_global
        return AsyncLeaderSGD(groups, flat, cfg.tau_local, cfg.tau_global, cfg.pull_local,
                              cfg.pull_global, cfg.leader_window, staleness, log=log)
    if cfg.algorithm == "allreduce":
        return AllreduceSGD(groups, flat, log=log, bucket_bytes=int(cfg.bucket_mb * 2**20))
    if cfg.algorithm == "easgd":
        alpha = cfg.easgd_alpha if cfg.easgd_alpha is not None else 0.9 / groups.world.size
        return EASGD(groups, flat, alpha, cfg.easgd_tau or cfg.tau_local, log=log)
    if cfg.algorithm == "local-sgd":
        return LocalSGD(groups, flat, cfg.local_steps, t_max=max(1, steps_per_epoch),
                        cost_ratio=cfg.local_steps_cost_ratio, log=log)
    if cfg.algorithm == "diloco":
        return DiLoCo(groups, flat, local_steps=int(cfg.local_steps), outer_lr=cfg.outer_lr,
                      outer_momentum=cfg.outer_momentum, outer_nesterov=cfg.outer_nesterov,
                      optimizer=optimizer, log=log)
    if cfg.algorithm == "slowmo":
        return SlowMo(groups, flat, local_steps=int(cfg.local_steps),
                      slowmo_every=cfg.slowmo_every, slowmo_beta=cfg.slowmo_beta,
                      slowmo_alpha=cfg.slowmo_alpha, optimizer=optimizer, log=log)
    if cfg.algorithm == "gossip":
        from ..topology import build_topology
        topo = build_topology(cfg.topology, groups.world.size, node_of=groups.node_of)
        return GossipSGD(groups, flat, topo, log=log)
    raise ValueError(f"unknown algorithm {cfg.algorithm!r}")
