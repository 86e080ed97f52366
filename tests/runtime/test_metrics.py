"""MetricsWriter: flushes append the rows since the last one (memory holds those only), what
changes the file's layout writes it anew, and load_existing (resume) keeps the rows up to
the checkpoint's counts on disk; a file that cannot give them is an error naming the file and
the group."""

import os
import signal
import subprocess
import sys
import textwrap

import h5py
import pytest

from lsgd_hpc.runtime.metrics import (GROUPS, MetricsWriter, clear_status_flags,
                                      open_rank_file)


def train_row(w, s):
    w.log("train", step=s, epoch=s / 10, wall_time=float(s), loss=1.0 / s, accuracy=0.5,
          lr=0.1, comm_bytes_sent=10 * s, comm_bytes_recv=10 * s, comm_seconds=0.0,
          compute_seconds=0.0, overhead_seconds=0.0, probe_seconds=0.0, eval_seconds=0.0,
          checkpoint_seconds=0.0, metrics_seconds=0.0, training_time=float(s))


def writer(path, n_train=5):
    w = MetricsWriter(str(path), {"rank": 0})
    for s in range(1, n_train + 1):
        train_row(w, s)
    w.log("eval", step=5, epoch=0.5, wall_time=5.0, training_time=5.0, test_loss=0.3,
          test_accuracy=0.9)
    w.flush()
    return w


def lengths(path):
    with open_rank_file(path) as f:
        return {g: {len(d) for d in f[g].values()} for g in f}


def test_rows_after_the_checkpoint_are_dropped(tmp_path):
    writer(tmp_path / "m.h5")
    fresh = MetricsWriter(str(tmp_path / "m.h5"), {"rank": 0})
    fresh.load_existing({"train": 3, "eval": 0, "leader": 0, "consensus": 0})
    assert fresh.column("train", "step") == [1, 2, 3]
    assert fresh.column("train", "comm_bytes_sent") == [10, 20, 30]
    assert fresh.row_counts() == {"train": 3, "eval": 0, "leader": 0, "consensus": 0}
    assert fresh.rows["train"]["step"] == []                 # only counts kept in memory
    # the file itself holds the checkpoint's rows only, and the run goes on from there
    assert lengths(tmp_path / "m.h5") == {"train": {3}, "eval": {0}, "leader": {0},
                                          "consensus": {0}}
    train_row(fresh, 4)
    fresh.flush()
    with h5py.File(tmp_path / "m.h5", "r") as f:
        assert list(f["train"]["step"]) == [1, 2, 3, 4]


def test_flushes_append_and_memory_holds_one_interval(tmp_path):
    path = tmp_path / "m.h5"
    w = MetricsWriter(str(path), {"rank": 0, "config": "{}"})
    for s in range(1, 8):
        train_row(w, s)
        if s % 3 == 0:
            w.flush()
            assert w.rows["train"]["step"] == [] and w.written["train"] == s
    assert w.row_counts()["train"] == 7 and w.rows["train"]["step"] == [7]
    assert w.column("train", "step") == list(range(1, 8))
    w.flush()
    with h5py.File(path, "r") as f:       # between flushes an ordinary, closed HDF5 file
        assert list(f["train"]["step"]) == list(range(1, 8))
        assert f["train"]["step"].chunks and f["train"]["step"].maxshape == (None,)
        assert "faults" not in f and "end_time" not in f.attrs
    # the first /faults row and the end_time of close() change the layout: written anew
    faults = {c: "" if dt.startswith("S") else 0 for c, dt in GROUPS["faults"].items()}
    w.log("faults", **dict(faults, step=7, wall_time=7.0, lost_ranks="1", n_lost=1))
    w.flush()
    train_row(w, 8)
    w.close()
    with h5py.File(path, "r") as f:
        assert list(f["train"]["step"]) == list(range(1, 9))
        assert list(f["faults"]["lost_ranks"]) == [b"1"] and "end_time" in f.attrs
        assert f.attrs["config"] == "{}"
    assert not os.path.exists(f"{path}.tmp")


def test_a_reader_of_this_process_holding_the_file(tmp_path):
    """An open reader in the same process does not keep the writer from appending (it writes
    through a file object of its own, which HDF5 does not match with the reader's): the file
    is not written anew (same inode) and the reader sees the new rows."""
    path = tmp_path / "m.h5"
    w = writer(path)
    inode = os.stat(path).st_ino
    with open_rank_file(path) as r:
        train_row(w, 6)
        w.flush()
        assert os.stat(path).st_ino == inode
        assert list(r["train"]["step"]) == [1, 2, 3, 4, 5, 6]
    assert w.column("train", "step") == [1, 2, 3, 4, 5, 6]
    train_row(w, 7)
    w.flush()
    assert w.column("train", "step") == list(range(1, 8))
    assert os.stat(path).st_ino == inode


