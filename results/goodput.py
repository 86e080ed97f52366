"""Predicted goodput of abort + requeue, shrink and heal from 64 to 16,384 GPUs at the failure
rate of the Llama 3 report, with the policy to choose at each size: the model of
``python -m lsgd_hpc.plan --mtbf-hours`` (lsgd_hpc.planning.goodput), no training.

    python results/goodput.py [--out results]

Writes ``OUT/goodput/goodput_llama3.csv`` and ``OUT/goodput/goodput_llama3.md`` (the table,
its assumptions, and how the choice at 16,384 GPUs moves when one assumption does).
"""

from __future__ import annotations

import argparse
import csv
import math
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from lsgd_hpc.planning import goodput as gp  # noqa: E402
from lsgd_hpc.planning.failplan import DEFAULTS  # noqa: E402

GPUS = [64 * 2 ** k for k in range(9)]          # 64 ... 16,384
GPUS_PER_NODE = 8
JOB_DAYS = 54
COLUMNS = ["gpus", "nodes", "job_mtbf_h", "failures", "daly_interval_min", "abort",
           "shrink", "shrink_requeue", "shrink_requeue_window_h", "heal", "choose",
           "choose_without_heal"]


def base_model(nodes: int) -> gp.FailureModel:
    """The planner's defaults (lsgd_hpc.planning.failplan.DEFAULTS) at the Llama 3 rate."""
    return gp.FailureModel(
        nodes=nodes, node_mtbf_s=gp.llama3_node_mtbf_hours() * gp.HOUR,
        checkpoint_s=DEFAULTS["checkpoint_seconds"], restart_s=DEFAULTS["restart_seconds"],
        down_s=DEFAULTS["queue_seconds"], shrink_pause_s=DEFAULTS["shrink_pause_seconds"],
        heal_pause_s=DEFAULTS["heal_pause_seconds"],
        replacement_s=DEFAULTS["replacement_seconds"], job_s=JOB_DAYS * 24 * gp.HOUR,
        survivable=DEFAULTS["survivable"])


def table_row(m: gp.FailureModel) -> dict:
    res = gp.policies(m)
    by = {r["policy"]: r for r in res["rows"]}
    window = by["shrink+requeue"]["window_s"]
    # the same rule among abort and shrink (a library without heal)
    without = by["abort"]
    for name in ("shrink", "shrink+requeue"):
        if by[name]["goodput"] > without["goodput"] + 0.001:
            without = by[name]
    return {"gpus": m.nodes * GPUS_PER_NODE, "nodes": m.nodes,
            "job_mtbf_h": res["job_mtbf_s"] / gp.HOUR, "failures": res["failures"],
            "daly_interval_min": res["daly_s"] / 60, "abort": by["abort"]["goodput"],
            "shrink": by["shrink"]["goodput"],
            "shrink_requeue": by["shrink+requeue"]["goodput"],
            "shrink_requeue_window_h": None if math.isinf(window) else window / gp.HOUR,
            "heal": by["heal"]["goodput"], "choose": res["recommended"],
            "choose_without_heal": without["policy"]}


