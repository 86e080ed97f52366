"""Run every benchmark under mpirun (each under a timeout) and write DIR/results.json and DIR/README.md.

    python benchmarks/run_all.py --out results/benchmarks [--quick] [--only NAME ...]

Speed and memory claims of this project are ratios measured side by side in one run, here;
never timed assertions in tests.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import List, Optional

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO))
from _common import write_result  # noqa: E402

from lsgd_hpc.testing import mpi_env, mpirun_cmd, run_group  # noqa: E402


@dataclass
class Bench:
    """One section of results.json (``benchmarks[key]``) and of the table.

    To add a section: write benchmarks/<module>.py and add a Bench here. Either a script
    that ``mpirun -np np`` starts with ``--out FILE [--quick] *args`` and whose rank 0 writes
    a JSON dict to FILE, or (``driver=True``) a module whose ``run(quick=, timeout=, log=,
    **kwargs)`` returns the dict (it starts its own jobs). The dict has ``rows`` (see
    _common.row) and may have ``ratio`` and ``target`` (e.g. ">= 0.95"), which land in
    results.json's ``targets``, ``notes`` (lines under the table) and anything else.
    """

    key: str                      # key in results.json
    module: str                   # benchmarks/<module>.py
    np: int = 4
    timeout: float = 120.0        # seconds for the whole mpirun (per job for drivers)
    args: List[str] = field(default_factory=list)
    driver: bool = False          # runs its own jobs: module.run(quick, timeout, log, **kwargs)
    kwargs: dict = field(default_factory=dict)
    full_only: bool = False       # skipped by --quick
    optional_s: Optional[float] = None   # run only if at least this many seconds remain


#: Table and run order; optional benchmarks (optional_s) run after all others.
BENCHES = [
    Bench("fused_vs_per_tensor", "fused_vs_per_tensor", timeout=120),
    Bench("hierarchical_broadcast", "hierarchical_broadcast", timeout=90,
          args=["--ranks-per-node", "2"]),
    Bench("hierarchical_broadcast_8", "hierarchical_broadcast", np=8, timeout=120,
          args=["--ranks-per-node", "2"], full_only=True, optional_s=60),
    Bench("election", "election", timeout=90),
    # how the ranks' top-k records are combined (allgather vs gather + broadcast vs a dense
    # allreduce), at 2 ranks and at 16 (oversubscribed here)
    Bench("sparse_exchange", "sparse_exchange", np=2, timeout=120),
    Bench("sparse_exchange_16", "sparse_exchange", np=16, timeout=240, full_only=True),
    Bench("workers_bytes", "workers_bytes", timeout=120, args=["--ranks-per-node", "2"]),
    Bench("topology_speed", "topology_speed", np=1, timeout=150),
    Bench("backends", "backends", timeout=150),
    Bench("algorithms_cost", "algorithms_cost", timeout=120, driver=True),
    Bench("collective_efficiency", "collectives", timeout=240),
    Bench("loop_overhead", "loop_overhead", np=1, timeout=240),
    # an asynchronous checkpoint's stall against a synchronous save, mlp_wide (33.7 MB)
    Bench("checkpoint_stall", "checkpoint_stall", np=1, timeout=180),
    # the metrics writer alone: a flush at 1,000,000 rows over one at 10,000 (target <= 2)
    Bench("metrics_flush", "metrics_flush", np=1, timeout=120),
    # drivers of their own mpirun jobs (per-job timeouts); the *_network and cluster ones
    # bring up the emulated cluster (root; skipped with a reason otherwise)
    Bench("peers", "peers", timeout=600, driver=True, kwargs={"key": "peers"}),
    Bench("peers_network", "peers", timeout=600, driver=True,
          kwargs={"network": "1gbit", "key": "peers_network", "rounds": 2}),
    # lsgd_hpc's allreduce SGD on --backend torch against DDP, both on gloo, same cluster
    Bench("torch_vs_ddp", "peers", timeout=600, driver=True,
          kwargs={"network": "1gbit", "key": "torch_vs_ddp", "rounds": 2,
                  "torch_backend": True}),
    Bench("nonblocking_allreduce", "nonblocking_allreduce", timeout=240, driver=True),
    # communication behind compute at 100 Mbit/s: bucketed allreduce, Streaming DiLoCo,
    # LSGD's pull delay, each against itself without the overlap
    Bench("overlap", "overlap", timeout=600, driver=True),
    Bench("overlap_compressed", "overlap_compressed", timeout=600, driver=True),
    # allreduce SGD's gradient in int8 + error feedback and top-k 1 % int2 + error feedback
    # against fp32 (digits, 4 ranks as 2 nodes): bytes per step, steps to 93 %, time priced
    # at 1 Gbit/s between the nodes (one mpirun job; no root needed)
    Bench("compressed_allreduce", "compressed_allreduce", timeout=600, driver=True),
    # one rank lost at 30 % of the budget: shrink vs abort + resume vs no failure (ULFM)
    Bench("goodput_under_failure", "goodput_under_failure", timeout=300, driver=True),
    # --backend torch --on-failure shrink (torchft replica groups, 3 workers, no mpirun):
    # the survivors' stall after a worker is SIGKILLed against torchft's own DDP (target
    # <= 1.0), and the managed groups' steps/s against plain torch.distributed (>= 0.95)
    Bench("torch_ft_recovery", "torch_ft_recovery", np=3, timeout=120, driver=True),
    Bench("torch_ft_overhead", "torch_ft_overhead", np=3, timeout=120, driver=True),
    # 20 seeded failure scenarios at 16 ranks and 20 at 8 (about 30 min here; --quick: 3)
    Bench("ft_soak", "ft_soak", timeout=300, driver=True),
    Bench("time_to_accuracy", "time_to_accuracy", timeout=600, driver=True),
    Bench("scale_model", "scale_model", timeout=300, driver=True),
    # its own mpirun jobs at 4 ranks, unslowed then slowed (8 ranks: benchmarks/stragglers.py
    # --np 4 8, about 5 more minutes here; make results has the straggler experiment)
    Bench("stragglers", "stragglers", timeout=600, driver=True, kwargs={"nps": (4,)}),
]
#: Wall-clock targets of the whole run (seconds); optional benchmarks are dropped past them.
BUDGET_S = {"full": 1100.0, "quick": 500.0}


def _version(pkg: str) -> str:
    try:
        return metadata.version(pkg)
    except metadata.PackageNotFoundError:
        return "not installed"


def machine_info(max_np: int) -> dict:
    """What the figures were measured on."""
    env = mpi_env()
    try:
        out = subprocess.run([sys.executable, "-c", "from mpi4py import MPI; "
                              "print(MPI.Get_library_version().replace(chr(0), '').splitlines()[0].strip())"],
                             env=env, capture_output=True, text=True, timeout=60)
        mpi_lib = out.stdout.strip() or out.stderr.strip()[-200:]
    except (OSError, subprocess.SubprocessError) as exc:
        mpi_lib = f"unknown ({exc})"
    try:
        sha = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True,
                             text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        sha = ""
    nproc = os.cpu_count() or 1
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else nproc
    return {
        "hostname": socket.gethostname(), "nproc": nproc, "usable_cpus": usable,
        "platform": platform.platform(), "python": platform.python_version(),
        "mpi_library": mpi_lib, "mpi4py": _version("mpi4py"), "torch": _version("torch"),
        "horovod": _version("horovod"), "numpy": _version("numpy"),
        "max_ranks": max_np, "oversubscribed": max_np > usable,
        "mpirun_flags": "--oversubscribe --bind-to none", "omp_num_threads": 1,
        "loadavg_start": list(os.getloadavg()), "git_sha": sha,
    }


def _fail(bench: Bench, status: str) -> dict:
    label = bench.key if bench.np == 4 else f"{bench.key} ({bench.np} ranks)"
    return {"name": bench.module, "status": status,
            "rows": [{"label": label, "compared": "", "figures": status, "ratio": None,
                      "ratio_label": "", "data": {}}]}


def run_bench(bench: Bench, out_dir: Path, quick: bool) -> dict:
    raw = out_dir / "raw" / f"{bench.key}.json"
    raw.parent.mkdir(parents=True, exist_ok=True)
    if raw.exists():
        raw.unlink()
    if bench.driver:
        import importlib
        mod = importlib.import_module(bench.module)
        result = mod.run(quick=quick, timeout=bench.timeout,
                         log=lambda m: print(m, flush=True), **bench.kwargs)
        write_result(str(raw), result)
        return result
    cmd = mpirun_cmd(bench.np, [sys.executable, str(HERE / f"{bench.module}.py"),
                                "--out", str(raw), *bench.args, *(["--quick"] if quick else [])])
    p = run_group(cmd, env=mpi_env(), cwd=REPO, timeout=bench.timeout)
    if p.returncode is None:
        return _fail(bench, f"timed out after {bench.timeout:.0f} s")
    if p.returncode != 0 or not raw.exists():
        tail = (p.stderr or p.stdout or "").strip().splitlines()[-3:]
        return _fail(bench, f"failed (exit {p.returncode}): {' / '.join(tail)[-300:]}")
    with open(raw) as fh:
        return json.load(fh)


def target_met(ratio, target: str) -> Optional[bool]:
    """Whether ``ratio`` meets ``target`` (">= 0.95", "<= 1.03"); None when either is missing."""
    try:
        op, value = target.split()
        value = float(value)
    except (AttributeError, ValueError):
        return None
    if ratio is None or ratio != ratio:
        return None
    return {">=": ratio >= value, "<=": ratio <= value, ">": ratio > value,
            "<": ratio < value}.get(op)


def targets(results: dict) -> dict:
    """key -> {ratio, target, met} for every section that states a target."""
    out = {}
    for b in BENCHES:
        res = results.get(b.key)
        # a target is a comparison (">= 0.95"); some sections' "target" is an accuracy
        if res and isinstance(res.get("target"), str):
            out[b.key] = {"ratio": res.get("ratio"), "target": res["target"],
                          "met": target_met(res.get("ratio"), res["target"])}
            # loop_overhead also measures the library loop in the same rounds
            if res.get("library_ratio") is not None:
                out["library_overhead"] = {
                    "ratio": res["library_ratio"], "target": res["target"],
                    "met": target_met(res["library_ratio"], res["target"])}
        # goodput_under_failure: its recovery seconds have a target of their own
        for key, extra in ((res or {}).get("extra_targets") or {}).items():
            out[key] = {"ratio": extra["value"], "target": extra["target"],
                        "met": target_met(extra["value"], extra["target"])}
    return out


def _cell(text) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _ratio(r: dict) -> str:
    if r.get("ratio") is None:
        return "-"
    v = r["ratio"]
    num = f"{v:.3g}" if v < 10 else f"{v:.1f}"
    return f"**{num}x** ({r['ratio_label']})"


def table(results: dict) -> str:
    lines = ["| benchmark | what is compared | figures | ratio |", "|---|---|---|---|"]
    for b in BENCHES:
        res = results.get(b.key)
        if res is None:
            continue
        for r in res["rows"]:
            lines.append(f"| {_cell(r['label'])} | {_cell(r['compared'])} | "
                         f"{_cell(r['figures'])} | {_cell(_ratio(r))} |")
    return "\n".join(lines)


def targets_table(tg: dict) -> str:
    lines = ["| key | ratio | target | met |", "|---|---|---|---|"]
    for key, t in tg.items():
        r = "-" if t["ratio"] is None else f"{t['ratio']:.3f}"
        met = {True: "yes", False: "**no**", None: "-"}[t["met"]]
        lines.append(f"| {key} | {r} | {t['target']} | {met} |")
    return "\n".join(lines)


def key_list(results: dict) -> str:
    """One line per key of results.json's ``benchmarks``: what it measures."""
    lines = []
    for b in BENCHES:
        res = results.get(b.key)
        if res is None:
            continue
        doc = (res.get("doc") or "").strip().splitlines()
        lines.append(f"- `{b.key}` ({b.module}.py, {b.np} ranks): "
                     f"{doc[0] if doc else res.get('name', '')}")
    return "\n".join(lines)


