"""An alpha-beta cost model of one training step per method: compute plus its communication.

Every function here is pure (numbers in, numbers out): no MPI, no torch, so the model can be
tested on constructed inputs and evaluated for clusters far larger than the one at hand.

Links (Hockney). Sending m bytes over a link costs ``alpha + m * beta`` seconds: alpha is the
per-message latency, beta = 1 / bandwidth. A cluster has two kinds of link: inside a node
(shared memory, NVLink: ``intra``) and between nodes (the network: ``inter``). p = N * q ranks,
N nodes of q ranks, consecutive ranks on one node (as ``NodeGroups`` lays them out). All of a
node's traffic to other nodes shares its one network link.

Collectives over g ranks on one kind of link (n bytes):

    ring allreduce          2 (g-1) alpha + 2 (g-1)/g n beta
    recursive doubling      ceil(log2 g) (alpha + n beta)
    binomial broadcast      ceil(log2 g) (alpha + n beta)
    scatter + allgather     (ceil(log2 g) + g - 1) alpha + 2 (g-1)/g n beta   (broadcast)

and over a whole cluster (1 < N, 1 < q), where each algorithm's slowest hop sets its pace:

    flat ring               2 (p-1) alpha_e + 2 (p-1)/p n beta_e
                            (every step waits for a hop between nodes; one rank per node
                            sends across, so the node link carries 2 (p-1)/p n)
    hierarchical ring       2 (q-1) alpha_i + 2 (q-1)/q n beta_i + 2 (N-1) alpha_e
                            + 2 (N-1)/N n beta_e   (reduce-scatter inside, q rings of n/q
                            between nodes sharing the node link, allgather inside)
    recursive doubling      log2 q (alpha_i + n beta_i) + log2 N (alpha_e + q n beta_e)
                            (in the steps between nodes all q ranks of a node send n at once)
    binomial broadcast      log2 N (alpha_e + n beta_e) + log2 q (alpha_i + n beta_i)
                            (largest distance first: one sender per node crosses)

A library picks its algorithm by message size; ``Collectives(algorithm="auto")`` takes the
fastest of them (a well-tuned library), or a named one (``ring``, ``hierarchical``,
``doubling``) to describe a library that always uses it.

Per method, the communication per step is the cost of one communication round divided by the
period (tau, T) that amortises it, plus elementwise passes over the model (the pulls and
averages read and write the whole flat vector: ``mem_Bps``), plus a software cost per
collective call (``call_overhead_s``: the Python path, and lsgd_hpc's agreement check, a
48-byte allreduce before every collective unless LSGD_HPC_COMM_VALIDATE=0). Step time is

    t_step = t_compute + t_comm            (no overlap; ``overlap`` hides up to that fraction
                                            of compute behind allreduce SGD's communication)

Bytes per step are lsgd_hpc's logical payload per rank, as /train/comm_bytes_sent counts them
(allreduce of n: n sent; broadcast: n sent by its root only; neighbour exchange: n per
out-neighbour), averaged over ranks.

Workers that span ranks (``worker_ranks`` = K or ``node``; :func:`with_workers`): q_w ranks of
a node form one worker. Inside it, every step, the gradient's allreduce over q_w ranks on the
intra-node link (allreduce SGD on a one-node cluster of q_w ranks, in float32); between
workers, the method's own cost on the cluster of the workers' first ranks, N nodes of
q / q_w of them (N workers with ``node``: every round on the inter-node link), with
N_workers in place of ranks; after each of its rounds the result is spread from the first
rank to the others of its worker (one broadcast of the round's payload over q_w ranks on the
intra link):

    t_comm = A_intra(g, q_w) + t_method(cluster of workers) + rounds/step * B_intra(m, q_w)

Bytes per step (comm_bytes_sent) are the method's between workers, sent by first ranks only
(mean over all ranks: / q_w); the traffic inside a worker (worker_bytes_sent) is apart.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Dict, List, Optional, Sequence, Tuple

__all__ = ["wire_bytes", "pull_bytes", "hierarchical", "hier_allreduce_time", "round_bytes_sent",
           "exchange_ranks", "call_cost", "node_cluster", "pass_time",
           "Link", "Cluster", "Workload", "Collectives", "MethodCost", "ALLREDUCE_ALGORITHMS",
           "ring_allreduce", "doubling_allreduce", "binomial_broadcast",
           "scatter_allgather_broadcast", "allreduce_time", "broadcast_time",
           "cluster_broadcast_time", "hierarchical_broadcast_time", "election_time",
           "gossip_exchange", "neighbor_degrees", "topology_degrees", "method_cost",
           "allreduce_sgd", "lsgd", "easgd", "local_sgd", "diloco", "slowmo",
           "gossip", "smallest_period", "ELECTION_BYTES", "CHECK_BYTES", "FLOAT_BYTES",
           "WorkerCost", "worker_size", "workers_cluster", "with_workers",
           "between_nodes_allreduce_time", "rho", "VALUE_BITS", "TOPK_CHUNK",
           "topk_payload_bytes", "ring_allgather_time"]

#: MPI.DOUBLE_INT (score, rank), padded: the payload of one MINLOC election
ELECTION_BYTES = 16
#: lsgd_hpc's agreement check before each collective: (numel, dtype, root) and their negatives
CHECK_BYTES = 48
FLOAT_BYTES = 4
#: top-k (lsgd_hpc.comm.sparse): elements per chunk, and bits of each kind of value sent
TOPK_CHUNK = 4096
VALUE_BITS = {"fp32": 32, "bf16": 16, "int8": 8, "fp8": 8, "int4": 4, "int2": 2}
ALLREDUCE_ALGORITHMS = ("auto", "ring", "hierarchical", "doubling")


def _log2(g: int) -> int:
    return int(math.ceil(math.log2(g))) if g > 1 else 0


@dataclass(frozen=True)
class Link:
    """One kind of link: latency ``alpha_s`` (seconds per message), ``beta_s`` (seconds per
    byte, 1 / bandwidth; 0 means infinite bandwidth)."""

    alpha_s: float
    beta_s: float

    @classmethod
    def from_gbps(cls, gbit_per_s: float, latency_us: float) -> "Link":
        """A link of ``gbit_per_s`` Gbit/s (inf for infinite) and ``latency_us`` microseconds."""
        beta = 0.0 if math.isinf(gbit_per_s) else 8.0 / (gbit_per_s * 1e9)
        return cls(latency_us * 1e-6, beta)

    def time(self, nbytes: float) -> float:
        return self.alpha_s + nbytes * self.beta_s

    @property
    def gbps(self) -> float:
        return math.inf if self.beta_s == 0 else 8.0 / self.beta_s / 1e9


@dataclass(frozen=True)
class Cluster:
    """``nodes`` x ``ranks_per_node`` ranks; ``intra`` and ``inter`` links; software costs.

    ``mem_Bps``: bytes per second of an elementwise pass over the model (memory bandwidth of
    the device that holds it; inf: free). ``call_overhead_s``: fixed software cost of each
    collective call. ``checks``: lsgd_hpc's agreement check precedes every collective.
    """

    nodes: int
    ranks_per_node: int
    intra: Link
    inter: Link
    mem_Bps: float = math.inf
    call_overhead_s: float = 0.0
    checks: bool = False

    @property
    def ranks(self) -> int:
        return self.nodes * self.ranks_per_node

    def node_of(self) -> List[int]:
        return [r // self.ranks_per_node for r in range(self.ranks)]


@dataclass(frozen=True)
class Workload:
    """The model and its step: ``n_params`` trainable parameters, ``n_buffers`` floating-point
    buffer elements (BatchNorm statistics), ``compute_s`` seconds of one local step
    (forward, backward, optimizer) on one rank."""

    n_params: int
    n_buffers: int
    compute_s: float
    element_bytes: float = FLOAT_BYTES
    topk: float = 1.0        # < 1: the periodic methods send a top-k (topk_payload_bytes)
    value_bits: int = 32     # bits of each top-k value (VALUE_BITS of the comm_dtype)
    #: int8/fp8/int4/int2, or top-k: the averaging methods' rounds are the package's
    #: compressed allreduce (hierarchical or flat, hier_allreduce_time)
    comm_dtype: str = "fp32"

    @property
    def grad_bytes(self) -> float:
        return self.n_params * self.element_bytes

    @property
    def flat_bytes(self) -> float:
        """The fused vector every averaging method moves: parameters and buffers."""
        return (self.n_params + self.n_buffers) * self.element_bytes

    @property
    def buffer_bytes(self) -> float:
        return self.n_buffers * self.element_bytes


# -- collectives on one kind of link -----------------------------------------------------------
def ring_allreduce(nbytes: float, g: int, link: Link) -> float:
    """2 (g-1) alpha + 2 (g-1)/g n beta (reduce-scatter, then allgather, around a ring)."""
    if g <= 1:
        return 0.0
    return 2 * (g - 1) * link.alpha_s + 2 * (g - 1) / g * nbytes * link.beta_s


def doubling_allreduce(nbytes: float, g: int, link: Link) -> float:
    """ceil(log2 g) (alpha + n beta): recursive doubling, every step a full exchange."""
    return _log2(g) * link.time(nbytes)


def binomial_broadcast(nbytes: float, g: int, link: Link) -> float:
    """ceil(log2 g) (alpha + n beta)."""
    return _log2(g) * link.time(nbytes)


def scatter_allgather_broadcast(nbytes: float, g: int, link: Link) -> float:
    """(ceil(log2 g) + g - 1) alpha + 2 (g-1)/g n beta (van de Geijn: binomial scatter of n/g
    pieces, then a ring allgather)."""
    if g <= 1:
        return 0.0
    return (_log2(g) + g - 1) * link.alpha_s + 2 * (g - 1) / g * nbytes * link.beta_s


@dataclass(frozen=True)
class Collectives:
    """Which allreduce algorithm the library uses: ``auto`` (the fastest of ring, hierarchical
    and recursive doubling at each size), or one of them always. Broadcasts take the faster
    of binomial and scatter-allgather."""

    algorithm: str = "auto"

    def __post_init__(self):
        if self.algorithm not in ALLREDUCE_ALGORITHMS:
            raise ValueError(f"allreduce algorithm must be one of {', '.join(ALLREDUCE_ALGORITHMS)}"
                             f", got {self.algorithm!r}")


def _allreduce_candidates(nbytes: float, c: Cluster) -> Dict[str, float]:
    N, q = c.nodes, c.ranks_per_node
    p = N * q
    if p <= 1:
        return {"ring": 0.0, "hierarchical": 0.0, "doubling": 0.0}
    if N == 1 or q == 1:
        link = c.intra if N == 1 else c.inter
        ring = ring_allreduce(nbytes, p, link)
        return {"ring": ring, "hierarchical": ring, "doubling": doubling_allreduce(nbytes, p, link)}
    a_i, b_i, a_e, b_e = c.intra.alpha_s, c.intra.beta_s, c.inter.alpha_s, c.inter.beta_s
    flat_ring = 2 * (p - 1) * max(a_e, a_i) + 2 * (p - 1) / p * nbytes * max(b_e, b_i)
    hier = ring_allreduce(nbytes, q, c.intra) + (2 * (N - 1) * a_e + 2 * (N - 1) / N * nbytes * b_e)
    doubling = _log2(q) * c.intra.time(nbytes) + _log2(N) * (a_e + q * nbytes * b_e)
    return {"ring": flat_ring, "hierarchical": hier, "doubling": doubling}


def allreduce_time(nbytes: float, c: Cluster, coll: Collectives = Collectives()) -> float:
    """Seconds of one allreduce of ``nbytes`` over every rank of the cluster."""
    cand = _allreduce_candidates(nbytes, c)
    t = min(cand.values()) if coll.algorithm == "auto" else cand[coll.algorithm]
    return t + call_cost(c)


def topk_payload_bytes(n: int, topk: float, value_bits: int = 32,
                       chunk: int = TOPK_CHUNK) -> int:
    """S, one rank's top-k payload for an n-element vector (lsgd_hpc.comm.sparse's count):
    m = ceil(n / c) chunks of c = min(chunk, n), k = ceil(F c) (1 to c) of each sent as an
    int16 index (int32 above 32768 elements) and a value of ``value_bits``, one float32
    scale per chunk for quantized values (none for fp32):
    S = m (scale + 2 k + ceil(k bits / 8))."""
    c = min(chunk, n)
    m = -(-n // c)
    k = max(1, min(c, math.ceil(topk * c)))
    index = 2 if c <= 32768 else 4
    scale = 0 if value_bits >= 16 else 4          # fp32 and bf16 values carry no scale
    return m * (scale + k * index + -(-k * value_bits // 8))


def ring_allgather_time(nbytes: float, c: Cluster) -> float:
    """One allgather of ``nbytes`` from every rank over the whole cluster (the top-k
    exchange, flat over all ranks): a ring of p - 1 steps, each waiting for the slowest hop;
    every rank, and each node's network link, receives (p - 1) n:
    (p-1) alpha + (p-1) n beta, alpha and beta of the slowest link used."""
    p = c.ranks
    if p <= 1:
        return 0.0
    links = [c.intra] if c.nodes == 1 else [c.inter] if c.ranks_per_node == 1 \
        else [c.intra, c.inter]
    alpha, beta = max(x.alpha_s for x in links), max(x.beta_s for x in links)
    return (p - 1) * (alpha + nbytes * beta) + call_cost(c)


def between_nodes_allreduce_time(nbytes: float, c: Cluster) -> float:
    """Seconds of the between-nodes stage of a hierarchical allreduce of ``nbytes`` (the
    package's fp32 allreduce crosses the network link once per node): q rings of n/q over
    the N nodes sharing each node's link, 2 (N-1) alpha_e + 2 (N-1)/N n beta_e; 0 on one
    node."""
    return ring_allreduce(nbytes, c.nodes, c.inter)


def rho(n_params: int, c: Cluster, compute_s: float) -> float:
    """The communication-to-compute ratio: seconds of one fp32 allreduce of the model's
    ``n_params`` parameters between nodes (between_nodes_allreduce_time of 4 n bytes) over
    ``compute_s``, the seconds of one compute step (inf when that is 0 and something
    crosses; 0 on one node)."""
    t = between_nodes_allreduce_time(n_params * FLOAT_BYTES, c)
    if compute_s <= 0:
        return math.inf if t > 0 else 0.0
    return t / compute_s


def broadcast_time(nbytes: float, g: int, link: Link) -> float:
    """Seconds of one broadcast over g ranks on one kind of link (the faster algorithm)."""
    if g <= 1:
        return 0.0
    return min(binomial_broadcast(nbytes, g, link), scatter_allgather_broadcast(nbytes, g, link))


def cluster_broadcast_time(nbytes: float, c: Cluster) -> float:
    """One broadcast over the whole cluster by the library's own algorithm (no node
    awareness): binomial (largest distance first) or scatter-allgather, the faster."""
    N, q = c.nodes, c.ranks_per_node
    if N == 1 or q == 1:
        return broadcast_time(nbytes, N * q, c.intra if N == 1 else c.inter)
    p = N * q
    binomial = _log2(N) * c.inter.time(nbytes) + _log2(q) * c.intra.time(nbytes)
    sag = (_log2(p) + p - 1) * max(c.inter.alpha_s, c.intra.alpha_s) \
        + 2 * (p - 1) / p * nbytes * max(c.inter.beta_s, c.intra.beta_s)
    return min(binomial, sag)


def hierarchical_broadcast_time(nbytes: float, c: Cluster) -> float:
    """LSGD's global broadcast, crossing node boundaries once per node: inside the leader's
    node first when the leader is not its node's root (probability 1 - 1/q, leader uniform),
    then among the N node roots, then inside every node:

        (1 - 1/q) B_intra(q) + B_inter(N) + B_intra(q)
    """
    N, q = c.nodes, c.ranks_per_node
    b_in = broadcast_time(nbytes, q, c.intra)
    in_node, roots = call_cost(node_cluster(c)), call_cost(_roots(c))
    return ((1 - 1 / q) * (b_in + in_node) + broadcast_time(nbytes, N, c.inter) + roots
            + b_in + in_node)


def election_time(c: Cluster, scope: str = "world") -> float:
    """One MINLOC election (16 bytes): recursive doubling, log2 q steps inside the node and
    log2 N between nodes; ``scope='node'``: inside one node only."""
    on = node_cluster(c) if scope == "node" else c
    return min(_allreduce_candidates(ELECTION_BYTES, on).values()) + call_cost(on)


def call_cost(c: Cluster) -> float:
    """Software cost of one collective call on the (sub-)cluster ``c``: the fixed overhead,
    and the agreement check (48 bytes, latency-bound) when on. Nothing for one rank."""
    if c.ranks <= 1:
        return 0.0
    check = min(_allreduce_candidates(CHECK_BYTES, c).values()) if c.checks else 0.0
    return c.call_overhead_s + check


def node_cluster(c: Cluster) -> Cluster:
    """The sub-cluster of one node (a node communicator)."""
    return replace(c, nodes=1)


def _roots(c: Cluster) -> Cluster:
    """The sub-cluster of the node roots (one rank per node)."""
    return replace(c, ranks_per_node=1)


def pass_time(nbytes: float, c: Cluster, k: float) -> float:
    """k elementwise passes (read + write) over nbytes of model."""
    return 0.0 if math.isinf(c.mem_Bps) else k * 2 * nbytes / c.mem_Bps


# -- gossip ----------------------------------------------------------------------------------
def neighbor_degrees(out_neighbors: Sequence[Sequence[int]], ranks_per_node: int
                     ) -> List[Tuple[int, int]]:
    """(out-neighbours on the rank's own node, out-neighbours on other nodes) of every rank."""
    q = ranks_per_node
    out = []
    for i, outs in enumerate(out_neighbors):
        d_inter = sum(1 for j in outs if j // q != i // q)
        out.append((len(outs) - d_inter, d_inter))
    return out


def gossip_exchange(degrees: Sequence[Tuple[int, int]], nbytes: float,
                    c: Cluster) -> Tuple[float, float, int]:
    """One neighbour exchange: every rank sends its n bytes to each out-neighbour at once.

    ``degrees[i]`` = (d_intra, d_inter) of rank i (neighbor_degrees). A rank's sends inside
    its node share its own link (d_intra n beta_i); a node's sends to other nodes share the
    node's network link (sum over its ranks of d_inter n beta_e); the slower of the two sets
    the pace, plus one latency of the slowest kind of hop used:

        t = alpha + max(max_i d_intra(i) n beta_i,  max_node sum_{i in node} d_inter(i) n beta_e)

    Returns (seconds, mean bytes sent per rank, largest degree).
    """
    q, p = c.ranks_per_node, len(degrees)
    if p <= 1:
        return 0.0, 0.0, 0
    node_inter: Dict[int, int] = {}
    for i, (_, d_inter) in enumerate(degrees):
        node_inter[i // q] = node_inter.get(i // q, 0) + d_inter
    worst_intra = max(d for d, _ in degrees)
    has_inter = any(d for _, d in degrees)
    alpha = max(c.inter.alpha_s if has_inter else 0.0, c.intra.alpha_s if worst_intra else 0.0)
    bw = max(worst_intra * nbytes * c.intra.beta_s,
             max(node_inter.values()) * nbytes * c.inter.beta_s)
    # the agreement check over a graph: two neighbour allgathers of a few bytes
    calls = c.call_overhead_s + (2 * alpha if c.checks else 0.0)
    sent = sum(a + b for a, b in degrees) * nbytes / p
    return alpha + bw + calls, sent, max(a + b for a, b in degrees)


def topology_degrees(name: str, c: Cluster) -> List[Tuple[int, int]]:
    """(d_intra, d_inter) of every rank in lsgd_hpc's topology ``name`` (at step 0), ranks laid
    out node by node. The complete graph is counted directly (it has p^2 edges)."""
    p, q = c.ranks, c.ranks_per_node
    if name == "complete":
        return [(q - 1, p - q)] * p
    from lsgd_hpc.topology import build_topology
    topo = build_topology(name, p, node_of=c.node_of())
    return neighbor_degrees([topo.out_neighbors(i, 0) for i in range(p)], q)


# -- methods -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class MethodCost:
    """Predicted cost of one step: ``comm_s`` is communication (and the update passes it
    needs) per step, amortised over the method's period; ``bytes_per_step`` the payload a
    rank sends per step (mean over ranks)."""

    method: str
    setting: str
    compute_s: float
    comm_s: float
    bytes_per_step: float

    @property
    def step_s(self) -> float:
        return self.compute_s + self.comm_s

    @property
    def comm_share(self) -> float:
        return self.comm_s / self.step_s if self.step_s > 0 else 0.0


def allreduce_sgd(w: Workload, c: Cluster, coll: Collectives = Collectives(),
                  overlap: float = 0.0, bucket_bytes: float = 0.0) -> MethodCost:
    """Every step: allreduce of the gradients (mean: one pass), broadcast of the buffers from
    rank 0. With ``bucket_bytes`` > 0 the gradients go in k = ceil(n / bucket) allreduces of
    n / k bytes (k latencies and call costs). ``overlap`` in [0, 1]: fraction of compute that
    can hide communication (buckets started during backward): comm counts only
    max(0, t_comm - overlap t_compute). With ``w.comm_dtype`` int8/fp8/int4/int2 or
    ``w.topk`` < 1 each bucket (of ceil(n / k) float32 gradients) is the package's compressed
    allreduce (hier_allreduce_time, round_bytes_sent) and the buffers' broadcast stays
    float32."""
    p = c.ranks
    if p == 1:
        return MethodCost("allreduce", "every step", w.compute_s, 0.0, 0.0)
    compressed = w.topk < 1 or w.comm_dtype not in ("fp32", "bf16")
    grad = FLOAT_BYTES * w.n_params if compressed else w.grad_bytes
    k = max(1, math.ceil(grad / bucket_bytes)) if bucket_bytes > 0 else 1
    if compressed:
        m = math.ceil(w.n_params / k)
        t = k * hier_allreduce_time(m, c, w.comm_dtype, w.topk) + pass_time(grad, c, 1)
        sent = k * round_bytes_sent(m, c, w.comm_dtype, w.topk)
        buffers = FLOAT_BYTES * w.n_buffers
    else:
        t = k * allreduce_time(w.grad_bytes / k, c, coll) + pass_time(w.grad_bytes, c, 1)
        sent, buffers = float(w.grad_bytes), w.buffer_bytes
    if w.n_buffers:
        t += cluster_broadcast_time(buffers, c) + call_cost(c)
        sent += buffers / p
    t = max(0.0, t - overlap * w.compute_s)
    setting = "every step" + (f", {k} buckets" if k > 1 else "") + \
        (f", top-k {w.topk:g}" if compressed and w.topk < 1 else "")
    return MethodCost("allreduce", setting, w.compute_s, t, sent)


def lsgd(w: Workload, c: Cluster, tau_local: int, tau_global: int,
         bn: str = "keep") -> MethodCost:
    """Every tau_L steps (multi-leader: 1 < N < p): elect the node's leader and broadcast
    inside the node; every tau_G steps: elect the global leader and broadcast it
    hierarchically (hierarchical_broadcast_time). One node or one rank per node: single
    leader, one flat broadcast every tau_G. Each pull: copy + difference + update, 3 passes.
    ``bn`` is the trainer's --lsgd-bn: with ``keep`` (its default) the leader sends its
    parameters only, with ``copy`` or ``pull`` the BatchNorm buffers too.

        t_comm = (E_node + B_intra(q) + pull) / tau_L + (E_world + B_hier + pull) / tau_G
    """
    if tau_local < 1 or tau_global < 1 or tau_global % tau_local:
        raise ValueError("tau_global must be a positive multiple of tau_local")
    if bn not in ("keep", "copy", "pull"):
        raise ValueError(f"bn must be keep, copy or pull, got {bn!r}")
    N, q, p = c.nodes, c.ranks_per_node, c.ranks
    n = w.grad_bytes if bn == "keep" else w.flat_bytes
    if p == 1:
        return MethodCost("lsgd", f"tau {tau_global}", w.compute_s, 0.0, 0.0)
    pull = pass_time(n, c, 3)
    multi = 1 < N < p
    if multi:
        local = (election_time(c, "node") + broadcast_time(n, q, c.intra)
                 + call_cost(node_cluster(c)) + pull)
        glob = election_time(c) + hierarchical_broadcast_time(n, c) + pull
        # bytes: the node broadcast's root sends n; the hierarchical one sends n in the
        # leader's node, n among roots and n inside every other node: (N + 1) n in all
        sent = n / q / tau_local + (N + 1) * n / p / tau_global
        setting = f"tau_L {tau_local}, tau_G {tau_global}"
        return MethodCost("lsgd", setting, w.compute_s, local / tau_local + glob / tau_global, sent)
    link = c.intra if N == 1 else c.inter
    glob = election_time(c) + broadcast_time(n, p, link) + call_cost(c) + pull
    return MethodCost("lsgd", f"tau {tau_global} (single leader)", w.compute_s,
                      glob / tau_global, n / p / tau_global)


# -- compressed rounds (the package's Quantized communicators) ----------------------------------
@lru_cache(maxsize=None)
def _topk_bytes(n: int, topk: float, kind: str) -> int:
    from lsgd_hpc.comm.sparse import sparse_layout
    return sparse_layout(n, topk, kind).counted


@lru_cache(maxsize=None)
def _dense_bytes(n: int, groups: int, kind: str) -> int:
    from lsgd_hpc.comm.quantized import allreduce_bytes
    return allreduce_bytes(n, max(1, groups), kind=kind)


def wire_bytes(n: int, nodes: int, kind: str = "fp32", topk: float = 1.0) -> int:
    """Bytes of an n-element round between ``nodes`` nodes: 4 n (fp32), the quantized
    allreduce's count (dense kind), or one node's top-k payload S (topk < 1)."""
    if topk < 1:
        return _topk_bytes(int(n), float(topk), kind)
    if kind in ("fp32", "bf16"):
        return VALUE_BITS[kind] // 8 * int(n)
    return _dense_bytes(int(n), int(nodes), kind)


def pull_bytes(n: int, kind: str = "fp32", topk: float = 1.0) -> int:
    """Bytes of LSGD's compressed pull C(x_leader - r): a compressed broadcast of n elements
    (4 n; quantized.broadcast_bytes; or the top-k payload S)."""
    if topk < 1:
        return _topk_bytes(int(n), float(topk), kind)
    if kind in ("fp32", "bf16"):
        return VALUE_BITS[kind] // 8 * int(n)
    from lsgd_hpc.comm.quantized import broadcast_bytes
    return broadcast_bytes(int(n), kind=kind)


def hierarchical(c: Cluster) -> bool:
    """Whether a compressed allreduce runs hierarchically on ``c`` (several nodes, more than
    one rank a node), as lsgd_hpc.comm.quantized.quantized_groups does; else flat."""
    return c.nodes > 1 and c.ranks_per_node > 1


def exchange_ranks(c: Cluster) -> int:
    """The ranks a compressed exchange runs over: the node roots, or all ranks (flat)."""
    return c.nodes if hierarchical(c) else c.ranks


def hier_allreduce_time(n: int, c: Cluster, kind: str = "fp32", topk: float = 1.0) -> float:
    """One compressed (``kind``, ``topk``) allreduce of n float32 elements as the package runs
    it (the module docstring's T(kind, F)): reduced in float32 inside each node and
    compressed between the node roots when hierarchical(c); else the flat compressed
    allreduce over all ranks."""
    if c.ranks <= 1:
        return 0.0
    g = exchange_ranks(c)
    b = wire_bytes(n, g, kind, topk)
    if hierarchical(c):
        inside, link = ring_allreduce(FLOAT_BYTES * n, c.ranks_per_node, c.intra), c.inter
    else:
        inside, link = 0.0, c.intra if c.nodes == 1 else c.inter
    if topk < 1:
        between = (g - 1) * (link.alpha_s + b * link.beta_s)
    else:
        between = ring_allreduce(b, g, link)
    return inside + between + call_cost(c)


def round_bytes_sent(n: int, c: Cluster, kind: str = "fp32", topk: float = 1.0) -> float:
    """Bytes one compressed allreduce of n elements counts sent, the mean over ranks (the
    module docstring's): B / q (the node roots' exchange), or B_p (flat)."""
    if c.ranks <= 1:
        return 0.0
    b = wire_bytes(n, exchange_ranks(c), kind, topk)
    return b / c.ranks_per_node if hierarchical(c) else float(b)


def _averaging_round(w: Workload, c: Cluster, coll: Collectives,
                     topk: bool = False) -> Tuple[float, float]:
    """(seconds, bytes sent per rank) of one averaging round of the flat vector. With
    ``w.comm_dtype`` int8/fp8/int4/int2 or ``topk`` (top-k ``w.topk`` of ``w.comm_dtype``
    values): the package's compressed allreduce, hierarchical on several nodes of several
    ranks (float32 inside the node, compressed between the node roots), flat over all ranks
    otherwise (hier_allreduce_time and round_bytes_sent); else the
    library's allreduce of ``w.flat_bytes`` (fp32, bf16)."""
    if topk or w.comm_dtype not in ("fp32", "bf16"):
        m, f = w.n_params + w.n_buffers, w.topk if topk else 1.0
        kind = w.comm_dtype                       # (top-k values may be bf16: 2 bytes)
        return hier_allreduce_time(m, c, kind, f), round_bytes_sent(m, c, kind, f)
    return allreduce_time(w.flat_bytes, c, coll), w.flat_bytes


def _periodic_allreduce(name: str, setting: str, w: Workload, c: Cluster, period: int,
                        passes: int, coll: Collectives, sparse: bool = False) -> MethodCost:
    """Every ``period`` steps one averaging round of the flat vector (_averaging_round) and
    ``passes`` elementwise passes over its float32 copy (EASGD, local SGD, DiLoCo); nothing
    on one rank. ``sparse`` (all but SlowMo's, which prices its own) with ``w.topk`` < 1: the
    round is top-k's."""
    topk = sparse and w.topk < 1
    if topk:
        setting += f", top-k {w.topk:g}"
    if c.ranks == 1:
        return MethodCost(name, setting, w.compute_s, 0.0, 0.0)
    t, sent = _averaging_round(w, c, coll, topk)
    t += pass_time((w.n_params + w.n_buffers) * FLOAT_BYTES, c, passes)
    return MethodCost(name, setting, w.compute_s, t / period, sent / period)


def easgd(w: Workload, c: Cluster, tau: int, coll: Collectives = Collectives()) -> MethodCost:
    """Every tau steps one allreduce of the elastic differences d_i (the flat vector) and six
    elementwise passes (d, x, deviation, centre)."""
    if tau < 1:
        raise ValueError("tau must be >= 1")
    return _periodic_allreduce("easgd", f"tau {tau}", w, c, tau, 6, coll, sparse=True)


def local_sgd(w: Workload, c: Cluster, T: int, coll: Collectives = Collectives()) -> MethodCost:
    """Every T steps one allreduce of the flat vector (copy in, mean, copy back: 3 passes;
    with top-k the difference from the reference, the update and the new reference: 3 too)."""
    if T < 1:
        raise ValueError("T must be >= 1")
    return _periodic_allreduce("local-sgd", f"T {T}", w, c, T, 3, coll, sparse=True)


def diloco(w: Workload, c: Cluster, H: int, coll: Collectives = Collectives()) -> MethodCost:
    """DiLoCo: every H steps one allreduce of the flat vector (the pseudo-gradient
    x_prev - x_i and the BatchNorm statistics), like local SGD with T = H; the outer Nesterov
    step adds passes: difference, gradient copy, momentum buffer, Nesterov sum, update, copy
    back (7 in all with the statistics' copy)."""
    if H < 1:
        raise ValueError("H must be >= 1")
    return _periodic_allreduce("diloco", f"H {H}", w, c, H, 7, coll, sparse=True)


def slowmo(w: Workload, c: Cluster, T: int, every: int,
           coll: Collectives = Collectives()) -> MethodCost:
    """SlowMo over local SGD: every T steps local SGD's round (one allreduce of the flat
    vector, 3 passes); every ``every`` steps (a multiple of T) the slow step, no
    communication, 5 passes over the parameters (u: 3, x_old, copy back)."""
    if T < 1 or every < 1 or every % T:
        raise ValueError("T must be >= 1 and every a positive multiple of T")
    n = (w.n_params + w.n_buffers) * FLOAT_BYTES
    topk = w.topk < 1
    setting = f"T {T}, slow every {every}" + (f", top-k {w.topk:g}" if topk else "")
    if c.ranks == 1:
        return MethodCost("slowmo", setting, w.compute_s, 0.0, 0.0)
    round_s, sent = _averaging_round(w, c, coll, topk)
    t = (round_s + pass_time(n, c, 3)) / T + pass_time(n, c, 5) / every
    return MethodCost("slowmo", setting, w.compute_s, t, sent / T)


def gossip(w: Workload, c: Cluster, topology: str,
           degrees: Optional[Sequence[Tuple[int, int]]] = None) -> MethodCost:
    """Every step one neighbour exchange over the topology (gossip_exchange) and the combine:
    one pass per neighbour plus one. ``degrees`` defaults to lsgd_hpc's own graph of that
    name (topology_degrees)."""
    n = w.flat_bytes
    if c.ranks == 1:
        return MethodCost("gossip", topology, w.compute_s, 0.0, 0.0)
    if degrees is None:
        degrees = topology_degrees(topology, c)
    t, sent, dmax = gossip_exchange(degrees, n, c)
    return MethodCost("gossip", topology, w.compute_s, t + pass_time(n, c, dmax + 1), sent)


def method_cost(method: str, w: Workload, c: Cluster, options: Optional[Dict] = None, *,
                coll: Collectives = Collectives(), overlap: float = 0.0,
                worker_ranks=1) -> MethodCost:
    """The cost of lsgd_hpc's method ``method`` (``--algorithm``) with ``options`` (its own
    options by their names; the rest at the library's defaults), from the method's spec:
    each spec names its entry here (lsgd_hpc.methods.registry). ``overlap`` applies to
    allreduce SGD (see allreduce_sgd). ``worker_ranks`` K or ``node``: the method between
    workers of that many ranks (with_workers)."""
    from lsgd_hpc.methods.registry import spec_of
    spec = spec_of(method)
    options = spec.resolve(dict(options or {}))
    if worker_ranks != 1 and spec.worker_grouping:
        return with_workers(method, w, c, options, worker_ranks, coll=coll, overlap=overlap)
    return spec.cost(sys.modules[__name__], w, c, options, coll, overlap)


# -- workers that span ranks -------------------------------------------------------------------
@dataclass(frozen=True)
class WorkerCost(MethodCost):
    """A method between workers that span ranks: ``comm_s`` = ``inside_s`` (the gradient's
    allreduce inside the worker, every step) + ``between_s`` (the method's rounds between
    workers and the spreading of their results inside each worker), per step;
    ``bytes_per_step`` the method's bytes between workers (mean over all ranks),
    ``worker_bytes_per_step`` those inside a worker (mean over ranks)."""

    inside_s: float = 0.0
    between_s: float = 0.0
    worker_bytes_per_step: float = 0.0
    worker_ranks: int = 1
    n_workers: int = 1


def worker_size(c: Cluster, worker_ranks) -> int:
    """Ranks per worker: the node's (``node``) or K, which must divide the node's ranks."""
    if worker_ranks == "node":
        return c.ranks_per_node
    k = int(worker_ranks)
    if k < 1 or c.ranks_per_node % k:
        raise ValueError(f"worker_ranks must divide the ranks of every node "
                         f"(worker_ranks={worker_ranks}; {c.ranks_per_node} per node)")
    return k


def workers_cluster(c: Cluster, q_w: int) -> Cluster:
    """The cluster of the workers' first ranks: N nodes of q / q_w each."""
    return replace(c, ranks_per_node=c.ranks_per_node // q_w)


def _rounds(method: str, o: Dict, cw: Cluster) -> Tuple[float, float]:
    """(rounds per step, elements each round spreads inside a worker, in units of the flat
    vector) of the method between the workers of ``cw``."""
    if method in ("lsgd", "lsgd-async"):
        share = 1.0 if o.get("lsgd_bn", "keep") != "keep" else math.nan   # nan: params only
        multi = 1 < cw.nodes < cw.ranks
        return 1 / o["tau_global"] + (1 / o["tau_local"] if multi else 0.0), share
    if method == "easgd":
        return 1 / o["easgd_tau"], 1.0
    if method == "gossip":
        degrees = topology_degrees(o["topology"], cw)
        return 1.0, sum(a + b for a, b in degrees) / max(1, len(degrees))
    return 1 / o["local_steps"], 1.0           # local SGD, DiLoCo, SlowMo: every T (H) steps


def with_workers(method: str, w: Workload, c: Cluster, options: Dict, worker_ranks,
                 coll: Collectives = Collectives(), overlap: float = 0.0) -> WorkerCost:
    """``method`` (with its resolved ``options``) between workers of ``worker_ranks`` ranks
    (the module docstring's formula). The gradient inside a worker moves in float32 (whatever
    ``w.element_bytes``, which is what the method sends), in buckets of allreduce SGD's
    default size."""
    from lsgd_hpc.methods.registry import SPECS, spec_of
    spec = spec_of(method)
    if spec.workers_refused:
        raise ValueError(f"worker_ranks {spec.workers_refused}")
    q_w = worker_size(c, worker_ranks)
    cw = workers_cluster(c, q_w)
    between = spec.cost(sys.modules[__name__], w, cw, options, coll, overlap)
    one_worker = Cluster(1, q_w, c.intra, c.intra, c.mem_Bps, c.call_overhead_s, c.checks)
    bucket = SPECS["allreduce"].option("bucket_mb").default * 2 ** 20
    inside = allreduce_sgd(replace(w, element_bytes=FLOAT_BYTES), one_worker, coll, overlap,
                           bucket_bytes=bucket)
    rounds, share = _rounds(method, options, cw)
    payload = w.grad_bytes if math.isnan(share) else share * w.flat_bytes
    if cw.ranks == 1:
        rounds = 0.0                  # one worker: nothing between workers, nothing to spread
    spread_s = rounds * (broadcast_time(payload, q_w, c.intra) + call_cost(one_worker))
    spread_bytes = rounds * payload / q_w if q_w > 1 else 0.0     # sent by the first rank
    return WorkerCost(method, between.setting, w.compute_s, inside.comm_s + between.comm_s + spread_s,
                      between.bytes_per_step / q_w, inside_s=inside.comm_s,
                      between_s=between.comm_s + spread_s,
                      worker_bytes_per_step=inside.bytes_per_step + spread_bytes,
                      worker_ranks=q_w, n_workers=cw.ranks)


def smallest_period(cost_at, max_share: float, periods: Sequence[int] = tuple(2 ** k for k in
                                                                               range(0, 13))):
    """The smallest period (from ``periods``) whose MethodCost ``cost_at(period)`` has a
    communication share <= max_share; the largest period when none has."""
    best = None
    for t in periods:
        best = (t, cost_at(t))
        if best[1].comm_share <= max_share:
            return best
    return best
