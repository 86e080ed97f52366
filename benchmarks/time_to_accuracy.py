"""Training time to a stated test accuracy per method on the emulated cluster, and LSGD's ratio.

2 nodes x 2 ranks, node links limited to 1 and to 10 Gbit/s; median of 3 seeds; LSGD's time
over the best baseline's.

    python benchmarks/time_to_accuracy.py --out FILE [--quick]      (as root: it makes the
                                                                    cluster and removes it)

The cluster is scripts/cluster.sh's (network namespaces on a bridge, one host name per node, a
tc tbf limit on what each node sends), under a name and subnet of its own, without SLURM, and is
always taken down afterwards. Per link rate, one mpirun job runs every (seed, method) training
one after another (seed-major, so that a slow spell of the machine hits every method alike),
after a network probe (lsgd_hpc.planning.netprobe) of the same nodes.

Methods: LSGD and lsgd_hpc's baselines (METHODS), and PyTorch DistributedDataParallel (gloo,
gradient buckets overlapped with backward; its process group as benchmarks/peers.py makes it),
which trains the allreduce run's configuration: the same data shards, initial model, batch,
learning rate, momentum, weight decay, steps and evaluation steps (ddp_train). LSGD's periods
match the baselines' (tau_L 4 inside a node, tau_G 8 across nodes; local SGD T = 8, EASGD
tau 4), with the trainer's default pull strengths (0.1, 0.1): nothing tuned on the test set.

Workload: digits, mlp_wide (1.13 M parameters, 4.5 MB per model exchange), batch 32 per rank.
An MLP's compute per step is 6 x parameters x batch FLOP and its allreduce moves ~1.5 x 4
bytes per parameter over each node's link, so compute : allreduce = batch x bandwidth / FLOP
rate, whatever the width: with this machine's ~5 GFLOP/s per rank and batch 32 that is about
1 : 1 at 1 Gbit/s and 8 : 1 at 10 Gbit/s. The ratio measured in the run (the allreduce method's
compute seconds over its communication seconds) is reported beside the GPU cases it stands for
(computed with lsgd_hpc.costmodel: ResNet-50 on A100s over 100 Gbit/s is about 8 : 1; VGG-16
over 25 Gbit/s Ethernet about 1 : 1).

Time to accuracy: at each evaluation (every EVAL_EVERY steps) the test accuracy is that of the
method's model: LSGD's leader (the rank elected by the last global election, as the LSGD paper
and lsgd_hpc.aggregate report it), EASGD's centre, and for the others the mean over ranks of
each worker's own model (LSGD's mean over ranks is reported too); the time is the
training time at that step (/train/training_time: wall time less evaluation, probes and
checkpoints; the slowest rank's), and a run's time to accuracy is that of its first evaluation
at or above TARGET. Consensus probes are off (--consensus-every 0). A run that does not reach
the target within MAX_STEPS counts as infinite; the median over seeds is then infinite when
most seeds miss.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO))
# the emulated cluster (_cluster.py, shared with _common.cluster_job); _sh is read from here by
# results/experiments/lm.py, which runs cluster.sh with its own ranks per node
from _cluster import (CLUSTER_NAME, CLUSTER_SUBNET, NODES, NP, RANKS_PER_NODE,  # noqa: E402,F401
                      _sh, cluster_available, emulated_cluster)
from _common import LayoutError, check_layout, median, rho_fields, row, write_result  # noqa: E402

from lsgd_hpc.testing import mpi_env, mpirun_path, run_group  # noqa: E402

RATES = ("1gbit", "10gbit")
SEEDS = (0, 1, 2)
TARGET = 0.93
MAX_STEPS = 60
EVAL_EVERY = 5
BATCH = 32
SKIP_STEPS = 5            # start-up steps left out of the per-step costs
MODEL = "mlp_wide"
#: PyTorch DDP's label; it trains the allreduce run's configuration (ddp_train)
DDP_LABEL = "ddp"
#: (label, --algorithm, its options): LSGD and the baselines at the same period where they have one
METHODS = [
    ("lsgd", "lsgd", ["--tau-local", "4", "--tau-global", "8"]),
    ("allreduce", "allreduce", []),
    ("easgd", "easgd", ["--easgd-tau", "4"]),
    ("local-sgd T=8", "local-sgd", ["--local-steps", "8"]),
    ("diloco H=8", "diloco", ["--local-steps", "8"]),
    ("slowmo T=8", "slowmo", ["--local-steps", "8", "--slowmo-every", "16"]),
    ("gossip ring", "gossip", ["--topology", "ring"]),
]


def common_options(steps: Optional[int] = None, eval_every: Optional[int] = None) -> List[str]:
    """Options of every run: the workload, its length and evaluation period (default MAX_STEPS
    and EVAL_EVERY)."""
    steps, eval_every = steps or MAX_STEPS, eval_every or EVAL_EVERY
    return ["--dataset", "digits", "--model", MODEL, "--batch-size", str(BATCH),
            "--max-steps", str(steps), "--epochs", "100", "--eval-every", str(eval_every)]


#: GPU cases the measured compute : allreduce ratio is compared with:
#: (label, parameters, step seconds, nodes, ranks per node, intra Gbit/s, inter Gbit/s)
GPU_CASES = [
    ("ResNet-50 on 4 x 8 A100 (batch 256, ~0.1 s/step), NVLink 2400 Gbit/s, 100 Gbit/s IB",
     25_557_032, 0.100, 4, 8, 2400.0, 100.0),
    ("ResNet-50 on 4 x 8 A100, 400 Gbit/s IB", 25_557_032, 0.100, 4, 8, 2400.0, 400.0),
    ("VGG-16 (138 M) on 4 x 8 V100 (batch 64, ~0.12 s/step), NVLink 1200 Gbit/s, 25 Gbit/s "
     "Ethernet", 138_357_544, 0.120, 4, 8, 1200.0, 25.0),
]


def gpu_case_ratios() -> List[Dict]:
    """compute : one allreduce of the gradients, by lsgd_hpc.costmodel, for each GPU case."""
    from lsgd_hpc.planning import costmodel as cm
    out = []
    for label, params, step_s, nodes, q, intra, inter in GPU_CASES:
        c = cm.Cluster(nodes, q, cm.Link.from_gbps(intra, 2.0), cm.Link.from_gbps(inter, 5.0))
        t = cm.allreduce_time(params * 4, c)
        out.append({"case": label, "compute_s": step_s, "allreduce_s": t, "ratio": step_s / t})
    return out


def consensus_off() -> List[str]:
    """--consensus-every 0 where the trainer accepts it; else a period past the run's end."""
    from lsgd_hpc.cli.config import ConfigError, parse_config
    try:
        parse_config(["--consensus-every", "0"], env={})
        return ["--consensus-every", "0"]
    except (ConfigError, SystemExit):
        return ["--consensus-every", str(10 * MAX_STEPS)]


