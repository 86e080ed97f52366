"""Price overlapped and compressed communication, and recommend a method, its period and its
compressor for a cluster (``python -m lsgd_hpc.plan ... --recommend``).

Pricing (n: the elements of the fused model, parameters and float buffers; 4 n its float32
bytes; N nodes of q ranks; alpha_e, beta_e the network link, alpha_i, beta_i the link inside
a node; t_c the compute seconds of one step; pass(k) = k elementwise passes over 4 n bytes at
the memory bandwidth, costmodel.pass_time):

Compressors. ``(kind, F)``: values of ``kind`` (fp32, int8, int4, int2) and top-k fraction F
(1: dense). Bytes of the model on the wire between nodes, from the package's own counts:

    dense fp32          4 n
    dense kind          quantized.allreduce_bytes(n, N, kind) = ceil(n bits / 8) + 4 N b
                        (b = ceil(ceil(n / N) / 4096) scales per chunk): int8 0.25, int4
                        0.125, int2 0.0625 of 4 n, plus one 4-byte scale per block
    top-k F, kind       S = sparse.sparse_layout(n, F, kind).counted
                          = m (scale + k index + ceil(k bits / 8)), m = ceil(n / 4096)
                        chunks, k = ceil(4096 F) (index, value) records per chunk, int16
                        indices, a 4-byte scale per chunk (none for fp32 values)

Compressed allreduce (``hier_allreduce_time``), as lsgd_hpc.comm.quantized runs it. With
several nodes and more than one rank a node, hierarchical: float32 reduce-scatter and
allgather inside the node (shared memory, NVLink), compression only between nodes, where q
rings (one per slice of n / q) share each node's link:

    T(kind, F) = 2 (q-1) alpha_i + 2 (q-1)/q 4 n beta_i + X
    X = 2 (N-1) alpha_e + 2 (N-1)/N B beta_e      dense, B the bytes above (fp32: the
                                                  package's hierarchical allreduce, rho's)
    X = (N-1) alpha_e + (N-1) S beta_e            top-k: an allgather of every node's
                                                  records, each node's link receiving (N-1) S

One node, or one rank a node: the flat compressed allreduce over all p ranks, on the one
kind of link they share (inside the node, or between nodes), chunked by p:

    T(kind, F) = 2 (p-1) alpha + 2 (p-1)/p B_p beta      dense, B_p = allreduce_bytes(n, p)
    T(kind, F) = (p-1) (alpha + S beta)                  top-k: an allgather of the records

Bytes counted per round (``round_bytes_sent``, comm_bytes_sent's mean over ranks): the node
roots send B (or S) between nodes, the other ranks nothing: B / q; flat: B_p (or S) a rank.
The plan's methods table prices EASGD, local SGD, DiLoCo and SlowMo with ``--comm-dtype``
int8/fp8/int4/int2 or ``--topk`` by these (costmodel._periodic_allreduce).

A dense fp32 round is the library's own allreduce (costmodel.allreduce_time, the fastest of
ring, hierarchical and recursive doubling), as the methods' table prices it.

Methods, communication seconds per step (the step is t_c plus this):

    allreduce SGD        costmodel's (every step, fp32, buckets of its default size)
    DiLoCo H             (T(kind, F) + pass(7)) / H
    EASGD tau            (T(kind, F) + pass(6)) / tau
    Streaming DiLoCo     P fragments of n / P, one synced every H / P steps, its allreduce
    (H, P, tau)          hidden behind tau (< H / P) steps of compute:
                         P (max(0, T_frag(kind, F) - tau t_c) + pass(7) / P) / H
    LSGD (tau_L, tau_G,  the global pull sends C(x_leader - r): the bytes of a compressed
    d, kind, F)          broadcast of the parameters, Bg = 4 n (fp32), quantized.
                         broadcast_bytes(n, kind) (dense) or S (top-k); the local pull
                         inside a node the dense broadcast of ``kind``, Bl (F = 1); each
                         broadcast runs behind d (< tau_L) steps of compute (the pull delay):
                         (E_node + max(0, B_intra(Bl) - d t_c) + pass(3)) / tau_L
                         + (E_world + max(0, B_hier(Bg) - d t_c) + pass(3)) / tau_G
                         (one node or one rank per node: one level, a flat broadcast of Bg)

A compressed allreduce started early (Streaming DiLoCo's sync delay) hides behind compute as
an fp32 one does: lsgd_hpc.comm.quantized's non-blocking allreduce is staged (quantize,
alltoall, requantize, allgather, each stage run from the step's test()). A compressed
broadcast (LSGD's dense int8/int4/int2 pull with a pull delay) still runs at once, so it hides
nothing (``COMPRESSED_OVERLAP`` False); the plan's ``--assume-compressed-overlap`` prices it as
an fp32 one. LSGD's top-k pull (topk < 1) sends its records as bytes through the non-blocking
hierarchical broadcast: with a pull delay it hides as an fp32 one does. The quantization's
own arithmetic is not priced (a few passes over the model on the device).

Recommendation (:func:`recommend`): every candidate of an explicit grid (``GRID_*``) that
passes the quality guard is priced; those within ``slack`` (default 5%) of the fastest
predicted step are eligible, and the recommended one is the least aggressive of them: the
smallest period first (how far replicas drift apart between rounds), then the most bytes sent
(the mildest compression), then the fastest; one the trainer refuses today
(:func:`trainer_problem`) comes after every one it runs. The guard (``MAX_PERIOD`` 500, ``MIN_TOPK``
0.01, values of at least 2 bits) keeps to what the field has trained with: DiLoCo H = 500,
INTELLECT-1 int8 with H = 100, SparseLoCo top-k 1-3% with 2-bit values. Speed alone would
always pick the longest period and the strongest compression; the model does not see the
loss, so the rule spends only what the slack allows on quality.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Dict, List, Optional, Tuple

from lsgd_hpc.planning import costmodel as cm
# the bytes and seconds of a compressed round live in costmodel (its methods table prices them)
from lsgd_hpc.planning.costmodel import (exchange_ranks, hier_allreduce_time, hierarchical,
                                         pull_bytes, round_bytes_sent, wire_bytes)

__all__ = ["wire_bytes", "pull_bytes", "hier_allreduce_time", "round_bytes_sent", "hierarchical",
           "diloco_cost", "easgd_cost",
           "streaming_diloco_cost", "lsgd_cost", "Candidate", "candidates", "recommend",
           "GRID_PERIODS", "GRID_KINDS", "GRID_TOPK", "GRID_FRAGMENTS", "MAX_PERIOD",
           "MIN_TOPK", "MIN_VALUE_BITS", "SLACK", "STREAMING_DELAY", "PULL_DELAY",
           "COMPRESSED_OVERLAP", "trainer_problem"]

#: the candidate grid: periods (H, tau, tau_G), values, top-k fractions, fragments
GRID_PERIODS = (4, 16, 64, 128, 500)
GRID_KINDS = ("fp32", "int8", "int4", "int2")
GRID_TOPK = (1.0, 0.03, 0.01)
GRID_FRAGMENTS = 4
#: Streaming DiLoCo's sync delay (the paper's tau = 5), capped below H / P
STREAMING_DELAY = 5
#: LSGD's pull delay of the delayed candidates, capped below tau_L
PULL_DELAY = 4
#: the quality guard: the longest period, the smallest top-k fraction and the fewest value
#: bits the field has trained with (DiLoCo H = 500; SparseLoCo top-k 1% with 2-bit values)
MAX_PERIOD = 500
MIN_TOPK = 0.01
MIN_VALUE_BITS = 2
#: eligible: predicted step within this fraction of the fastest candidate's
SLACK = 0.05
#: whether a compressed broadcast started before its result is due (LSGD's int8/int4/int2
#: pull with a pull delay) runs behind compute: lsgd_hpc.comm.quantized runs a compressed
#: non-blocking broadcast at once ("no overlap"), so a delay hides nothing of it today; True
#: prices it as an fp32 one (``--assume-compressed-overlap``). LSGD's top-k pull (records as
#: bytes, non-blocking for real) always hides as an fp32 one. The compressed allreduce is
#: non-blocking for real and always priced as hiding (Streaming DiLoCo).
COMPRESSED_OVERLAP = False


def _round_time(n: int, c: cm.Cluster, kind: str, topk: float,
                coll: cm.Collectives) -> float:
    if kind == "fp32" and topk >= 1:
        return cm.allreduce_time(cm.FLOAT_BYTES * n, c, coll)
    return hier_allreduce_time(n, c, kind, topk)


# -- methods -----------------------------------------------------------------------------------
def _periodic(name: str, setting: str, w: cm.Workload, c: cm.Cluster, period: int,
              passes: int, kind: str, topk: float, coll: cm.Collectives) -> cm.MethodCost:
    n = w.n_params + w.n_buffers
    if c.ranks == 1:
        return cm.MethodCost(name, setting, w.compute_s, 0.0, 0.0)
    t = _round_time(n, c, kind, topk, coll) + cm.pass_time(cm.FLOAT_BYTES * n, c, passes)
    return cm.MethodCost(name, setting, w.compute_s, t / period,
                         wire_bytes(n, exchange_ranks(c), kind, topk) / period)


def diloco_cost(w: cm.Workload, c: cm.Cluster, H: int, kind: str = "fp32", topk: float = 1.0,
                coll: cm.Collectives = cm.Collectives()) -> cm.MethodCost:
    """DiLoCo every H steps: (T(kind, F) + pass(7)) / H. ``bytes_per_step``: the bytes of a
    round between nodes (wire_bytes) / H."""
    return _periodic("diloco", f"H {H}", w, c, H, 7, kind, topk, coll)


def easgd_cost(w: cm.Workload, c: cm.Cluster, tau: int, kind: str = "fp32", topk: float = 1.0,
               coll: cm.Collectives = cm.Collectives()) -> cm.MethodCost:
    """EASGD every tau steps: (T(kind, F) + pass(6)) / tau."""
    return _periodic("easgd", f"tau {tau}", w, c, tau, 6, kind, topk, coll)


def _hidden(delay: int, w: cm.Workload, kind: str, topk: float, overlap) -> float:
    """Seconds of compute a delayed collective hides behind: delay t_c, or 0 for a compressed
    one unless ``overlap`` (see COMPRESSED_OVERLAP)."""
    compressed = kind != "fp32" or topk < 1
    if compressed and not (COMPRESSED_OVERLAP if overlap is None else overlap):
        return 0.0
    return delay * w.compute_s


def streaming_diloco_cost(w: cm.Workload, c: cm.Cluster, H: int, fragments: int, delay: int,
                          kind: str = "fp32", topk: float = 1.0,
                          coll: cm.Collectives = cm.Collectives()) -> cm.MethodCost:
    """Streaming DiLoCo: P fragments of n / P elements, one synced every H / P steps, its
    allreduce running behind ``delay`` steps of compute:
    P (max(0, T_frag - delay t_c) + pass(7) / P) / H (a compressed allreduce too: the
    package's is non-blocking for real)."""
    P = fragments
    if H < 1 or P < 1 or H % P or not 0 <= delay < H // P:
        raise ValueError(f"streaming DiLoCo needs fragments dividing H and delay < H / "
                         f"fragments (H {H}, fragments {P}, delay {delay})")
    n = w.n_params + w.n_buffers
    setting = f"H {H}, {P} fragments, delay {delay}"
    if c.ranks == 1:
        return cm.MethodCost("streaming-diloco", setting, w.compute_s, 0.0, 0.0)
    frag = -(-n // P)
    # the compressed allreduce is non-blocking for real (staged from test()): it hides as an
    # fp32 one does
    exposed = max(0.0, _round_time(frag, c, kind, topk, coll) - _hidden(delay, w, kind, topk, True))
    t = P * exposed / H + cm.pass_time(cm.FLOAT_BYTES * n, c, 7) / H
    return cm.MethodCost("streaming-diloco", setting, w.compute_s, t,
                         P * wire_bytes(frag, exchange_ranks(c), kind, topk) / H)


def lsgd_cost(w: cm.Workload, c: cm.Cluster, tau_local: int, tau_global: int,
              pull_delay: int = 0, kind: str = "fp32", topk: float = 1.0,
              compressed_overlap: Optional[bool] = None) -> cm.MethodCost:
    """LSGD whose global pull sends C(x_leader - r) (pull_bytes of the parameters: top-k
    records with ``topk`` < 1), its local pull the dense broadcast of ``kind``, each
    broadcast running behind ``pull_delay`` steps of compute (costmodel.lsgd with the
    broadcasts' seconds less pull_delay t_c, at least 0; a dense compressed one hides nothing
    unless ``compressed_overlap``, default COMPRESSED_OVERLAP; the top-k pull's records, bytes
    in a non-blocking broadcast, hide as fp32)."""
    if tau_local < 1 or tau_global % tau_local or not 0 <= pull_delay < tau_local:
        raise ValueError("tau_global must be a multiple of tau_local and pull_delay < tau_local")
    N, q, p = c.nodes, c.ranks_per_node, c.ranks
    setting = f"tau_L {tau_local}, tau_G {tau_global}, delay {pull_delay}"
    if p == 1:
        return cm.MethodCost("lsgd", setting, w.compute_s, 0.0, 0.0)
    b = pull_bytes(w.n_params, kind, topk)
    # (top-k: the records go as bytes, non-blocking for real, hiding as fp32 does)
    hide = _hidden(pull_delay, w, "fp32" if topk < 1 else kind, 1.0, compressed_overlap)
    pull = cm.pass_time(w.grad_bytes, c, 3)
    if 1 < N < p:
        b_loc = pull_bytes(w.n_params, kind)          # the local pull: dense, of ``kind``
        hide_loc = _hidden(pull_delay, w, kind, 1.0, compressed_overlap)
        local = (cm.election_time(c, "node")
                 + max(0.0, cm.broadcast_time(b_loc, q, c.intra) + cm.call_cost(cm.node_cluster(c))
                       - hide_loc)
                 + pull)
        glob = cm.election_time(c) + max(0.0, cm.hierarchical_broadcast_time(b, c) - hide) + pull
        sent = b_loc / q / tau_local + (N + 1) * b / p / tau_global
        return cm.MethodCost("lsgd", setting, w.compute_s,
                             local / tau_local + glob / tau_global, sent)
    link = c.intra if N == 1 else c.inter
    glob = (cm.election_time(c) + max(0.0, cm.broadcast_time(b, p, link) + cm.call_cost(c) - hide)
            + pull)
    return cm.MethodCost("lsgd", setting, w.compute_s, glob / tau_global, b / p / tau_global)


# -- the recommendation ------------------------------------------------------------------------
@dataclass
class Candidate:
    """One priced configuration: ``method`` (allreduce, lsgd, diloco, streaming-diloco,
    easgd), its ``period`` (H, tau, tau_G; 1 for allreduce), its options, its compressor,
    and the predicted seconds."""

    method: str
    period: int
    comm_dtype: str
    topk: float
    step_s: float
    comm_s: float
    compute_s: float
    wire_bytes_per_step: float  # the bytes of one round's model on the wire / period
    wire_fraction: float        # bytes of a round's model on the wire / its fp32 bytes
    options: Dict
    args: str                   # the trainer's options
    trainer_refuses: Optional[str] = None   # why the trainer refuses it today, or None

    @property
    def comm_share(self) -> float:
        return self.comm_s / self.step_s if self.step_s > 0 else 0.0

    def row(self) -> Dict:
        d = asdict(self)
        d.update(comm_share=self.comm_share,
                 comm_ratio=self.comm_s / self.compute_s if self.compute_s > 0 else math.inf)
        return d


def _args(method: str, options: Dict, kind: str, topk: float) -> str:
    parts = ["--algorithm", "diloco" if method == "streaming-diloco" else method]
    names = {"H": "--local-steps", "fragments": "--fragments",
             "sync_delay": "--fragment-sync-delay", "tau_local": "--tau-local",
             "tau_global": "--tau-global", "pull_delay": "--pull-delay", "tau": "--easgd-tau"}
    for k, v in options.items():
        if k in names and not (k in ("pull_delay", "sync_delay") and v == 0):
            parts += [names[k], str(v)]
    if kind != "fp32":
        parts += ["--comm-dtype", kind]
    if topk < 1:
        parts += ["--topk", f"{topk:g}"]
    if (kind != "fp32" or topk < 1) and method != "lsgd":
        parts.append("--error-feedback")      # LSGD's pull: its reference is its feedback
    if method == "diloco" and topk < 1:
        # SparseLoCo's form: with top-k, DiLoCo's outer Nesterov momentum on top of error
        # feedback diverged in results/lm_links; the decayed residual takes its place
        parts += ["--outer-momentum", "0", "--outer-lr", "1", "--error-feedback-decay", "0.95"]
    return " ".join(parts)


def trainer_problem(method: str, kind: str, topk: float) -> Optional[str]:
    """Why the trainer (MPI backend) refuses ``method`` with this compressor today, or None
    (lsgd_hpc.methods.spec's refusals: e.g. top-k of LSGD's pull until it lands)."""
    from lsgd_hpc.methods.spec import comm_dtype_problem, topk_problem
    base = "diloco" if method == "streaming-diloco" else method
    return comm_dtype_problem(kind, "mpi", base) or topk_problem(topk, kind, "mpi", base)


def _guard(period: int, kind: str, topk: float, max_period: int, min_topk: float) -> bool:
    return (period <= max_period and (topk >= 1 or topk >= min_topk - 1e-12)
            and cm.VALUE_BITS[kind] >= MIN_VALUE_BITS)


def candidates(w: cm.Workload, c: cm.Cluster, coll: cm.Collectives = cm.Collectives(),
               max_period: int = MAX_PERIOD, min_topk: float = MIN_TOPK,
               periods=GRID_PERIODS, kinds=GRID_KINDS, topks=GRID_TOPK,
               diloco_topk: bool = True,
               compressed_overlap: Optional[bool] = None) -> List[Candidate]:
    """Every candidate of the grid that passes the guard, priced. ``diloco_topk`` False: no
    top-k for (streaming) DiLoCo (the trainer refuses it on a model with buffers)."""
    from lsgd_hpc.methods.registry import SPECS
    n = w.n_params + w.n_buffers
    out: List[Candidate] = []

    def add(cost: cm.MethodCost, method, period, kind, topk, options):
        m = w.n_params if method == "lsgd" else n          # LSGD pulls the parameters only
        wire = (pull_bytes(m, kind, topk) if method == "lsgd"
                else wire_bytes(m, exchange_ranks(c), kind, topk))
        out.append(Candidate(method, period, kind, topk, cost.step_s, cost.comm_s,
                             cost.compute_s, wire / period, wire / (4.0 * m) if m else 1.0,
                             options, _args(method, options, kind, topk),
                             trainer_problem(method, kind, topk)))

    bucket = SPECS["allreduce"].option("bucket_mb").default * 2 ** 20
    full_w = cm.Workload(w.n_params, w.n_buffers, w.compute_s)
    add(cm.allreduce_sgd(full_w, c, coll, bucket_bytes=bucket), "allreduce", 1, "fp32", 1.0, {})
    for period in periods:
        for kind in kinds:
            for topk in topks:
                if not _guard(period, kind, topk, max_period, min_topk):
                    continue
                tau_l = max(1, period // 2)
                for d in sorted({0, min(PULL_DELAY, tau_l - 1)}):
                    add(lsgd_cost(w, c, tau_l, period, d, kind, topk, compressed_overlap),
                        "lsgd", period, kind, topk,
                        {"tau_local": tau_l, "tau_global": period, "pull_delay": d})
                add(easgd_cost(w, c, period, kind, topk, coll), "easgd", period, kind, topk,
                    {"tau": period})
                if topk < 1 and not diloco_topk:
                    continue
                add(diloco_cost(w, c, period, kind, topk, coll), "diloco", period, kind, topk,
                    {"H": period})
                P = GRID_FRAGMENTS
                if period % P == 0:
                    delay = max(0, min(STREAMING_DELAY, period // P - 1))
                    add(streaming_diloco_cost(w, c, period, P, delay, kind, topk, coll),
                        "streaming-diloco", period, kind, topk,
                        {"H": period, "fragments": P, "sync_delay": delay})
    return out


def _key(cand: Candidate) -> Tuple:
    """What the trainer runs today first; then the least aggressive: smallest period, most
    bytes, then fastest."""
    return (cand.trainer_refuses is not None, cand.period, -cand.wire_fraction, cand.step_s)


def recommend(w: cm.Workload, c: cm.Cluster, coll: cm.Collectives = cm.Collectives(),
              slack: float = SLACK, max_period: int = MAX_PERIOD, min_topk: float = MIN_TOPK,
              diloco_topk: bool = True, runners_up: int = 5,
              compressed_overlap: Optional[bool] = None) -> Dict:
    """The recommended candidate (the module docstring's rule), the runners-up (the next
    eligible ones in the rule's order, then the fastest and allreduce SGD when not among
    them), and the rule's figures."""
    cands = candidates(w, c, coll, max_period, min_topk, diloco_topk=diloco_topk,
                       compressed_overlap=compressed_overlap)
    overlap = COMPRESSED_OVERLAP if compressed_overlap is None else compressed_overlap
    fastest = min(cands, key=lambda x: x.step_s)
    bound = fastest.step_s * (1 + slack)
    eligible = sorted((x for x in cands if x.step_s <= bound * (1 + 1e-12)), key=_key)
    best = eligible[0]
    rest = eligible[1:1 + runners_up]
    for extra in (fastest, next(x for x in cands if x.method == "allreduce")):
        if extra is not best and all(extra is not r for r in rest):
            rest.append(extra)
    return {
        "rule": (f"of {len(cands)} candidates (guard: period <= {max_period}, top-k >= "
                 f"{min_topk:g}, values >= {MIN_VALUE_BITS} bits), those within "
                 f"{slack:.0%} of the fastest predicted step; of them what the trainer runs "
                 "today, then the smallest period, then the most bytes sent (the mildest "
                 "compression), then the fastest; a compressed allreduce overlaps compute "
                 "as fp32 does, so does LSGD's top-k pull; its dense compressed pull "
                 + ("too (assumed)" if overlap else
                    "hides nothing behind compute (the package broadcasts it at once)")),
        "slack": slack, "max_period": max_period, "min_topk": min_topk,
        "compressed_overlap": overlap,
        "candidates": len(cands), "fastest_step_s": fastest.step_s,
        "recommended": best.row(),
        "runners_up": [dict(r.row(), eligible=r.step_s <= bound * (1 + 1e-12)) for r in rest],
    }