def sec2_swmr_writer_killed(path):
    """Open ``path`` for SWMR writing as HDF5 does by itself (this package's writer before
    it wrote through _CrashSafeFile) and SIGKILL the process holding it."""
    code = textwrap.dedent(f"""
        import os, signal, h5py
        fapl = h5py.h5p.create(h5py.h5p.FILE_ACCESS)
        fapl.set_libver_bounds(h5py.h5f.LIBVER_LATEST, h5py.h5f.LIBVER_LATEST)
        fid = h5py.h5f.open({str(path).encode()!r}, h5py.h5f.ACC_RDWR | h5py.h5f.ACC_SWMR_WRITE,
                            fapl)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    res = subprocess.run([sys.executable, "-c", code], timeout=60)
    assert res.returncode == -signal.SIGKILL


def test_a_file_left_open_by_another_killed_swmr_writer(tmp_path):
    """A file whose superblock status flags a killed SWMR writer left set (an older version
    of this package): a plain open refuses it, open_rank_file reads it, a resume keeps its
    rows and leaves an ordinary file."""
    path = tmp_path / "m.h5"
    writer(path)
    sec2_swmr_writer_killed(path)
    with pytest.raises(OSError, match="already open for write"):
        h5py.File(path, "r", locking=False)
    assert lengths(path)["train"] == {5}
    fresh = MetricsWriter(str(path), {"rank": 0})
    fresh.load_existing({"train": 4, "eval": 1, "leader": 0, "consensus": 0})
    with h5py.File(path, "r") as f:
        assert list(f["train"]["step"]) == [1, 2, 3, 4] and list(f["eval"]["step"]) == [5]


def test_a_flush_into_a_flagged_file_writes_it_anew(tmp_path):
    """The writer's append refuses a file whose status flags are set (HDF5: already open for
    write); the flush writes the file anew, an ordinary one, with every row."""
    path = tmp_path / "m.h5"
    w = writer(path)
    sec2_swmr_writer_killed(path)
    train_row(w, 6)
    w.flush()
    with h5py.File(path, "r") as f:
        assert list(f["train"]["step"]) == [1, 2, 3, 4, 5, 6]


def test_clear_status_flags_is_h5clear(tmp_path):
    """clear_status_flags on the superblock of a file left flagged gives one that HDF5 opens
    (checksum made anew: lookup3); on bytes that are no superblock of version 2 or later,
    the bytes themselves."""
    path = tmp_path / "m.h5"
    writer(path)
    with open(path, "rb") as f:
        clean = f.read(48)
    sec2_swmr_writer_killed(path)
    with open(path, "r+b") as f:
        flagged = f.read(48)
        assert flagged[11] != 0 and flagged != clean
        assert clear_status_flags(flagged) == clean
        f.seek(0)
        f.write(clear_status_flags(flagged))
    with h5py.File(path, "r") as f:
        assert list(f["train"]["step"]) == [1, 2, 3, 4, 5]
    assert clear_status_flags(b"not an HDF5 file") == b"not an HDF5 file"
    assert clear_status_flags(clean) == clean


def test_fewer_rows_than_the_checkpoint_is_an_error(tmp_path):
    writer(tmp_path / "m.h5", n_train=2)
    fresh = MetricsWriter(str(tmp_path / "m.h5"), {"rank": 0})
    with pytest.raises(RuntimeError, match=r"m\.h5: /train/step has 2 rows, checkpoint expects 4"):
        fresh.load_existing({"train": 4})


def test_missing_column_is_an_error(tmp_path):
    writer(tmp_path / "m.h5")
    with h5py.File(tmp_path / "m.h5", "a") as f:
        del f["train"]["loss"]
    fresh = MetricsWriter(str(tmp_path / "m.h5"), {"rank": 0})
    with pytest.raises(RuntimeError, match=r"/train/loss missing; cannot resume"):
        fresh.load_existing({"train": 3})


def test_missing_group_is_an_error(tmp_path):
    writer(tmp_path / "m.h5")
    with h5py.File(tmp_path / "m.h5", "a") as f:
        del f["leader"]
    fresh = MetricsWriter(str(tmp_path / "m.h5"), {"rank": 0})
    with pytest.raises(RuntimeError, match=r"/leader/\w+ missing; cannot resume"):
        fresh.load_existing({"leader": 0})


def test_missing_file_is_an_error(tmp_path):
    fresh = MetricsWriter(str(tmp_path / "none.h5"), {"rank": 0})
    with pytest.raises(OSError):
        fresh.load_existing({"train": 1})