# -- the MPI job (every rank) -------------------------------------------------------------------
def job(spec_path: str) -> int:
    """Probe the links (nodes by host name, or ``ranks_per_node`` consecutive ranks), then train
    every command line of the spec, one after another. Shared with scale_model.py."""
    with open(spec_path) as fh:
        spec = json.load(fh)
    from mpi4py import MPI
    from lsgd_hpc.comm import NodeGroups
    from lsgd_hpc.comm.mpi import MPICommunicator
    from lsgd_hpc.planning.netprobe import probe_groups
    world = MPICommunicator(MPI.COMM_WORLD)
    groups = NodeGroups.build(world, spec.get("ranks_per_node"))
    probe = probe_groups(groups)
    # The layout and link rate the results will claim ("expect": nodes, rate), checked on what
    # this job measured before anything trains: a wrong one fails the job, nothing is trained.
    error = None
    if world.rank == 0 and spec.get("expect"):
        try:
            check_layout(spec["expect"].get("what", "time_to_accuracy"), groups.node_of,
                         spec["expect"]["nodes"], probe, spec["expect"].get("rate"))
        except LayoutError as exc:
            error = str(exc)
    if world.rank == 0:
        write_result(spec["probe_out"], {"probe": probe, "node_of": groups.node_of,
                                         "layout_error": error})
    error = MPI.COMM_WORLD.bcast(error, root=0)
    groups.free()
    if error:
        if world.rank == 0:
            print(f"time_to_accuracy: {error}", file=sys.stderr, flush=True)
        return 3
    from lsgd_hpc.cli import train
    for item in spec["argvs"]:
        # a trainer command line, or {"ddp": the allreduce run's command line}
        argv = item["ddp"] if isinstance(item, dict) else item
        code = ddp_train(argv, MPI.COMM_WORLD) if isinstance(item, dict) else train.main(argv)
        if code != 0:
            print(f"time_to_accuracy: {'ddp ' if isinstance(item, dict) else ''}"
                  f"{' '.join(argv)} exited {code}", file=sys.stderr, flush=True)
            return code
    return 0


