"""Plan a run before spending an allocation: what to run on a stated cluster (method, compressor,
worker shape and, with --mtbf-hours, failure policy and checkpoint interval, with its train
command), from the predicted step time, communication share and bytes per step of every method
(the alpha-beta cost model, lsgd_hpc.planning.costmodel).

    python -m lsgd_hpc.plan --params 1e9 --nodes 64 --ranks-per-node 8 --inter-gbps 10 \\
        [--mtbf-hours 50000]
    python -m lsgd_hpc.plan --model resnet20 --nodes 64 --ranks-per-node 8 \\
        --inter-gbps 100 --intra-gbps 600 [--step-ms 45]
    mpirun -np 4 python -m lsgd_hpc.plan --model resnet20 --measure [--nodes 64 ...]

Parameter and buffer counts come from the real model (lsgd_hpc.models), or --params N names any
model of N parameters (no buffers). What a user may not know has a default, printed as an
"assumed: ..." line (lsgd_hpc.planning.advice states the figures): the link inside a node from
--interconnect or the GPU kind (--gpu, default h100: NVLink 4), and the compute of one step of
a --params model from 6 N x --tokens-per-step FLOP (default 8192 tokens a rank) at --tflops
(default 40 % of the GPU's published peak). Every plan states rho: the predicted
seconds of one fp32 allreduce of the parameters between nodes (hierarchical: each node's link
crossed once) over the compute seconds of one step. --comm-dtype int4/int2 and --topk F (EASGD,
DiLoCo; LSGD's global pull) are priced from their byte counts (costmodel.topk_payload_bytes,
planning.recommend); a compressed round of EASGD, local SGD, DiLoCo or SlowMo is priced as the
package runs it: on several nodes of several ranks, float32 inside the node and compressed
between the node roots only; on one node, or one rank a node, flat over all ranks
(planning.recommend.hier_allreduce_time). Without --step-ms the
compute time of one step of a zoo model is estimated from its multiply-adds (training ~ 3 x
forward, 2 FLOP per multiply-add) at --tflops achieved TFLOP/s (default 10: small networks do
not reach a GPU's sustained rate). With --measure (under mpirun or srun,
one process per rank) the job first measures latency and bandwidth inside and between its
nodes (lsgd_hpc.planning.netprobe) and the step time of the model on its own devices, then plans with
those figures for --nodes x --ranks-per-node (default: the job's own layout).

With --worker-ranks K (or node), K ranks of a node form one worker (the trainer's
--worker-ranks): every method but allreduce is costed between the workers (N_workers in place
of ranks, on the network) plus an allreduce of the gradient inside each worker every step and
the spreading of each round's result inside it (on the node's link); bytes/step/rank is then
the method's traffic between workers, and the traffic inside a worker is printed apart.

With --mtbf-hours H (a per-node MTBF) and --params or --inter-gbps, the failure planner
(lsgd_hpc.planning.failplan, goodput) joins the plan: the goodput of abort + requeue at the
Young/Daly checkpoint interval, shrink and heal for the model's checkpoint (its weights and
momentum over --write-gbytes-per-s, default 1 GB/s a writer), and the one recommendation
carries the policy, the checkpoint interval in steps of the method's predicted step and the
predicted goodput. --mtbf-hours alone (--nodes, no link figure) is the failure planner only.

Periods: the smallest period (powers of two) whose predicted communication share is at
most --max-comm-share (tau_G first, then the smallest tau_L dividing it); for gossip, among the
topologies within that share, the one with the largest spectral gap per step (the cheapest one
when none is within it).

The method, its period and its compressor (lsgd_hpc.planning.recommend; every rank a worker,
so not with --worker-ranks): allreduce SGD, LSGD (pull delay, compressed global pull),
DiLoCo, Streaming DiLoCo (fragments, sync delay) and EASGD over H/tau in 4..500, values
fp32/int8/int4/int2 and top-k 1, 0.03, 0.01, compressed rounds reduced in float32 inside a node
and compressed between nodes; of the candidates within --recommend-slack of the fastest
predicted step, the one with the smallest period, then the mildest compression (the quality
guard: --max-period, --min-topk). The plan ends with one "recommended:" line and its command.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass, field, replace
from typing import Dict, List, Optional, Sequence, Tuple

from lsgd_hpc.data.specs import DATASETS
from lsgd_hpc.methods.registry import SPECS
from lsgd_hpc.methods.spec import COMM_DTYPES, TOPK_METHODS, comm_dtype_problem, topk_problem
from lsgd_hpc.planning import advice, failplan
from lsgd_hpc.planning import costmodel as cm

__all__ = ["ModelFacts", "model_facts", "params_facts", "PlanInputs", "plan", "format_plan", "main",
           "DATASET_SHAPES", "recommendation", "format_recommendation"]

#: (classes, input shape) of lsgd_hpc.data's data sets of a fixed shape (their specs'), and
#: the data set each model is run on
DATASET_SHAPES = {d.name: (d.num_classes, d.input_shape) for d in DATASETS.values()
                  if d.input_shape is not None}
MODEL_DATASET = {"digits_cnn": "digits", "cnn7": "cifar10", "vgg16": "cifar10",
                 "resnet20": "cifar10", "mlp": "synthetic", "mlp_wide": "digits"}
#: bytes per element on the wire of each comm_dtype (int8 and fp8, int4, int2: 1, 1/2, 1/4
#: byte plus one fp32 scale per block of 4096 elements, lsgd_hpc.comm.quantized)
WIRE_BYTES = {"fp32": 4.0, "bf16": 2.0, "int8": 1 + 4 / 4096, "fp8": 1 + 4 / 4096,
              "int4": 0.5 + 4 / 4096, "int2": 0.25 + 4 / 4096}
#: SlowMo's slow period in the plan: its default (fairscale's slowmo_frequency)
SLOWMO_EVERY = SPECS["slowmo"].option("slowmo_every").default
#: multiply-adds -> FLOP of one training step per sample: forward 1x, backward 2x, 2 FLOP each
TRAIN_FLOP_PER_MAC = 6


class UsageError(ValueError):
    """A user's mistake: one line, exit status 2."""


@dataclass(frozen=True)
class ModelFacts:
    model: str
    dataset: Optional[str]  # None: --params (no zoo model)
    n_params: int
    n_buffers: int          # floating-point buffer elements (BatchNorm statistics)
    macs_per_sample: int    # forward multiply-adds of convolutions and linear layers


