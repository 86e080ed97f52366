"""The headline table of results/: task x method, quality, time to target and bytes, and LSGD's
ratios to the best tuned baseline, computed from the experiments' CSV tables.

    python results/headline.py [--out results]

``results/run_all.py`` calls :func:`headline` after the experiments (and on ``--readme-only``),
writes ``OUT/headline.csv`` and puts the two tables at the top of ``OUT/README.md``. Sources:
``methods/methods_summary.csv`` (digits and noisy digits, tuned, 3 seeds: test accuracy of the
reported model), ``network/time_to_accuracy.csv`` (emulated 1 and 10 Gbit/s links: time to the
target test accuracy) and ``lm/lm_summary.csv`` (the character language model: held-out
perplexity). An experiment whose table is missing is left out.
"""

from __future__ import annotations

import argparse
import csv
import math
import sys
from pathlib import Path
from typing import List, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from _common import fmt_bytes  # noqa: E402  (the benchmarks' and experiments' byte format)

COLUMNS = ["task", "method", "family", "quality", "quality_of", "quality_std",
           "training_time_s", "time_to_target_s", "bytes_sent", "source", "rho"]


def _f(x) -> Optional[float]:
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(v) else v


def _read(path: Path) -> List[dict]:
    if not path.exists():
        return []
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


def _family(method: str) -> str:
    return "LSGD" if "lsgd" in method.lower() else "baseline"


def methods_rows(out: Path) -> List[dict]:
    rows = []
    for s in _read(out / "methods" / "methods_summary.csv"):
        task = {"digits": "digits", "noisy": "noisy digits (40 % labels wrong)"}.get(
            s["task"], s["task"])
        everyone = s.get("reached_target", "0/1").split("/")
        rows.append({"task": f"{task}, {s['ranks']} ranks", "method": s["method"],
                     "family": _family(s["method"]),
                     "quality": _f(s["final_acc_leader_mean"]), "quality_of": "test accuracy",
                     "quality_std": _f(s["final_acc_leader_std"]),
                     "training_time_s": _f(s["training_time_s_mean"]),
                     # to the target only when every seed got there
                     "time_to_target_s": (_f(s["time_to_target_s_mean"])
                                          if everyone[0] == everyone[-1] else None),
                     "bytes_sent": _f(s["bytes_sent_mean"]), "source": "methods",
                     "rho": None})
    return rows


def network_rows(out: Path) -> List[dict]:
    rows = []
    for s in _read(out / "network" / "time_to_accuracy.csv"):
        steps, per_step = _f(s.get("steps_to_target")), _f(s.get("bytes_sent_per_step"))
        reached = s.get("reached", "") == s.get("seeds", "?")
        rows.append({"task": f"digits MLP, 2 emulated nodes at {s['rate']}",
                     "method": s["method"], "family": _family(s["method"]),
                     "quality": _f(s.get("final_accuracy")), "quality_of": "test accuracy",
                     "quality_std": None, "training_time_s": None,
                     "time_to_target_s": _f(s.get("time_to_target_s")) if reached else None,
                     "bytes_sent": (steps * per_step if reached and steps is not None
                                    and per_step is not None else None),
                     "source": "network", "rho": _f(s.get("rho"))})
    return rows


def lm_rows(out: Path) -> List[dict]:
    rows = []
    for s in _read(out / "lm" / "lm_summary.csv"):
        ppl = _f(s.get("final_perplexity", s.get("perplexity_mean")))
        rows.append({"task": f"character LM, {s['ranks']} ranks", "method": s["method"],
                     "family": _family(s["method"]), "quality": ppl,
                     "quality_of": "held-out perplexity",
                     "quality_std": _f(s.get("perplexity_std")),
                     "training_time_s": _f(s.get("training_time_s_mean",
                                                 s.get("training_time_s"))),
                     "time_to_target_s": _f(s.get("time_to_target_s_mean",
                                                  s.get("time_to_target_s"))),
                     "bytes_sent": _f(s.get("bytes_sent_mean", s.get("bytes_sent"))),
                     "source": "lm", "rho": _f(s.get("rho"))})
    return rows


def collect(out: Path) -> List[dict]:
    return methods_rows(out) + network_rows(out) + lm_rows(out)


def _better(row: dict, other: dict) -> bool:
    """Is ``row``'s quality better than ``other``'s (higher accuracy, lower perplexity)?"""
    if other is None or other["quality"] is None:
        return row["quality"] is not None
    if row["quality"] is None:
        return False
    lower = row["quality_of"].endswith("perplexity")
    return row["quality"] < other["quality"] if lower else row["quality"] > other["quality"]