def ddp_train(argv: List[str], comm) -> int:
    """PyTorch DDP (gloo, gradient buckets overlapped with backward) on the run that the
    trainer's command line ``argv`` describes: its data set, model, initial model (the seed),
    data shards (lsgd_hpc.data.ShardedBatches), batch, SGD learning rate, momentum, weight
    decay and steps, evaluated on the whole test set at the trainer's steps. Writes the
    trainer's metrics file (lsgd_hpc.metrics) so that read_run reads it as any other run:
    /train/training_time is the wall time since DDP was built less the evaluations;
    comm_seconds and compute_seconds are NaN (DDP's allreduces run inside backward, not
    separable); comm_bytes_sent counts one allreduce of the gradients per step, as lsgd_hpc's
    allreduce counts it."""
    import socket

    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    from lsgd_hpc import data
    from lsgd_hpc.models import zoo as models
    from lsgd_hpc.cli.config import parse_config
    from lsgd_hpc.runtime.metrics import SCHEMA_VERSION, MetricsWriter, rank_file
    from peers import gloo_group, plain_step
    cfg = parse_config(argv, env={})
    rank, size = comm.Get_rank(), comm.Get_size()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1") or 1))
    ds = data.load_dataset(cfg.dataset, cfg.data_dir, cfg.seed, cfg.synthetic_size)
    sampler = data.ShardedBatches(ds, rank, size, cfg.batch_size, cfg.seed)
    spe = sampler.steps_per_epoch
    total = min(math.ceil(cfg.epochs * spe), cfg.max_steps or math.inf)
    torch.manual_seed(cfg.seed)                 # the trainer's x_0 (DDP broadcasts rank 0's)
    net = models.build_model(cfg.model, ds.num_classes, ds.input_shape)
    grad_bytes = 4 * sum(p.numel() for p in net.parameters())
    writer = MetricsWriter(rank_file(cfg.run_dir, rank), {
        "schema_version": SCHEMA_VERSION, "rank": rank, "world_size": size,
        "hostname": socket.gethostname(), "algorithm": "ddp",
        "torch_version": torch.__version__}, flush_every=10 ** 9, flush_seconds=math.inf)
    loss_fn = torch.nn.CrossEntropyLoss()

    def evaluate() -> (float, float):
        model.eval()
        correct, loss_sum = 0, 0.0
        with torch.no_grad():
            for xb, yb in ds.test_batches(cfg.eval_batch_size):
                out = model.module(xb)           # this rank's replica, no collective
                loss_sum += float(torch.nn.functional.cross_entropy(out, yb, reduction="sum"))
                correct += int((out.argmax(1) == yb).sum())
        model.train()
        return loss_sum / ds.n_test, correct / ds.n_test

    with gloo_group(comm):
        model = DDP(net)
        opt = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum,
                              weight_decay=cfg.weight_decay, nesterov=bool(cfg.nesterov))
        t_start, eval_s, step = time.perf_counter(), 0.0, 0
        nan = math.nan
        while step < total:
            for xb, yb in sampler.batches(*divmod(step, spe)):
                loss = plain_step(model, opt, loss_fn, xb, yb)
                step += 1
                wall = time.perf_counter() - t_start
                writer.log("train", step=step, epoch=step / spe, wall_time=wall, loss=loss,
                           accuracy=nan, lr=cfg.lr, comm_bytes_sent=grad_bytes * step,
                           comm_bytes_recv=grad_bytes * step, comm_seconds=nan,
                           compute_seconds=nan, overhead_seconds=0.0, probe_seconds=0.0,
                           eval_seconds=eval_s, checkpoint_seconds=0.0, metrics_seconds=0.0,
                           training_time=wall - eval_s)
                if step % cfg.eval_every == 0 or step == total:
                    t_eval = time.perf_counter()
                    test_loss, test_acc = evaluate()
                    writer.log("eval", step=step, epoch=step / spe, wall_time=wall,
                               training_time=wall - eval_s, test_loss=test_loss,
                               test_accuracy=test_acc)
                    eval_s += time.perf_counter() - t_eval
                if step == total:
                    break
    writer.flush()
    return 0


