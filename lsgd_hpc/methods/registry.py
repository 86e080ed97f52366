"""The methods, one :class:`~lsgd_hpc.methods.spec.MethodSpec` each: the only place where a
method's options, defaults (the papers' values), ranges, help and cost-model entry are
written. Importable without torch.

To add a method: write its update rule (``methods/rules/``), its public class
(``methods/api.py``, naming its spec), and its spec here; the trainer's options, ``--help``,
the docs' methods table and the planner pick it up (docs/library.md, "Adding a method").
"""

from __future__ import annotations

from typing import Dict

from lsgd_hpc.methods.spec import Check, MethodSpec, Option

__all__ = ["SPECS", "LSGD_BN_POLICIES", "spec_of"]

#: What an LSGD pull does to the floating-point buffers (BatchNorm running statistics)
LSGD_BN_POLICIES = ("keep", "copy", "pull")

def _multiple(of: str, name: str):
    def test(o):
        if o[name] % o[of]:
            return f"must be a multiple of {of} ({o[name]} vs {o[of]})"
        return None
    return Check(name, test)


# -- LSGD ---------------------------------------------------------------------------------------
_LEADER_OPTIONS = (
    Option("tau_local", 64, "int", "steps between local (in-node) leader pulls",
           section="LSGD", low=1),
    Option("tau_global", 128, "int",
           "steps between global leader pulls (a multiple of tau_local)", section="LSGD", low=1),
    Option("pull_local", 0.1, "float", "c_L: pull strength toward the node's leader",
           section="LSGD", low=0, high=1),
    Option("pull_global", 0.1, "float", "c_G: pull strength toward the global leader",
           section="LSGD", low=0, high=1),
    Option("leader_window", 10, "int",
           "K: a worker's score is its mean loss over its last K minibatches",
           section="LSGD", low=1),
)
_LEADER_CHECKS = (_multiple("tau_local", "tau_global"),)


def _pull_delay_below_period(o):
    if o["pull_delay"] >= o["tau_local"]:
        return (f"must be < tau_local (one pull per level in flight), got {o['pull_delay']} "
                f"vs {o['tau_local']}")
    return None


def _lsgd_cost(cm, w, c, o, coll, overlap=0.0):
    return cm.lsgd(w, c, o["tau_local"], o["tau_global"], o.get("lsgd_bn", "keep"))


LSGD = MethodSpec(
    name="lsgd", class_name="LeaderSGD",
    summary="each worker pulled toward its node's leader and the global leader",
    options=_LEADER_OPTIONS + (
        Option("lsgd_pull_every_step", False, "bool",
               "also pull toward the last leader copies at every step, strength c/tau",
               section="LSGD"),
        Option("lsgd_bn", "keep", "choice",
               "BatchNorm statistics on a pull: keep local, copy the leader's, or pull",
               section="LSGD", choices=LSGD_BN_POLICIES),
        Option("score_fn", None, "callable",
               "a worker's score at each election is score_fn() (e.g. a held-out loss) "
               "instead of its window mean", section="LSGD",
               none="the mean of the last leader_window minibatch losses", cli=False),
        Option("pull_delay", 0, "int",
               "d: the leader's broadcast runs behind d steps of compute; the pull toward the "
               "leader of step s lands at step s + d (< tau_local)", section="LSGD", low=0),
    ),
    checks=_LEADER_CHECKS + (Check("pull_delay", _pull_delay_below_period),), cost=_lsgd_cost)

LSGD_ASYNC = MethodSpec(
    name="lsgd-async", class_name="AsyncLeaderSGD",
    summary="LSGD without per-step coupling: rounds by total work, non-blocking elections",
    options=_LEADER_OPTIONS + (
        Option("max_staleness", None, "int",
               "S: steps a worker takes past a probe or leader broadcast it posted before it "
               "waits for it", section="LSGD", low=0, none="tau_global"),
    ),
    checks=_LEADER_CHECKS, cost=_lsgd_cost,
    workers_refused="is not supported by lsgd-async (its ranks take uneven numbers of steps, "
                    "and the ranks of a worker average gradients at every step together); use "
                    "lsgd")