def readme(doc: dict) -> str:
    m = doc["machine"]
    notes = []
    for b in BENCHES:
        res = doc["benchmarks"].get(b.key)
        if res is None:
            continue
        for n in res.get("notes", []):
            line = f"- {res.get('name', b.key)}: {n}"
            if line not in notes:
                notes.append(line)
    return "\n".join([
        "# Benchmarks", "",
        f"`{doc['command']}` on {doc['started']} ({'quick' if doc['quick'] else 'full'} run, "
        f"{doc['runtime_s']:.0f} s).", "",
        f"Machine: {m['hostname']}, {m['nproc']} CPUs ({m['usable_cpus']} usable), "
        f"{m['mpi_library']}, torch {m['torch']}, mpi4py {m['mpi4py']}, horovod {m['horovod']}; "
        f"up to {m['max_ranks']} ranks, {'over' if m['oversubscribed'] else 'not over'}subscribed "
        f"(`{m['mpirun_flags']}`, OMP_NUM_THREADS=1); load average at start "
        f"{m['loadavg_start'][0]:.1f}, at end {m['loadavg_end'][0]:.1f}.", "",
        "Every ratio is measured side by side in this one run: the compared variants alternate "
        "repetition by repetition (order rotated), each timing starts after a barrier, a sample "
        "is the slowest rank's time, and the figure is the median over samples. Each ratio "
        "says in its own words which way it goes (its label). The older collective benchmarks "
        "run with the agreement check of lsgd_hpc.comm off (LSGD_HPC_COMM_VALIDATE=0), so that "
        "the collectives themselves are compared; collective_efficiency keeps it on (the "
        "default users get) and reports both. Raw samples and quartiles: results.json.", "",
        table(doc["benchmarks"]), "",
        *(["Targets:", "", targets_table(doc["targets"]), ""] if doc["targets"] else []),
        *(["Notes:", "", *notes, ""] if notes else []),
        "Keys of results.json `benchmarks` (each holds `rows`, the raw figures and `doc`):", "",
        key_list(doc["benchmarks"]), "",
    ])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="output folder (results.json, README.md)")
    p.add_argument("--quick", action="store_true", help="fewer repetitions; about 2 minutes")
    p.add_argument("--only", nargs="*", metavar="NAME",
                   help=f"run only these ({', '.join(b.key for b in BENCHES)})")
    args = p.parse_args(argv)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    started = dt.datetime.now().astimezone().isoformat(timespec="seconds")
    mode = "quick" if args.quick else "full"
    by_key = {b.key: b for b in BENCHES}
    todo = [b for b in BENCHES if not (args.quick and b.full_only)]
    todo.sort(key=lambda b: b.optional_s is not None)           # optional ones last (stable)
    if args.only:
        unknown = set(args.only) - set(by_key)
        if unknown:
            p.error(f"unknown benchmark(s): {', '.join(sorted(unknown))}")
        todo = [b for b in todo if b.key in args.only]
    machine = machine_info(max(b.np for b in todo) if todo else 4)
    print(f"benchmarks ({mode}): {', '.join(b.key for b in todo)}", flush=True)
    results = {}
    for b in todo:
        elapsed = time.perf_counter() - t_start
        if b.optional_s is not None and BUDGET_S[mode] - elapsed < b.optional_s:
            results[b.key] = _fail(b, f"skipped: {elapsed:.0f} s gone of a {BUDGET_S[mode]:.0f} s "
                                      "budget")
            print(f"- {b.key}: skipped (time budget)", flush=True)
            continue
        t0 = time.perf_counter()
        print(f"- {b.key} ({b.np} ranks) ...", flush=True)
        try:
            results[b.key] = run_bench(b, out_dir, args.quick)
        except Exception as exc:              # one broken benchmark must not lose the others
            results[b.key] = _fail(b, f"error: {type(exc).__name__}: {exc}")
        results[b.key]["seconds_to_run"] = time.perf_counter() - t0
        print(f"  done in {time.perf_counter() - t0:.0f} s", flush=True)
    machine["loadavg_end"] = list(os.getloadavg())
    doc = {
        "command": " ".join(["python", "benchmarks/run_all.py", *(argv or sys.argv[1:])]),
        "started": started,
        "quick": args.quick, "runtime_s": time.perf_counter() - t_start,
        "machine": machine, "benchmarks": results, "targets": targets(results),
        "table": [r for b in BENCHES if b.key in results for r in results[b.key]["rows"]],
    }
    write_result(str(out_dir / "results.json"), doc)
    (out_dir / "README.md").write_text(readme(doc))
    print()
    print(table(results))
    if doc["targets"]:
        print()
        print(targets_table(doc["targets"]))
    print(f"\n{len(todo)} benchmarks in {doc['runtime_s']:.0f} s; wrote {out_dir}/results.json "
          f"and {out_dir}/README.md")
    failed = [k for k, r in results.items() if r.get("status", "").startswith(("failed", "timed",
                                                                                "error"))]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
