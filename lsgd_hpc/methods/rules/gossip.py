"""Decentralized (gossip) SGD: neighbour-only exchange over a graph, no global collective;
with a compressed wire, CHOCO-SGD's public copies (Koloskova, Stich, Jaggi 2019)."""

from __future__ import annotations

import hashlib
import sys
from typing import List, Optional

import torch

from lsgd_hpc.comm import FlatParams, NodeGroups
from lsgd_hpc.comm.codec import BLOCK, dequantize, quantize
from lsgd_hpc.comm.quantized import Quantized, _Booked, layout
from lsgd_hpc.comm.sparse import decode, encode, select, sent_vector, sparse_layout
from lsgd_hpc.topology import Topology
from lsgd_hpc.methods.rules.base import Rule
from lsgd_hpc.methods.spec import QUANTIZED_COMM_DTYPES

__all__ = ["GossipRule", "ChocoCodec", "choco_gamma", "COMPRESSED_GAMMA"]

#: gamma, CHOCO's consensus step, when none is given: 1 where C rounds mildly (one byte per
#: element), smaller as C drops more (see docs/algorithms.md, "Compressed gossip")
COMPRESSED_GAMMA = {"int8": 1.0, "fp8": 1.0, "int4": 0.8, "int2": 0.4}


def choco_gamma(comm_dtype: str, topk: float = 1.0) -> float:
    """The default consensus step of compressed gossip: ``COMPRESSED_GAMMA[comm_dtype]``
    (fp32 values: 1) for dense compression, and with top-k (``topk`` = F < 1) that times
    min(1, 4 F) (top-k of a fraction F keeps at least F of ||v||^2; a smaller gamma keeps the
    public copies from overshooting)."""
    gamma = COMPRESSED_GAMMA.get(comm_dtype, 1.0)
    return gamma * min(1.0, 4.0 * topk) if topk < 1 else gamma


