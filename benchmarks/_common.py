"""Shared pieces of the benchmarks: argument parsing, interleaved timing with medians, result files."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

#: Benchmarks time the collectives themselves: the agreement check that precedes every
#: collective of lsgd_hpc.comm (a 48-byte allreduce) is switched off unless asked for.
VALIDATE_ENV = "LSGD_HPC_COMM_VALIDATE"


def parse_args(description: str, argv=None, device: bool = False) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--out", required=True, help="JSON file that rank 0 writes")
    p.add_argument("--quick", action="store_true", help="fewer repetitions")
    if device:
        p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                       help="where the buffers live (cuda: the GPU of the node-local rank; "
                            "the MPI must be CUDA-aware); default: cpu")
    return p.parse_args(argv)


def median(xs) -> float:
    return float(statistics.median(xs)) if len(xs) else float("nan")


def interleaved(comm, methods: Dict[str, Callable[[], None]], reps: int, warmup: int = 3,
                inner: int = 1, budget_s: Optional[float] = None) -> Dict[str, List[float]]:
    """Time each method ``reps`` times, alternating methods (order rotated each repetition)
    so that a slow spell of the shared machine hits all of them alike.

    ``comm`` is an mpi4py communicator. Every timing starts after a barrier; one sample is
    the slowest rank's seconds for ``inner`` back-to-back calls, divided by ``inner``.
    With ``budget_s``, rank 0 stops the loop early (same decision on every rank) once that
    many seconds have gone, keeping at least 5 repetitions. Returns name -> samples (on
    rank 0; other ranks get an empty dict).
    """
    names = list(methods)
    for _ in range(warmup):
        for n in names:
            methods[n]()
    comm.Barrier()
    mine: Dict[str, List[float]] = {n: [] for n in names}
    t_start = time.perf_counter()
    for r in range(reps):
        order = names[r % len(names):] + names[:r % len(names)]
        for n in order:
            comm.Barrier()
            t0 = time.perf_counter()
            for _ in range(inner):
                methods[n]()
            mine[n].append((time.perf_counter() - t0) / inner)
        if budget_s is not None and r + 1 >= 5:
            stop = comm.bcast(time.perf_counter() - t_start > budget_s, root=0)
            if stop:
                break
    everyone = comm.gather(mine, root=0)
    if comm.Get_rank() != 0:
        return {}
    return {n: [max(rank[n][i] for rank in everyone) for i in range(len(mine[n]))]
            for n in names}


def spread(samples: List[float]) -> Dict[str, float]:
    """Median and quartiles of a list of samples (seconds)."""
    if not samples:
        return {"median": float("nan"), "q1": float("nan"), "q3": float("nan"), "n": 0}
    qs = statistics.quantiles(samples, n=4) if len(samples) >= 2 else [samples[0]] * 3
    return {"median": median(samples), "q1": float(qs[0]), "q3": float(qs[2]),
            "n": len(samples)}


def fmt_s(seconds: float) -> str:
    """Seconds in a readable unit."""
    if seconds != seconds:
        return "n/a"
    if seconds < 1e-3:
        return f"{seconds * 1e6:.0f} us"
    if seconds < 1:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds:.2f} s"


def fmt_bytes(n: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def write_result(path: str, result: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        json.dump(result, fh, indent=2, sort_keys=True, default=str)
    os.replace(tmp, path)


def driver_main(run: Callable[[bool], dict], description: str, argv=None) -> int:
    """``main()`` of a benchmark that starts its own jobs (run_all's ``driver=True``):
    ``--out FILE [--quick]``, ``run(quick)`` written to FILE, one line per row printed; exit 1
    when the result lists errors."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--out", required=True, help="JSON file to write")
    p.add_argument("--quick", action="store_true", help="a smaller budget")
    args = p.parse_args(argv)
    result = run(args.quick)
    write_result(args.out, result)
    for r in result["rows"]:
        print(f"{r['label']}: {r['figures']}  ratio {r['ratio']}")
    return 0 if not result.get("errors") else 1


def failed(base: dict, key: str, why: str) -> dict:
    """A benchmark's result when it could not measure: its status and one row saying why."""
    return {**base, "status": f"failed: {why}", "rows": [row(key, "", f"failed: {why}", None, "")]}


