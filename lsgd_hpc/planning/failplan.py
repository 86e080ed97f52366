"""The failure planner: ``python -m lsgd_hpc.plan --mtbf-hours H --nodes N [...]``.

Expected goodput (useful training time over wall time) of abort + requeue at the Young/Daly
checkpoint interval, shrink (to the end, or requeued at full size every H hours), heal, and
heal with spare nodes, from a per-node MTBF and the costs of checkpoints, restarts, pauses and
replacements (lsgd_hpc.planning.goodput holds the model; docs/planning.md, "Failures and
goodput", states it). The checkpoint write cost is given (--checkpoint-seconds), or measured:
the model's state (--model: parameters and buffers, with SGD's momentum, 4 bytes each) over
the write bandwidth of --checkpoint-dir (a 64 MB write and fsync; --write-gbytes-per-s gives
it instead), or a default. ``--mtbf-hours llama3`` takes the Llama 3 report's failure rate.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from dataclasses import asdict
from typing import Callable, Dict, Optional, Sequence

from lsgd_hpc.planning import goodput as gp

__all__ = ["DEFAULTS", "main", "format_failure_plan", "failure_plan", "probe_write_bandwidth",
           "add_failure_options", "check", "state_checkpoint_cost", "finite"]

#: Defaults of the costs (seconds), for a large GPU cluster: stated in every plan
DEFAULTS = {"checkpoint_seconds": 60.0, "restart_seconds": 600.0, "queue_seconds": 0.0,
            "shrink_pause_seconds": 60.0, "heal_pause_seconds": 30.0,
            "replacement_seconds": 300.0, "job_hours": 24.0, "survivable": 0.78}
PROBE_BYTES = 64 * 2 ** 20
#: bytes of checkpointed state per model element: the weights and SGD's momentum, float32
STATE_BYTES_PER_ELEMENT = 8


class FailureUsageError(ValueError):
    """A user's mistake: one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise FailureUsageError(message)