def model_facts(model: str, dataset: Optional[str] = None) -> ModelFacts:
    """Counts of the real model of lsgd_hpc.models on its data set's input shape."""
    import torch
    from torch import nn
    from lsgd_hpc.models.zoo import build_model
    dataset = dataset or MODEL_DATASET.get(model, "cifar10")
    if dataset not in DATASET_SHAPES:
        raise UsageError(f"--dataset: unknown data set {dataset!r}; choose from "
                         f"{', '.join(DATASET_SHAPES)}")
    classes, shape = DATASET_SHAPES[dataset]
    try:
        net = build_model(model, classes, shape)
    except ValueError as exc:
        raise UsageError(f"--model: {exc}") from None
    macs = [0]

    def count(mod, inp, out):
        if isinstance(mod, nn.Conv2d):
            k = mod.kernel_size[0] * mod.kernel_size[1] * mod.in_channels // mod.groups
            macs[0] += out[0].numel() * k
        elif isinstance(mod, nn.Linear):
            macs[0] += mod.in_features * mod.out_features

    hooks = [m.register_forward_hook(count) for m in net.modules()
             if isinstance(m, (nn.Conv2d, nn.Linear))]
    net.eval()
    with torch.no_grad():
        net(torch.zeros(1, *shape))
    for h in hooks:
        h.remove()
    n_params = sum(p.numel() for p in net.parameters())
    n_buffers = sum(b.numel() for b in net.buffers() if b.is_floating_point())
    return ModelFacts(model, dataset, n_params, n_buffers, macs[0])


#: the model name of a plan for ``--params N`` (no zoo model: no data set, no buffers)
PARAMS_MODEL = "custom (--params)"


def params_facts(n_params: int) -> ModelFacts:
    """A model given by its parameter count only (``--params N``): no buffers, no data set,
    no multiply-adds (its step time must be given)."""
    return ModelFacts(PARAMS_MODEL, None, int(n_params), 0, 0)


@dataclass
class PlanInputs:
    """Everything a plan depends on (printed with the plan, and in --json)."""

    model: str
    dataset: Optional[str]
    nodes: int
    ranks_per_node: int
    intra: cm.Link
    inter: cm.Link
    step_s: float
    step_source: str        # "given", "estimated ..." or "measured ..."
    link_source: str
    batch_size: Optional[int]
    mem_Bps: float
    max_comm_share: float
    allreduce: str = "auto"
    comm_dtype: str = "fp32"   # what the methods send: fp32, bf16 (2 bytes), int8/fp8 (1 + scales)
    worker_ranks: object = 1   # ranks per worker (the trainer's --worker-ranks): K or "node"
    topk: float = 1.0          # < 1: the periodic methods send each chunk's top-k (--topk)
    recommend: bool = False    # --recommend: search the candidate grid (planning.recommend)
    recommend_slack: float = 0.05
    max_period: int = 500
    min_topk: float = 0.01
    compressed_overlap: bool = False   # --assume-compressed-overlap
    assumptions: List[str] = field(default_factory=list)   # "assumed: ..." lines: defaults


def _topologies() -> Tuple[str, ...]:
    from lsgd_hpc.topology import TOPOLOGIES
    return TOPOLOGIES


def _per_step_gap(name: str, p: int, node_of: Sequence[int]) -> float:
    """Spectral gap of one step: 1 - (1 - gap over one period)^(1/period) (time-varying graphs
    mix over their period); nan when the analyser cannot tell."""
    from lsgd_hpc.topology import build_topology, spectral_gap
    try:
        topo = build_topology(name, p, node_of=node_of)
        gap = spectral_gap(topo)
    except (ValueError, NotImplementedError, MemoryError):
        return math.nan
    period = max(1, int(getattr(topo, "period", 1)))
    return 1.0 - max(0.0, 1.0 - gap) ** (1.0 / period)


class _Costing:
    """``cost(method, **options)``: a method's predicted cost on the plan's cluster, with what
    it sends (``inp.comm_dtype``; fp32 for a method that cannot send it, as the trainer
    refuses it there: int8 and fp8 for lsgd-async)."""

    def __init__(self, inp: PlanInputs, facts: ModelFacts):
        self.inp = inp
        self.cluster = cm.Cluster(inp.nodes, inp.ranks_per_node, inp.intra, inp.inter,
                                  mem_Bps=inp.mem_Bps)
        self.workload = cm.Workload(facts.n_params, facts.n_buffers, inp.step_s,
                                    element_bytes=WIRE_BYTES[inp.comm_dtype],
                                    comm_dtype=inp.comm_dtype)
        self.full_workload = cm.Workload(facts.n_params, facts.n_buffers, inp.step_s)
        # top-k for EASGD, and DiLoCo on a model without buffers (the trainer refuses it
        # with BatchNorm statistics: they share the pseudo-gradient's allreduce)
        self.topk_methods = () if inp.topk >= 1 else \
            tuple(m for m in TOPK_METHODS if m != "diloco" or facts.n_buffers == 0)
        self.sparse_workload = replace(self.workload, topk=inp.topk,
                                       value_bits=cm.VALUE_BITS.get(inp.comm_dtype, 32))
        self.coll = cm.Collectives(inp.allreduce)
        # the cluster the methods run on: the ranks, or the workers' first ranks
        # (--worker-ranks)
        c = self.cluster
        self.methods_cluster = c if inp.worker_ranks == 1 else \
            cm.workers_cluster(c, cm.worker_size(c, inp.worker_ranks))

    def load(self, method: str) -> cm.Workload:
        if method in self.topk_methods:
            return self.sparse_workload
        return self.full_workload if comm_dtype_problem(self.inp.comm_dtype, "mpi", method) \
            else self.workload

    def __call__(self, method: str, **options) -> cm.MethodCost:
        inp = self.inp
        if (method == "lsgd" and inp.topk < 1 and inp.worker_ranks == 1
                and not topk_problem(inp.topk, inp.comm_dtype, "mpi", "lsgd")):
            # LSGD's compressed global pull: the top-k records of the leader's change
            # (planning.recommend.lsgd_cost; no pull delay, as the trainer refuses one)
            from lsgd_hpc.planning.recommend import lsgd_cost
            tau_l, tau_g = options["tau_local"], options["tau_global"]
            c = lsgd_cost(self.full_workload, self.cluster, tau_l, tau_g, 0, inp.comm_dtype,
                          inp.topk)
            return replace(c, setting=f"tau_L {tau_l}, tau_G {tau_g}, top-k {inp.topk:g}")
        return cm.method_cost(method, self.load(method), self.cluster, options, coll=self.coll,
                              worker_ranks=self.inp.worker_ranks)


