"""The language model at three ratios of communication to compute: rho about 1, 30 and 300
between 2 emulated nodes (links of 100 Mbit/s, 4 Mbit/s and 400 kbit/s), allreduce SGD against
LSGD, DiLoCo and Streaming DiLoCo at fp32, int8 and top-k 1 % with 2-bit values: each
method's time to allreduce SGD's final perplexity, and the bytes between the nodes.

    python results/experiments/lm_links.py --out results/lm_links [--quick]
        [--rates 100mbit 4mbit 400kbit] [--steps S] [--factor F] [--seeds 1 2 3]
        [--methods LABEL ... [--add]] [--link-budget SECONDS]

As root. The workload is results/experiments/lm.py's (examples/char_lm.py: a byte-level
transformer, 0.47 M parameters, 1.9 MB in fp32, AdamW with a cosine schedule over the run's
steps, 16 windows of 64 bytes per rank and step, the Python standard library's sources;
held-out perplexity of the reported model), on 4 ranks = 2 nodes x 2 ranks (network namespaces
with their own host names; a tc tbf limit of the rate on what each node sends, its bucket
scripts/cluster.sh's default of 256 kB). Per rate ONE mpirun job probes the link (the layout
and the rate are checked before anything trains; fewer round trips on a slow link), warms
up, then runs every training one after another.

Methods (H = 8, LSGD tau 4 / 16, the language-model experiment's periods; no tuning: each
method's learning rate is its pick in the committed lm_links run of 2026-12-03, a new
compressed variant its fp32 parent's, LRS):

* allreduce SGD: gradients averaged every step (buckets of 1 MB during backward);
* LSGD worker=node: one worker per node (the node's 2 ranks average gradients every step
  over shared memory; single-leader LSGD between the nodes), in fp32 and with its pull as
  top-k 1 % with int2 values and error feedback;
* DiLoCo H=8 (outer Nesterov SGD, lr 0.7) and Streaming DiLoCo (the same H in 4 fragments,
  each fragment's allreduce started 1 step before its sync, mixed back with alpha = 0.5),
  each in fp32, int8 with error feedback, and top-k 1 % with int2 values and error feedback;
* SparseLoCo H=8: DiLoCo's top-k 1 % int2 round with the error-feedback residual decayed by
  0.95 a round (--error-feedback-decay) in place of the outer momentum (outer SGD, lr 1,
  momentum 0), as SparseLoCo (Sarfi et al., 2025) runs it; its fp32 parent is DiLoCo H=8.

Steps: allreduce SGD --steps (144), the others --factor (3) times as many (432), so that they
can reach allreduce SGD's final perplexity (the target, per seed) at all; one that does not
reach it within its budget is reported as not reaching it. The fastest rate runs every
method to its budget. At a slower rate a run whose traffic would hold the link longer than
--link-budget seconds (120; what crossed the link at the fastest rate, per node, over the
rate) runs only TRUNCATED_ROUNDS rounds of its method (4 steps of allreduce SGD, 16 of
DiLoCo, 32 of LSGD; the same command line, stopped early: a prefix of the full run). Its
figures are *predicted*: every method here trains the same bits at every rate for a seed (the
job checks it: each run's per-step training losses against the fastest rate's over their
common steps, column identical_to_fastest), so its time to the target is the step at which
the fastest rate's run reached it times the seconds a step measured at this rate, its bytes
between the nodes its own scaled to the budget's steps, its perplexity the fastest rate's.
Every such figure is marked (time_source, link_bytes_source, perplexity_source = predicted);
the a + b / rate fit of allreduce SGD's seconds a step over the rates is a finding.

Bytes between nodes are measured on the wire: the rank of local rank 0 on each node reads its
namespace's eth0 transmit counter (/proc/net/dev) before and after each training, summed over
both nodes (TCP and IP headers included), less the evaluations' traffic (LSGD's reported
model, the elected leader's, is broadcast to every rank for each evaluation: counted apart
as link_bytes_eval). The initial broadcast of x_0 is skipped when every rank already holds
the same parameters (they do: same seed), as it would cost 38 s a training at 400 kbit/s.

Outputs in --out: links_runs.csv (one row per run), links_summary.csv (per rate and method:
time to the target, speed-up over allreduce SGD, bytes between the nodes, perplexity at equal
steps against the fp32 parent, rho and what it stands for), links_table.md (the same as a
table), links_<rate>.png (held-out perplexity against training time and against bytes between
the nodes; predicted curves dashed), links.json. rho (docs/planning.md): one fp32 allreduce
of the parameters between the nodes, predicted from the link the rate's job probed, over the
run's compute seconds a step (training time less communication, / steps), in the columns
rho, rho_allreduce_s, rho_compute_s, rho_source; a rate's rho is allreduce SGD's, and what it
stands for is the same rho for a 1 B-parameter model on 16 nodes of 8 GPUs with a 640 ms
step (lsgd_hpc.planning.costmodel; the link speed that gives it).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import shutil
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
for _p in (REPO, REPO / "benchmarks", HERE):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))
import lm  # noqa: E402
from _common import rate_bps  # noqa: E402
from _shared import (RHO_COLUMNS, LayoutError, check_layout, new_figure, raw_dir,  # noqa: E402
                     rho_sentence, save_figure, write_csv, write_json)
from _shared import add_rho as shared_add_rho  # noqa: E402

NAME = "lm_links"
TITLE = ("Three ratios: the language model at rho about 1, 30 and 300 (100 Mbit/s, 4 Mbit/s, "
         "400 kbit/s), time to allreduce SGD's perplexity and bytes between nodes")
CLUSTER_NAME, CLUSTER_SUBNET = "lsgdlk", "10.79.11"
WORLD = 4
ALLREDUCE = "allreduce SGD"
_DILOCO = ["--method", "diloco", "--local-steps", "8", "--outer-lr", "0.7"]
_STREAMING = [*_DILOCO, "--fragments", "4", "--fragment-sync-delay", "1",
              "--fragment-update-alpha", "0.5"]
_LSGD_NODE = ["--method", "lsgd", "--tau-local", "4", "--tau-global", "16",
              "--worker-ranks", "node"]
_INT8 = ["--comm-dtype", "int8", "--error-feedback"]
_TOPK = ["--topk", "0.01", "--comm-dtype", "int2", "--error-feedback"]
TOPK = "top-k 1% int2+EF"
#: SparseLoCo (docs/algorithms.md): DiLoCo's top-k 1 % int2 round with the error-feedback
#: accumulator decayed by 0.95 in place of the outer momentum (outer SGD, lr 1, momentum 0)
_SPARSELOCO = ["--method", "diloco", "--local-steps", "8", "--outer-lr", "1", "--outer-momentum",
               "0", *_TOPK, "--error-feedback-decay", "0.95"]
SPARSELOCO = f"SparseLoCo H=8 ({TOPK}, EF decay 0.95)"
#: (label, char_lm options, steps of one round between the nodes, the fp32 parent)
METHODS = [
    (ALLREDUCE, ["--method", "allreduce"], 2, None),
    ("LSGD worker=node", _LSGD_NODE, 16, None),
    (f"LSGD worker=node {TOPK}", [*_LSGD_NODE, *_TOPK], 16, "LSGD worker=node"),
    ("DiLoCo H=8", _DILOCO, 8, None),
    ("DiLoCo int8+EF", [*_DILOCO, *_INT8], 8, "DiLoCo H=8"),
    (f"DiLoCo {TOPK}", [*_DILOCO, *_TOPK], 8, "DiLoCo H=8"),
    (SPARSELOCO, _SPARSELOCO, 8, "DiLoCo H=8"),
    ("Streaming DiLoCo P=4", _STREAMING, 8, None),
    ("Streaming DiLoCo int8+EF", [*_STREAMING, *_INT8], 8, "Streaming DiLoCo P=4"),
    (f"Streaming DiLoCo {TOPK}", [*_STREAMING, *_TOPK], 8, "Streaming DiLoCo P=4"),
]
PARENT = {m: parent for m, _, _, parent in METHODS}
ROUND = {m: r for m, _, r, _ in METHODS}
#: AdamW learning rates: the picks of the committed run (git 6d37424, results/lm_links/
#: links_summary.csv, tuned over 3e-3, 1e-2, 3e-2 at 100 Mbit/s); new variants: the parent's
LRS = {ALLREDUCE: 1e-2, "LSGD worker=node": 1e-2, "DiLoCo H=8": 3e-3, "DiLoCo int8+EF": 1e-2,
       "Streaming DiLoCo P=4": 1e-2}
FULL = dict(steps=144, factor=3, rates=("100mbit", "4mbit", "400kbit"), seeds=(1,),
            link_budget_s=120.0, eval_every=16)
QUICK = dict(steps=16, factor=2, rates=("100mbit", "4mbit"), seeds=(1,), link_budget_s=10.0,
             eval_every=8)
#: rounds a truncated run trains (enough to time its steps)
TRUNCATED_ROUNDS = 2
#: seconds the link probe's 1 MiB round trips may take at most (at least 2 of them)
PROBE_BUDGET_S = 20.0
#: what rho stands for: the planner's cluster of this size, this step, a link that gives it
PLANNER = dict(params=1e9, nodes=16, ranks_per_node=8, intra_gbps=3600, step_ms=640)
RUN_COLUMNS = ["rate", "method", "parent", "lr", "seed", "run", "steps", "steps_budget",
               "identical_to_fastest", "final_perplexity", "final_loss", "final_val_loss",
               "training_time_s", "comm_s", "time_per_step_s", "bytes_sent", "link_bytes",
               "link_bytes_eval", "target_perplexity", "step_to_target", "time_to_target_s",
               "time_source", "link_bytes_budget", "link_bytes_source", "perplexity_budget",
               "perplexity_source", *RHO_COLUMNS]
SUMMARY_COLUMNS = ["rate", "method", "parent", "lr", "seeds", "steps_budget",
                   "target_perplexity", "time_to_target_s", "time_source",
                   "speedup_over_allreduce", "link_bytes", "link_bytes_to_target",
                   "link_bytes_source", "link_bytes_over_parent", "final_perplexity",
                   "perplexity_std", "perplexity_source", "perplexity_over_parent",
                   "training_time_s", "time_per_step_s", "comm_s", "bytes_sent",
                   "rho_stands_for", *RHO_COLUMNS]
#: what rho's fp32 allreduce moves: the language model's parameters
N_PARAMS = lm.N_PARAMS


# -- the MPI job (every rank) -----------------------------------------------------------------
def _tx_bytes(iface: str = "eth0") -> int:
    """Bytes this network namespace sent on ``iface``: /proc/net/dev is the calling process's
    own namespace's (/sys/class/net would be the mount's, the host's, under nsenter)."""
    with open("/proc/net/dev") as fh:
        for line in fh:
            name, _, fields = line.partition(":")
            if name.strip() == iface:
                return int(fields.split()[8])
    raise RuntimeError(f"no {iface} in /proc/net/dev: not inside an emulated node")