# -- reading runs -------------------------------------------------------------------------------
def read_run(run_dir: Path, target: Optional[float] = None) -> Dict:
    """Accuracy against training time, time to ``target`` (default TARGET), and per-step costs
    of one run. The accuracy is the method's model's: LSGD's leader, EASGD's centre, else the
    mean over ranks of each worker's own model (which is also kept, for every method)."""
    import h5py
    target = TARGET if target is None else target
    import numpy as np
    files = sorted((run_dir / "metrics").glob("rank*.h5"))
    if len(files) != NP:
        raise RuntimeError(f"{run_dir}: {len(files)} rank files, expected {NP}")
    accs, times_at, per_rank = [], [], []
    time_col = "wall_time"
    hosts = set()
    node_of = []
    elections = centre = False
    for f in files:
        with h5py.File(f, "r", locking=False) as h:
            hosts.add(str(h.attrs.get("hostname", "")))
            node_of.append(int(h.attrs.get("node_index", -1)))
            elections |= "leader" in h and bool((h["leader"]["scope"][:] == 0).any())
            t, e = h["train"], h["eval"]
            if "training_time" in t:
                time_col = "training_time"
            step = t["step"][:]
            clock = dict(zip(step.tolist(), t[time_col][:].tolist()))
            es = e["step"][:]
            centre |= "center_test_accuracy" in e
            acc = e["center_test_accuracy"][:] if "center_test_accuracy" in e else \
                e["test_accuracy"][:]
            accs.append(dict(zip(es.tolist(), acc.tolist())))
            times_at.append(clock)
            last = int(step[-1])
            # per-step costs over a window that leaves out start-up and the last step (whose
            # row may include the final evaluation where the time column is wall time)
            a, b = min(SKIP_STEPS, len(step) - 2), len(step) - 2
            span = float(step[b] - step[a]) if b > a else math.nan

            def per_step(col, a=a, b=b, span=span, t=t):
                return float(t[col][b] - t[col][a]) / span

            per_rank.append({
                "steps": last, "comm_s_per_step": per_step("comm_seconds"),
                "compute_s_per_step": per_step("compute_seconds"),
                "time_per_step": per_step(time_col),
                "bytes_sent_per_step": float(t["comm_bytes_sent"][-1]) / last})
    steps = sorted(set.intersection(*(set(a) for a in accs)))
    leader = _leader_accuracy(run_dir) if elections else {}
    curve = []
    for s in steps:
        if all(s in c for c in times_at):
            mean_acc = float(np.mean([a[s] for a in accs]))
            curve.append({"step": s, "accuracy": leader.get(s, mean_acc),
                          "accuracy_mean_over_ranks": mean_acc,
                          "time": max(c[s] for c in times_at)})
    hit = next((p for p in curve if p["accuracy"] >= target), None)
    hit_mean = next((p for p in curve if p["accuracy_mean_over_ranks"] >= target), None)
    mean = {k: float(np.mean([r[k] for r in per_rank])) for k in per_rank[0] if k != "steps"}
    return {"curve": curve, "time_to_target": hit["time"] if hit else math.inf,
            "step_to_target": hit["step"] if hit else None,
            "time_to_target_mean_over_ranks": hit_mean["time"] if hit_mean else math.inf,
            "final_accuracy": curve[-1]["accuracy"] if curve else math.nan,
            "model": "leader" if leader else "centre" if centre else "mean over ranks",
            "time_column": time_col, "hosts": sorted(hosts), "node_of": node_of, **mean}