# -- allreduce SGD --------------------------------------------------------------------------------
ALLREDUCE = MethodSpec(
    name="allreduce", class_name="AllreduceSGD",
    summary="gradients averaged every step, identical replicas (as DDP, Horovod)",
    options=(
        Option("bucket_mb", 1.0, "float",
               "MB per gradient bucket averaged during backward (0: one allreduce after "
               "backward)", low=0),
        Option("check_replicas_every", 100, "int",
               "steps between checks that every replica holds the same bits (0: never)",
               low=0),
    ),
    cost=lambda cm, w, c, o, coll, overlap=0.0: cm.allreduce_sgd(
        w, c, coll, overlap, bucket_bytes=o["bucket_mb"] * 2 ** 20),
    worker_grouping=False)


# -- EASGD ----------------------------------------------------------------------------------------
def _easgd_stable(o, world_size):
    alpha = o["easgd_alpha"] if o["easgd_alpha"] is not None else 0.9 / world_size
    if world_size * alpha >= 2:
        return f"p * alpha = {world_size * alpha:.3g} >= 2 makes the centre update unstable"
    return None


EASGD = MethodSpec(
    name="easgd", class_name="EASGD",
    summary="elastic pull toward a centre held identically on every rank",
    options=(
        Option("easgd_alpha", None, "float", "moving rate alpha", low=0, high=1,
               low_open=True, high_open=True, none="0.9 / world size"),
        Option("easgd_tau", 4, "int", "steps between elastic updates", low=1),
    ),
    world_checks=(Check("easgd_alpha", _easgd_stable),),
    cost=lambda cm, w, c, o, coll, overlap=0.0: cm.easgd(w, c, o["easgd_tau"], coll))


# -- local SGD, DiLoCo, SlowMo ----------------------------------------------------------------------
def _local_sgd_cost(cm, w, c, o, coll, overlap=0.0):
    if o["local_steps"] == "auto":
        raise ValueError("local_steps auto: the cost depends on the T chosen at run time; "
                         "give an integer T")
    return cm.local_sgd(w, c, o["local_steps"], coll)


LOCAL_SGD = MethodSpec(
    name="local-sgd", class_name="LocalSGD",
    summary="x <- mean x every T local steps (T fixed, or auto)",
    options=(
        Option("local_steps", 8, "int_or_auto",
               "T local steps between averages, or auto (T chosen at run time from the "
               "measured cost ratio and loss decay)", low=1),
        Option("local_steps_cost_ratio", None, "float",
               "auto: take one averaging round to cost this many local steps", low=0,
               low_open=True, none="measured at run time"),
        Option("local_steps_max", 1024, "int", "auto: the largest T it may choose", low=1),
    ),
    cost=_local_sgd_cost)

def _fragment_count(o) -> int:
    f = o["fragments"]
    return f if isinstance(f, int) else len(f)


def _fragments_divide_h(o):
    p = _fragment_count(o)
    if o["local_steps"] % p:
        return f"must divide local_steps ({p} fragments, local_steps {o['local_steps']})"
    return None


def _delay_below_fragment_period(o):
    period = o["local_steps"] // _fragment_count(o)
    if o["local_steps"] % _fragment_count(o) == 0 and o["fragment_sync_delay"] >= period:
        return (f"must be < local_steps / fragments = {period} (a fragment's allreduce completes "
                f"before the next one starts), got {o['fragment_sync_delay']}")
    return None