def _subclasses(cls) -> List[type]:
    out = [cls]
    for sub in cls.__subclasses__():
        out += _subclasses(sub)
    return out


def _instrument(state: Dict, counting: bool) -> None:
    """The job's hooks into the library's methods (this process only; the training's bits do
    not change): a run stops once it took ``state["stop_at"]`` steps (a truncated run: the
    same command line, its schedule and data, cut short); the evaluations' model broadcasts
    (a method whose reported model lives on another rank: LSGD's leader) add what this node
    sent to ``state["eval_tx"]``; the initial broadcast of x_0 is skipped when every rank
    holds the same parameters already (a digest compared: the same seed everywhere)."""
    from mpi4py import MPI

    from lsgd_hpc.methods import api
    world = MPI.COMM_WORLD
    control, initial = api.Method._control, api.Method.broadcast_initial

    def _control(self):
        control(self)
        if state["stop_at"] and self.steps >= state["stop_at"] and not self.done:
            self.done = True
            self.drain()

    def broadcast_initial(self):
        digest = hashlib.sha1(self.flat.flat.detach().cpu().numpy().tobytes()).hexdigest()
        if len(set(world.allgather(digest))) > 1:
            return initial(self)
        for v in self.rule.eval_models().values():
            v.copy_(self.flat.flat)

    def counted(reported_state):
        def wrapper(self):
            world.Barrier()        # the blocking traffic before it (a pull) is off the links
            before = _tx_bytes() if counting else 0
            vec = reported_state(self)
            world.Barrier()                  # received everywhere: it left the interfaces
            if counting:
                state["eval_tx"] += _tx_bytes() - before
            return vec
        return wrapper

    api.Method._control, api.Method.broadcast_initial = _control, broadcast_initial
    for cls in _subclasses(api.Method):
        if "reported_state" in vars(cls) and cls is not api.Method:
            cls.reported_state = counted(cls.reported_state)