def ratios(rows: List[dict]) -> List[dict]:
    """Per task and LSGD method: against the best baseline by quality (the best tuned
    baseline), the quality difference and the time-to-target and bytes ratios; and the
    fastest baseline to the target."""
    out = []
    for task in dict.fromkeys(r["task"] for r in rows):
        mine = [r for r in rows if r["task"] == task]
        base = [r for r in mine if r["family"] == "baseline"]
        best = None
        for r in base:
            if _better(r, best):
                best = r
        timed = [r for r in base if r["time_to_target_s"] is not None]
        fastest = min(timed, key=lambda r: r["time_to_target_s"]) if timed else None
        for r in mine:
            if r["family"] != "LSGD" or best is None:
                continue
            diff = (None if r["quality"] is None or best["quality"] is None
                    else r["quality"] - best["quality"])

            def ratio(a, b):
                return None if a is None or not b else a / b
            ar = next((x for x in mine if x["method"] in ("allreduce", "allreduce SGD")), None)
            out.append({"task": task, "method": r["method"], "best_baseline": best["method"],
                        "rho": ar.get("rho") if ar else None,
                        "quality_of": r["quality_of"], "quality": r["quality"],
                        "best_quality": best["quality"], "quality_diff": diff,
                        "fastest_baseline": fastest["method"] if fastest else None,
                        "time_to_target_ratio": ratio(r["time_to_target_s"],
                                                      fastest["time_to_target_s"] if fastest
                                                      else None),
                        "bytes_ratio": ratio(r["bytes_sent"], best["bytes_sent"])})
    return out


def _q(r: dict, value=None) -> str:
    v = r["quality"] if value is None else value
    if v is None:
        return "n/a"
    if r["quality_of"].endswith("perplexity"):
        return f"{v:.2f}" + (f" ± {r['quality_std']:.2f}" if r.get("quality_std") else "")
    return f"{100 * v:.1f} %" + (f" ± {100 * r['quality_std']:.1f}" if r.get("quality_std")
                                 else "")


def _b(x) -> str:
    return "n/a" if x is None else fmt_bytes(x)


def _t(x) -> str:
    return "n/a" if x is None else f"{x:.2f}"


def markdown(rows: List[dict]) -> List[str]:
    if not rows:
        return []
    lines = ["## Headline", "",
             "Every method with the setting its tuning chose (methods, and the language model "
             "where it tuned; the network experiment runs each method's defaults). Quality: "
             "test accuracy of the model each method reports (LSGD: the elected leader, EASGD: "
             "the centre, else rank 0), mean ± standard deviation over seeds, or held-out "
             "perplexity (lower is better). Time to target: training time until the reported "
             "model first reached the experiment's target (n/a: not in every seed). Bytes: sent "
             "by all ranks together over the run (network: up to the target). Computed by "
             "`results/headline.py` from the tables below (headline.csv).", "",
             "| task | method | quality | training time (s) | time to target (s) | bytes sent |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        name = f"**{r['method']}**" if r["family"] == "LSGD" else r["method"]
        lines.append(f"| {r['task']} | {name} | {_q(r)} | {_t(r['training_time_s'])} | "
                     f"{_t(r['time_to_target_s'])} | {_b(r['bytes_sent'])} |")
    rat = ratios(rows)
    if rat:
        lines += ["", "LSGD against the best tuned baseline of each task (best quality; for "
                  "time to target, the fastest baseline to the target); rho: one fp32 "
                  "allreduce of the model between the nodes over one compute step, allreduce "
                  "SGD's in that task (predicted from the probed link; n/a: one host, no "
                  "link; docs/planning.md):", "",
                  "| task | rho | LSGD method | best baseline | quality: LSGD vs baseline | "
                  "time to target, x fastest baseline | bytes, x best baseline |",
                  "|---|---|---|---|---|---|---|"]
        for r in rat:
            ref = {"quality_of": r["quality_of"], "quality": r["best_quality"]}
            diff = r["quality_diff"]
            d = ("n/a" if diff is None else f"{diff:+.2f}" if r["quality_of"].endswith(
                "perplexity") else f"{100 * diff:+.1f} points")
            tt = ("n/a" if r["time_to_target_ratio"] is None else
                  f"x{r['time_to_target_ratio']:.2f} ({r['fastest_baseline']})")
            rho = "n/a" if r["rho"] is None else f"{r['rho']:.3g}"
            lines.append(f"| {r['task']} | {rho} | {r['method']} | {r['best_baseline']} | "
                         f"{_q(r)} vs {_q(ref)} ({d}) | {tt} | "
                         + ("n/a" if r["bytes_ratio"] is None else f"x{r['bytes_ratio']:.2f}")
                         + " |")
    return lines + [""]


def headline(out: Path) -> List[str]:
    """Write OUT/headline.csv and return the README section (empty without any source)."""
    rows = collect(Path(out))
    if rows:
        with open(Path(out) / "headline.csv", "w", newline="") as fh:
            w = csv.DictWriter(fh, fieldnames=COLUMNS)
            w.writeheader()
            for r in rows:
                w.writerow({k: "" if r[k] is None else r[k] for k in COLUMNS})
    return markdown(rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(Path(__file__).resolve().parent))
    args = p.parse_args(argv)
    print("\n".join(headline(Path(args.out))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
