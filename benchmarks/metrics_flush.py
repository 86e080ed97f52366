"""The metrics writer's flush: its cost at 1,000,000 rows in the file over its cost at 10,000.

    mpirun -np 1 python benchmarks/metrics_flush.py --out metrics_flush.json [--quick]

The writer alone (lsgd_hpc.runtime.metrics.MetricsWriter), no training: two writers, one
whose file holds 10,000 /train rows and one whose file holds 1,000,000 (with an /eval row
every 50 steps and /leader and /consensus rows every 10, as a run logs them; written by the
writers themselves in large flushes). Each sample logs the same 50 new steps into one writer
(not timed) and times its ``flush()``: everything the flush does for durability, the file
opened in SWMR mode, the new rows appended, the file flushed, closed and fsynced. The two
writers alternate (order rotated every repetition). The key is the ratio of the mean flush
times (1,000,000 rows / 10,000 rows; target <= 2: a flush costs what its new rows cost, not
the whole run); the medians are recorded too. Before the append-only flush, the whole file
was rewritten at every flush: 0.011 s at 10,000 rows, 0.44 s at 1,000,000 (40x).
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time

from _common import fmt_s, parse_args, row, spread, write_result

SIZES = (10_000, 1_000_000)
NEW_ROWS = 50
#: repetitions per size (after 3 untimed ones)
REPS = {"full": 60, "quick": 25}
TRAIN = None          # the /train columns (set in main: lsgd_hpc imported there)


def log_steps(writer, first: int, n: int) -> None:
    """Steps first..first+n-1: a /train row each, /eval every 50, /leader and /consensus
    every 10."""
    for s in range(first, first + n):
        writer.log("train", **{c: s for c in TRAIN})
        if s % 10 == 0:
            writer.log("leader", step=s, scope=0, leader_rank=0, score=float(s))
            writer.log("consensus", step=s, distance=1.0 / s)
        if s % 50 == 0:
            writer.log("eval", step=s, epoch=s / 100, wall_time=float(s),
                       training_time=float(s), test_loss=1.0 / s, test_accuracy=0.5)


def make_writer(folder: str, n_rows: int):
    """A writer whose file holds ``n_rows`` steps, written by it in flushes of 100,000."""
    from lsgd_hpc.runtime.metrics import SCHEMA_VERSION, MetricsWriter
    w = MetricsWriter(os.path.join(folder, f"rank{n_rows}.h5"),
                      {"schema_version": SCHEMA_VERSION, "rank": 0, "world_size": 1},
                      flush_every=10 ** 12, flush_seconds=float("inf"))
    step = 1
    while step <= n_rows:
        n = min(100_000, n_rows - step + 1)
        log_steps(w, step, n)
        w.flush()
        step += n
    return w, step


def main(argv=None) -> int:
    args = parse_args(__doc__, argv)
    from mpi4py import MPI
    global TRAIN
    from lsgd_hpc.runtime.metrics import GROUPS
    TRAIN = list(GROUPS["train"])
    if MPI.COMM_WORLD.Get_rank() != 0:        # a single-process benchmark
        return 0
    reps = REPS["quick" if args.quick else "full"]
    folder = tempfile.mkdtemp(prefix="metrics_flush_")
    try:
        t0 = time.perf_counter()
        writers = {n: make_writer(folder, n) for n in SIZES}
        build_s = time.perf_counter() - t0
        samples = {n: [] for n in SIZES}
        for r in range(reps + 3):
            for n in (SIZES if r % 2 == 0 else SIZES[::-1]):
                w, step = writers[n]
                log_steps(w, step, NEW_ROWS)
                writers[n] = (w, step + NEW_ROWS)
                t = time.perf_counter()
                w.flush()
                if r >= 3:
                    samples[n].append(time.perf_counter() - t)
        sizes = {n: os.path.getsize(w.path) for n, (w, _) in writers.items()}
        for w, _ in writers.values():
            w.close()
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    small, big = SIZES
    mean = {n: sum(v) / len(v) for n, v in samples.items()}
    st = {n: spread(v) for n, v in samples.items()}
    ratio = mean[big] / mean[small]
    result = {
        "name": "metrics_flush", "doc": __doc__.strip(), "np": 1, "new_rows": NEW_ROWS,
        "reps": reps, "build_seconds": build_s,
        "file_bytes": {str(n): s for n, s in sizes.items()},
        "mean_seconds": {str(n): m for n, m in mean.items()},
        "spread": {str(n): s for n, s in st.items()},
        "samples": {str(n): v for n, v in samples.items()},
        "ratio": ratio, "median_ratio": st[big]["median"] / st[small]["median"],
        "target": "<= 2",
        "rows": [row("metrics_flush",
                     f"MetricsWriter.flush() of {NEW_ROWS} new steps into a file of "
                     f"{big:,} rows vs of {small:,} rows (append in SWMR mode, fsync)",
                     f"mean {fmt_s(mean[big])} at {big:,} rows, {fmt_s(mean[small])} at "
                     f"{small:,} rows (medians {fmt_s(st[big]['median'])}, "
                     f"{fmt_s(st[small]['median'])}; {reps} flushes each)",
                     ratio, f"flush at {big:,} rows / at {small:,} rows, means (target <= 2)")],
        "notes": ["metrics_flush: the writer alone; each flush appends the rows logged since "
                  "the last one (docs/metrics.md, 'The per-rank HDF5 file'), so its cost does "
                  "not grow with the rows already in the file."],
    }
    write_result(args.out, result)
    print(f"metrics_flush: {result['rows'][0]['figures']}; ratio {ratio:.2f}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
