"""One planner question, one answer: the figures a user may not know (a GPU kind's sustained
FLOP/s and the link inside its node), and the one recommendation of ``python -m
lsgd_hpc.plan``: method, compressor, worker shape, failure policy and checkpoint interval, with
the predicted goodput and the train command (``mpirun ... python -m lsgd_hpc.train ...``).

The figures (``GPUS``, ``INTERCONNECTS``) are published peaks; the planner uses a stated share
of them and prints every one it assumed ("assumed: ... (pass --x to set)"):

    GPU    peak (dense tensor)        inside a node
    h100   989 TFLOP/s BF16 (SXM)     NVLink 4: 900 GB/s a GPU, both directions -> 3600 Gbit/s
    a100   312 TFLOP/s BF16 (SXM)     NVLink 3: 600 GB/s -> 2400 Gbit/s
    v100   125 TFLOP/s FP16 (SXM2)    NVLink 2: 300 GB/s -> 1200 Gbit/s
    cpu    5.12 TFLOP/s FP32          shared memory, 25 GB/s a rank -> 200 Gbit/s (assumed)
           (32 cores x 2.5 GHz x 64 FLOP a cycle, AVX-512)
    PCIe x16 in place of NVLink (--interconnect): 5.0 64 GB/s, 4.0 32 GB/s, 3.0 16 GB/s a
    direction -> 512, 256, 128 Gbit/s

Sustained: ``MFU`` (40 %) of the peak (Llama 3 trained at 38-43 % of the H100's BF16 peak).
The compute of one step of an N-parameter model over T tokens (or samples) a rank: 6 N T FLOP
(forward 2 N T, backward 4 N T; the transformer rule of Kaplan et al. 2020, attention left
out), so step = 6 N T / (MFU x peak).

No import of the method planner (lsgd_hpc.planning.plan imports this module).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

__all__ = ["GPU", "GPUS", "INTERCONNECTS", "MFU", "TOKENS_PER_STEP", "WRITE_GBYTES_PER_S",
           "DEFAULT_GPU", "intra_link", "params_step", "failure_problem", "launcher",
           "run_recommendation", "format_run"]


@dataclass(frozen=True)
class GPU:
    name: str
    peak_tflops: float      # dense tensor peak (cpu: FP32 vector peak)
    precision: str          # what the peak is of
    interconnect: str       # the link inside its node (INTERCONNECTS)


GPUS: Dict[str, GPU] = {
    "h100": GPU("NVIDIA H100 SXM", 989.0, "dense BF16", "nvlink4"),
    "a100": GPU("NVIDIA A100 SXM", 312.0, "dense BF16", "nvlink3"),
    "v100": GPU("NVIDIA V100 SXM2", 125.0, "FP16 tensor", "nvlink2"),
    "cpu": GPU("a CPU socket (32 cores x 2.5 GHz x 64 FLOP a cycle, AVX-512)", 5.12, "FP32",
               "shm"),
}
#: Gbit/s of one rank's link inside a node, one direction, and what the figure is
INTERCONNECTS: Dict[str, Tuple[float, str]] = {
    "nvlink4": (3600.0, "NVLink 4, 900 GB/s a GPU both directions"),
    "nvlink3": (2400.0, "NVLink 3, 600 GB/s a GPU both directions"),
    "nvlink2": (1200.0, "NVLink 2, 300 GB/s a GPU both directions"),
    "pcie5": (512.0, "PCIe 5.0 x16, 64 GB/s a direction"),
    "pcie4": (256.0, "PCIe 4.0 x16, 32 GB/s a direction"),
    "pcie3": (128.0, "PCIe 3.0 x16, 16 GB/s a direction"),
    "shm": (200.0, "shared memory, about 25 GB/s of copies a rank, a rough figure"),
}
DEFAULT_GPU = "h100"
#: sustained share of the peak (model FLOP utilisation)
MFU = 0.40
#: tokens (or samples) a rank computes per step, for a model given by --params
TOKENS_PER_STEP = 8192
#: write bandwidth of one checkpoint writer, GB/s, when neither given nor probed
WRITE_GBYTES_PER_S = 1.0


def intra_link(gpu: str, interconnect: Optional[str]) -> Tuple[float, str]:
    """Gbit/s inside a node and its assumption line."""
    name = interconnect or GPUS[gpu].interconnect
    gbps, what = INTERCONNECTS[name]
    how = "--interconnect" if interconnect else f"the {gpu}'s"
    return gbps, (f"assumed: inside a node {gbps:g} Gbit/s a rank: {name} ({what}; {how}) "
                  "(pass --intra-gbps or --interconnect to set)")


def params_step(n_params: int, tokens: int, tflops: Optional[float], gpu: str,
                tokens_given: bool) -> Tuple[float, str]:
    """Seconds of one step of an ``n_params`` model over ``tokens`` a rank (6 N T FLOP) at
    ``tflops`` (None: MFU of the GPU's peak), and its assumption line."""
    flop = 6.0 * n_params * tokens
    if tflops is None:
        g = GPUS[gpu]
        tflops = MFU * g.peak_tflops
        rate = (f"{tflops:.4g} TFLOP/s sustained ({MFU:.0%} of {gpu}'s {g.peak_tflops:g} "
                f"{g.precision} peak)")
    else:
        rate = f"{tflops:g} TFLOP/s (given)"
    t = "" if tokens_given else " (assumed)"
    step = flop / (tflops * 1e12)
    return step, (f"assumed: compute {step * 1e3:.3g} ms a step = 6 x {n_params:,} parameters "
                  f"x {tokens:,} tokens a rank{t} / {rate} (pass --step-ms, or "
                  "--tokens-per-step, --tflops, --gpu to set)")


# -- the train command -------------------------------------------------------------------------
#: mpirun's options for ULFM (shrink, heal) and for heal's spawned replacements
#: (lsgd_hpc.comm.ulfm.RECOVERABLE_SPAWNS; docs/cluster.md, "When a node dies")
ULFM = ("--with-ft", "ulfm")
RECOVERABLE = ("--prtemca", "state_base_recoverable", "1")


def failure_problem(method: str, options: Dict, topk: float, on_failure: str) -> Optional[str]:
    """Why the trainer refuses this method with ``--on-failure`` (lsgd_hpc.cli.config's
    rule; the test parses the command with the trainer's parser), or None."""
    if on_failure == "heal" and method == "lsgd-async":
        return ("heal is not for lsgd-async (a joining rank needs step boundaries that every "
                "rank shares; use shrink)")
    return None


def launcher(on_failure: str, ranks: int, ranks_per_node: int) -> List[str]:
    """mpirun's words for ``ranks`` ranks, ``ranks_per_node`` a node, under ``on_failure``."""
    words = ["mpirun"]
    if on_failure in ("shrink", "heal"):
        words += list(ULFM)
    if on_failure == "heal":
        words += list(RECOVERABLE)
    return words + ["-np", str(ranks), "--map-by", f"ppr:{ranks_per_node}:node"]


def _policy(failures: Dict, method: Dict) -> Tuple[Dict, Optional[str]]:
    """The failure plan's policy when the trainer runs it with ``method``, else the best one
    it does run (the same margin for more machinery), and why."""
    rows = {r["policy"]: r for r in failures["rows"]}
    chosen = rows[failures["recommended"]]
    flag = chosen["policy"].split("+")[0]
    problem = failure_problem(method["method"], method["options"], method["topk"], flag)
    if problem is None:
        return chosen, None
    ok = [r for r in failures["rows"] if failure_problem(
        method["method"], method["options"], method["topk"], r["policy"].split("+")[0]) is None]
    best = ok[0]
    for r in ok[1:]:
        if r["goodput"] > best["goodput"] + 0.001:
            best = r
    return best, f"not {chosen['policy']}: {problem}"


def _pick(rec: Dict, failures: Optional[Dict]) -> Tuple[Dict, Optional[Dict], Optional[str]]:
    """(method row, policy row, note): the recommended method unless the trainer refuses the
    failure plan's policy with it and an eligible runner-up takes it."""
    best = rec["recommended"]
    if failures is None:
        return best, None, None
    for cand in [best] + [r for r in rec["runners_up"] if r.get("eligible")]:
        if cand.get("trainer_refuses"):
            continue
        policy, why = _policy(failures, cand)
        if why is None:
            note = None if cand is best else (
                f"{best['method']} ({_setting(best)}) is refused with "
                f"--on-failure {policy['policy'].split('+')[0]}: the next eligible one")
            return cand, policy, note
    policy, why = _policy(failures, best)
    return best, policy, why


def _setting(r: Dict) -> str:
    o = r["options"]
    names = (("H", "H"), ("fragments", "P"), ("sync_delay", "delay"), ("tau_local", "tau_L"),
             ("tau_global", "tau_G"), ("pull_delay", "delay"), ("tau", "tau"))
    return ", ".join(f"{short} {o[k]}" for k, short in names if k in o) or "every step"


def _compressor(r: Dict) -> str:
    return r["comm_dtype"] + (f", top-k {r['topk']:g}" if r["topk"] < 1 else "")


def run_recommendation(rec: Dict, failures: Optional[Dict], nodes: int, ranks_per_node: int,
                       device: str, model_args: Sequence[str]) -> Dict:
    """The one recommendation: the method planner's (``rec``, planning.recommend's result)
    with, given ``failures`` (failplan.failure_plan's), the failure policy and the checkpoint
    interval in steps of the method's predicted step; and the train command."""
    method, policy, note = _pick(rec, failures)
    ranks = nodes * ranks_per_node
    out = {"method": method["method"], "setting": _setting(method),
           "compressor": _compressor(method), "options": method["options"],
           "comm_dtype": method["comm_dtype"], "topk": method["topk"],
           "step_s": method["step_s"], "comm_share": method["comm_share"], "rho": rec["rho"],
           "workers": ranks, "worker_ranks": 1, "nodes": nodes,
           "ranks_per_node": ranks_per_node, "note": note}
    train = ["python", "-m", "lsgd_hpc.train"] + method["args"].split()
    on_failure, spare_ranks = "abort", 0
    if policy is not None:
        on_failure = policy["policy"].split("+")[0]
        interval = (failures["daly_s"] if on_failure == "abort"
                    else failures["shrink_heal_interval_s"])
        every = None if math.isinf(interval) else max(1, round(interval / method["step_s"]))
        spare_ranks = (failures["inputs"]["spares"] * ranks_per_node
                       if policy["policy"] == "heal+spares" else 0)
        train += ["--on-failure", on_failure]
        train += ["--spares", str(spare_ranks)] if spare_ranks else []
        train += ["--checkpoint-every", str(every)] if every else []
        out.update(policy=policy["policy"], on_failure=on_failure, goodput=policy["goodput"],
                   checkpoint_interval_s=interval, checkpoint_every=every,
                   spare_ranks=spare_ranks, requeue_s=policy.get("window_s"),
                   checkpoint_s=failures["checkpoint"]["seconds"])
    train += (["--device", "cuda"] if device == "cuda" else []) + list(model_args)
    out["command"] = " ".join(launcher(on_failure, ranks + spare_ranks, ranks_per_node) + train)
    out["train_args"] = train[3:]
    return out


def _hms(s: float) -> str:
    if s < 600:
        return f"{s:.3g} s"
    return f"{s / 60:.3g} min" if s < 3 * 3600 else f"{s / 3600:.3g} h"


def format_run(run: Dict, model_note: Optional[str] = None) -> str:
    """The one "recommended" line, its train command and what the command still needs."""
    shape = (f"{run['workers']} workers of 1 rank ({run['nodes']} nodes x "
             f"{run['ranks_per_node']})")
    head = (f"recommended: {run['method']} ({run['setting']}), {run['compressor']}; {shape}; "
            f"{run['step_s'] * 1e3:.3g} ms a step, {100 * run['comm_share']:.1f}% "
            f"communication (rho {run['rho']:.3g})")
    if "policy" in run:
        ckpt = ("no periodic checkpoint (every failure survivable)"
                if run["checkpoint_every"] is None else
                f"a checkpoint every {_hms(run['checkpoint_interval_s'])} "
                f"(--checkpoint-every {run['checkpoint_every']:,})")
        requeue = run.get("requeue_s")
        requeue = (f", requeued at full size every {_hms(requeue)}"
                   if requeue is not None and math.isfinite(requeue)
                   and run["policy"] == "shrink+requeue" else "")
        spares = (f", {run['spare_ranks']} spare ranks" if run["spare_ranks"] else "")
        head += (f"; --on-failure {run['on_failure']}{spares}{requeue}, {ckpt}; predicted "
                 f"goodput {100 * run['goodput']:.2f}% (failures and checkpoints)")
    lines = ["", head, f"  {run['command']}"]
    if run.get("note"):
        lines.append(f"  ({run['note']})")
    if model_note:
        lines.append(f"  ({model_note})")
    return "\n".join(lines)
