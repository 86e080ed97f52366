"""A metrics writer SIGKILLed at any instant leaves a file that a plain ``h5py.File(path, "r")``
opens (no status flags left set: no "already open for write") and whose groups, their columns
cut to the shortest (what the readers do), hold a prefix of the rows logged.

- every write of a flush cut short, replayed: the file as it is on disk after each of the
  writes that appends do (SIGKILL leaves the writes made before it, none after), opened
  plainly, in-process (fast);
- 30 seeded random instants, most of them in the middle of a flush (the writer flushes
  every few rows, now and then writing the file anew for a changed attribute)."""

import os
import random
import select
import signal
import subprocess
import sys
import textwrap
import time

import h5py
import numpy as np
import pytest

from lsgd_hpc.analysis.rundir import read_rank_file
from lsgd_hpc.runtime import metrics
from lsgd_hpc.runtime.metrics import GROUPS, MetricsWriter
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
        print("begin", flush=True)
        w.flush()
        print("end", flush=True)
""")

#: every which row of the writer's /train row i a group has a row
EVERY = {"train": 1, "eval": 3, "consensus": 2, "leader": 4, "faults": 50}
EXTRA = {f"x{j:02d}" for j in range(40)}


def check_prefix(path):
    """The file opens with a plain h5py.File (HDF5's file locking included); each group's
    rows, cut to the common length, are the writer's first ones. Returns the /train rows."""
    with h5py.File(path, "r") as f:
        assert f.attrs["rank"] == 0
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
        rows = min(len(d) for d in f["train"].values())
    data = read_rank_file(path)                      # the readers' view: aligned columns
    assert len({len(v) for v in data["train"].values()}) == 1
    return rows


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
            assert wait_line(proc, 60).startswith("begin")
            assert wait_line(proc, 60).startswith("end")        # the file exists
            time.sleep(rnd.uniform(0.0, 0.6))
        finally:
            proc.send_signal(signal.SIGKILL)
            out, _ = proc.communicate(timeout=60)
        assert proc.returncode == -signal.SIGKILL
        mid_flush += out.split()[-1:] == ["begin"]      # killed between begin and end
        rows.append(check_prefix(path))
        os.remove(path)
    assert min(rows) >= 1 and len(set(rows)) > 1, rows
    # most of the writer's time is spent flushing: some kills came in the middle of one
    assert mid_flush >= 1, rows
    print(f"{mid_flush} of {KILLS} kills mid-flush; /train rows left: {rows}")


# -- every write of a flush cut short, replayed ---------------------------------------------

class Recording(metrics._CrashSafeFile):
    """The writer's file, its writes and truncations recorded in order as they reach the
    file: ("w", offset, bytes), ("t", length, None), and ("s", 0, bytes) for a superblock
    that _CrashSafeFile writes of itself (a write went past its end-of-file address)."""
    events: list = []
    _own = False

    def _put_superblock(self, eof):
        self._own = True
        try:
            super()._put_superblock(eof)
        finally:
            self._own = False

    def _pwrite(self, view, pos):
        Recording.events.append(("s" if self._own else "w", pos, bytes(view)))
        return super()._pwrite(view, pos)

    def _ftruncate(self, size):
        Recording.events.append(("t", size, None))
        super()._ftruncate(size)


def replayed(before: bytes, events) -> bytes:
    image = bytearray(before)
    for kind, pos, data in events:
        if kind == "t":
            del image[pos:]
            image.extend(bytes(pos - len(image)))
        else:
            image.extend(bytes(max(0, pos + len(data) - len(image))))
            image[pos:pos + len(data)] = data
    return bytes(image)


def check_replayed_prefix(path, n_before):
    """The file opens plainly; /train and /eval hold the first rows (step i, every column i;
    /eval every 3rd step), at least those before the flush."""
    with h5py.File(path, "r") as f:
        for g, every in (("train", 1), ("eval", 3)):
            cols = {c: f[g][c][()] for c in f[g]}
            n = min(len(v) for v in cols.values())
            assert n >= n_before // every, (g, n, n_before)
            for c, v in cols.items():
                assert np.array_equal(v[:n], every * np.arange(1, n + 1)), (g, c)


def test_every_write_of_a_flush_cut_short_leaves_a_plain_readable_prefix(tmp_path,
                                                                         monkeypatch):
    """Appends within a chunk, across chunks (1,024 rows of 8 bytes) and across many (the
    columns' chunk indexes grow): after each of their writes, the file opens with a plain
    h5py.File and holds a prefix of the rows. A control: the same writes without the
    superblocks that _CrashSafeFile writes when a write goes past its end-of-file address
    leave files whose new chunks HDF5 refuses to read ("addr overflow")."""
    monkeypatch.setattr(metrics, "_CrashSafeFile", Recording)
    path = str(tmp_path / "rank00000.h5")
    w = MetricsWriter(path, {"rank": 0}, flush_every=10 ** 9, flush_seconds=float("inf"))
    step = 0

    def log(n):
        nonlocal step
        for _ in range(n):
            step += 1
            w.log("train", **{c: step for c in w.columns["train"]})
            if step % 3 == 0:
                w.log("eval", **{c: step for c in w.columns["eval"]})

    log(1000)
    w.flush()                                         # the file written whole
    image = str(tmp_path / "image.h5")
    replays = control_failures = 0
    for n in (7, 40, 1100, 3):
        with open(path, "rb") as f:
            before = f.read()
        n_before = step
        Recording.events = []
        log(n)
        w.flush()
        events = Recording.events
        assert events and os.stat(path).st_size > 0
        for k in range(len(events) + 1):
            with open(image, "wb") as f:
                f.write(replayed(before, events[:k]))
            check_replayed_prefix(image, n_before)
            replays += 1
        with open(image, "wb") as f:
            f.write(replayed(before, events))
        check_replayed_prefix(image, step)            # the whole flush: every row
        if n >= 40:                                   # new chunks: the control
            assert any(e[0] == "s" for e in events), "no write past the end-of-file address"
            bare = [e for e in events if e[0] != "s"]
            for k in range(len(bare) + 1):
                with open(image, "wb") as f:
                    f.write(replayed(before, bare[:k]))
                try:
                    check_replayed_prefix(image, n_before)
                except OSError as exc:
                    assert "addr overflow" in str(exc)
                    control_failures += 1
    assert replays > 100
    assert control_failures > 0
