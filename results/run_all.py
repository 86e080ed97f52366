"""Regenerate every experiment under results/ and results/README.md: ``make results``.

    python results/run_all.py [--out results] [--quick] [--only NAME ...]
    python results/run_all.py --refresh NAME ...     (tables, figures, findings; no training)

Each experiment is ``results/experiments/<name>.py`` (runnable alone, with options for a bigger
budget on a cluster); this driver calls its ``run(out, quick, log)`` in the order of
EXPERIMENTS, each into ``OUT/<name>/``, keeps going when one fails (and then exits 1), and writes
``OUT/summary.json`` (machine, durations, findings) and ``OUT/README.md``: per experiment its
command, duration, tables, figures, the findings it computed from its numbers, and the reading in
``results/readings/<name>.md`` (written by people, for the committed run).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE / "experiments"))

#: (name, what a quiet 2-core machine needs in full mode, in minutes), in the order they run.
EXPERIMENTS = [
    ("methods", 7),
    ("topologies", 3),
    ("local_steps", 1),
    ("network", 3),
    ("stragglers", 1),
    ("lm", 20),
    # the language model at rho ~1, 30, 300 (100 Mbit/s, 4 Mbit/s, 400 kbit/s): 9 methods, one
    # seed; what would hold a slow link too long runs 2 rounds and is predicted
    ("lm_links", 40),
]

INTRO = """\
# results/

What the package's methods do on real runs: every table and figure here, `summary.json` and
this file were written by

    make results            # = python results/run_all.py --out results   (about {minutes} min)

on the machine below; the readings come from `readings/<name>.md` (written by people for this
run; `python results/run_all.py --readme-only` puts them in after editing). Each experiment can be rerun alone, with a bigger budget on a cluster:
`python results/experiments/<name>.py --out results/<name> --help` lists its options. Raw runs
(one HDF5 file per rank) go to `runs/results/<name>/` and are not kept in git; the CSV tables
and PNG figures are. `make bench` writes `results/benchmarks/` (speed ratios; per machine, not
kept in git; see benchmarks/README.md).

The failure planner's table, [`goodput/goodput_llama3.md`](goodput/goodput_llama3.md) (and `.csv`),
is written by `python results/goodput.py` (no training, seconds): predicted goodput of abort +
requeue, shrink and heal from 64 to 16,384 GPUs at the Llama 3 failure rate, with the policy to
choose at each size and its assumptions (the model of `python -m lsgd_hpc.plan --mtbf-hours`,
docs/planning.md).