def job(spec_path: str) -> int:
    """lm.job's probe and trainings, plus each node's transmit counter around each training
    (written to RUN_DIR/link_bytes.json by rank 0: what crossed the links, and of that what
    the evaluations sent); a run with a stop step is truncated there."""
    import importlib.util
    spec = json.loads(Path(spec_path).read_text())
    from mpi4py import MPI

    from lsgd_hpc.comm import NodeGroups
    from lsgd_hpc.comm.mpi import MPICommunicator
    from lsgd_hpc.planning.netprobe import probe_groups
    world = MPICommunicator(MPI.COMM_WORLD)
    groups = NodeGroups.build(world, None)
    probe = probe_groups(groups, repeats=spec["probe_repeats"])
    error = None
    if world.rank == 0:
        try:
            check_layout(spec["what"], groups.node_of, lm.NODES, probe, spec["rate"])
        except LayoutError as exc:
            error = str(exc)
        Path(spec["probe_out"]).write_text(json.dumps({"probe": probe, "node_of":
                                                       groups.node_of, "layout_error": error},
                                                      default=float))
    error = MPI.COMM_WORLD.bcast(error, root=0)
    counting = groups.local_rank == 0          # one reader per node (its namespace)
    groups.free()
    if error:
        return 3
    mod_spec = importlib.util.spec_from_file_location("char_lm", lm.CHAR_LM)
    char_lm = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(char_lm)
    state = {"stop_at": None, "eval_tx": 0}
    _instrument(state, counting)
    for argv, stop_at in zip(spec["argvs"], spec["stops"]):
        sys.argv = [str(lm.CHAR_LM), *argv]
        state.update(stop_at=stop_at, eval_tx=0)
        MPI.COMM_WORLD.Barrier()
        before = _tx_bytes() if counting else 0
        char_lm.main()
        MPI.COMM_WORLD.Barrier()
        sent = MPI.COMM_WORLD.gather((_tx_bytes() - before, state["eval_tx"]) if counting
                                    else (0, 0), root=0)
        if world.rank == 0:
            run_dir = Path(argv[argv.index("--run-dir") + 1])
            tx, ev = sum(s for s, _ in sent), sum(e for _, e in sent)
            (run_dir / "link_bytes.json").write_text(json.dumps(
                {"link_bytes": tx - ev, "link_bytes_eval": ev,
                 "link_tx_max_node": max(s for s, _ in sent)}))
            print(f"links: ran {' '.join(argv)}" + (f" (stopped at {stop_at})" if stop_at
                                                   else ""), flush=True)
    return 0


# -- what runs where --------------------------------------------------------------------------
def probe_repeats(rate: str) -> int:
    """Round trips of the link probe: its 1 MiB messages take 42 s a round trip at 400 kbit/s,
    so at most PROBE_BUDGET_S of them (at least 2, at most the probe's default 10)."""
    trip = 2 * (1 << 20) * 8 / rate_bps(rate)
    return max(2, min(10, int(PROBE_BUDGET_S / trip)))


def plan_runs(rate: str, fastest: str, chosen: List[str], seeds, steps: int, factor: int,
              link_budget_s: float, ref: Dict) -> List[tuple]:
    """(method, seed, steps of its budget, stop step or None) of every run at ``rate``: a run
    is truncated to TRUNCATED_ROUNDS rounds when, at a rate slower than the fastest, what its
    fastest-rate run (``ref[(method, seed)]``) sent on the busier node would hold this link
    longer than ``link_budget_s``."""
    out = []
    for seed in seeds:
        for label in chosen:
            budget = steps if label == ALLREDUCE else steps * factor
            r, stop = ref.get((label, seed)), None
            short = TRUNCATED_ROUNDS * ROUND[label]
            if rate != fastest and r and short < budget \
                    and r["link_tx_max_node"] * 8 / rate_bps(rate) > link_budget_s:
                stop = short
            out.append((label, seed, budget, stop))
    return out


def _read(d: Path, rate: str, label: str, seed: int, budget: int, stop) -> Dict:
    r = lm.read_run(d)
    link = json.loads((d / "link_bytes.json").read_text())
    return {"rate": rate, "method": label, "parent": PARENT[label] or "", "lr": lr_of(label),
            "seed": seed, "run": "truncated" if stop else "full", "steps_budget": budget,
            "raw": str(d), **{k: int(v) for k, v in link.items()}, **r}


def lr_of(label: str) -> float:
    """The method's learning rate: its own pick, else its fp32 parent's (LRS)."""
    return LRS.get(label, LRS.get(PARENT[label] or "", 1e-2))


def identical_losses(fast_dir, slow_dir) -> Optional[int]:
    """The steps over which two runs' per-step training losses (every rank's /train loss
    column) are bit-identical, all their common steps; None when they differ there."""
    import numpy as np

    from lsgd_hpc.analysis import aggregate
    a, b = aggregate.read_run(fast_dir).ranks, aggregate.read_run(slow_dir).ranks
    if set(a) != set(b):
        return None
    common = None
    for rank in a:
        x, y = aggregate.col(a[rank], "train", "loss"), aggregate.col(b[rank], "train", "loss")
        m = min(len(x), len(y))
        if not np.array_equal(x[:m], y[:m]):
            return None
        common = m if common is None else min(common, m)
    return common


# -- reading ----------------------------------------------------------------------------------
def reach(curve: List[Dict], loss: float, key: str = "training_time") -> Optional[float]:
    """The first ``key`` (training time, or step) at which an evaluation curve reaches
    ``loss``, linear between two evaluations; None when it never does."""
    pts = [(c[key], c["loss"]) for c in curve]
    for (t0, l0), (t1, l1) in zip(pts, pts[1:]):
        if l1 <= loss:
            return t0 + (t1 - t0) * (l0 - loss) / (l0 - l1) if l0 > loss else t0
    return None


