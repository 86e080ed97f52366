"""Decentralized (gossip) SGD: neighbour-only exchange over a graph, no global collective."""

from __future__ import annotations

import sys

import torch

from lsgd_hpc.comm import FlatParams, NodeGroups
from lsgd_hpc.topology import Topology
from lsgd_hpc.methods.rules.base import Rule

__all__ = ["GossipRule"]


class GossipRule(Rule):
    """Adapt-then-combine decentralized SGD over a mixing matrix W:
        x_i <- sum_j W_ij (x_j - eta g_j)
    (the optimizer step is the "adapt"; this hook is the "combine"). Only neighbours
    exchange parameters, through the communicator's neighbour allgather on an MPI
    distributed-graph communicator (one per distinct graph; a time-varying topology
    cycles through its period). W doubly stochastic keeps the global mean of x.
    """

    name = "gossip"

    def __init__(self, groups: NodeGroups, flat: FlatParams, topology: Topology, log=None):
        super().__init__(groups, flat, log)
        if topology.n != self.world.size:
            raise ValueError(f"topology has {topology.n} nodes, world has {self.world.size}")
        self.topology = topology
        #: the topology asked for (rebuilt under this name over the survivors of a failure)
        self.topology_name = topology.name
        self._recv = {}

    def after_step(self, step: int, loss: float) -> None:
        self.combine(step)

    def combine(self, step: int) -> None:
        me, topo, x = self.world.rank, self.topology, self.flat.flat
        src, dst = topo.in_neighbors(me, step), topo.out_neighbors(me, step)
        w_self, w = topo.weights(me, step)
        recv = self._recv.get(len(src))
        if recv is None:
            recv = self._recv[len(src)] = torch.empty((len(src), x.numel()), dtype=x.dtype,
                                                      device=x.device)
        key = (topo.name, step % topo.period)   # names the whole graph on every rank
        self.world.neighbor_allgather(x, src, dst, out=recv, graph_key=key)
        x.mul_(w_self)
        for k, j in enumerate(src):
            x.add_(recv[k], alpha=w[j])

    def resume(self, recovery) -> None:
        """The topology rebuilt over the survivors (a ring when it cannot be built at the new
        size), with a warning from the lowest survivor."""
        from lsgd_hpc.topology import build_topology
        name, n = self.topology_name, recovery.world.size
        try:
            topo = build_topology(name, n, node_of=self.groups.node_of)
            note = f"topology {name} rebuilt over the {n} survivors"
        except ValueError as exc:
            topo = build_topology("ring", n)
            note = f"topology {name} cannot be built over {n} ranks ({exc}); a ring instead"
        self.topology = topo
        self._recv = {}
        if recovery.world.rank == 0 and recovery.ctx.first_attempt:
            print(f"[lsgd_hpc] warning: GossipSGD: {note}, with its weights for {n} ranks",
                  file=sys.stderr, flush=True)