Training time everywhere is the trainer's `training_time`: wall time less evaluation,
consensus probes, checkpoints and metric flushes (docs/metrics.md). Ranks of one "node" are
emulated with `--ranks-per-node` except in the network experiment, which runs on emulated nodes
(network namespaces with rate-limited links, scripts/cluster.sh).
"""


def machine() -> dict:
    """What the experiments ran on: benchmarks/run_all.py's machine_info, loaded apart so that
    its module state (sys.path, benchmarks' modules) does not leak into the experiments'."""
    import importlib.util
    path, modules = list(sys.path), set(sys.modules)
    try:
        spec = importlib.util.spec_from_file_location("_bench_run_all",
                                                      REPO / "benchmarks" / "run_all.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod              # dataclasses look their module up
        spec.loader.exec_module(mod)
        info = mod.machine_info(16)
    finally:
        sys.path[:] = path
        for name in set(sys.modules) - modules:
            del sys.modules[name]
    info.pop("max_ranks", None)
    return info


def load_experiment(name: str):
    """results/experiments/<name>.py as a module of its own name (results_experiment_<name>):
    imported by path, so that a module of the same bare name elsewhere on sys.path (benchmarks/
    has a stragglers.py too, and experiments put benchmarks/ on the path) is never taken."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(f"results_experiment_{name}",
                                                  HERE / "experiments" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def headline_section(out: Path) -> list:
    """results/headline.py's tables (and OUT/headline.csv), from the experiments' CSV files;
    loaded by path, like the experiments."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("results_headline", HERE / "headline.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.headline(out)


def _section(name: str, res: dict, out: Path) -> list:
    lines = [f"## {res.get('title', name)}", ""]
    lines += [f"`python results/experiments/{name}.py --out results/{name}"
              f"{' --quick' if res.get('quick') else ''}` - {res.get('seconds', 0) / 60:.1f} min"
              f" in this run; status: {res.get('status', 'ok')}.", ""]
    reading = HERE / "readings" / f"{name}.md"
    if reading.exists():
        lines += ["### Reading", "", reading.read_text().strip(), ""]
    if res.get("findings"):
        lines += ["### Findings (computed from this run's numbers)", ""]
        lines += [f"- {f}" for f in res["findings"]] + [""]
    if res.get("tables"):
        lines += ["Tables: " + ", ".join(f"[`{t}`]({name}/{t})" for t in res["tables"]), ""]
    for fig in res.get("figures", []):
        lines += [f"![{name}: {fig}]({name}/{fig})", ""]
    return lines


def readme(doc: dict) -> str:
    m = doc["machine"]
    # the whole of make results: every experiment's own minutes (some may be from an earlier run)
    total_s = sum(float(r.get("seconds", 0.0)) for r in doc["experiments"].values())
    kept: dict = {}                   # (started, git) of an earlier run -> its experiments
    for n, r in doc["experiments"].items():
        if n not in doc.get("rerun", doc["experiments"]):
            kept.setdefault((r.get("run_started", "?"), r.get("git_sha", "?")), []).append(n)
    lines = [INTRO.format(minutes=round(total_s / 60)),
             f"This run: `{doc['command']}`, started {doc['started']}, "
             f"{doc['runtime_s'] / 60:.1f} min{' (quick mode: small budgets, not for reading)' if doc['quick'] else ''}; "
             f"git {m.get('git_sha', '')[:10]}."
             + (f" It reran {', '.join(doc['rerun'])} only; the others keep their results, "
                "machine and load from earlier runs: " + "; ".join(
                    f"{', '.join(ns)} from the run started {st} (git {sha[:10]})"
                    for (st, sha), ns in kept.items()) + "." if kept else ""), "",
             f"Machine: {m['hostname']}, {m['nproc']} CPUs ({m['usable_cpus']} usable), "
             f"{m['platform']}; {m['mpi_library']}; torch {m['torch']}, mpi4py {m['mpi4py']}; "
             f"OMP_NUM_THREADS=1 per rank, `--oversubscribe` (up to 16 ranks on these cores); "
             f"load average at start {m['loadavg_start'][0]:.1f}, at end "
             f"{m.get('loadavg_end', [float('nan')])[0]:.1f}.", ""]
    lines += ["| experiment | minutes | status |", "|---|---|---|"]
    for name, res in doc["experiments"].items():
        lines.append(f"| [{res.get('title', name)}](#{name}) | {res.get('seconds', 0) / 60:.1f} | "
                     f"{res.get('status', 'ok')} |")
    lines.append("")
    lines += headline_section(Path(doc["out"]))
    for name, res in doc["experiments"].items():
        lines += [f'<a id="{name}"></a>', ""] + _section(name, res, Path(doc["out"]))
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(HERE), help="output folder (default: results/)")
    p.add_argument("--quick", action="store_true",
                   help="every experiment in its quick form (minutes; checks that it runs)")
    names = [n for n, _ in EXPERIMENTS]
    p.add_argument("--only", nargs="*", metavar="NAME", choices=names,
                   help=f"run only these ({', '.join(names)}); README keeps the others' last "
                        "results from OUT/summary.json")
    p.add_argument("--readme-only", action="store_true",
                   help="rewrite OUT/README.md from OUT/summary.json and results/readings/ "
                        "(after editing a reading), running nothing")
    p.add_argument("--refresh", nargs="+", metavar="NAME", choices=names,
                   help="recompute these experiments' tables, figures and findings from the "
                        "raw numbers they stored (their refresh()), training nothing; then "
                        "rewrite OUT/summary.json and OUT/README.md")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.refresh:
        doc = json.loads((out / "summary.json").read_text())
        for name in args.refresh:
            mod = load_experiment(name)
            if not hasattr(mod, "refresh"):
                p.error(f"--refresh: {name} stores no raw numbers to recompute from")
            doc["experiments"][name].update(mod.refresh(out / name))
            print(f"refreshed {name} from {out / name}")
        (out / "summary.json").write_text(json.dumps(doc, indent=1, default=float))
        (out / "README.md").write_text(readme(doc))
        print(f"wrote {out}/summary.json and {out}/README.md")
        return 0
    if args.readme_only:
        doc = json.loads((out / "summary.json").read_text())
        (out / "README.md").write_text(readme(doc))
        print(f"wrote {out}/README.md")
        return 0
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    todo = [n for n in names if not args.only or n in args.only]
    previous = {}
    if args.only and (out / "summary.json").exists():
        before = json.loads((out / "summary.json").read_text())
        previous = before.get("experiments", {})
        for r in previous.values():    # where each kept result comes from (older files: the run)
            r.setdefault("run_started", before.get("started", "?"))
            r.setdefault("git_sha", before.get("machine", {}).get("git_sha", "?"))
    started = dt.datetime.now().astimezone().isoformat(timespec="seconds")
    t_start = time.perf_counter()
    info = machine()
    results, failed = {}, []
    for name in names:
        if name not in todo:
            if name in previous:
                results[name] = previous[name]
            continue
        print(f"- {name} ...", flush=True)
        t0 = time.perf_counter()
        try:
            mod = load_experiment(name)
            res = mod.run(out / name, quick=args.quick, log=lambda m: print(f"  {m}", flush=True))
            res.setdefault("status", "ok")
        except Exception as exc:              # one broken experiment must not lose the others
            traceback.print_exc()
            res = {"name": name, "status": f"failed: {type(exc).__name__}: {exc}"[:300]}
            failed.append(name)
        res["seconds"] = time.perf_counter() - t0
        res["quick"] = args.quick
        res["run_started"], res["git_sha"] = started, info.get("git_sha", "?")
        results[name] = res
        print(f"  {name}: {res['status']} in {res['seconds'] / 60:.1f} min", flush=True)
    info["loadavg_end"] = list(os.getloadavg())
    doc = {"command": " ".join(["python", "results/run_all.py", *(argv or sys.argv[1:])]),
           "started": started, "quick": args.quick, "runtime_s": time.perf_counter() - t_start,
           "machine": info, "out": str(out), "experiments": results}
    if args.only:
        doc["rerun"] = todo
    (out / "summary.json").write_text(json.dumps(doc, indent=1, default=float))
    (out / "README.md").write_text(readme(doc))
    print(f"{len(todo)} experiments in {doc['runtime_s'] / 60:.1f} min; wrote {out}/README.md"
          + (f"; FAILED: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