def _lsgd_periods(cost: _Costing, share: float) -> Tuple[int, int]:
    """LSGD's (tau_L, tau_G): tau_G first (with tau_L = tau_G), then the smallest tau_L that
    divides it (on a cluster of several nodes of several ranks each)."""
    tau_g, _ = cm.smallest_period(lambda t: cost("lsgd", tau_local=t, tau_global=t), share)
    cw = cost.methods_cluster
    if 1 < cw.nodes < cw.ranks:
        for t in (2 ** k for k in range(0, int(math.log2(tau_g)) + 1)):
            if cost("lsgd", tau_local=t, tau_global=tau_g).comm_share <= share:
                return t, tau_g
    return tau_g, tau_g


def _periodic_methods(cost: _Costing, share: float) -> Tuple[List[cm.MethodCost], Dict]:
    """Allreduce SGD and the periodic methods at their recommended periods: their costs, and
    the recommended settings (plan's "recommended", less local SGD's cost ratio and gossip)."""
    # allreduce SGD at its defaults (buckets of bucket_mb), no overlap counted (a CPU MPI
    # progresses non-blocking collectives only inside MPI calls)
    rows: List[cm.MethodCost] = [cost("allreduce")]
    tau_l, tau_g = _lsgd_periods(cost, share)
    rows.append(cost("lsgd", tau_local=tau_l, tau_global=tau_g))
    tau_e, easgd_cost = cm.smallest_period(lambda t: cost("easgd", easgd_tau=t), share)
    rows.append(easgd_cost)
    T, local_cost = cm.smallest_period(lambda t: cost("local-sgd", local_steps=t), share)
    rows.append(local_cost)
    # DiLoCo: the same amortised allreduce as local SGD, every H steps
    H, diloco_cost = cm.smallest_period(lambda t: cost("diloco", local_steps=t), share)
    rows.append(diloco_cost)
    # SlowMo: local SGD's T, the slow step every fairscale's 48 steps (rounded up to a
    # multiple of T)
    slow_every = T * max(1, math.ceil(SLOWMO_EVERY / T))
    rows.append(cost("slowmo", local_steps=T, slowmo_every=slow_every))
    return rows, {"lsgd": {"tau_local": tau_l, "tau_global": tau_g},
                  "easgd": {"tau": tau_e}, "diloco": {"H": H},
                  "slowmo": {"T": T, "every": slow_every}, "local-sgd": {"T": T}}


def _gossip_rows(cost: _Costing) -> List[Dict]:
    """Gossip on every topology that fits the methods' cluster: cost and spectral gap per step
    (``"cost"``: the MethodCost)."""
    cw = cost.methods_cluster
    node_of = cw.node_of()
    rows = []
    for name in _topologies():
        if name == "hypercube" and cw.ranks & (cw.ranks - 1):
            continue
        try:
            g_cost = cost("gossip", topology=name)
        except ValueError:
            continue
        rows.append({"topology": name, "step_s": g_cost.step_s,
                     "comm_share": g_cost.comm_share, "bytes_per_step": g_cost.bytes_per_step,
                     "gap_per_step": _per_step_gap(name, cw.ranks, node_of), "cost": g_cost})
    return rows


def _best_gossip(gossip_rows: List[Dict], share: float) -> Tuple[Dict, str]:
    """The recommended topology and why: the largest spectral gap per step among those within
    ``share``, else the cheapest."""
    within = [g for g in gossip_rows
              if g["comm_share"] <= share and not math.isnan(g["gap_per_step"])]
    if within:
        best = max(within, key=lambda g: (g["gap_per_step"], -g["step_s"]))
        return best, f"largest spectral gap per step with comm share <= {share:.0%}"
    best = min(gossip_rows, key=lambda g: g["step_s"])
    return best, f"no topology within {share:.0%} comm share: the cheapest"


def _cost_ratio(cost: _Costing) -> float:
    """Cost ratio r of one averaging round to one local step (what local SGD's auto T
    measures; with workers a local step includes the gradient's allreduce inside them)."""
    one = cost("local-sgd", local_steps=1)
    round_s = getattr(one, "between_s", one.comm_s)
    local_step_s = cost.workload.compute_s + getattr(one, "inside_s", 0.0)
    return round_s / local_step_s if local_step_s > 0 else math.inf


def _method_row(r: cm.MethodCost) -> Dict:
    row = dict(method=r.method, setting=r.setting, step_s=r.step_s,
               compute_s=r.compute_s, comm_s=r.comm_s, comm_share=r.comm_share,
               bytes_per_step=r.bytes_per_step)
    if isinstance(r, cm.WorkerCost):
        row.update(inside_s=r.inside_s, between_s=r.between_s,
                   worker_bytes_per_step=r.worker_bytes_per_step)
    return row


def plan(inp: PlanInputs, facts: ModelFacts) -> Dict:
    """Predicted cost of every method, with the recommended periods and topology."""
    cost = _Costing(inp, facts)
    share = inp.max_comm_share
    rows, recommended = _periodic_methods(cost, share)
    gossip_rows = _gossip_rows(cost)
    best, why = _best_gossip(gossip_rows, share)
    rows.append(best["cost"])
    recommended["local-sgd"]["cost_ratio"] = _cost_ratio(cost)
    recommended["gossip"] = {"topology": best["topology"], "why": why}
    out = {
        "inputs": _inputs_dict(inp, facts),
        "rho": _rho(cost.cluster, facts, inp.step_s),
        "methods": [_method_row(r) for r in rows],
        "recommended": recommended,
        "gossip": [{k: v for k, v in g.items() if k != "cost"} for g in gossip_rows],
    }
    if inp.recommend:
        out["recommendation"] = recommendation(inp, facts, out["rho"]["rho"])
    return out


def recommendation(inp: PlanInputs, facts: ModelFacts, rho: float) -> Dict:
    """--recommend: the method, period and compressor to run (lsgd_hpc.planning.recommend),
    with the configuration's rho."""
    from lsgd_hpc.planning import recommend as rc
    cost = _Costing(inp, facts)
    rec = rc.recommend(cost.full_workload, cost.cluster, cost.coll, slack=inp.recommend_slack,
                       max_period=inp.max_period, min_topk=inp.min_topk,
                       diloco_topk=facts.n_buffers == 0,
                       compressed_overlap=inp.compressed_overlap)
    rec["rho"] = rho
    return rec


