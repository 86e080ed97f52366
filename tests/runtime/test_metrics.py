"""MetricsWriter.load_existing (resume): rows are taken back up to the checkpoint's counts,
and a file that cannot give them is an error naming the file and the group."""

import h5py
import pytest

from lsgd_hpc.runtime.metrics import MetricsWriter


def writer(path, n_train=5):
    w = MetricsWriter(str(path), {"rank": 0})
    for s in range(1, n_train + 1):
        w.log("train", step=s, epoch=s / 10, wall_time=float(s), loss=1.0 / s, accuracy=0.5,
              lr=0.1, comm_bytes_sent=10 * s, comm_bytes_recv=10 * s, comm_seconds=0.0,
              compute_seconds=0.0, overhead_seconds=0.0, probe_seconds=0.0, eval_seconds=0.0,
              checkpoint_seconds=0.0, metrics_seconds=0.0, training_time=float(s))
    w.log("eval", step=5, epoch=0.5, wall_time=5.0, training_time=5.0, test_loss=0.3,
          test_accuracy=0.9)
    w.flush()
    return w


def test_rows_after_the_checkpoint_are_dropped(tmp_path):
    writer(tmp_path / "m.h5")
    fresh = MetricsWriter(str(tmp_path / "m.h5"), {"rank": 0})
    fresh.load_existing({"train": 3, "eval": 0, "leader": 0, "consensus": 0})
    assert fresh.rows["train"]["step"] == [1, 2, 3]
    assert fresh.rows["train"]["comm_bytes_sent"] == [10, 20, 30]
    assert fresh.row_counts() == {"train": 3, "eval": 0, "leader": 0, "consensus": 0}


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
