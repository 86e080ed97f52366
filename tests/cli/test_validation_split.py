"""--validation-size: a fixed slice of the training set, never trained on, evaluated at every
evaluation (val_loss, val_accuracy; EASGD's centre too), apart from the leader score's slice,
so that settings can be chosen without looking at the test set (results/experiments/methods.py)."""

import json
import sys

import pytest
import torch

from mpi_util import run_mpi
from test_outer_methods import read
from test_reliability import _check_one_line, _run_cli

WORLD = 2


BAD = [(["--validation-size", "-1"], "--validation-size"),
       (["--validation-size", "5000"], "--validation-size"),
       (["--dataset", "imagefolder", "--data-dir", "{tmp}", "--validation-size", "10"],
        "--validation-size"),
       (["--dataset", "imagefolder", "--data-dir", "{tmp}", "--leader-score", "heldout"],
        "--leader-score")]


@pytest.mark.parametrize("args,option", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_validation_size_one_line_exit_2(tmp_path, args, option):
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    _check_one_line(_run_cli(["--run-dir", str(tmp_path / "never"), *args]), option)


def test_validation_slice_is_apart_from_the_heldout_slice_and_from_training():
    from lsgd_hpc.data.loaders import load_dataset
    from lsgd_hpc.data.splits import split_heldout, split_validation
    ds = load_dataset("digits", seed=3)
    train, val = split_validation(ds, 200, seed=3)
    assert train.n_train == ds.n_train - 200 and torch.equal(train.x_test, ds.x_test)
    assert torch.equal(val, split_validation(load_dataset("digits", seed=3), 200, 3)[1])
    # not the leader score's draw with the same seed and size
    assert not torch.equal(val, split_heldout(ds, 200, seed=3)[1])
    keep = torch.tensor(sorted(set(range(ds.n_train)) - set(val.tolist())))
    assert torch.equal(train.x_train, ds.x_train[keep])
    # the held-out slice is then drawn from what is left: no sample in both
    rest, held = split_heldout(train, 100, seed=3)
    val_rows = {r.numpy().tobytes() for r in ds.x_train[val]}
    assert not val_rows & {r.numpy().tobytes() for r in train.x_train[held]}
    assert not val_rows & {r.numpy().tobytes() for r in rest.x_train}


@pytest.mark.mpi
def test_validation_metrics_in_a_real_run(tmp_path):
    """EASGD on 2 ranks with --validation-size 150: fewer steps per epoch, and every
    evaluation row has val_* for the worker and for the centre; the worker's last val_accuracy
    and val_loss are those of its checkpointed model on the slice, computed here."""
    from lsgd_hpc.data.loaders import load_dataset
    from lsgd_hpc.data.splits import split_validation
    from lsgd_hpc.models.zoo import build_model
    from lsgd_hpc.runtime import checkpoint as ck
    run, seed, size = tmp_path / "val", 5, 150
    run_mpi(WORLD, [sys.executable, "-m", "lsgd_hpc.train", "--run-dir", str(run),
                    "--algorithm", "easgd", "--validation-size", str(size), "--seed", str(seed),
                    "--max-steps", "12", "--eval-every", "6", "--consensus-every", "0"],
            timeout=300)
    ranks = [read(run, r) for r in range(WORLD)]
    cfg = json.loads(ranks[0]["attrs"]["config"])
    # (1437 - 150) samples over 2 ranks, batches of 32: 643 // 32 = 20 steps (22 without)
    assert cfg["steps_per_epoch"] == 20 and cfg["validation_size"] == size
    ds = load_dataset("digits", seed=seed)
    _, idx = split_validation(ds, size, seed)
    x, y = ds.normalize(ds.x_train[idx]), ds.y_train[idx]
    for r, m in enumerate(ranks):
        ev = m["eval"]
        assert list(ev["step"]) == [6, 12]
        for col in ("val_loss", "val_accuracy", "center_val_loss", "center_val_accuracy"):
            assert len(ev[col]) == 2 and all(0 <= v < 10 for v in ev[col]), col
        model = build_model("digits_cnn", ds.num_classes, ds.input_shape)
        model.load_state_dict(ck.load_rank(str(run), 12, r)["objects"]["model"])
        model.eval()
        with torch.no_grad():
            out = model(x)
        loss = float(torch.nn.functional.cross_entropy(out, y))
        acc = int((out.argmax(1) == y).sum()) / len(y)
        assert ev["val_loss"][-1] == pytest.approx(loss, rel=1e-5)
        assert ev["val_accuracy"][-1] == pytest.approx(acc, abs=1e-9)