def format_recommendation(rec: Dict) -> str:
    """The method candidates of the text plan (the recommendation itself is the run's line,
    lsgd_hpc.planning.advice.format_run)."""
    best = rec["recommended"]

    def compressor(r):
        return r["comm_dtype"] + (f", top-k {r['topk']:g}" if r["topk"] < 1 else "")

    def setting(r):
        o = r["options"]
        names = (("H", "H"), ("fragments", "P"), ("sync_delay", "delay"), ("tau_local", "tau_L"),
                 ("tau_global", "tau_G"), ("pull_delay", "delay"), ("tau", "tau"))
        return ", ".join(f"{short} {o[k]}" for k, short in names if k in o) or "every step"

    lines = [
        "",
        f"method candidates (rho {rec['rho']:.3g}): the first by the rule is {best['method']}, "
        f"{setting(best)}, {compressor(best)}: {_fmt_ms(best['step_s'])} ms a step "
        f"({100 * best['comm_share']:.1f}% communication, "
        f"comm/compute {best['comm_ratio']:.3g})",
        f"  rule: {rec['rule']}",
        "",
        f"{'':2}{'method':<17} {'setting':<30} {'compressor':<16} {'step ms':>9} "
        f"{'comm share':>10} {'wire/step':>11}  note",
    ]
    fastest = rec["fastest_step_s"]
    for i, r in enumerate([best] + rec["runners_up"]):
        note = "first by the rule" if i == 0 else "within slack" if r.get("eligible") else ""
        if r["step_s"] == fastest:
            note = (note + ", " if note else "") + "fastest"
        if r["method"] == "allreduce":
            note = (note + ", " if note else "") + "baseline"
        if r.get("trainer_refuses"):
            note = (note + ", " if note else "") + "trainer refuses it today"
        lines.append(f"{'':2}{r['method']:<17} {setting(r):<30} {compressor(r):<16} "
                     f"{_fmt_ms(r['step_s']):>9} {100 * r['comm_share']:>9.1f}% "
                     f"{_fmt_bytes(r['wire_bytes_per_step']):>11}  {note}")
    return "\n".join(lines)


def _rho(c: cm.Cluster, facts: ModelFacts, step_s: float) -> Dict:
    """rho (cm.rho) and its parts: the fp32 bytes of the model's parameters, the seconds of
    their allreduce between nodes (hierarchical: each node's link crossed once) and of one
    compute step."""
    return {"rho": cm.rho(facts.n_params, c, step_s),
            "allreduce_between_nodes_s": cm.between_nodes_allreduce_time(
                facts.n_params * cm.FLOAT_BYTES, c),
            "compute_s": step_s, "fp32_bytes": facts.n_params * cm.FLOAT_BYTES}