def _leader_accuracy(run_dir: Path) -> Dict[int, float]:
    """LSGD's model: per evaluation step, the test accuracy of the rank elected by the last
    global election (lsgd_hpc.aggregate's leader figure, as the LSGD paper reports it)."""
    from lsgd_hpc.analysis import aggregate
    table = aggregate.eval_table(aggregate.read_run(run_dir, warn=lambda msg: None))
    return {int(s): float(a) for s, a in zip(table["step"], table["acc_leader"]) if a == a}


def _median_time(xs: List[float]) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2] if len(xs) % 2 else (xs[len(xs) // 2 - 1] + xs[len(xs) // 2]) / 2


def _fmt_t(s: float) -> str:
    return "not reached" if math.isinf(s) else f"{s:.2f} s"


def _dir_name(label: str) -> str:
    return label.replace(" ", "_").replace("=", "")


def run(quick: bool = False, timeout: float = 600, log=print,
        methods: Optional[List] = None, ddp: bool = True, name: str = CLUSTER_NAME,
        subnet: str = CLUSTER_SUBNET, keep: Optional[Path] = None,
        seeds: Optional[Sequence[int]] = None, steps: int = MAX_STEPS,
        target: float = TARGET) -> Dict:
    """Per link rate, one mpirun job of every (seed, method) run, seed-major. ``methods``:
    (label, --algorithm, options) (default METHODS), plus DDP (label DDP_LABEL) on the
    allreduce run's options when ``ddp``; cluster ``name`` on ``subnet``; runs kept under
    ``keep`` (else removed); ``seeds`` default: SEEDS, the first one in quick mode; ``steps``
    per run and the ``target`` test accuracy."""
    why_not = cluster_available()
    methods = list(METHODS if methods is None else methods)
    seeds = list(seeds if seeds is not None else SEEDS[:1] if quick else SEEDS)
    labels = [m[0] for m in methods] + ([DDP_LABEL] if ddp else [])
    base = {"name": "time_to_accuracy", "doc": __doc__.splitlines()[0], "target": target,
            "seeds": seeds, "rates": list(RATES), "model": MODEL, "batch": BATCH,
            "methods": labels, "steps": steps}
    if why_not:
        return {**base, "status": f"skipped: {why_not}",
                "rows": [row("time_to_accuracy", "", f"skipped: {why_not}", None, "")]}
    off = consensus_off()
    tmp = Path(keep) if keep else Path(tempfile.mkdtemp(prefix="lsgd_bench_tta_"))
    # gloo (DDP) on the emulated nodes' own interface
    env = mpi_env({"LSGD_HPC_RANKS_PER_NODE": "", "GLOO_SOCKET_IFNAME": "eth0"})
    env.pop("LSGD_HPC_RANKS_PER_NODE", None)
    per_rate: Dict[str, Dict] = {}
    errors: Dict[str, str] = {}
    try:
        for rate in RATES:
            dirs, argvs = {}, []
            for seed in seeds:
                for label, alg, opts in methods:
                    d = tmp / rate / f"{_dir_name(label)}-s{seed}"
                    dirs[(label, seed)] = d
                    argvs.append([*common_options(steps), *off, "--algorithm", alg, *opts,
                                  "--seed", str(seed), "--run-dir", str(d)])
                if ddp:      # the allreduce run's command line, trained by DDP
                    d = tmp / rate / f"{DDP_LABEL}-s{seed}"
                    dirs[(DDP_LABEL, seed)] = d
                    argvs.append({"ddp": [*common_options(steps), *off, "--algorithm", "allreduce",
                                          "--seed", str(seed), "--run-dir", str(d)]})
            spec = tmp / f"{rate}.json"
            probe_out = tmp / f"{rate}-probe.json"
            spec.parent.mkdir(parents=True, exist_ok=True)
            spec.write_text(json.dumps({"argvs": argvs, "probe_out": str(probe_out),
                                        "expect": {"what": f"time_to_accuracy {rate}",
                                                   "nodes": NODES, "rate": rate}}))
            try:
                with emulated_cluster(rate, log, name, subnet) as margs:
                    cmd = [mpirun_path(), *margs, "-x", "PYTHONPATH", "-x", "OMP_NUM_THREADS",
                           "-x", "PATH", "-x", "GLOO_SOCKET_IFNAME", "-np", str(NP),
                           sys.executable, str(Path(__file__)), "--job", str(spec)]
                    t0 = time.perf_counter()
                    p = run_group(cmd, env=env, cwd=REPO, timeout=timeout)
                    log(f"  time_to_accuracy: {rate}: {len(argvs)} runs in "
                        f"{time.perf_counter() - t0:.0f} s")
            except (RuntimeError, subprocess.SubprocessError, OSError) as exc:
                errors[rate] = str(exc)
                continue
            probe = json.loads(probe_out.read_text()) if probe_out.exists() else None
            if probe and probe.get("layout_error"):
                # Not the layout or link the figures would claim: none of them is written.
                return layout_failed(base, probe["layout_error"])
            if p.returncode != 0:
                why = "timed out" if p.returncode is None else f"exit {p.returncode}"
                errors[rate] = f"{why}: {(p.stderr or p.stdout).strip()[-400:]}"
            runs = {}
            for (label, seed), d in dirs.items():
                try:
                    r = runs.setdefault(label, {})[seed] = read_run(d, target)
                except Exception as exc:       # a missing file: report, go on
                    errors[f"{rate} {label} seed {seed}"] = f"{type(exc).__name__}: {exc}"
                    continue
                if label != DDP_LABEL:         # the trainer's own node_index attributes
                    try:
                        check_layout(f"time_to_accuracy {rate} {label} seed {seed}",
                                     r["node_of"], NODES)
                    except LayoutError as exc:
                        return layout_failed(base, str(exc))
            per_rate[rate] = {"runs": runs, "probe": probe}
    finally:
        if not keep:
            shutil.rmtree(tmp, ignore_errors=True)
    return summarise(base, per_rate, errors, off)


def layout_failed(base: Dict, error: str) -> Dict:
    """The result of a run whose layout or link rate is not the claimed one: no figures."""
    return {**base, "status": f"failed: layout check: {error}", "errors": {"layout": error},
            "results": {}, "rows": [row("time_to_accuracy", "", f"failed: {error}", None, "")]}


def _n_params() -> int:
    """The parameters of MODEL on digits (what rho's fp32 allreduce moves)."""
    from lsgd_hpc.planning.plan import model_facts
    return model_facts(MODEL, "digits").n_params


def summarise(base: Dict, per_rate: Dict, errors: Dict, off: List[str]) -> Dict:
    rows, table = [], {}
    gpu = gpu_case_ratios()
    for rate, data in per_rate.items():
        runs = data["runs"]
        tt = {label: _median_time([r["time_to_target"] for r in by_seed.values()])
              for label, by_seed in runs.items()}
        ar = list(runs.get("allreduce", {}).values())
        ratio = median([r["compute_s_per_step"] / r["comm_s_per_step"] for r in ar
                        if r["comm_s_per_step"] > 0])
        baselines = {k: v for k, v in tt.items() if k != "lsgd"}
        best = min(baselines, key=baselines.get) if baselines else None
        lsgd_t = tt.get("lsgd", math.inf)
        vs = lsgd_t / baselines[best] if best and math.isfinite(baselines[best]) else None
        closest = min(gpu, key=lambda g: abs(math.log(g["ratio"] / ratio))) if ratio == ratio \
            and ratio > 0 else None
        # rho: one fp32 allreduce of the model between the nodes, predicted from the probed
        # link, over the allreduce runs' compute seconds a step (median over seeds)
        inter = ((data["probe"] or {}).get("probe") or {}).get("inter")
        rho = rho_fields(_n_params(), NODES, RANKS_PER_NODE, inter, median(
            [r["compute_s_per_step"] for r in ar])) if inter and ar else {}
        table[rate] = {"time_to_target_median": tt, "best_baseline": best,
                       "lsgd_over_best_baseline": vs, "compute_to_allreduce": ratio,
                       "gpu_case": closest["case"] if closest else None, **rho,
                       "seeds": {label: {str(s): {k: v for k, v in r.items() if k != "curve"}
                                         for s, r in by_seed.items()}
                                 for label, by_seed in runs.items()},
                       "curves": {label: {str(s): r["curve"] for s, r in by_seed.items()}
                                  for label, by_seed in runs.items()},
                       "probe": data["probe"]}
        per_method = "; ".join(f"{k} {_fmt_t(v)}" for k, v in tt.items())
        if "lsgd" in runs:     # its leader's model above; every worker's, for comparison
            per_method += "; lsgd by the mean over ranks " + _fmt_t(_median_time(
                [r["time_to_target_mean_over_ranks"] for r in runs["lsgd"].values()]))
        rows.append(row(
            f"time_to_accuracy {rate}",
            f"training time to {base['target']:.0%} test accuracy (median of "
            f"{len(base['seeds'])} seeds), "
            f"LSGD vs best baseline ({best}; baselines: "
            f"{', '.join(k for k in tt if k != 'lsgd')})",
            f"{per_method}; compute:allreduce {ratio:.2g}:1"
            + (f" (like {closest['case']}, {closest['ratio']:.2g}:1)" if closest else "")
            + (f"; rho {rho['rho']:.3g} ({rho['rho_source']})" if rho else ""),
            vs, "LSGD time / best baseline's", lsgd_s=lsgd_t, best_baseline=best,
            compute_to_allreduce=ratio, **rho))
    for k, v in errors.items():
        rows.append(row(f"time_to_accuracy {k}", "", f"failed: {v}", None, ""))
    status = "ok" if not errors else ("failed" if not per_rate else "partial")
    return {**base, "status": status if status != "partial" else "ok (with errors)",
            "errors": errors, "results": table, "gpu_cases": gpu, "rows": rows,
            "consensus_option": off,
            "notes": [
                f"2 nodes x 2 ranks as network namespaces (scripts/cluster.sh --no-slurm), tc tbf "
                f"per node link at {', '.join(RATES)}; {MODEL} on digits, batch {BATCH}, "
                f"{base['steps']} steps, evaluation every {EVAL_EVERY}; options "
                f"{' '.join(common_options(base['steps']))} "
                f"{' '.join(off)}.",
                "Accuracy: the test accuracy of the model each method reports (LSGD: its elected "
                "global leader, EASGD: the centre, others: the mean over ranks); "
                "time: /train/training_time (or wall_time where the trainer has no training "
                "time), slowest rank; not reached within the steps counts as infinite.",
                f"{DDP_LABEL}: torch DistributedDataParallel (gloo, its default 25 MB buckets "
                "overlapped with backward) trains the allreduce run's configuration (data "
                "shards, initial model, batch, SGD lr, momentum, weight decay, steps, "
                "evaluation steps) in the same mpirun job, seed-major with the others; its "
                "time is the wall time since DDP was built less evaluations, slowest rank.",
            ]}


def main(argv=None) -> int:
    import argparse
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="JSON file to write")
    p.add_argument("--quick", action="store_true", help="one seed")
    p.add_argument("--job", help=argparse.SUPPRESS)     # the MPI job itself (every rank)
    args = p.parse_args(argv)
    if args.job:
        return job(args.job)
    if not args.out:
        p.error("--out is required")
    result = run(args.quick)
    write_result(args.out, result)
    for r in result["rows"]:
        print(f"{r['label']}: {r['figures']}  ratio {r['ratio']}")
    return 0 if result["status"].startswith(("ok", "skipped")) else 1


if __name__ == "__main__":
    sys.exit(main())
