"""Communication behind compute at 100 Mbit/s: how much of each overlapping method's traffic is hidden.

Three methods overlap their communication with the training steps, each measured against the
same method with the overlap turned off, on the emulated cluster (2 nodes x 2 ranks, 100 Mbit/s
per node link, tc tbf), ResNet-20 on synthetic 3x32x32 images (batch 32, a 1.1 MB model: one
step's compute and one model exchange over the link take about as long):

  allreduce      gradient buckets of 1 MB started during backward   vs  one allreduce after it
  streaming      Streaming DiLoCo, H = 8, 4 fragments, the fragment's allreduce started 1 step
                 before its sync (fragment_sync_delay 1, alpha 0.5)  vs  the same, delay 0
  lsgd           multi-leader LSGD (tau 4/8), the leader's broadcast behind 2 steps of compute
                 (pull_delay 2)                                       vs  pull_delay 0

Each configuration trains STEPS steps through the library (``lsgd_hpc.init``, the method
classes), after WARMUP steps left out; rounds interleave the six so a slow spell of the shared
machine hits all alike. Per configuration: the exposed communication seconds per step (what
the ranks spent blocked in the method's collectives, ``comm.stats.seconds``; the slowest rank)
and the step time (wall seconds per step, the slowest rank). The hidden share of a method is

    1 - exposed(with overlap) / exposed(without overlap)

(the traffic is the same bytes either way, so the blocking run's exposed time is the whole of
it), and its speed-up is step time without over step time with the overlap.

    python benchmarks/overlap.py --out FILE [--quick]        (root: the emulated cluster)
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, Optional

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO))
from _cluster import NODES, RANKS_PER_NODE  # noqa: E402
from _common import (LayoutError, check_layout, cluster_bench_main, cluster_job,  # noqa: E402
                     failed, rho_fields, row, spread, write_result)


RATE = "100mbit"
CLUSTER = dict(name="bovl", subnet="10.79.7")
MODEL, SHAPE, BATCH = "resnet20", (3, 32, 32), 32
STEPS, WARMUP = {"full": 16, "quick": 8}, 4
ROUNDS = {"full": 3, "quick": 1}
#: (method, configuration, class, options with the overlap, options without it)
PAIRS = [
    ("allreduce", "AllreduceSGD", {"bucket_mb": 1.0}, {"bucket_mb": 0.0}),
    ("streaming", "DiLoCo", dict(local_steps=8, fragments=4, fragment_sync_delay=1,
                                 fragment_update_alpha=0.5),
     dict(local_steps=8, fragments=4, fragment_sync_delay=0, fragment_update_alpha=0.5)),
    ("lsgd", "LeaderSGD", dict(tau_local=4, tau_global=8, pull_delay=2),
     dict(tau_local=4, tau_global=8, pull_delay=0)),
]


def worker(out: str, quick: bool, nodes: int, rate: str, pairs: Optional[list] = None) -> int:
    """The ranks: train each configuration of ``pairs`` (default PAIRS) in turn."""
    import torch
    from mpi4py import MPI

    import lsgd_hpc
    from lsgd_hpc.models.zoo import build_model
    from lsgd_hpc.planning.netprobe import probe_groups
    comm = lsgd_hpc.init(backend="mpi", device="cpu")
    # the layout and link this job claims, from its own node grouping and probe
    probe = probe_groups(comm.groups)
    error = None
    if comm.rank == 0:
        try:
            check_layout("overlap", comm.groups.node_of, nodes, probe, rate)
        except LayoutError as exc:
            error = str(exc)
            write_result(out, {"layout_error": error})
    if comm.allgather_object(error)[0]:
        return 3
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(comm.rank)
    data = [(torch.randn(BATCH, *SHAPE, generator=g), torch.randint(0, 10, (BATCH,), generator=g))
            for _ in range(4)]
    steps = STEPS["quick" if quick else "full"]

    def train(cls: str, options: dict) -> tuple:
        torch.manual_seed(0)
        model = build_model(MODEL, 10, SHAPE)
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        t0 = s0 = 0.0
        with getattr(lsgd_hpc, cls)(model, opt, comm, consensus_every=0, **options) as method:
            for i in range(WARMUP + steps):
                if i == WARMUP:
                    comm.barrier()
                    t0, s0 = time.perf_counter(), comm.stats.seconds
                x, y = data[i % len(data)]
                loss = torch.nn.functional.cross_entropy(model(x), y)
                opt.zero_grad()
                loss.backward()
                method.step(loss)
            method.drain()
            mine = ((time.perf_counter() - t0) / steps, (comm.stats.seconds - s0) / steps)
        # the slowest rank's step time and exposed communication
        return tuple(max(v) for v in zip(*comm.allgather_object(mine)))

    samples: Dict[str, Dict[str, list]] = {}
    configs = [(f"{name} {kind}", cls, opts) for name, cls, on, off in (pairs or PAIRS)
               for kind, opts in (("overlap", on), ("blocking", off))]
    for r in range(ROUNDS["quick" if quick else "full"]):
        for label, cls, opts in configs[r % len(configs):] + configs[:r % len(configs)]:
            step_s, comm_s = train(cls, opts)
            entry = samples.setdefault(label, {"step_s": [], "comm_s": []})
            entry["step_s"].append(step_s)
            entry["comm_s"].append(comm_s)
    if comm.rank == 0:
        write_result(out, {"samples": samples, "steps": steps,
                           "model_bytes": 4 * sum(p.numel() for p in
                                                  build_model(MODEL, 10, SHAPE).parameters()),
                           "inter": probe.get("inter")})
    return 0


def run(quick: bool = False, timeout: float = 600, log=print, key: str = "overlap") -> Dict:
    base = {"name": key, "doc": __doc__.splitlines()[0], "rate": RATE, "model": MODEL}
    res, done = cluster_job(str(Path(__file__)), key, base, CLUSTER, RATE, quick, timeout, log)
    if done:
        return done
    if "samples" not in res:
        return failed(base, key, "the worker wrote no samples")
    med = {label: {k: spread(v)["median"] for k, v in s.items()}
           for label, s in res["samples"].items()}
    rows, shares = [], {}
    for name, _, on, _ in PAIRS:
        a, b = med[f"{name} overlap"], med[f"{name} blocking"]
        hidden = 1.0 - a["comm_s"] / b["comm_s"] if b["comm_s"] > 0 else float("nan")
        speedup = b["step_s"] / a["step_s"]
        # rho: one fp32 allreduce of the model between the nodes, predicted from the probed
        # link, over the blocking run's compute a step (its step less its communication)
        rho = rho_fields(res["model_bytes"] // 4, NODES, RANKS_PER_NODE, res["inter"],
                         b["step_s"] - b["comm_s"]) if res.get("inter") else {}
        shares[name] = {"hidden_share": hidden, "speedup": speedup, "overlap": a, "blocking": b,
                        **rho}
        rows.append(row(f"overlap_{name}",
                        f"{name} ({', '.join(f'{k}={v}' for k, v in on.items())}) vs the same "
                        f"without overlap, {MODEL} batch {BATCH}, 2 nodes x 2 ranks at {RATE}",
                        f"exposed comm {a['comm_s'] * 1e3:.1f} vs {b['comm_s'] * 1e3:.1f} ms/step "
                        f"(hidden {100 * hidden:.0f} %); step {a['step_s'] * 1e3:.1f} vs "
                        f"{b['step_s'] * 1e3:.1f} ms"
                        + (f"; rho {rho['rho']:.3g} ({rho['rho_source']})" if rho else ""),
                        speedup, "step time without / with the overlap (hidden share in figures)",
                        hidden_share=hidden, **rho))
    return {**base, "status": "ok", "methods": shares, "steps": res["steps"],
            "model_bytes": res["model_bytes"], "samples": res["samples"], "rows": rows,
            "notes": ["overlap: hidden share = 1 - exposed comm (overlap) / exposed comm "
                      "(blocking); exposed = seconds blocked in the method's collectives, "
                      "slowest rank, median over rounds"]}


def main(argv: Optional[list] = None) -> int:
    return cluster_bench_main(__doc__.splitlines()[0], run, worker, RATE, argv)


if __name__ == "__main__":
    try:
        sys.exit(main())
    except subprocess.TimeoutExpired:
        sys.exit(1)
