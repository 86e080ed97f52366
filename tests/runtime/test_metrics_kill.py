"""A metrics writer SIGKILLed at any instant leaves a file that h5py opens and whose groups,
their columns cut to the shortest (what the readers do), hold a prefix of the rows logged:
30 seeded random instants, about half of them in the middle of a flush (the writer flushes every
few rows, now and then writing the file anew for a changed attribute)."""

import os
import random
import select
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from lsgd_hpc.analysis.rundir import read_rank_file
from lsgd_hpc.runtime.metrics import GROUPS, open_rank_file
from mpi_util import mpi_env

KILLS, SEED = 30, 20240601

WRITER = textwrap.dedent("""
    import random, sys
    from lsgd_hpc.runtime.metrics import MetricsWriter
    path, seed = sys.argv[1], int(sys.argv[2])
    rnd = random.Random(seed)
    # columns of its own: most of a flush's time is spent with the file open for writing
    w = MetricsWriter(path, {"rank": 0, "progress": 0}, flush_every=10**9,
                      flush_seconds=float("inf"),
                      extra_columns={"train": {f"x{j:02d}": "f8" for j in range(40)}})
    def row(group, i):   # every column of row i holds i (step == i)
        return {c: (str(i) if dt.startswith("S") else i) for c, dt in w.columns[group].items()}
    i = 0
    while True:
        for _ in range(rnd.randint(1, 7)):
            i += 1
            w.log("train", **row("train", i))
            if i % 3 == 0:
                w.log("eval", **row("eval", i))
            if i % 2 == 0:
                w.log("consensus", **row("consensus", i))
            if i % 4 == 0:
                w.log("leader", **row("leader", i))
            if i % 50 == 0:
                w.log("faults", **row("faults", i))
        if rnd.random() < 0.02:
            w.attrs["progress"] = i               # a changed attribute: the file anew
        w.flush()
        if i < 10:
            print("flushed", flush=True)
""")

#: every which row of the writer's /train row i a group has a row
EVERY = {"train": 1, "eval": 3, "consensus": 2, "leader": 4, "faults": 50}
EXTRA = {f"x{j:02d}" for j in range(40)}


def check_prefix(path):
    """The file opens; each group's rows, cut to the common length, are the writer's first
    ones. Returns whether it was left open for SWMR writing (killed mid-flush)."""
    with open_rank_file(path) as f:
        mid_flush = f.swmr_mode
        for g in f:
            cols = {c: f[g][c][()] for c in f[g]}
            want_cols = set(GROUPS[g]) | (EXTRA if g == "train" else set())
            assert set(cols) == want_cols, (g, sorted(cols))
            n = min(len(v) for v in cols.values())
            # columns differ by the rows of the one flush cut (at most 7 /train rows)
            assert max(len(v) for v in cols.values()) - n <= 7, \
                (g, {c: len(v) for c, v in cols.items()})
            want = EVERY[g] * np.arange(1, n + 1)
            for c, v in cols.items():
                got = v[:n].astype(str).astype(float) if v.dtype.kind == "S" else v[:n]
                assert np.array_equal(got, want), (g, c, got[-5:], want[-5:])
    data = read_rank_file(path)                      # the readers' view: aligned columns
    assert len({len(v) for v in data["train"].values()}) == 1
    return mid_flush


def wait_line(proc, timeout):
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    assert ready, "the writer printed nothing"
    return proc.stdout.readline()


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_killed_at_random_instants_leaves_a_readable_prefix(tmp_path):
    rnd = random.Random(SEED)
    mid_flush, rows = 0, []
    for k in range(KILLS):
        path = str(tmp_path / f"rank{k:05d}.h5")
        proc = subprocess.Popen([sys.executable, "-c", WRITER, path, str(SEED + k)],
                                stdout=subprocess.PIPE, text=True, env=mpi_env())
        try:
            assert wait_line(proc, 60).startswith("flushed")
            time.sleep(rnd.uniform(0.0, 0.6))
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=60)
        assert proc.returncode == -signal.SIGKILL
        mid_flush += check_prefix(path)
        with open_rank_file(path) as f:
            rows.append(min(len(d) for d in f["train"].values()))
        os.remove(path)
    assert min(rows) >= 1 and len(set(rows)) > 1, rows
    # most of the writer's time is spent flushing: some kills came in the middle of one
    assert mid_flush >= 1, rows
    print(f"{mid_flush} of {KILLS} kills mid-flush; /train rows left: {rows}")