def rows() -> list:
    return [table_row(base_model(g // GPUS_PER_NODE)) for g in GPUS]


SENSITIVITY = [
    ("the assumptions above", {}),
    ("restart + queue 30 min instead of 10", {"restart_s": 1800.0}),
    ("heal's join pause 300 s instead of 30", {"heal_pause_s": 300.0}),
    ("shrink's pause 10 s instead of 60", {"shrink_pause_s": 10.0}),
    ("checkpoint 10 s instead of 60", {"checkpoint_s": 10.0}),
    ("every failure survivable (1.0 instead of 0.78)", {"survivable": 1.0}),
    ("a replica is 16 nodes (128 GPUs: tensor x pipeline parallel)", {"replica_nodes": 16}),
    ("a replica is 16 nodes, 4 spare nodes never refilled", {"replica_nodes": 16,
                                                              "spares": 4}),
]


def _pct(x: float) -> str:
    return f"{100 * x:.2f} %"


def markdown(table: list) -> str:
    d = DEFAULTS
    mtbf = gp.llama3_node_mtbf_hours()
    lines = [
        "# Predicted goodput at the Llama 3 failure rate",
        "",
        "Written by `python results/goodput.py --out results` (no training: the model of "
        "`python -m lsgd_hpc.plan --mtbf-hours`, lsgd_hpc/planning/goodput.py; "
        "docs/planning.md, \"Failures and goodput\"). Goodput = useful training time / wall "
        "time; *choose* = the policy of highest goodput, where more machinery (in the order "
        "abort, shrink, shrink + requeue, heal) must gain more than 0.1 point; *without "
        "heal* = the same choice among abort and shrink.",
        "",
        "Assumptions:",
        "",
        f"- Failure rate: the Llama 3 report (54 days on 16,384 H100s, 8 per node: 466 job "
        f"interruptions, 419 unexpected, about 78 % of those hardware). Each unexpected "
        f"interruption is a failure of one of the 2048 nodes: job MTBF = 54 x 24 h / 419 = "
        f"{54 * 24 / 419:.2f} h, per-node MTBF = 2048 x {54 * 24 / 419:.2f} h = "
        f"{mtbf:,.0f} h, the same per node at every size (independent, exponential).",
        f"- {GPUS_PER_NODE} GPUs per node; a node is one data-parallel replica (its loss "
        "costs 1/N of the capacity under shrink); every job needs "
        f"{JOB_DAYS} days of training at full size.",
        f"- Checkpoint: {d['checkpoint_seconds']:g} s of blocked training per write; abort "
        f"writes one every Daly interval for the job MTBF. Restart (requeue, launch, set-up, "
        f"checkpoint load) {d['restart_seconds']:g} s, no queue wait ({d['queue_seconds']:g} "
        "s: a reserved allocation; a real queue only adds to abort's and the requeues' cost).",
        f"- Shrink: every survivor idle {d['shrink_pause_seconds']:g} s per failure "
        "(detection, recovery); lost nodes are not replaced until the job is requeued at full "
        "size: *shrink* runs to the end of the job, *shrink + requeue* requeues every "
        "window (chosen to maximise goodput; a checkpoint and a restart each time).",
        f"- Heal: the shrink pause, then a replacement ready after "
        f"{d['replacement_seconds']:g} s (node, start-up; the job runs one node short "
        f"meanwhile) joins with a {d['heal_pause_seconds']:g} s pause of every rank.",
        f"- {100 * d['survivable']:.0f} % of failures survivable by shrink and heal (the "
        "hardware share of the report); the others end the job under every policy, so shrink "
        "and heal keep a checkpoint every Daly interval for those, and pay their restarts.",
        "",
        "| GPUs | nodes | job MTBF (h) | failures in 54 d | Daly interval (min) | abort + "
        "requeue | shrink | shrink + requeue (window) | heal | choose | without heal |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for r in table:
        window = ("" if r["shrink_requeue_window_h"] is None
                  else f" ({r['shrink_requeue_window_h']:.0f} h)")
        lines.append(
            f"| {r['gpus']:,} | {r['nodes']:,} | {r['job_mtbf_h']:,.1f} | {r['failures']:.1f} "
            f"| {r['daly_interval_min']:.0f} | {_pct(r['abort'])} | {_pct(r['shrink'])} | "
            f"{_pct(r['shrink_requeue'])}{window} | {_pct(r['heal'])} | **{r['choose']}** | "
            f"{r['choose_without_heal']} |")
    lines += ["", "At 16,384 GPUs, one assumption changed at a time:", "",
              "| change | abort + requeue | shrink + requeue | heal | heal + spares | choose |",
              "|---|---:|---:|---:|---:|---|"]
    for what, change in SENSITIVITY:
        m = replace(base_model(16384 // GPUS_PER_NODE), **change)
        res = gp.policies(m)
        by = {r["policy"]: r["goodput"] for r in res["rows"]}
        spare = _pct(by["heal+spares"]) if "heal+spares" in by else "-"
        lines.append(f"| {what} | {_pct(by['abort'])} | {_pct(by['shrink+requeue'])} | "
                     f"{_pct(by['heal'])} | {spare} | **{res['recommended']}** |")
    lines += ["", "Not modelled: failures during a restart's set-up, a pause or a start-up "
              "under shrink and heal (second order), several nodes lost at once, stragglers, "
              "and the cost of keeping spare nodes (per node-hour, heal + spares earns N / "
              "(N + spares) of its goodput)."]
    return "\n".join(lines) + "\n"


def write(out: Path) -> Path:
    folder = out / "goodput"
    folder.mkdir(parents=True, exist_ok=True)
    table = rows()
    with open(folder / "goodput_llama3.csv", "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=COLUMNS)
        w.writeheader()
        for r in table:
            w.writerow({k: (f"{v:.6g}" if isinstance(v, float) else
                            ("" if v is None else v)) for k, v in r.items()})
    (folder / "goodput_llama3.md").write_text(markdown(table))
    return folder


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(Path(__file__).resolve().parent),
                   help="the results folder (default: this one)")
    args = p.parse_args(argv)
    folder = write(Path(args.out))
    print(f"wrote {folder / 'goodput_llama3.md'} and {folder / 'goodput_llama3.csv'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