def cluster_job(script: str, key: str, base: dict, cluster: Dict[str, str], rate: str,
                quick: bool, timeout: float, log=print, worker_args: Tuple[str, ...] = ()
                ) -> Tuple[dict, Optional[dict]]:
    """Run ``script --worker`` on 2 emulated nodes x 2 ranks joined at ``rate`` (the cluster
    ``cluster["name"]`` on ``cluster["subnet"]``, brought up and down here). Returns (the
    worker's JSON result, None), or ({}, the benchmark's result) when the cluster is missing
    (skipped) or the job failed, timed out or found the wrong layout (failed)."""
    from _cluster import NODES, NP, cluster_available, emulated_cluster
    from lsgd_hpc.testing import mpi_env, mpirun_path, run_group

    why_not = cluster_available()
    if why_not:
        return {}, {**base, "status": f"skipped: {why_not}",
                    "rows": [row(key, "", f"skipped: {why_not}", None, "")]}
    with tempfile.TemporaryDirectory(prefix=f"lsgd_bench_{key}_") as tmp:
        out = Path(tmp) / "out.json"
        with emulated_cluster(rate, log, cluster["name"], cluster["subnet"]) as margs:
            cmd = [mpirun_path(), *margs, "-x", "PYTHONPATH", "-x", "OMP_NUM_THREADS",
                   "-x", "PATH", "-np", str(NP), sys.executable, script, "--worker",
                   "--out", str(out), "--nodes", str(NODES), "--rate", rate,
                   *worker_args, *(["--quick"] if quick else [])]
            env = mpi_env({})
            env.pop("LSGD_HPC_RANKS_PER_NODE", None)
            p = run_group(cmd, env=env, cwd=str(Path(script).resolve().parents[1]),
                          timeout=timeout)
        res = json.loads(out.read_text()) if out.exists() else {}
    if res.get("layout_error"):
        return {}, failed(base, key, f"layout check: {res['layout_error']}")
    if p.returncode != 0 or not res:
        why = "timed out" if p.returncode is None else f"exit {p.returncode}"
        return {}, failed(base, key, f"{why}: {(p.stderr or p.stdout or '').strip()[-400:]}")
    return res, None


