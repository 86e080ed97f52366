"""Topology analysis: the structured paths of lsgd_hpc.topology vs a dense eigendecomposition."""

from __future__ import annotations

import sys
import time

from _common import fmt_s, parse_args, row, spread, write_result

#: graphs whose analysis avoids the dense n x n eigendecomposition
NAMES = ("tree", "hierarchical", "one-peer-exponential", "torus", "exponential")


def _dense_analysis(top, gammas):
    """What the analysis costs without structure: dense W, its spectrum, and ENN from it
    (Lyapunov for non-symmetric or time-varying W)."""
    import numpy as np
    from lsgd_hpc.topology import effective_neighbors, second_singular_value
    Ws = np.array([top.mixing_matrix(t) for t in range(top.period)])
    second_singular_value(Ws)
    for g in gammas:
        effective_neighbors(Ws if top.period > 1 else Ws[0], g)


def main(argv=None) -> int:
    args = parse_args(__doc__, argv)
    from mpi4py import MPI
    from lsgd_hpc.topology import analyse, build_topology

    if MPI.COMM_WORLD.Get_rank() != 0:        # a single-process benchmark
        return 0
    n = 512 if args.quick else 1024
    reps = 3          # the ratios are 10x-500x: three interleaved samples settle them
    gammas = [0.9]
    samples = {name: {"structured": [], "dense": []} for name in NAMES}
    for r in range(reps):
        for name in NAMES:                     # alternate the variants, side by side
            top = build_topology(name, n)
            order = ("structured", "dense") if r % 2 == 0 else ("dense", "structured")
            for variant in order:
                t0 = time.perf_counter()
                if variant == "structured":
                    analyse(name, n, gammas)
                else:
                    _dense_analysis(top, gammas)
                samples[name][variant].append(time.perf_counter() - t0)
    big = {}
    for name in NAMES:
        t0 = time.perf_counter()
        analyse(name, 4096, gammas)
        big[name] = time.perf_counter() - t0
    rows = []
    for name in NAMES:
        s, d = spread(samples[name]["structured"]), spread(samples[name]["dense"])
        rows.append(row(f"topology analysis: {name}",
                        f"analyse() at n={n} vs dense W + eigen/Lyapunov at n={n}",
                        f"structured {fmt_s(s['median'])}, dense {fmt_s(d['median'])}; "
                        f"structured at n=4096: {fmt_s(big[name])}",
                        d["median"] / s["median"], "dense / structured",
                        structured=s, dense=d, structured_4096_s=big[name]))
    write_result(args.out, {"name": "topology_speed", "doc": __doc__.strip(), "n": n,
                            "rows": rows, "samples": samples})
    return 0


if __name__ == "__main__":
    sys.exit(main())
