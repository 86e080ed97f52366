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

from lsgd_hpc.runtime.metrics import GROUPS, MetricsWriter, open_rank_file


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
    """An open reader in the same process keeps HDF5 from opening the file for SWMR writing:
    the flush writes it anew instead."""
    path = tmp_path / "m.h5"
    w = writer(path)
    with open_rank_file(path) as r:
        train_row(w, 6)
        w.flush()
        assert len(r["train"]["step"]) == 5
    assert w.column("train", "step") == [1, 2, 3, 4, 5, 6]
    train_row(w, 7)
    w.flush()
    assert w.column("train", "step") == list(range(1, 8))


def test_a_file_left_open_by_a_killed_writer(tmp_path):
    """A writer SIGKILLed while it holds the file in SWMR mode: open_rank_file reads it, and
    a resume keeps its rows and leaves an ordinary file."""
    path = tmp_path / "m.h5"
    writer(path)
    code = textwrap.dedent(f"""
        import os, signal, h5py
        from lsgd_hpc.runtime.metrics import _swmr_fapl
        fid = h5py.h5f.open({str(path).encode()!r}, h5py.h5f.ACC_RDWR | h5py.h5f.ACC_SWMR_WRITE,
                            _swmr_fapl())
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    res = subprocess.run([sys.executable, "-c", code], timeout=60)
    assert res.returncode == -signal.SIGKILL
    with pytest.raises(OSError, match="already open for write"):
        h5py.File(path, "r", locking=False)
    assert lengths(path)["train"] == {5}
    fresh = MetricsWriter(str(path), {"rank": 0})
    fresh.load_existing({"train": 4, "eval": 1, "leader": 0, "consensus": 0})
    with h5py.File(path, "r") as f:
        assert list(f["train"]["step"]) == [1, 2, 3, 4] and list(f["eval"]["step"]) == [5]


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