def derive(rows: List[Dict], fastest: str) -> None:
    """Per run: the target (allreduce SGD's final held-out loss with the same seed at the
    fastest rate), the step and the training time at which the run reaches it, its bytes
    between the nodes and perplexity over its whole budget; a truncated run's from the
    fastest rate's run of the same method and seed and its own seconds a step (predicted)."""
    ref = {(r["method"], r["seed"]): r for r in rows if r["rate"] == fastest}
    for r in rows:
        f, ar = ref.get((r["method"], r["seed"])), ref.get((ALLREDUCE, r["seed"]))
        target = ar["final_loss"] if ar and ar["run"] == "full" else None
        cut = r["run"] == "truncated"
        tps = r["training_time_s"] / r["steps"]
        step = reach((f if cut and f else r)["curve"], target, "step") \
            if target is not None else None
        if cut:
            t = step * tps if step is not None and f else None
        else:
            t = reach(r["curve"], target) if target is not None else None
        src = "predicted" if cut else "measured"
        r.update(time_per_step_s=tps, target_perplexity=math.exp(target) if target is not None
                 else math.nan, step_to_target=step, time_to_target_s=t, time_source=src,
                 link_bytes_budget=r["link_bytes"] * r["steps_budget"] / r["steps"],
                 link_bytes_source=src, training_time_budget_s=tps * r["steps_budget"] if cut
                 else r["training_time_s"], perplexity_source=src,
                 perplexity_budget=(f["final_perplexity"] if f else math.nan) if cut
                 else r["final_perplexity"])


def _mean(xs) -> Optional[float]:
    xs = list(xs)
    return None if not xs or any(x is None for x in xs) else sum(xs) / len(xs)


def summarize(rows: List[Dict]) -> List[Dict]:
    """Per rate and method: the means over seeds (a time to the target only when every seed
    reached it), the speed-up over allreduce SGD at the rate, bytes and perplexity over the
    fp32 parent's (equal steps: the same budget)."""
    by: Dict = {}
    for r in rows:
        by.setdefault((r["rate"], r["method"]), []).append(r)
    out = []
    for (rate, label), rs in by.items():
        ppl = [r["perplexity_budget"] for r in rs]
        m = sum(ppl) / len(ppl)
        def src(k):
            return "predicted" if any(r[k] == "predicted" for r in rs) else "measured"
        out.append({
            "rate": rate, "method": label, "parent": PARENT.get(label) or "", "lr": rs[0]["lr"],
            "seeds": " ".join(str(r["seed"]) for r in rs), "steps_budget": rs[0]["steps_budget"],
            "target_perplexity": _mean(r["target_perplexity"] for r in rs),
            "time_to_target_s": _mean(r["time_to_target_s"] for r in rs),
            "time_source": src("time_source"), "link_bytes": _mean(r["link_bytes_budget"]
                                                                   for r in rs),
            "link_bytes_to_target": _mean(None if r["step_to_target"] is None else
                                          r["link_bytes_budget"] * r["step_to_target"]
                                          / r["steps_budget"] for r in rs),
            "link_bytes_source": src("link_bytes_source"), "final_perplexity": m,
            "perplexity_std": math.sqrt(sum((p - m) ** 2 for p in ppl) / (len(ppl) - 1))
            if len(ppl) > 1 else 0.0, "perplexity_source": src("perplexity_source"),
            "training_time_s": _mean(r["training_time_budget_s"] for r in rs),
            "time_per_step_s": _mean(r["time_per_step_s"] for r in rs)})
    at = {(s["rate"], s["method"]): s for s in out}
    for s in out:
        ar, parent = at.get((s["rate"], ALLREDUCE)), at.get((s["rate"], s["parent"]))
        if ar and ar["time_to_target_s"] and s["time_to_target_s"]:
            s["speedup_over_allreduce"] = ar["time_to_target_s"] / s["time_to_target_s"]
        if parent:
            s["perplexity_over_parent"] = s["final_perplexity"] / parent["final_perplexity"]
            s["link_bytes_over_parent"] = (s["link_bytes"] / parent["link_bytes"]
                                           if parent["link_bytes"] else math.nan)
    return out