def _inputs_dict(inp: PlanInputs, facts: ModelFacts) -> Dict:
    d = {k: v for k, v in asdict(inp).items() if k not in ("intra", "inter")}
    for name, link in (("intra", inp.intra), ("inter", inp.inter)):
        d[name] = {"gbps": link.gbps, "latency_us": link.alpha_s * 1e6}
    if inp.worker_ranks != 1:
        q_w = inp.ranks_per_node if inp.worker_ranks == "node" else int(inp.worker_ranks)
        d.update(worker_size=q_w, n_workers=inp.nodes * inp.ranks_per_node // q_w)
    d.update(ranks=inp.nodes * inp.ranks_per_node, n_params=facts.n_params,
             n_buffers=facts.n_buffers, macs_per_sample=facts.macs_per_sample,
             model_bytes=(facts.n_params + facts.n_buffers) * cm.FLOAT_BYTES)
    return d


def _fmt_bytes(n: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def _fmt_ms(s: float) -> str:
    return f"{s * 1e3:.3g}"


def format_plan(result: Dict) -> str:
    i, rec, r = result["inputs"], result["recommended"], result["rho"]
    dataset = f" ({i['dataset']})" if i["dataset"] else ""
    lines = [
        f"model {i['model']}{dataset}: {i['n_params']:,} parameters + {i['n_buffers']:,} "
        f"buffer elements = {_fmt_bytes(i['model_bytes'])} per model exchange",
        f"cluster: {i['nodes']} nodes x {i['ranks_per_node']} ranks = {i['ranks']} ranks; "
        f"inside a node {i['intra']['gbps']:.4g} Gbit/s, {i['intra']['latency_us']:.3g} us; "
        f"between nodes {i['inter']['gbps']:.4g} Gbit/s, {i['inter']['latency_us']:.3g} us "
        f"({i['link_source']})",
        f"compute per step: {_fmt_ms(i['step_s'])} ms ({i['step_source']})",
        f"rho = {r['rho']:.3g}: one fp32 allreduce of the parameters between nodes "
        f"({_fmt_bytes(r['fp32_bytes'])}, hierarchical: each node's link crossed once) "
        f"{_fmt_ms(r['allreduce_between_nodes_s'])} ms / compute {_fmt_ms(r['compute_s'])} ms"
        + (" (one node: nothing crosses)" if i["nodes"] == 1 else ""),
    ]
    workers = "worker_size" in i
    if workers:
        lines.append(f"workers: {i['n_workers']} of {i['worker_size']} ranks (--worker-ranks "
                     f"{i['worker_ranks']}); bytes/step/rank is the method's traffic between "
                     "workers, inside/step/rank the gradient's allreduce inside a worker and "
                     "the results spread in it (allreduce: one replica over all ranks)")
    lines += [
        "",
        f"{'method':<10} {'setting':<30} {'step ms':>9} {'comm share':>10} {'bytes/step/rank':>16}"
        + (f" {'inside/step/rank':>17}" if workers else ""),
    ]
    for m in result["methods"]:
        inside = m.get("worker_bytes_per_step")
        lines.append(f"{m['method']:<10} {m['setting']:<30} {_fmt_ms(m['step_s']):>9} "
                     f"{100 * m['comm_share']:>9.1f}% {_fmt_bytes(m['bytes_per_step']):>16}"
                     + ((f" {_fmt_bytes(inside):>17}" if inside is not None else f" {'-':>17}")
                        if workers else ""))
    lines += [
        "",
        # with the method recommendation, the run's one "recommended" line is the answer
        ("periods" if "recommendation" in result else "recommended")
        + f" (comm share <= {i['max_comm_share']:.0%}): "
        f"LSGD --tau-local {rec['lsgd']['tau_local']} --tau-global {rec['lsgd']['tau_global']}; "
        f"local SGD --local-steps {rec['local-sgd']['T']} (cost ratio of a round to a step "
        f"{rec['local-sgd']['cost_ratio']:.3g}; --local-steps auto refines it from the loss); "
        f"DiLoCo --local-steps {rec['diloco']['H']}; SlowMo --local-steps "
        f"{rec['slowmo']['T']} --slowmo-every {rec['slowmo']['every']}; "
        f"EASGD --easgd-tau {rec['easgd']['tau']}; gossip --topology {rec['gossip']['topology']} "
        f"({rec['gossip']['why']})",
        "",
        f"gossip topologies: {'topology':<22} {'step ms':>9} {'comm share':>10} {'gap/step':>9}",
    ]
    for g in result["gossip"]:
        gap = "n/a" if math.isnan(g["gap_per_step"]) else f"{g['gap_per_step']:.3g}"
        lines.append(f"{'':<19}{g['topology']:<22} {_fmt_ms(g['step_s']):>9} "
                     f"{100 * g['comm_share']:>9.1f}% {gap:>9}")
    return "\n".join(lines)


# -- --measure -----------------------------------------------------------------------------------
def measure_step_seconds(model: str, dataset: str, batch: int, steps: int = 5,
                         warmup: int = 2) -> float:
    """Median seconds of one local SGD step (forward, backward, update) of the real model on
    a random batch of its input shape, on this process's CPU."""
    import time
    import torch
    from lsgd_hpc.models.zoo import build_model
    classes, shape = DATASET_SHAPES[dataset]
    torch.manual_seed(0)
    net = build_model(model, classes, shape)
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    x, y = torch.randn(batch, *shape), torch.randint(0, classes, (batch,))
    times = []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(net(x), y).backward()
        opt.step()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def measure_job(facts: ModelFacts, batch: int, ranks_per_node: Optional[int] = None):
    """Collective over MPI.COMM_WORLD: node layout (host names, or K consecutive ranks), links
    inside and between nodes (lsgd_hpc.planning.netprobe), and the step time (every rank at once, as in
    training; the slowest rank's median). Returns (figures, rank, problem): the same figures
    and problem (None or one line) on every rank."""
    from mpi4py import MPI
    from lsgd_hpc.comm import NodeGroups
    from lsgd_hpc.comm.mpi import MPICommunicator
    from lsgd_hpc.planning.netprobe import probe_groups
    world = MPICommunicator(MPI.COMM_WORLD)
    groups = NodeGroups.build(world, ranks_per_node)
    rank, p, N = world.rank, world.size, groups.n_nodes
    sizes = [groups.node_of.count(n) for n in range(N)]
    layout = f"{N} node(s) of {'/'.join(map(str, sorted(set(sizes))))} rank(s)"
    if len(set(sizes)) > 1:
        groups.free()
        return None, rank, f"--measure: nodes hold different numbers of ranks ({layout})"
    probe = probe_groups(groups)
    out = {"nodes": N, "ranks_per_node": p // N, "layout": layout, "probe": probe}
    if facts.dataset is not None:       # a zoo model (--params: its step is given)
        step = measure_step_seconds(facts.model, facts.dataset, batch)
        out.update(step_s=MPI.COMM_WORLD.allreduce(step, op=MPI.MAX),
                   step_source=f"measured: slowest of {p} rank(s), batch {batch}, this job's "
                               "CPUs")
    groups.free()
    for kind in ("intra", "inter"):
        link = probe.get(kind)
        if link is not None:
            out[kind] = cm.Link(float(link["alpha_s"]), float(link["beta_s_per_byte"]))
    return out, rank, None


# -- command line --------------------------------------------------------------------------------
class _Parser(argparse.ArgumentParser):
    def error(self, message):     # one line, exit 2
        raise UsageError(message)


def _add_recommend_options(p: argparse.ArgumentParser) -> None:
    """The method recommendation's options (lsgd_hpc.planning.recommend)."""
    p.add_argument("--recommend", action="store_true",
                   help="(the default without --worker-ranks) recommend a method, its period "
                        "and its compressor: the least aggressive candidate (smallest "
                        "period, then mildest compression) of a grid (allreduce; lsgd; "
                        "diloco; streaming diloco; easgd; H/tau in 4..500; fp32/int8/int4/"
                        "int2; top-k 1, 0.03, 0.01) whose predicted step is within "
                        "--recommend-slack of the fastest")
    p.add_argument("--recommend-slack", type=float, default=0.05, metavar="S",
                   help="with --recommend: eligible candidates are within this fraction of "
                        "the fastest predicted step (default 0.05)")
    p.add_argument("--max-period", type=int, default=500, metavar="H",
                   help="with --recommend, the quality guard: no period (H, tau) above H "
                        "(default 500: DiLoCo's)")
    p.add_argument("--min-topk", type=float, default=0.01, metavar="F",
                   help="with --recommend, the quality guard: no top-k below F (default 0.01: "
                        "SparseLoCo's 1%%)")
    p.add_argument("--assume-compressed-overlap", action="store_true",
                   help="with --recommend: price LSGD's compressed pull started early "
                        "(--pull-delay) as hidden behind compute like an fp32 one (the "
                        "package runs a compressed non-blocking broadcast at once today, "
                        "hiding nothing; a compressed allreduce hides for real)")


def _parser() -> argparse.ArgumentParser:
    from lsgd_hpc.models.zoo import MODELS
    p = _Parser(prog="python -m lsgd_hpc.plan",
                description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("--model", choices=MODELS, help="network (lsgd_hpc.models); or --params")
    p.add_argument("--params", type=float, metavar="N",
                   help="in place of --model: a model of N parameters (e.g. 1e9), no buffers; "
                        "its step: --step-ms, else 6 N x --tokens-per-step FLOP at --tflops")
    p.add_argument("--dataset", choices=tuple(DATASET_SHAPES),
                   help="data set whose input shape the model takes (default: the model's own)")
    p.add_argument("--nodes", type=int, help="compute nodes (default with --measure: the job's)")
    p.add_argument("--ranks-per-node", type=int, help="ranks (GPUs) per node")
    p.add_argument("--inter-gbps", type=float, help="bandwidth between nodes, Gbit/s per node")
    p.add_argument("--intra-gbps", type=float,
                   help="bandwidth inside a node, Gbit/s per rank (default: measured with "
                        "--measure, else --interconnect's, else --gpu's; printed as assumed)")
    p.add_argument("--gpu", choices=tuple(advice.GPUS),
                   help=f"the ranks' device (default {advice.DEFAULT_GPU}, assumed): its "
                        "link inside a node (h100 NVLink 4, a100 NVLink 3, v100 NVLink 2, cpu "
                        "shared memory), its sustained TFLOP/s for a --params model "
                        f"({advice.MFU * 100:.0f}%% of its peak) and the train command's --device")
    p.add_argument("--interconnect", choices=tuple(advice.INTERCONNECTS),
                   help="the link inside a node in place of the GPU's (e.g. pcie4 for PCIe "
                        "cards): nvlink4 3600, nvlink3 2400, nvlink2 1200, pcie5 512, pcie4 "
                        "256, pcie3 128, shm 200 Gbit/s a rank")
    p.add_argument("--tokens-per-step", type=int, metavar="T",
                   help=f"--params: tokens (or samples) one rank computes per step, for the "
                        f"step estimate of 6 N T FLOP (default {advice.TOKENS_PER_STEP})")
    p.add_argument("--inter-latency-us", type=float, default=5.0,
                   help="latency between nodes, microseconds (default 5: InfiniBand)")
    p.add_argument("--intra-latency-us", type=float, default=2.0,
                   help="latency inside a node, microseconds (default 2: NVLink)")
    p.add_argument("--step-ms", type=float, help="compute time of one local step, ms")
    p.add_argument("--batch-size", type=int, help="per-rank minibatch (default: the data set's)")
    p.add_argument("--tflops", type=float,
                   help="achieved TFLOP/s per rank for the estimate without --step-ms (default: "
                        f"--params {advice.MFU * 100:.0f}%% of --gpu's peak; --model 10)")
    p.add_argument("--mem-gbytes-per-s", type=float, default=1500.0,
                   help="device memory bandwidth for the pulls' elementwise passes, GB/s")
    p.add_argument("--max-comm-share", type=float, default=0.1,
                   help="target communication share for the recommended periods (default 0.1)")
    p.add_argument("--allreduce", choices=cm.ALLREDUCE_ALGORITHMS, default="auto",
                   help="allreduce algorithm the library uses (auto: the fastest)")
    p.add_argument("--measure", action="store_true",
                   help="under mpirun/srun: measure links and step time first")
    p.add_argument("--measure-ranks-per-node", type=int,
                   help="with --measure: K consecutive ranks form a node (default: by host name)")
    p.add_argument("--comm-dtype", choices=COMM_DTYPES, default="fp32",
                   help="what the methods send (the trainer's --comm-dtype): bf16 halves the "
                        "bytes, int8 and fp8 quarter them, int4 an eighth, int2 a sixteenth "
                        "(plus a scale per 4096 elements); allreduce SGD and gossip stay fp32 "
                        "with int8/fp8/int4/int2, as the trainer refuses them")
    p.add_argument("--topk", type=float, default=1.0, metavar="F",
                   help="the trainer's --topk: EASGD, local SGD, SlowMo and DiLoCo (without "
                        "buffers) send the largest F of each chunk of 4096, with "
                        "--comm-dtype's values, by an allgather; LSGD's global pull the top-k "
                        "records of the leader's change, broadcast (default 1: dense)")
    p.add_argument("--worker-ranks", default="1", metavar="{K,node}",
                   help="ranks per worker (the trainer's --worker-ranks): K ranks of a node, or "
                        "node, train one replica with an allreduce of the gradient inside; the "
                        "methods run between workers (default 1: every rank a worker)")
    _add_recommend_options(p)
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--mtbf-hours", metavar="H",
                   help="per-node MTBF, hours (llama3: the Llama 3 report's): with --params or "
                        "--inter-gbps the recommendation adds the failure policy, checkpoint "
                        "interval and goodput; without them, the failure planner alone "
                        "(python -m lsgd_hpc.plan --mtbf-hours H --nodes N --help)")
    failplan.add_failure_options(p.add_argument_group("failures (with --mtbf-hours)"))
    return p


def _check_model(args) -> None:
    """Exactly one of --model and --params; --params a whole count >= 1, no --dataset;
    --tokens-per-step with --params only."""
    if (args.model is None) == (args.params is None):
        raise UsageError("--model or --params: give exactly one (a model of lsgd_hpc.models, "
                         "or a parameter count such as 1e9)")
    if args.params is None:
        if args.tokens_per_step is not None:
            raise UsageError("--tokens-per-step: for --params (a zoo model's step is "
                             "estimated from its multiply-adds and --batch-size)")
        return
    n = args.params
    if not (math.isfinite(n) and n >= 1 and n == int(n)):
        raise UsageError(f"--params: must be a whole number >= 1, got {n:g}")
    if args.tokens_per_step is not None and args.tokens_per_step < 1:
        raise UsageError(f"--tokens-per-step: must be >= 1, got {args.tokens_per_step}")
    if args.dataset is not None:
        raise UsageError("--dataset: a data set is for --model, not --params")


def _check(args) -> None:
    """Every check that needs no MPI, so that every rank fails alike before any collective."""
    def positive(name, v, integer=False):
        if v is None:
            return
        if not (v > 0) or math.isinf(v) and integer:
            raise UsageError(f"--{name.replace('_', '-')}: must be > 0, got {v}")

    _check_model(args)
    for name in ("nodes", "ranks_per_node", "batch_size", "measure_ranks_per_node"):
        positive(name, getattr(args, name), integer=True)
    for name in ("inter_gbps", "intra_gbps", "step_ms", "tflops", "mem_gbytes_per_s"):
        positive(name, getattr(args, name))
    for name in ("inter_latency_us", "intra_latency_us"):
        v = getattr(args, name)
        if not v >= 0 or math.isinf(v):
            raise UsageError(f"--{name.replace('_', '-')}: must be >= 0 and finite, got {v}")
    if not 0 < args.topk <= 1:
        raise UsageError(f"--topk: must be in (0, 1], got {args.topk:g}")
    problem = topk_problem(args.topk, args.comm_dtype, "mpi", "diloco")
    if problem:
        raise UsageError(f"--topk: {problem}")
    if not 0 <= args.recommend_slack < 1:
        raise UsageError(f"--recommend-slack: must be in [0, 1), got {args.recommend_slack:g}")
    if args.max_period < 1:
        raise UsageError(f"--max-period: must be >= 1, got {args.max_period}")
    if not 0 < args.min_topk <= 1:
        raise UsageError(f"--min-topk: must be in (0, 1], got {args.min_topk:g}")
    if args.recommend and args.worker_ranks not in ("1", 1):
        raise UsageError("--recommend: prices every rank as a worker; leave out --worker-ranks")
    _check_failures(args)
    if not 0 < args.max_comm_share < 1:
        raise UsageError(f"--max-comm-share: must be in (0, 1), got {args.max_comm_share}")
    if not args.measure:
        missing = [f"--{n.replace('_', '-')}" for n in ("nodes", "ranks_per_node", "inter_gbps")
                   if getattr(args, n) is None]
        if missing:
            raise UsageError(f"{', '.join(missing)}: required without --measure")
    elif args.measure_ranks_per_node is not None and args.measure_ranks_per_node < 1:
        raise UsageError("--measure-ranks-per-node: must be >= 1")
    if args.worker_ranks != "node":
        try:
            args.worker_ranks = int(args.worker_ranks)
            if args.worker_ranks < 1:
                raise ValueError
        except ValueError:
            raise UsageError(f"--worker-ranks: must be an integer >= 1 or node, got "
                             f"{args.worker_ranks!r}") from None
        if args.ranks_per_node and args.ranks_per_node % args.worker_ranks:
            raise UsageError(f"--worker-ranks: must divide the ranks of every node "
                             f"(worker_ranks={args.worker_ranks}; --ranks-per-node "
                             f"{args.ranks_per_node})")
    if args.nodes and args.ranks_per_node and args.nodes * args.ranks_per_node > 65536:
        raise UsageError(f"--nodes x --ranks-per-node: at most 65536 ranks, got "
                         f"{args.nodes * args.ranks_per_node}")


#: the failure options (failplan.add_failure_options) and their defaults
FAILURE_OPTIONS = {"job_hours": failplan.DEFAULTS["job_hours"], "checkpoint_seconds": None,
                   "checkpoint_dir": None, "write_gbytes_per_s": None,
                   "restart_seconds": failplan.DEFAULTS["restart_seconds"],
                   "queue_seconds": failplan.DEFAULTS["queue_seconds"],
                   "shrink_pause_seconds": failplan.DEFAULTS["shrink_pause_seconds"],
                   "heal_pause_seconds": failplan.DEFAULTS["heal_pause_seconds"],
                   "replacement_seconds": failplan.DEFAULTS["replacement_seconds"],
                   "survivable": failplan.DEFAULTS["survivable"], "replica_nodes": 1,
                   "spares": 0, "requeue_hours": None}


def _check_failures(args) -> None:
    """--mtbf-hours with the method plan: the failure planner's checks; the failure options
    without it are refused."""
    if args.mtbf_hours is None:
        given = [k for k, v in FAILURE_OPTIONS.items() if getattr(args, k) != v]
        if given:
            raise UsageError(f"--{given[0].replace('_', '-')}: needs --mtbf-hours")
        return
    if args.measure:
        raise UsageError("--mtbf-hours: not with --measure (give --nodes, --ranks-per-node and "
                         "--inter-gbps)")
    try:
        failplan.check(args, combined=True)
    except failplan.FailureUsageError as exc:
        raise UsageError(str(exc)) from None


def _batch_size(args, facts: ModelFacts) -> Optional[int]:
    if facts.dataset is None:           # --params: the batch is the user's, if given
        return args.batch_size
    return args.batch_size or int(DATASETS[facts.dataset].defaults["batch_size"])


def _step(args, facts: ModelFacts, batch: Optional[int], m: Dict) -> Tuple[float, str, List]:
    """Compute seconds of one step, where they come from, and the assumption lines."""
    if args.step_ms is not None:
        return args.step_ms / 1e3, "given", []
    if "step_s" in m:
        return m["step_s"], m["step_source"], []
    if facts.dataset is None:           # --params: 6 N T FLOP at the GPU's sustained rate
        tokens = args.tokens_per_step or advice.TOKENS_PER_STEP
        step_s, line = advice.params_step(facts.n_params, tokens, args.tflops,
                                          args.gpu or advice.DEFAULT_GPU,
                                          args.tokens_per_step is not None)
        return step_s, "estimated: 6 N T FLOP, see the assumed line", [line]
    tflops = args.tflops or 10.0
    flop = TRAIN_FLOP_PER_MAC * facts.macs_per_sample * batch
    step_s = flop / (tflops * 1e12)
    src = (f"estimated: {flop / 1e9:.3g} GFLOP for batch {batch} at {tflops:g} TFLOP/s; pass "
           "--step-ms for a measured figure")
    extra = [] if args.tflops else [
        f"assumed: compute {step_s * 1e3:.3g} ms a step = {flop / 1e9:.3g} GFLOP (batch "
        f"{batch}) at 10 TFLOP/s achieved (pass --step-ms, or --tflops to set)"]
    return step_s, src, extra


def _links(args, m: Dict) -> Tuple[Dict, List[str], List[str]]:
    """The links (given, measured, or the intra-node one from --interconnect or --gpu), their
    sources and the assumption lines."""
    links, srcs, assumed = {}, [], []
    for kind in ("intra", "inter"):
        gbps, lat = getattr(args, f"{kind}_gbps"), getattr(args, f"{kind}_latency_us")
        if gbps is not None:
            links[kind] = cm.Link.from_gbps(gbps, lat)
            srcs.append(f"{kind} given")
        elif kind in m:
            links[kind] = m[kind]
            srcs.append(f"{kind} measured")
        elif kind == "intra":
            gbps, line = advice.intra_link(args.gpu or advice.DEFAULT_GPU, args.interconnect)
            links[kind] = cm.Link.from_gbps(gbps, lat)
            srcs.append("intra assumed")
            assumed.append(line)
        else:
            raise UsageError(f"--{kind}-gbps: the job has no {kind}-node link to measure "
                             f"({m.get('layout', 'one rank')}); give --{kind}-gbps")
    return links, srcs, assumed


def _assumptions(args, measured: bool) -> List[str]:
    """The lines of the defaults that stand for the device and the latencies."""
    out = []
    if args.gpu is None:
        g = advice.GPUS[advice.DEFAULT_GPU]
        out.append(f"assumed: every rank one {g.name} ({advice.DEFAULT_GPU}; the train command's "
                   "--device cuda) (pass --gpu to set)")
    if not measured and (args.intra_latency_us, args.inter_latency_us) == (2.0, 5.0):
        out.append("assumed: latency 2 us inside a node, 5 us between nodes (InfiniBand); "
                   f"device memory {args.mem_gbytes_per_s:g} GB/s (pass --intra-latency-us, "
                   "--inter-latency-us, --mem-gbytes-per-s to set)")
    return out


def _inputs(args, facts: ModelFacts, measured: Optional[Dict] = None) -> PlanInputs:
    batch = _batch_size(args, facts)
    m = measured or {}
    step_s, step_src, step_assumed = _step(args, facts, batch, m)
    links, srcs, link_assumed = _links(args, m)
    rpn = args.ranks_per_node or m.get("ranks_per_node")
    if args.worker_ranks != "node" and rpn and rpn % args.worker_ranks:
        raise UsageError(f"--worker-ranks: must divide the ranks of every node "
                         f"(worker_ranks={args.worker_ranks}; {rpn} per node)")
    return PlanInputs(facts.model, facts.dataset, args.nodes or m.get("nodes"),
                      rpn, links["intra"],
                      links["inter"], step_s, step_src, ", ".join(srcs), batch,
                      args.mem_gbytes_per_s * 1e9, args.max_comm_share, args.allreduce,
                      args.comm_dtype, args.worker_ranks, args.topk,
                      args.recommend or args.worker_ranks == 1,
                      args.recommend_slack, args.max_period, args.min_topk,
                      args.assume_compressed_overlap,
                      _assumptions(args, bool(m)) + link_assumed + step_assumed)


def _failures(args, facts: ModelFacts) -> Tuple[Dict, List[str]]:
    """--mtbf-hours with the method plan: the failure plan of this model's checkpoint, and the
    assumption lines of its defaults."""
    state = (facts.n_params + facts.n_buffers) * failplan.STATE_BYTES_PER_ELEMENT
    try:
        ckpt = failplan.state_checkpoint_cost(args, state, advice.WRITE_GBYTES_PER_S * 1e9)
    except failplan.FailureUsageError as exc:
        raise UsageError(str(exc)) from None
    fargs = argparse.Namespace(**{**vars(args), "step_ms": None})
    result = failplan.failure_plan(fargs, checkpoint=ckpt)
    lines = []
    if ckpt["assumed"]:
        lines.append(f"assumed: checkpoint {ckpt['seconds']:.3g} s = {state / 1e9:.3g} GB of "
                     f"state (weights + momentum) at {advice.WRITE_GBYTES_PER_S:g} GB/s a writer "
                     "(pass --write-gbytes-per-s, --checkpoint-dir or --checkpoint-seconds to "
                     "set)")
    names = {"job_hours": "{:g} h of training", "restart_seconds": "restart {:g} s",
             "shrink_pause_seconds": "shrink pause {:g} s",
             "heal_pause_seconds": "heal join {:g} s",
             "replacement_seconds": "replacement ready after {:g} s",
             "survivable": "{:.0%} of failures survivable"}
    default = [k for k in names if getattr(args, k) == FAILURE_OPTIONS[k]]
    if default:
        lines.append("assumed: " + ", ".join(names[k].format(getattr(args, k)) for k in default)
                     + " (pass " + ", ".join(f"--{k.replace('_', '-')}" for k in default)
                     + " to set)")
    return result, lines


def _model_args(args, facts: ModelFacts) -> Tuple[List[str], Optional[str]]:
    """The train command's model and data options, and what it still needs."""
    if facts.dataset is None:
        return [], ("add your data set and model: --dataset module:callable --model "
                    "module:callable, docs/library.md")
    note = None
    if DATASETS[facts.dataset].needs_data_dir:
        note = (f"--dataset {facts.dataset} needs --data-dir DIR: python -m lsgd_hpc.data fetch "
                f"{facts.dataset} --root DIR")
    return ["--dataset", facts.dataset, "--model", facts.model], note


def answer(args, facts: ModelFacts, result: Dict) -> None:
    """The one recommendation (``result["run"]``) of the plan's method and, with
    --mtbf-hours, the failure plan (``result["failures"]``); assumption lines added to
    ``result["inputs"]["assumptions"]``."""
    rec = result.get("recommendation")
    if rec is None:
        return
    failures = None
    if args.mtbf_hours is not None:
        failures, lines = _failures(args, facts)
        result["inputs"]["assumptions"] += lines
        result["failures"] = failures
    model_args, note = _model_args(args, facts)
    device = "cpu" if (args.gpu or advice.DEFAULT_GPU) == "cpu" else "cuda"
    run = advice.run_recommendation(rec, failures, result["inputs"]["nodes"],
                                    result["inputs"]["ranks_per_node"], device, model_args)
    run["model_note"] = note
    result["run"] = run


def format_answer(result: Dict) -> str:
    """The whole text: assumptions, the plan, the method candidates, the failure plan, and
    the one recommendation with its command."""
    parts = []
    if result["inputs"].get("assumptions"):
        parts.append("\n".join(result["inputs"]["assumptions"]) + "\n")
    parts.append(format_plan(result))
    if "recommendation" in result:
        parts.append(format_recommendation(result["recommendation"]))
    if "failures" in result:
        parts.append("\n" + failplan.format_failure_plan(result["failures"], verdict=False))
    if "run" in result:
        parts.append(advice.format_run(result["run"], result["run"].get("model_note")))
    return "\n".join(parts)


def _routes_to_failure_planner(argv: Sequence[str]) -> bool:
    """--mtbf-hours without --params, --inter-gbps or --measure: the failure planner alone."""
    def given(name):
        return any(a == name or a.startswith(name + "=") for a in argv)
    return given("--mtbf-hours") and not any(
        given(n) for n in ("--params", "--inter-gbps", "--measure"))


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if _routes_to_failure_planner(argv):
        return failplan.main(argv, model_facts)
    try:
        args = _parser().parse_args(argv)
        _check(args)
        facts = (model_facts(args.model, args.dataset) if args.model is not None
                 else params_facts(int(args.params)))
    except UsageError as exc:
        print(f"lsgd_hpc.plan: error: {exc}", file=sys.stderr)
        return 2
    measured, rank = None, 0
    if args.measure:
        measured, rank, problem = measure_job(facts, _batch_size(args, facts),
                                              args.measure_ranks_per_node)
        if problem:
            if rank == 0:
                print(f"lsgd_hpc.plan: error: {problem}", file=sys.stderr)
            return 2
    try:
        result = plan(_inputs(args, facts, measured), facts)
        answer(args, facts, result)
    except UsageError as exc:    # the same on every rank: measured figures are broadcast
        if rank == 0:
            print(f"lsgd_hpc.plan: error: {exc}", file=sys.stderr)
        return 2
    if rank == 0:
        if measured:
            result["measured"] = {k: (asdict(v) if isinstance(v, cm.Link) else v)
                                  for k, v in measured.items()}
        doc = failplan.finite(result) if "failures" in result else result  # inf: never
        print(json.dumps(doc, indent=2, default=str) if args.json else format_answer(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