def add_failure_options(p: argparse.ArgumentParser) -> None:
    """The failure costs and the job's shape beyond its size: the options of this planner that
    the method planner (lsgd_hpc.planning.plan) takes too, for ``--mtbf-hours`` with
    ``--params`` or ``--inter-gbps`` (one recommendation of both)."""
    d = DEFAULTS
    p.add_argument("--job-hours", type=float, default=d["job_hours"],
                   help="training time the job needs at full size without failures "
                        f"(default {d['job_hours']:g})")
    p.add_argument("--checkpoint-seconds", type=float,
                   help="seconds one checkpoint blocks training (default: measured with "
                        f"--model, else {d['checkpoint_seconds']:g}; with --params or "
                        "--inter-gbps: the model's state over --write-gbytes-per-s)")
    p.add_argument("--checkpoint-dir",
                   help="where the write probe writes (the failure planner alone, with "
                        "--model: default the temp dir; with --params or --inter-gbps: "
                        "probed only when given)")
    p.add_argument("--write-gbytes-per-s", type=float,
                   help="the checkpoint write bandwidth of one writer, GB/s (no probe)")
    for name, what in (("restart", "from the requeued job's start to its first step: "
                                    "launch, set-up, checkpoint load"),
                       ("queue", "abort: wait before the restart (detection, queue); no "
                                 "node is held, so no failure hits it"),
                       ("shrink-pause", "every survivor idle per failure under shrink and "
                                        "heal: detection and recovery"),
                       ("heal-pause", "heal: every rank idle while a replacement joins"),
                       ("replacement", "heal: from a failure until a spawned replacement "
                                       "can join (node, start-up)")):
        key = f"{name.replace('-', '_')}_seconds"
        p.add_argument(f"--{name}-seconds", type=float, default=DEFAULTS[key],
                       help=f"{what} (default {DEFAULTS[key]:g})")
    p.add_argument("--survivable", type=float, default=d["survivable"],
                   help="share of failures shrink and heal survive; the rest end the job "
                        f"(default {d['survivable']:g}: Llama 3's hardware share)")
    p.add_argument("--replica-nodes", type=int, default=1,
                   help="nodes of one data-parallel replica (model parallelism): a lost node "
                        "takes its replica with it (default 1)")
    p.add_argument("--spares", type=int, default=0, help="heal: spare nodes kept started")
    p.add_argument("--requeue-hours", type=float,
                   help="heal with spares: requeue every H hours, refilling the spares "
                        "(default: never)")


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m lsgd_hpc.plan --mtbf-hours H",
                description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("--mtbf-hours", required=True,
                   help="mean time between failures of one node, hours (llama3: the Llama 3 "
                        "report's, 6,335 h)")
    p.add_argument("--nodes", type=int, required=True, help="nodes of the job")
    p.add_argument("--ranks-per-node", type=int, default=8, help="GPUs per node (default 8)")
    p.add_argument("--model", help="measure the checkpoint: this model's state over the "
                                    "write bandwidth of --checkpoint-dir")
    p.add_argument("--dataset", help="with --model: its input shape (default: the model's)")
    add_failure_options(p)
    p.add_argument("--step-ms", type=float,
                   help="one training step, ms: the interval also in steps (--checkpoint-every)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    return p


def _mtbf_hours(text: str) -> float:
    if text.strip().lower() == "llama3":
        return gp.llama3_node_mtbf_hours()
    try:
        return float(text)
    except ValueError:
        raise FailureUsageError(f"--mtbf-hours: a number of hours or llama3, got {text!r}") \
            from None


def check(args, combined: bool = False) -> None:
    """Every check of the failure options (``combined``: with the method planner's, which
    checked the counts and lets --write-gbytes-per-s go without --model)."""
    def bad(name, v, what):
        raise FailureUsageError(f"--{name.replace('_', '-')}: {what}, got {v}")

    args.mtbf_hours = _mtbf_hours(args.mtbf_hours)
    for name in ("mtbf_hours", "job_hours", "step_ms", "write_gbytes_per_s", "requeue_hours",
                 "checkpoint_seconds"):
        v = getattr(args, name)
        if v is not None and not (0 < v < math.inf):
            bad(name, v, "must be > 0 and finite")
    for name in ("restart_seconds", "queue_seconds", "shrink_pause_seconds",
                 "heal_pause_seconds", "replacement_seconds"):
        v = getattr(args, name)
        if not 0 <= v < math.inf:
            bad(name, v, "must be >= 0 and finite")
    for name in ("nodes", "ranks_per_node", "replica_nodes"):
        if getattr(args, name) < 1:
            bad(name, getattr(args, name), "must be >= 1")
    if args.spares < 0:
        bad("spares", args.spares, "must be >= 0")
    if not 0 <= args.survivable <= 1:
        bad("survivable", args.survivable, "must be in [0, 1]")
    if args.nodes % args.replica_nodes:
        raise FailureUsageError(f"--replica-nodes: must divide --nodes ({args.nodes}), got "
                                f"{args.replica_nodes}")
    if args.requeue_hours is not None and not args.spares:
        raise FailureUsageError("--requeue-hours: refills spares; needs --spares")
    if not combined and args.model is None and (args.dataset or args.write_gbytes_per_s):
        raise FailureUsageError("--dataset, --write-gbytes-per-s: need --model")


def probe_write_bandwidth(folder: str, nbytes: int = PROBE_BYTES) -> float:
    """Bytes per second of writing ``nbytes`` to a new file in ``folder`` and fsyncing it (the
    file is removed)."""
    block = os.urandom(1 << 20)
    fd, path = tempfile.mkstemp(prefix=".lsgd_write_probe_", dir=folder)
    try:
        t0 = time.perf_counter()
        with os.fdopen(fd, "wb") as fh:
            for _ in range(max(1, nbytes // len(block))):
                fh.write(block)
            fh.flush()
            os.fsync(fh.fileno())
        return max(1, nbytes // len(block)) * len(block) / (time.perf_counter() - t0)
    finally:
        os.unlink(path)


def _checkpoint_cost(args, model_facts: Optional[Callable]) -> Dict:
    """The checkpoint's seconds and where they come from."""
    if args.checkpoint_seconds is not None:
        return {"seconds": args.checkpoint_seconds, "source": "given"}
    if args.model is None or model_facts is None:
        return {"seconds": DEFAULTS["checkpoint_seconds"], "source": "default"}
    facts = model_facts(args.model, args.dataset)
    state = (facts.n_params + facts.n_buffers) * STATE_BYTES_PER_ELEMENT
    if args.write_gbytes_per_s:
        bw, how = args.write_gbytes_per_s * 1e9, "given"
    else:
        try:
            bw, how = _probe(args.checkpoint_dir or tempfile.gettempdir())
        except OSError as exc:
            raise FailureUsageError(f"--checkpoint-dir: cannot write a probe there "
                                    f"({exc.strerror or exc})") from None
    return {"seconds": state / bw, "bytes": state, "write_Bps": bw,
            "source": f"{facts.model}'s state {state / 1e6:.3g} MB (weights + momentum) at "
                      f"{bw / 1e9:.3g} GB/s ({how})"}


def _probe(folder: str):
    return (probe_write_bandwidth(folder),
            f"measured in {folder}, one writer, 64 MB + fsync")


def state_checkpoint_cost(args, state_bytes: float, assumed_write_Bps: float) -> Dict:
    """The checkpoint's seconds for a model of ``state_bytes`` (weights and momentum): given
    (--checkpoint-seconds), at --write-gbytes-per-s, probed in --checkpoint-dir when given,
    else at ``assumed_write_Bps`` (``"assumed": True``)."""
    if args.checkpoint_seconds is not None:
        return {"seconds": args.checkpoint_seconds, "source": "given", "assumed": False}
    assumed = False
    if args.write_gbytes_per_s:
        bw, how = args.write_gbytes_per_s * 1e9, "given"
    elif args.checkpoint_dir:
        try:
            bw, how = _probe(args.checkpoint_dir)
        except OSError as exc:
            raise FailureUsageError(f"--checkpoint-dir: cannot write a probe there "
                                    f"({exc.strerror or exc})") from None
    else:
        bw, how, assumed = assumed_write_Bps, "assumed", True
    return {"seconds": state_bytes / bw, "bytes": state_bytes, "write_Bps": bw,
            "assumed": assumed,
            "source": f"the model's state {state_bytes / 1e9:.3g} GB (weights + momentum) at "
                      f"{bw / 1e9:.3g} GB/s ({how})"}


def failure_model(args, checkpoint_s: float) -> gp.FailureModel:
    return gp.FailureModel(
        nodes=args.nodes, node_mtbf_s=args.mtbf_hours * gp.HOUR, checkpoint_s=checkpoint_s,
        restart_s=args.restart_seconds, down_s=args.queue_seconds,
        shrink_pause_s=args.shrink_pause_seconds, heal_pause_s=args.heal_pause_seconds,
        replacement_s=args.replacement_seconds, job_s=args.job_hours * gp.HOUR,
        replica_nodes=args.replica_nodes, spares=args.spares,
        requeue_s=math.inf if args.requeue_hours is None else args.requeue_hours * gp.HOUR,
        survivable=args.survivable)


def failure_plan(args, model_facts: Optional[Callable] = None,
                 checkpoint: Optional[Dict] = None) -> Dict:
    """The plan as a dict: inputs, checkpoint cost (``checkpoint``, or from the options), and
    goodput.policies' result."""
    ckpt = checkpoint if checkpoint is not None else _checkpoint_cost(args, model_facts)
    m = failure_model(args, ckpt["seconds"])
    res = gp.policies(m)
    inputs = {k: v for k, v in asdict(m).items() if k not in ("capacity", "floor")}
    inputs.update(ranks_per_node=args.ranks_per_node, ranks=args.nodes * args.ranks_per_node,
                  mtbf_hours=args.mtbf_hours, step_ms=args.step_ms,
                  llama3=math.isclose(args.mtbf_hours, gp.llama3_node_mtbf_hours()))
    res.update(inputs=inputs, checkpoint=ckpt, shrink_heal_interval_s=m.interval_s())
    return res


def _hms(s: float) -> str:
    if math.isinf(s):
        return "never"
    if s < 600:
        return f"{s:.3g} s"
    if s < 3 * 3600:
        return f"{s / 60:.3g} min"
    return f"{s / 3600:.3g} h" if s < 100 * 3600 else f"{s / 3600:,.0f} h"


def _steps(seconds: float, step_ms: Optional[float]) -> str:
    if step_ms is None or math.isinf(seconds):
        return ""
    return f" = --checkpoint-every {max(1, round(seconds * 1e3 / step_ms))} at {step_ms:g} ms/step"


def _header(r: Dict) -> list:
    i, c = r["inputs"], r["checkpoint"]
    mtbf = f"{i['mtbf_hours']:,.0f} h" + (
        " (Llama 3: 2048 nodes x 54 d x 24 h / 419 unexpected interruptions)"
        if i["llama3"] else "")
    return [
        f"failure plan: {i['nodes']} nodes x {i['ranks_per_node']} ranks = {i['ranks']} ranks; "
        f"node MTBF {mtbf} -> job MTBF {_hms(r['job_mtbf_s'])}; "
        f"job: {_hms(i['job_s'])} of training, {r['failures']:.3g} failures expected",
        f"costs: checkpoint {_hms(c['seconds'])} ({c['source']}), restart "
        f"{_hms(i['restart_s'])} + wait {_hms(i['down_s'])}, shrink pause "
        f"{_hms(i['shrink_pause_s'])}, heal join pause {_hms(i['heal_pause_s'])}, replacement "
        f"ready after {_hms(i['replacement_s'])}; {100 * i['survivable']:.0f} % of failures "
        f"survivable by shrink and heal; replicas of {i['replica_nodes']} node(s)",
        f"abort's checkpoint interval: Young sqrt(2 delta M) = {_hms(r['young_s'])} (goodput "
        f"{100 * r['goodput_young']:.2f} %), Daly = {_hms(r['daly_s'])}"
        f"{_steps(r['daly_s'], i['step_ms'])} (abort's)",
        f"shrink and heal checkpoint every {_hms(r['shrink_heal_interval_s'])}"
        f"{_steps(r['shrink_heal_interval_s'], i['step_ms'])} (Daly's for the failures they "
        f"do not survive), keeping {100 * r['kappa']:.2f} % of their time",
    ]


def format_failure_plan(r: Dict, verdict: bool = True) -> str:
    """The text plan; ``verdict`` False: without its closing "recommended:" line (the method
    planner prints one recommendation of both)."""
    lines = _header(r) + ["", f"{'policy':<16} {'goodput':>8}  setting"]
    for row in r["rows"]:
        setting = row["detail"]
        if row["policy"] == "abort":
            setting = f"checkpoint every {_hms(r['daly_s'])} (Daly); requeue at full size"
        elif row["policy"] == "shrink+requeue" and not math.isinf(row["window_s"]):
            setting = f"requeue at full size every {_hms(row['window_s'])}"
        elif row["policy"] == "heal+spares":
            setting += f"; per node-hour {100 * row['per_node_hour']:.2f} %"
        lines.append(f"{row['policy']:<16} {100 * row['goodput']:>7.2f}%  {setting}")
    if not verdict:
        return "\n".join(lines)
    rows = sorted(r["rows"], key=lambda x: -x["goodput"])
    chosen = next(x for x in r["rows"] if x["policy"] == r["recommended"])
    top = rows[0] if rows[0] is not chosen else rows[1]
    gain = 100 * (top["goodput"] - chosen["goodput"])
    why = (f"next: {top['policy']} {100 * top['goodput']:.2f} %" if gain <= 0 else
           f"{top['policy']} gains {gain:.2f} points, not more than the 0.1 that more "
           "machinery must pay")
    flag = r["recommended"].split("+")[0]
    lines += ["", f"recommended: {r['recommended']} (--on-failure {flag}): "
                  f"{100 * chosen['goodput']:.2f} %; {why}"]
    return "\n".join(lines)


def main(argv: Sequence[str], model_facts: Optional[Callable] = None) -> int:
    """``model_facts(model, dataset)`` (lsgd_hpc.planning.plan's) counts a model's elements
    for --model; passed in, as plan.py imports this module."""
    try:
        args = _parser().parse_args(list(argv))
        check(args)
        result = failure_plan(args, model_facts)
    except ValueError as exc:      # ours, and plan.py's UsageError for a bad --model
        print(f"lsgd_hpc.plan: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(finite(result), indent=2, default=str) if args.json
          else format_failure_plan(result))
    return 0


def finite(x):
    """JSON without Infinity: inf (never) becomes null."""
    if isinstance(x, dict):
        return {k: finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [finite(v) for v in x]
    return None if isinstance(x, float) and math.isinf(x) else x