def add_rho(rows: List[Dict], summary: List[Dict], probes: Dict) -> None:
    """rho of every run and summary row (_shared.rho_fields): the fp32 allreduce of the
    model between the 2 nodes predicted from the link that rate's job probed, over the run's
    compute seconds a step (training time less communication, / steps; a summary row: the
    mean over its seeds); and in every summary row what the rate's rho (allreduce SGD's)
    stands for (stands_for)."""
    def link(r):
        return ((probes.get(r["rate"]) or {}).get("probe") or {}).get("inter")

    def compute(r):
        return (r["training_time_s"] - r["comm_s"]) / r["steps"]

    layout = lambda r: (lm.NODES, WORLD // lm.NODES)  # noqa: E731
    shared_add_rho(rows, N_PARAMS, link, layout, compute)
    for s in summary:
        rs = [r for r in rows if (r["rate"], r["method"]) == (s["rate"], s["method"])]
        mean = sum(map(compute, rs)) / len(rs)
        shared_add_rho([s], N_PARAMS, link, layout, lambda _: mean)
    for s in summary:
        ar = next((a for a in summary if (a["rate"], a["method"]) == (s["rate"], ALLREDUCE)
                   and "rho" in a), None)
        if ar:
            s["rho_stands_for"] = stands_for(ar["rho"])


def stands_for(rho: float) -> str:
    """The same rho for PLANNER's model and cluster (the planner's cost model: its fp32
    allreduce between the nodes over its step): the link speed between the nodes that gives
    it, and the planner's command line for that setting."""
    from lsgd_hpc.planning import costmodel as cm
    p = PLANNER

    def rho_at(gbps: float) -> float:
        c = cm.Cluster(p["nodes"], p["ranks_per_node"], cm.Link.from_gbps(p["intra_gbps"], 2),
                       cm.Link.from_gbps(gbps, 5))
        return cm.rho(int(p["params"]), c, p["step_ms"] / 1e3)

    lo, hi = 1e-6, 1e6                  # rho falls as the link gets faster
    for _ in range(80):
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if rho_at(mid) > rho else (lo, mid)
    g, n = f"{math.sqrt(lo * hi):.3g}", f"{p['params']:.0e}".replace("e+0", "e")
    return (f"{p['params'] / 1e9:g} B parameters on {p['nodes']} nodes x {p['ranks_per_node']}"
            f" GPUs, a {p['step_ms']} ms step, {g} Gbit/s between nodes (python -m "
            f"lsgd_hpc.plan --params {n} --nodes {p['nodes']} --ranks-per-node "
            f"{p['ranks_per_node']} --intra-gbps {p['intra_gbps']} --inter-gbps {g} --step-ms "
            f"{p['step_ms']} --recommend)")


# -- findings and the table -------------------------------------------------------------------
def _t(s: Dict) -> str:
    t = s.get("time_to_target_s")
    return "not reached" if t is None else f"{t:.1f} s ({s['time_source']})"


def _rates(summary: List[Dict]) -> List[str]:
    return list(dict.fromkeys(s["rate"] for s in summary))


def _rate_rho(summary: List[Dict], rate: str) -> Optional[Dict]:
    return next((s for s in summary if (s["rate"], s["method"]) == (rate, ALLREDUCE)
                 and "rho" in s), None)


def race_findings(summary: List[Dict]) -> List[str]:
    """Per rate: every method's time to allreduce SGD's final perplexity, fastest first, with
    its speed-up over allreduce SGD; who wins and by how much over the next one."""
    out = []
    for rate in _rates(summary):
        ss = [s for s in summary if s["rate"] == rate]
        ar, rho = next((s for s in ss if s["method"] == ALLREDUCE), None), _rate_rho(summary, rate)
        done = sorted((s for s in ss if s["time_to_target_s"] is not None),
                      key=lambda s: s["time_to_target_s"])
        if not ar or not done:
            continue
        line = (f"At {rate}" + (f" (rho {rho['rho']:.3g})" if rho else "") + ", time to "
                f"allreduce SGD's final perplexity {ar['target_perplexity']:.2f}: ")
        line += "; ".join(f"{s['method']} {_t(s)}" + (
            f", {s['speedup_over_allreduce']:.2f}x allreduce SGD's speed"
            if s.get("speedup_over_allreduce") and s is not ar else "") for s in done)
        missed = [s["method"] for s in ss if s["time_to_target_s"] is None]
        if missed:
            line += f"; not reached within the budget: {', '.join(missed)}"
        if len(done) > 1:
            lead = done[1]["time_to_target_s"] / done[0]["time_to_target_s"]
            line += f". {done[0]['method']} wins, {lead:.2f}x sooner than {done[1]['method']}"
        out.append(line + ".")
    return out


def parent_findings(summary: List[Dict]) -> List[str]:
    """At the fastest rate (every run to its budget): each compressed variant against its
    fp32 parent at equal steps, perplexity and bytes between the nodes."""
    rate = _rates(summary)[0] if summary else None
    at = {s["method"]: s for s in summary if s["rate"] == rate}
    out = []
    for s in at.values():
        p = at.get(s["parent"])
        if p:
            out.append(f"At equal steps ({s['steps_budget']}, {rate}): {s['method']} ends at "
                       f"perplexity {s['final_perplexity']:.2f} against {p['method']}'s "
                       f"{p['final_perplexity']:.2f} "
                       f"({100 * (s['perplexity_over_parent'] - 1):+.1f} %), with "
                       f"{s['link_bytes'] / 1e6:.3g} MB between the nodes against "
                       f"{p['link_bytes'] / 1e6:.3g} MB ({s['link_bytes_over_parent']:.3g}x).")
    return out


def identity_finding(rows: List[Dict], fastest: str) -> List[str]:
    """Whether every run at a slower rate trained the same bits as the fastest rate's."""
    slow = [r for r in rows if r["rate"] != fastest]
    if not slow:
        return []
    same = [r for r in slow if r.get("identical_to_fastest")]
    differ = [f"{r['method']} at {r['rate']}" for r in slow if not r.get("identical_to_fastest")]
    return [f"Bit-identical training across rates: {len(same)} of {len(slow)} runs at a slower "
            f"rate have the same per-step training losses on every rank as the {fastest} run of "
            f"the same method and seed over their common steps ("
            + ", ".join(f"{r['method']} at {r['rate']} over {r['identical_to_fastest']}"
                        for r in same) + ")"
            + (f"; differ: {', '.join(differ)} (their predictions do not hold)" if differ
               else "") + "."]


def fit_rate(points: List[tuple]) -> Optional[tuple]:
    """Least-squares a, b of t = a + b / rate over (rate in bit/s, t) points (2 or more)."""
    if len(points) < 2:
        return None
    xs, ys = [1 / r for r, _ in points], [t for _, t in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    if var == 0:
        return None
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var
    return my - b * mx, b


def fit_finding(summary: List[Dict]) -> List[str]:
    """allreduce SGD's seconds a step as a + b / rate over the rates it ran at."""
    ar = [s for s in summary if s["method"] == ALLREDUCE]
    fit = fit_rate([(rate_bps(s["rate"]), s["time_per_step_s"]) for s in ar])
    if not fit:
        return []
    a, b = fit
    return [f"allreduce SGD's seconds a step fit a + b / rate with a = {a:.3g} s and b = "
            f"{b / 1e6:.3g} s Mbit/s (" + "; ".join(
                f"{s['rate']}: measured {s['time_per_step_s']:.3g} s, fit "
                f"{a + b / rate_bps(s['rate']):.3g} s" for s in ar) + ")."]


def target_findings(summary: List[Dict]) -> List[str]:
    """The issue's two done-when targets, met or not, from the numbers."""
    out = []
    rhos = [(r, _rate_rho(summary, r)) for r in _rates(summary)]
    rhos = [(r, s["rho"]) for r, s in rhos if s]
    if rhos:
        rate, rho = min(rhos, key=lambda x: abs(math.log(x[1] / 30)))
        sp = [s for s in summary if s["rate"] == rate and s.get("speedup_over_allreduce")
              and s["method"] != ALLREDUCE]
        best = max(sp, key=lambda s: s["speedup_over_allreduce"], default=None)
        out.append(f"Target 1 (at rho about 30, the best method reaches allreduce SGD's final "
                   f"perplexity at least 3x sooner): at {rate} (rho {rho:.3g}) " + (
                       f"{best['method']} is {best['speedup_over_allreduce']:.2f}x sooner "
                       f"({best['time_source']}): "
                       + ("met." if best["speedup_over_allreduce"] >= 3 else "not met.")
                       if best else "no method reached it: not met."))
    fastest = _rates(summary)[0] if summary else None
    for label, form in ((f"DiLoCo {TOPK}", "with DiLoCo's outer Nesterov momentum"),
                        (SPARSELOCO, "SparseLoCo's form: the residual decayed by 0.95 in "
                                     "place of the outer momentum")):
        tk = next((s for s in summary if (s["rate"], s["method"]) == (fastest, label)
                   and s.get("link_bytes_over_parent") is not None), None)
        if not tk:
            continue
        ok = tk["link_bytes_over_parent"] <= 0.01 and abs(tk["perplexity_over_parent"] - 1) <= 0.02
        out.append(f"Target 2 (DiLoCo {TOPK} at most 0.01x fp32 DiLoCo's bytes between the "
                   f"nodes, perplexity within 2 % at equal steps), {form} ({label}): "
                   f"{tk['link_bytes_over_parent']:.3g}x the bytes, perplexity "
                   f"{100 * (tk['perplexity_over_parent'] - 1):+.1f} %: "
                   f"{'met' if ok else 'not met'}.")
    return out


def rho_findings(summary: List[Dict]) -> List[str]:
    """One sentence a rate: allreduce SGD's rho there, its parts and what it stands for."""
    return [rho_sentence(f"at {s['rate']}", s, N_PARAMS)[:-1] + f"; it stands for "
            f"{s['rho_stands_for']}." for s in summary
            if s["method"] == ALLREDUCE and "rho" in s and s.get("rho_stands_for")]


def table(summary: List[Dict]) -> str:
    """links_table.md: per rate its rho and what it stands for, then per method the time to
    allreduce SGD's final perplexity, speed-up, bytes between the nodes, perplexity at equal
    steps against the fp32 parent; predicted figures marked with *."""
    mark = lambda s, k: "*" if s.get(k) == "predicted" else ""  # noqa: E731
    lines = ["| rate | rho | stands for |", "|---|---|---|"]
    for rate in _rates(summary):
        s = _rate_rho(summary, rate)
        if s:
            lines.append(f"| {rate} | {s['rho']:.3g} | {s.get('rho_stands_for', '')} |")
    lines += ["", "| rate | method | time to target (s) | speed-up over allreduce SGD | "
              "MB between nodes (budget) | MB to target | perplexity (budget) | "
              "perplexity / fp32 parent |", "|---|---|---|---|---|---|---|---|"]
    for s in summary:
        t = s.get("time_to_target_s")
        lines.append(
            f"| {s['rate']} | {s['method']} | "
            + (f"{t:.1f}{mark(s, 'time_source')}" if t is not None else "not reached") + " | "
            + (f"{s['speedup_over_allreduce']:.2f}" if s.get("speedup_over_allreduce") else "")
            + f" | {s['link_bytes'] / 1e6:.3g}{mark(s, 'link_bytes_source')} | "
            + (f"{s['link_bytes_to_target'] / 1e6:.3g}" if s["link_bytes_to_target"] is not None
               else "") + f" | {s['final_perplexity']:.2f}{mark(s, 'perplexity_source')} | "
            + (f"{s['perplexity_over_parent']:.3f}" if s.get("perplexity_over_parent") else "")
            + " |")
    return "\n".join(lines + ["", "\\* predicted from a truncated run (time_source, "
                                  "link_bytes_source, perplexity_source in links_summary.csv)."
                                  " Target: allreduce SGD's final perplexity; budget: the "
                                  "method's steps (steps_budget)."]) + "\n"


# -- the figure -------------------------------------------------------------------------------
def _curve_of(r: Dict, ref: Dict) -> tuple:
    """(training times, MB between the nodes, perplexities, predicted) of a run's evaluations;
    a truncated run's predicted from the fastest rate's run of the same method and seed (its
    steps at this run's seconds a step, its bytes scaled to this run's)."""
    f = ref.get((r["method"], r["seed"]))
    cut = r["run"] == "truncated" and f is not None
    src = f if cut else r
    curve = [c for c in src["curve"] if c["step"] > 0]    # log axes: from the first evaluation
    t = [c["step"] * r["time_per_step_s"] if cut else c["training_time"] for c in curve]
    b = [c["bytes_sent"] / max(src["bytes_sent"], 1) * r["link_bytes_budget"] * src["steps"]
         / r["steps_budget"] / 1e6 for c in curve]   # the wire bytes, spread like the payload
    return t, b, [math.exp(c["loss"]) for c in curve], cut


def plot(rows: List[Dict], rate: str, out: Path) -> str:
    fig, (ax_t, ax_b) = new_figure(2, width=6.5, height=4.8)
    fastest = rows[0]["rate"]
    ref = {(r["method"], r["seed"]): r for r in rows if r["rate"] == fastest}
    cmap = __import__("matplotlib").colormaps["tab10"]
    mine = [r for r in rows if r["rate"] == rate]
    for i, label in enumerate(dict.fromkeys(r["method"] for r in rows)):
        for j, r in enumerate(r for r in mine if r["method"] == label):
            t, b, p, cut = _curve_of(r, ref)
            kw = dict(color=cmap(i % 10), alpha=0.85, ls="--" if cut else "-",
                      label=(label + (" (predicted)" if cut else "")) if j == 0 else None)
            for ax, x in ((ax_t, t), (ax_b, b)):      # log axes: the points past 0 only
                pts = [(xi, pi) for xi, pi in zip(x, p) if xi > 0]
                if pts:
                    ax.plot(*zip(*pts), **kw)
    ax_t.set_xlabel("training time (s; log)")
    ax_b.set_xlabel("bytes between the nodes (MB, measured on the links; log)")
    finals = [r["perplexity_budget"] for r in mine if math.isfinite(r["perplexity_budget"])]
    targets = [r["target_perplexity"] for r in mine if math.isfinite(r["target_perplexity"])]
    for ax in (ax_t, ax_b):
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(__import__("matplotlib").ticker.NullFormatter())
        ax.set_ylabel("held-out perplexity (per byte; log)")
        ax.set_yscale("log")
        if finals:    # the untrained model's ~256 would flatten the rest
            ax.set_ylim(0.9 * min(finals + targets), 3.0 * max(finals))
        if targets:
            ax.axhline(sum(targets) / len(targets), color="k", lw=0.8, ls=":",
                       label="target: allreduce SGD's final" if ax is ax_b else None)
        ax.grid(alpha=0.3, which="both")
    ax_t.set_title(f"{WORLD} ranks, 2 nodes, {rate} links: vs training time")
    ax_b.set_title("vs bytes between the nodes")
    ax_b.legend(fontsize=7, loc="upper right")
    name = f"links_{rate}.png"
    save_figure(fig, out / name)
    return name


# -- the experiment ---------------------------------------------------------------------------
def _outputs(out: Path, rows: List[Dict], probes: Dict, doc: Dict) -> Dict:
    """Everything after the trainings (run and refresh): derived figures, summary, rho,
    tables, figures, findings, links.json."""
    rates = list(dict.fromkeys(r["rate"] for r in rows))
    derive(rows, rates[0])
    summary = summarize(rows)
    add_rho(rows, summary, probes)
    write_csv(out / "links_runs.csv", rows, RUN_COLUMNS)
    write_csv(out / "links_summary.csv", summary, SUMMARY_COLUMNS)
    (out / "links_table.md").write_text(table(summary))
    figures = [plot(rows, rate, out) for rate in rates]
    s0 = [m for m in PARENT if any(r["method"] == m for r in rows)]
    found = [f"Setup: examples/char_lm.py (0.47 M parameters), {WORLD} ranks on 2 emulated "
             f"nodes, rates {', '.join(rates)}; steps: " + ", ".join(
                 f"{m} {next(r['steps_budget'] for r in rows if r['method'] == m)}" for m in s0)
             + f"; one learning rate per method (the committed picks), seeds "
             f"{', '.join(map(str, sorted({r['seed'] for r in rows})))}; runs truncated at a "
             "slower rate: " + (", ".join(f"{r['method']} at {r['rate']} ({r['steps']} steps)"
                                          for r in rows if r["run"] == "truncated") or "none")
             + "; bytes between nodes measured on the links."]
    found += rho_findings(summary) + race_findings(summary) + parent_findings(summary)
    found += identity_finding(rows, rates[0]) + fit_finding(summary) + target_findings(summary)
    found += [f"error in {k}: {v}" for k, v in doc.get("errors", {}).items()]
    write_json(out / "links.json", {**doc, "summary": summary, "runs": rows, "probes": probes})
    return {"figures": figures, "tables": ["links_table.md", "links_summary.csv",
                                           "links_runs.csv"], "findings": found}


def run(out, quick: bool = False, log=print, rates=None, steps=None, factor=None, seeds=None,
        methods=None, raw=None, timeout_per_run: float = 300.0,
        cluster=(CLUSTER_NAME, CLUSTER_SUBNET), eval_every: Optional[int] = None,
        link_budget_s: Optional[float] = None, add: bool = False) -> Dict:
    """Every method at every rate (``methods``: those only). ``add``: the runs of ``methods``
    replace theirs in OUT/links.json, whose other runs and probes are kept (a method added
    to a recorded experiment without running the others again); the outputs are written
    from them all."""
    t0 = time.perf_counter()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    budget = QUICK if quick else FULL
    rates = sorted(rates or budget["rates"], key=rate_bps, reverse=True)   # fastest first
    seeds = tuple(budget["seeds"] if seeds is None else seeds)
    n, k = int(steps or budget["steps"]), int(factor or budget["factor"])
    lb = budget["link_budget_s"] if link_budget_s is None else float(link_budget_s)
    ev = int(eval_every or budget["eval_every"])
    chosen = [m for m, _, _, _ in METHODS if not methods or m in methods]
    base = {"name": NAME, "title": TITLE, "quick": quick, "figures": [], "tables": [],
            "findings": []}
    why_not = lm.cluster_available()
    if why_not:
        return {**base, "status": f"skipped: {why_not}",
                "findings": [f"not run: the emulated cluster is not available here: {why_not}"],
                "seconds": time.perf_counter() - t0}
    raw = Path(raw or raw_dir(NAME))
    rows, errors, probes, ref = [], {}, {}, {}
    kept, kept_probes = recorded_except(out, chosen) if add else ([], {})
    for rate in rates:
        dirs = {}
        for label, seed, b, stop in plan_runs(rate, rates[0], chosen, seeds, n, k, lb, ref):
            d = raw / rate / f"{lm._slug(label)}-seed{seed}"
            shutil.rmtree(d, ignore_errors=True)
            dirs[(label, seed, b, stop)] = d
        argvs = [[*dict((m, o) for m, o, _, _ in METHODS)[label], *lm.WORKLOAD, "--lr",
                  f"{lr_of(label):g}", "--steps", str(b), "--eval-every", str(min(ev, b)),
                  "--seed", str(seed), "--run-dir", str(d)]
                 for (label, seed, b, stop), d in dirs.items()]
        res = _train(rate, argvs, [key[3] for key in dirs], raw, timeout_per_run, log, cluster)
        if res.get("layout"):
            return {**base, "status": f"failed: {res['error']}",
                    "findings": [f"not plotted: {res['error']}"],
                    "seconds": time.perf_counter() - t0}
        probes[rate] = res["probe"]
        if res["error"]:
            errors[rate] = res["error"]
        _read_all(dirs, rate, rows, errors, ref, rates[0])
    if not rows:
        return {**base, "status": "failed", "findings": [f"error: {k}: {v}"
                                                         for k, v in errors.items()],
                "seconds": time.perf_counter() - t0}
    order = {m: i for i, (m, _, _, _) in enumerate(METHODS)}
    every = sorted(kept + rows, key=lambda r: (-rate_bps(r["rate"]), order.get(r["method"], 99),
                                                r["seed"]))
    extra = {"errors": errors, "link_budget_s": lb, "seconds": time.perf_counter() - t0}
    if add:            # the recorded run's own figures stay; this one is listed as added
        prior = json.loads((out / "links.json").read_text())
        extra = {**{k: v for k, v in prior.items() if k not in ("summary", "runs", "probes")},
                 "added": [*prior.get("added", []), {"methods": chosen, **extra}]}
    # a rate's rho is allreduce SGD's, from the probe of the job it ran in: kept probes win
    res = _outputs(out, every, {**probes, **kept_probes}, extra)
    return {**base, "status": "ok" if not errors else "ok (with errors)", **res,
            "seconds": time.perf_counter() - t0}


def recorded_except(out: Path, methods: List[str]):
    """(runs, probes) of OUT/links.json without the runs of ``methods``: what ``--add``
    keeps of a recorded experiment (its probes: the links its other runs were measured on)."""
    prior = json.loads((Path(out) / "links.json").read_text())
    return [r for r in prior["runs"] if r["method"] not in methods], prior.get("probes", {})


def _read_all(dirs: Dict, rate: str, rows: List[Dict], errors: Dict, ref: Dict,
              fastest: str) -> None:
    """Read one rate's runs into ``rows`` (the fastest rate's into ``ref`` too); check each
    slower one's training bit for bit against the fastest rate's run."""
    for (label, seed, b, stop), d in dirs.items():
        try:
            r = _read(d, rate, label, seed, b, stop)
        except Exception as exc:
            errors[f"{rate} {label} seed {seed}"] = f"{type(exc).__name__}: {exc}"
            continue
        if rate == fastest:
            ref[(label, seed)] = r
        elif (label, seed) in ref:
            r["identical_to_fastest"] = identical_losses(ref[(label, seed)]["raw"], d) or ""
        rows.append(r)


def refresh(out) -> Dict:
    """The tables, figures and findings again from OUT/links.json, training nothing (after a
    change to how they are computed): ``python results/run_all.py --refresh lm_links``."""
    out = Path(out)
    doc = json.loads((out / "links.json").read_text())
    return _outputs(out, doc["runs"], doc.get("probes", {}),
                    {k: v for k, v in doc.items() if k not in ("summary", "runs", "probes")})


def _train(rate: str, argvs: List[List[str]], stops: List[Optional[int]], raw: Path,
           timeout_per_run: float, log, cluster) -> Dict:
    from lsgd_hpc.testing import mpi_env, mpirun_path, run_group
    env = mpi_env({})
    env.pop("LSGD_HPC_RANKS_PER_NODE", None)
    warm = raw / rate / "warmup"
    shutil.rmtree(warm, ignore_errors=True)
    spec = raw / f"{rate}.json"
    probe_out = spec.with_suffix(".probe.json")
    probe_out.unlink(missing_ok=True)
    spec.parent.mkdir(parents=True, exist_ok=True)
    # the warm-up: allreduce SGD's 4 steps cost 2.5 min at 400 kbit/s; 4 DiLoCo steps
    # (no outer step yet) send nothing between the nodes
    spec.write_text(json.dumps({"argvs": [[*_DILOCO, "--steps", "4", "--eval-every", "0",
                                           *lm.WORKLOAD, "--run-dir", str(warm)], *argvs],
                                "stops": [None, *stops], "probe_out": str(probe_out),
                                "probe_repeats": probe_repeats(rate), "rate": rate,
                                "what": f"links {WORLD} ranks at {rate}"}))
    try:
        with lm.emulated_cluster(rate, WORLD // lm.NODES, log, *cluster) as margs:
            cmd = [mpirun_path(), *margs, "-x", "PYTHONPATH", "-x", "OMP_NUM_THREADS",
                   "-x", "PATH", "-x", "PYTHONUNBUFFERED", "-np", str(WORLD),
                   sys.executable, str(Path(__file__)), "--job", str(spec)]
            t1 = time.perf_counter()
            p = run_group(cmd, env=env, cwd=REPO, timeout=timeout_per_run * (len(argvs) + 1))
            log(f"links: {len(argvs)} trainings at {rate} ({sum(1 for s in stops if s)} "
                f"truncated) in {time.perf_counter() - t1:.0f} s")
    except Exception as exc:
        return {"probe": None, "error": f"{type(exc).__name__}: {exc}"}
    probe = json.loads(probe_out.read_text()) if probe_out.exists() else None
    if probe and probe.get("layout_error"):
        return {"probe": probe, "error": f"layout check: {probe['layout_error']}",
                "layout": True}
    if p.returncode != 0:
        why = "timed out" if p.returncode is None else f"exit {p.returncode}"
        return {"probe": probe, "error": f"{why}: {(p.stderr or p.stdout).strip()[-600:]}"}
    return {"probe": probe, "error": None}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(REPO / "results" / NAME))
    p.add_argument("--quick", action="store_true",
                   help=f"allreduce SGD {QUICK['steps']} steps, the others {QUICK['factor']}x, "
                        f"at {' and '.join(QUICK['rates'])}, link budget "
                        f"{QUICK['link_budget_s']:g} s, one seed")
    p.add_argument("--rates", nargs="+", help="link rates, tc's units (default "
                                              f"{' '.join(FULL['rates'])})")
    p.add_argument("--steps", type=int, help=f"allreduce SGD's steps per rank (default "
                                             f"{FULL['steps']})")
    p.add_argument("--factor", type=int, help="the other methods' steps: this times "
                                              f"allreduce SGD's (default {FULL['factor']})")
    p.add_argument("--seeds", type=int, nargs="+", help="seeds (default 1)")
    p.add_argument("--methods", nargs="+", metavar="LABEL",
                   help="subset of: " + ", ".join(f"'{m}'" for m, _, _, _ in METHODS)
                   .replace("%", "%%"))
    p.add_argument("--add", action="store_true",
                   help="run only --methods and put their runs in place of theirs in OUT's "
                        "links.json, keeping the other methods' runs and the probes")
    p.add_argument("--link-budget", type=float, metavar="SECONDS",
                   help="truncate a run at a slower rate whose traffic would hold the link "
                        f"longer than this (default {FULL['link_budget_s']:g})")
    p.add_argument("--raw", metavar="DIR", help=f"raw runs (default runs/results/{NAME}/)")
    p.add_argument("--cluster", nargs=2, metavar=("NAME", "SUBNET"),
                   default=[CLUSTER_NAME, CLUSTER_SUBNET],
                   help=f"emulated cluster's name and subnet (default {CLUSTER_NAME} "
                        f"{CLUSTER_SUBNET})")
    p.add_argument("--eval-every", type=int, help=f"steps between evaluations (default "
                                                  f"{FULL['eval_every']})")
    p.add_argument("--job", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.job:
        return job(args.job)
    if args.add and not args.methods:
        p.error("--add needs --methods")
    if args.methods and set(args.methods) - set(PARENT):
        p.error(f"unknown methods {sorted(set(args.methods) - set(PARENT))}")
    res = run(args.out, args.quick, rates=args.rates, steps=args.steps, factor=args.factor,
              seeds=args.seeds, methods=args.methods, raw=args.raw,
              cluster=tuple(args.cluster), eval_every=args.eval_every,
              link_budget_s=args.link_budget, add=args.add)
    for f in res["findings"]:
        print("-", f)
    print(f"{res['seconds']:.0f} s; tables {res['tables']}; figures {res['figures']}")
    return 0 if res["status"].startswith("ok") else 1


if __name__ == "__main__":
    sys.exit(main())