def cluster_bench_main(description: str, run: Callable[[bool], dict],
                       worker: Callable[..., int], rate: Optional[str], argv=None) -> int:
    """``main()`` of a benchmark run by :func:`cluster_job`: ``--out FILE [--quick]`` runs it
    and writes the result; ``--worker`` (the ranks) runs ``worker(out, quick, nodes, rate)``."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--out", required=True)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--nodes", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--rate", default=rate, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return worker(args.out, args.quick, args.nodes, args.rate)
    res = run(args.quick)
    write_result(args.out, res)
    for r in res["rows"]:
        print(r["label"], "|", r["figures"], "|", r["ratio"])
    return 0 if res["status"] == "ok" else 1


def row(label: str, compared: str, figures: str, ratio: Optional[float], ratio_label: str,
        **data) -> dict:
    """One line of the results table (run_all renders it); ``data`` holds the raw numbers."""
    return {"label": label, "compared": compared, "figures": figures, "ratio": ratio,
            "ratio_label": ratio_label, "data": data}


# -- the layout and link rate a benchmark claims --------------------------------------------------
#: How far the probe's bandwidth between nodes may be from the claimed link rate: measured on
#: the emulated cluster (2 cores, load average 13), 1 Gbit/s links read 0.8-1.2 Gbit/s and
#: 10 Gbit/s links 2.9-17.7, while shared memory taken for a link read 13-108 Gbit/s.
RATE_FACTOR = 5.0


class LayoutError(RuntimeError):
    """A run did not have the node layout or the link rate its results claim."""


def rate_bps(rate: str) -> float:
    """A tc rate (1gbit, 10gbit, 500mbit, 100kbit, 2gbps, ...) in bits per second."""
    import re
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(bit|kbit|mbit|gbit|tbit|bps|kbps|mbps|gbps)", rate.lower())
    if not m:
        raise ValueError(f"link rate {rate!r}: a number and a unit of tc (e.g. 1gbit)")
    n, unit = float(m.group(1)), m.group(2)
    scale = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12,
             "bps": 8, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9}[unit]
    return n * scale


def check_layout(what: str, node_of, nodes: int, probe: Optional[dict] = None,
                 rate: Optional[str] = None, factor: float = RATE_FACTOR) -> dict:
    """Check that a run had the layout and link rate its results will claim, from what the
    run itself reported; raise LayoutError (naming ``what``) when not, so that the benchmark
    or experiment writes no figure for it.

    ``node_of``: the node index of every rank as the run saw it (NodeGroups.node_of, or the
    ``node_index`` attributes of its HDF5 files); it must hold exactly ``nodes`` nodes.
    ``probe``: lsgd_hpc.netprobe's result from the same ranks; with ``rate`` (a tc rate such
    as "1gbit"), its bandwidth between nodes (1 / beta of its fit t = alpha + beta n) must be
    within ``factor`` of that rate either way. Returns what was checked: nodes, ranks per node, claimed and measured Gbit/s."""
    node_of = [int(n) for n in node_of]
    found = len(set(node_of))
    per_node = [node_of.count(n) for n in sorted(set(node_of))]
    out = {"nodes": found, "ranks_per_node": per_node, "node_of": node_of}
    if not node_of or found != nodes:
        raise LayoutError(
            f"{what}: the ranks ran on {found} node(s) (node_of {node_of}), not the {nodes} "
            f"the results claim; mpirun placed them elsewhere (check its --host/--map-by and "
            f"PRTE_MCA_rmaps_* in the environment)")
    if rate is None:
        return out
    claimed = rate_bps(rate)
    inter = (probe or {}).get("inter")
    if not inter or not (inter.get("bandwidth_Bps") or inter.get("beta_s_per_byte")):
        raise LayoutError(f"{what}: no bandwidth between nodes was measured (probe: "
                          f"{'none' if probe is None else 'no inter-node link'}), so the "
                          f"claimed {rate} link is unchecked")
    # The fit's 1/beta, not size/time of the largest message: on a loaded machine a ping-pong
    # over shared memory can wait milliseconds per message for a core, which the latency
    # term takes up and size/time does not (measured: 0.55 Gbit/s by size/time, 13.5 by 1/beta).
    beta = float(inter.get("beta_s_per_byte") or 0.0)
    measured = 8.0 / beta if beta > 0 else 8.0 * float(inter["bandwidth_Bps"])
    out.update(claimed_gbps=claimed / 1e9, measured_gbps=measured / 1e9,
               measured_over_claimed=measured / claimed)
    if not claimed / factor <= measured <= claimed * factor:
        raise LayoutError(
            f"{what}: the probe measured {measured / 1e9:.3g} Gbit/s between nodes, "
            f"{measured / claimed:.2g}x the claimed {rate} (allowed {1 / factor:g}x to "
            f"{factor:g}x): the traffic did not go through the rate-limited link (shared "
            f"memory or loopback?) or the limit is not the claimed one")
    return out


def probe_main(out: str) -> int:
    """Every rank of an MPI job: group the ranks into nodes by host name and probe the links
    (lsgd_hpc.planning.netprobe); rank 0 writes {"node_of", "probe"} to ``out``, what check_layout
    takes. ``python benchmarks/_common.py --probe OUT`` under the benchmark's own mpirun
    options, for benchmarks whose jobs have no probe of their own."""
    from mpi4py import MPI

    from lsgd_hpc.comm import NodeGroups
    from lsgd_hpc.comm.mpi import MPICommunicator
    from lsgd_hpc.planning.netprobe import probe_groups
    groups = NodeGroups.build(MPICommunicator(MPI.COMM_WORLD))
    probe = probe_groups(groups)
    if MPI.COMM_WORLD.Get_rank() == 0:
        write_result(out, {"node_of": groups.node_of, "probe": probe})
    groups.free()
    return 0


def rho_fields(n_params: int, nodes: int, ranks_per_node: int, inter: Dict, compute_s: float,
               measured_allreduce_s: Optional[float] = None) -> Dict:
    """rho of one run (docs/planning.md, lsgd_hpc.planning.costmodel.rho): the seconds of one
    fp32 allreduce of the model's ``n_params`` parameters between the nodes over the run's
    compute seconds of one step. The allreduce seconds are ``measured_allreduce_s`` when the
    run measured them ("measured"), else the planner's prediction from the link it probed
    (``inter``: alpha_s, and beta_s or beta_s_per_byte; "predicted": the between-nodes stage
    of the hierarchical allreduce, 2 (N-1) alpha + 2 (N-1)/N 4 n beta)."""
    from lsgd_hpc.planning import costmodel as cm
    if measured_allreduce_s is not None:
        t, source = float(measured_allreduce_s), "measured"
    else:
        beta = inter.get("beta_s", inter.get("beta_s_per_byte"))
        link = cm.Link(float(inter["alpha_s"]), float(beta))
        c = cm.Cluster(nodes, ranks_per_node, link, link)
        t, source = cm.between_nodes_allreduce_time(cm.FLOAT_BYTES * n_params, c), "predicted"
    rho = t / compute_s if compute_s > 0 else float("nan")
    return {"rho": rho, "rho_allreduce_s": t, "rho_compute_s": compute_s, "rho_source": source}


if __name__ == "__main__":
    import sys
    if len(sys.argv) == 3 and sys.argv[1] == "--probe":
        sys.exit(probe_main(sys.argv[2]))
    print("usage: python benchmarks/_common.py --probe OUT   (under mpirun)", file=sys.stderr)
    sys.exit(2)