class ChocoCodec:
    """C, the compression operator of compressed gossip, on the package's wire formats (no
    quantizer of its own): dense ``kind`` (int8, fp8, int4, int2) blocks of at most ``block``
    elements with one float32 scale each, as a quantized broadcast sends them
    (lsgd_hpc.comm.quantized, ``layout(n, 1)``); or, with ``topk`` = F < 1, the top-k entries
    of every chunk with values as ``kind`` (fp32 allowed) (lsgd_hpc.comm.sparse). One
    message of ``wire`` bytes per vector (the ``counted`` bytes of it are the package's
    logical payload: padding left out). ``encode`` then ``decode`` of the same bytes gives the
    same bits on every rank: the sender and its neighbours all add the decoded message."""

    def __init__(self, n: int, kind: str, topk: float = 1.0, block: int = BLOCK):
        self.n, self.kind, self.sparse = n, kind, topk < 1
        if self.sparse:
            self.lay = sparse_layout(n, topk, kind, block)
            self.wire, self.counted = self.lay.m * self.lay.record, self.lay.counted
        else:
            self.lay = layout(n, 1, block, kind)
            self.wire, self.counted = self.lay.record, self.lay.counted

    def encode(self, v: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """The message of C(v) (``v``: n float32) into ``out`` (``wire`` bytes, uint8)."""
        lay = self.lay
        if self.sparse:
            encode(*select(v, lay), lay, out)
            return out
        pad = torch.zeros(lay.c, dtype=torch.float32, device=v.device)
        pad[:self.n] = v.reshape(-1)
        q, s = quantize(pad.view(1, lay.b, lay.be), self.kind)
        qv, sv = Quantized._split(out.view(1, lay.record), lay)
        qv.copy_(q)
        sv.copy_(s)
        return out

    def decode(self, message: torch.Tensor) -> torch.Tensor:
        """C(v), dense (n float32), from its message."""
        if self.sparse:
            return sent_vector(*decode(message, self.lay), self.lay)
        q, s = Quantized._split(message.view(1, self.lay.record), self.lay)
        return dequantize(q, s, self.kind).reshape(-1)[:self.n]


class GossipRule(Rule):
    """Adapt-then-combine decentralized SGD over a mixing matrix W:
        x_i <- sum_j W_ij (x_j - eta g_j)
    (the optimizer step is the "adapt"; this hook is the "combine"). Only neighbours
    exchange parameters, through the communicator's neighbour allgather on an MPI
    distributed-graph communicator (one per distinct graph; a time-varying topology
    cycles through its period). W doubly stochastic keeps the global mean of x.

    Compressed (``comm_dtype`` int8, fp8, int4 or int2, or ``topk`` < 1): CHOCO-SGD. Rank i
    keeps public copies x^_i of itself and x^_j of each rank j it ever receives from (the
    union of its in-neighbours over the topology's period), identical on every rank that
    holds them; after the local step (x_i = x_i - eta g_i):

        q_i   = C(x_i - x^_i)                          (ChocoCodec: the message sent)
        x^_j <- x^_j + q_j        for j = i and every j it receives from
        x_i  <- x_i + gamma sum_j W_ij (x^_j - x^_i)   (W of this step)

    The messages go to the out-neighbours of the union graph every step, so that every copy
    of x^_j sees every q_j (a time-varying topology exchanges over the union of its period's
    graphs and mixes with the step's W). gamma (``gamma``; None: :func:`choco_gamma`) is
    the consensus step; C exact and gamma 1 give plain gossip. With W doubly stochastic the
    mean of x is kept, as the copies of x^_j are the same everywhere:
    sum_i sum_j W_ij (x^_j - x^_i) = sum_j x^_j - sum_i x^_i = 0. What C drops stays in
    x_i - x^_i and is sent later: the copies are CHOCO's error feedback (no residual of the
    communicator's is used). The copies start (and restart, after a shrink, a rejoin or a
    checkpoint of another graph) as the exact x, by one float32 neighbour exchange at the
    next combine; a checkpoint holds them (the rank's own state), so a resume on the same
    graph goes on bit for bit.
    """

    name = "gossip"

    def __init__(self, groups: NodeGroups, flat: FlatParams, topology: Topology, log=None,
                 comm_dtype: str = "fp32", topk: float = 1.0, gamma: Optional[float] = None):
        super().__init__(groups, flat, log)
        if topology.n != self.world.size:
            raise ValueError(f"topology has {topology.n} nodes, world has {self.world.size}")
        self.topology = topology
        #: the topology asked for (rebuilt under this name over the survivors of a failure)
        self.topology_name = topology.name
        self._recv = {}
        self.comm_dtype, self.topk = comm_dtype, float(topk)
        #: whether the wire is compressed (CHOCO-SGD); fp32 and bf16 gossip plain
        self.compressed = comm_dtype in QUANTIZED_COMM_DTYPES or self.topk < 1
        self.gamma = (choco_gamma(comm_dtype, self.topk) if gamma is None else float(gamma)) \
            if self.compressed else 1.0
        if self.compressed:
            self.codec = ChocoCodec(flat.flat.numel(), comm_dtype, self.topk)
            self._choco_graph()
            #: x^_i (None: to be set to x by the next combine's exact exchange)
            self.public: Optional[torch.Tensor] = None
            #: x^_j of the union in-neighbours, one row each (``sources`` order)
            self.copies: Optional[torch.Tensor] = None

    def after_step(self, step: int, loss: float) -> None:
        self.combine(step)

    def combine(self, step: int) -> None:
        if self.compressed:
            self.choco_combine(step)
            return
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

    # -- CHOCO-SGD -----------------------------------------------------------------------------
    def _choco_graph(self) -> None:
        """The union graph of the period (this rank's sources and destinations), its key, its
        signature (the whole graph, the same on every rank) and the message buffers."""
        me, topo = self.world.rank, self.topology
        steps = range(topo.period)
        self.sources: List[int] = sorted({j for t in steps for j in topo.in_neighbors(me, t)})
        self.destinations: List[int] = sorted({j for t in steps
                                               for j in topo.out_neighbors(me, t)})
        self._row = {j: k for k, j in enumerate(self.sources)}
        self._union_key = (topo.name, 0 if topo.period == 1 else "union", "choco")
        every = [sorted({j for t in steps for j in topo.in_neighbors(i, t)})
                 for i in range(topo.n)]
        self.signature = hashlib.blake2b(repr((topo.name, topo.n, every)).encode(),
                                         digest_size=16).hexdigest()
        x = self.flat.flat
        u8 = dict(dtype=torch.uint8, device=x.device)
        self._message = torch.zeros(self.codec.wire, **u8)
        self._messages = torch.zeros((len(self.sources), self.codec.wire), **u8)

    @property
    def _plain(self):
        """The communicator under the compressed wrapper (the exact exchange of the copies;
        byte messages pass through either)."""
        return getattr(self.world, "inner", self.world)

    def _exact_copies(self) -> None:
        """x^_i <- x_i and x^_j <- x_j for every source j: one float32 neighbour exchange
        over the union graph (counted as such)."""
        x = self.flat.flat
        self.public = x.detach().clone()
        self.copies = torch.empty((len(self.sources), x.numel()), dtype=x.dtype,
                                  device=x.device)
        self._plain.neighbor_allgather(self.public, self.sources, self.destinations,
                                       out=self.copies, graph_key=self._union_key)

    def choco_combine(self, step: int) -> None:
        """One CHOCO-SGD round (the class docstring): q_i = C(x_i - x^_i) sent to the union
        out-neighbours, every copy advanced by its q, x_i moved by gamma toward the W-mix of
        the copies. Counted: the messages' payload, ``codec.counted`` bytes per destination
        sent and per source received."""
        if self.public is None:
            self._exact_copies()
        me, topo, x, codec = self.world.rank, self.topology, self.flat.flat, self.codec
        stats = self.world.stats
        with _Booked(stats, unit=(codec.wire, codec.counted)):
            codec.encode(x - self.public, self._message)
            self._plain.neighbor_allgather(self._message, self.sources, self.destinations,
                                           out=self._messages, graph_key=self._union_key)
        self.public.add_(codec.decode(self._message))
        for k in range(len(self.sources)):
            self.copies[k].add_(codec.decode(self._messages[k]))
        _, w = topo.weights(me, step)
        if not w:
            return
        mix = torch.zeros_like(x)
        for j in topo.in_neighbors(me, step):
            mix.add_(self.copies[self._row[j]] - self.public, alpha=w[j])
        x.add_(mix, alpha=self.gamma)

    # -- state ---------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Plain gossip: nothing. Compressed: the public copies (this rank's own state) and
        the signature of the graph they belong to."""
        if not self.compressed:
            return super().state_dict()
        copies = None if self.public is None else {
            "public": self.public.detach().clone(), "copies": self.copies.detach().clone(),
            "sources": list(self.sources)}
        return {"choco": {"signature": self.signature, "state": copies}}

    def load_state_dict(self, state: dict) -> None:
        """The copies back when they belong to this graph (the same signature on every rank:
        every rank decides alike); otherwise they restart from the exact x at the next
        combine."""
        if not self.compressed:
            return super().load_state_dict(state)
        saved = state.get("choco") or {}
        got = saved.get("state")
        if saved.get("signature") != self.signature or got is None \
                or got["public"].numel() != self.flat.flat.numel():
            self.public = self.copies = None
            return
        x = self.flat.flat
        self.public = got["public"].to(dtype=x.dtype, device=x.device).clone()
        self.copies = got["copies"].to(dtype=x.dtype, device=x.device).clone()

    def rejoin(self, world, joined: bool, source: int) -> str:
        how = super().rejoin(world, joined, source)
        if self.compressed:                 # every rank: the copies restart, exact
            self.public = self.copies = None
        return how

    def resume(self, recovery) -> None:
        """The topology rebuilt over the survivors (a ring when it cannot be built at the new
        size), with a warning from the lowest survivor. Compressed: the public copies restart
        on every survivor from the exact x (one float32 exchange at the next combine)."""
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
        if self.compressed:
            self.public = self.copies = None
            self._choco_graph()
        if recovery.world.rank == 0 and recovery.ctx.first_attempt:
            print(f"[lsgd_hpc] warning: GossipSGD: {note}, with its weights for {n} ranks",
                  file=sys.stderr, flush=True)