DILOCO = MethodSpec(
    name="diloco", class_name="DiLoCo",
    summary="H inner steps, then an outer Nesterov step on the averaged pseudo-gradient",
    options=(
        Option("local_steps", 500, "int", "H inner steps between outer steps", low=1),
        Option("outer_lr", 0.7, "float", "outer SGD learning rate", low=0, low_open=True),
        Option("outer_momentum", 0.9, "float", "outer SGD momentum", low=0, high=1,
               high_open=True),
        Option("outer_nesterov", True, "bool", "Nesterov outer momentum (off: heavy ball)"),
        Option("fragments", 1, "int_or_modules",
               "P (Streaming DiLoCo): the parameters in model order split into P fragments of "
               "whole tensors, one synced every local_steps / P steps, round-robin (library: "
               "or a list of submodules, one per fragment)", low=1),
        Option("fragment_sync_delay", 0, "int",
               "tau (Streaming DiLoCo): steps a fragment's pseudo-gradient allreduce runs "
               "behind compute before its outer step (< local_steps / fragments)", low=0),
        Option("fragment_update_alpha", 0.0, "float",
               "alpha (Streaming DiLoCo): a synced fragment becomes "
               "lerp(outer result, local, alpha) (0: the outer result)", low=0, high=1),
    ),
    checks=(Check("fragments", _fragments_divide_h),
            Check("fragment_sync_delay", _delay_below_fragment_period)),
    cost=lambda cm, w, c, o, coll, overlap=0.0: cm.diloco(w, c, o["local_steps"], coll))

SLOWMO = MethodSpec(
    name="slowmo", class_name="SlowMo",
    summary="local SGD with a slow momentum step on the average every slowmo_every steps",
    options=(
        Option("local_steps", 1, "int", "T local steps between averages", low=1),
        Option("slowmo_every", 48, "int",
               "steps between slow-momentum steps (a multiple of local_steps)", low=1),
        Option("slowmo_beta", 0.5, "float", "slow momentum beta", low=0, high=1, high_open=True),
        Option("slowmo_alpha", 1.0, "float", "slow learning rate alpha", low=0, low_open=True),
    ),
    checks=(_multiple("local_steps", "slowmo_every"),),
    cost=lambda cm, w, c, o, coll, overlap=0.0: cm.slowmo(w, c, o["local_steps"],
                                                           o["slowmo_every"], coll))


# -- gossip -----------------------------------------------------------------------------------------
def _topology_fits(o, world_size):
    from lsgd_hpc.topology import build_topology
    try:
        build_topology(o["topology"], world_size)
    except ValueError as exc:
        return str(exc)
    return None


def _topologies():
    from lsgd_hpc.topology.graphs import TOPOLOGIES
    return tuple(TOPOLOGIES)


GOSSIP = MethodSpec(
    name="gossip", class_name="GossipSGD",
    summary="x_i <- sum_j W_ij x_j over a topology, neighbours only",
    options=(
        Option("topology", "ring", "choice",
               "gossip graph (see python -m lsgd_hpc.topology)", choices=_topologies()),
        Option("gossip_gamma", None, "float",
               "gamma in (0, 1]: with --comm-dtype int8, fp8, int4 or int2 or --topk < 1 "
               "(compressed gossip, CHOCO-SGD), the consensus step x_i += gamma sum_j W_ij "
               "(x^_j - x^_i) over the public copies x^ (see docs/algorithms.md)",
               low=0, low_open=True, high=1,
               none="1 for int8 and fp8, 0.8 int4, 0.4 int2 (1 fp32 values), times "
                    "min(1, 4 topk) with topk < 1"),
    ),
    world_checks=(Check("topology", _topology_fits),),
    cost=lambda cm, w, c, o, coll, overlap=0.0: cm.gossip(w, c, o["topology"]))


#: every method by its name (the trainer's ``--algorithm``), in the order docs list them
SPECS: Dict[str, MethodSpec] = {s.name: s for s in
                                (LSGD, LSGD_ASYNC, ALLREDUCE, EASGD, LOCAL_SGD, DILOCO, SLOWMO,
                                 GOSSIP)}


def spec_of(name: str) -> MethodSpec:
    """The spec of method ``name``; ValueError naming the choices otherwise."""
    try:
        return SPECS[name]
    except KeyError:
        raise ValueError(f"unknown method {name!r}; choose one of {', '.join(SPECS)}") from None
