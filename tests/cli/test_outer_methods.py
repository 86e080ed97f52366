"""DiLoCo, SlowMo and LSGD's held-out leader score through the command line, under mpirun:
equivalence with local SGD in real runs, options refused with one line, and the held-out
slice (never trained on, what the election scores, booked as measurement time)."""

import json
import sys

import h5py
import numpy as np
import pytest
import torch

from mpi_util import REPO, run_mpi
from test_reliability import _check_one_line, _run_cli

DRIVER = str(REPO / "tests" / "parallel" / "train_driver.py")
WORLD = 2


def read(run_dir, rank):
    with h5py.File(run_dir / "metrics" / f"rank{rank:05d}.h5", "r") as f:
        return {"attrs": dict(f.attrs), **{g: {c: f[g][c][()] for c in f[g]} for g in f}}


@pytest.mark.mpi
def test_diloco_and_slowmo_reduce_to_local_sgd_in_real_runs(tmp_path):
    """Outer lr 1 / momentum 0 (DiLoCo) and beta 0 / alpha 1 (SlowMo) are local SGD with the
    same period, step for step. Not bit for bit: DiLoCo forms x_prev - mean(x_prev - x_i)
    and SlowMo x_old - gamma (x_old - x) / gamma where local SGD forms mean(x_i), each a
    rounding of float32 numbers (eps 1.2e-7) that the following steps carry on; measured on
    this run: at most 1.1e-6 apart in loss over 48 steps. Identical until the first average;
    1e-5 is the tolerance (a wrong rule is off by far more: the default outer optimizer
    moves the loss by > 1e-2 here)."""
    common = ["--max-steps", "48", "--eval-every", "16", "--local-steps", "4",
              "--consensus-every", "0", "--seed", "3", "--outer-lr", "1", "--outer-momentum",
              "0", "--slowmo-beta", "0", "--slowmo-alpha", "1", "--slowmo-every", "8"]
    run_mpi(WORLD, [sys.executable, DRIVER, str(tmp_path / "r"), "local-sgd,diloco,slowmo",
                    "--", *common], timeout=300)
    run_mpi(WORLD, [sys.executable, DRIVER, str(tmp_path / "d"), "diloco", "--",
                    *common[:-12]], timeout=300)         # DiLoCo's default outer optimizer
    for r in range(WORLD):
        base = read(tmp_path / "r-local-sgd", r)["train"]["loss"]
        for name in ("diloco", "slowmo"):
            loss = read(tmp_path / f"r-{name}", r)["train"]["loss"]
            assert len(loss) == len(base) == 48
            assert np.array_equal(loss[:4], base[:4]), name
            assert np.abs(loss - base).max() <= 1e-5, (name, np.abs(loss - base).max())
        other = read(tmp_path / "d-diloco", r)["train"]["loss"]
        assert np.abs(other - base).max() > 1e-2


BAD = [
    (["--algorithm", "diloco", "--outer-lr", "-1"], "--outer-lr"),
    (["--algorithm", "diloco", "--outer-momentum", "1"], "--outer-momentum"),
    (["--algorithm", "diloco", "--local-steps", "auto"], "--local-steps"),
    (["--algorithm", "slowmo", "--local-steps", "4", "--slowmo-every", "6"], "--slowmo-every"),
    (["--algorithm", "slowmo", "--slowmo-beta", "1"], "--slowmo-beta"),
    (["--algorithm", "slowmo", "--slowmo-alpha", "0"], "--slowmo-alpha"),
    (["--leader-score", "test"], "--leader-score"),
    (["--algorithm", "lsgd-async", "--leader-score", "heldout"], "--leader-score"),
    (["--algorithm", "easgd", "--leader-score", "heldout"], "--leader-score"),
    (["--leader-score", "heldout", "--heldout-size", "0"], "--heldout-size"),
    (["--leader-score", "heldout", "--heldout-size", "5000"], "--heldout-size"),
    (["--algorithm", "diloco", "--fragments", "3"], "--fragments"),
    (["--algorithm", "diloco", "--fragments", "2", "--fragment-sync-delay", "4"],
     "--fragment-sync-delay"),
    (["--algorithm", "diloco", "--fragment-update-alpha", "2"], "--fragment-update-alpha"),
    (["--pull-delay", "4"], "--pull-delay"),
]


@pytest.mark.slow
@pytest.mark.parametrize("args,option", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_values_one_line_exit_2(tmp_path, args, option):
    _check_one_line(_run_cli(["--run-dir", str(tmp_path / "never"), *args]), option)


def test_config_parses_the_new_options():
    from lsgd_hpc.cli.config import parse_config
    cfg = parse_config(["--algorithm", "diloco", "--no-outer-nesterov", "--outer-lr", "0.5"],
                       env={})
    assert (cfg.outer_nesterov, cfg.outer_lr, cfg.outer_momentum) == (False, 0.5, 0.9)
    cfg = parse_config(["--algorithm", "slowmo", "--local-steps", "2"], env={})
    assert (cfg.slowmo_every, cfg.slowmo_beta, cfg.slowmo_alpha) == (48, 0.5, 1.0)
    assert parse_config(["--algorithm", "diloco"], env={}).outer_nesterov is True and \
        parse_config([], env={}).leader_score == "train"
    # another method's options are not resolved for lsgd
    assert parse_config([], env={}).outer_nesterov is None


def test_heldout_slice_is_fixed_by_seed_and_never_in_a_training_batch():
    from lsgd_hpc.data.loaders import load_dataset
    from lsgd_hpc.data.sampler import ShardedBatches
    from lsgd_hpc.data.splits import default_heldout_size, split_heldout
    ds = load_dataset("synthetic", seed=1, synthetic_size=600)
    train, held = split_heldout(ds, 60, seed=4)
    again, held2 = split_heldout(load_dataset("synthetic", seed=1, synthetic_size=600), 60, 4)
    assert torch.equal(held, held2) and torch.equal(train.x_train, again.x_train)
    assert not torch.equal(held, split_heldout(ds, 60, seed=5)[1])
    assert train.n_train == 540 and torch.equal(train.x_test, ds.x_test)
    keep = torch.tensor(sorted(set(range(600)) - set(held.tolist())))
    assert torch.equal(train.x_train, ds.x_train[keep])
    # every training batch of every rank over two epochs: none is a held-out sample
    held_rows = {ds.normalize(ds.x_train[i:i + 1]).numpy().tobytes() for i in held.tolist()}
    seen = 0
    for rank in range(3):
        sampler = ShardedBatches(train, rank, 3, 16, seed=4)
        for epoch in (0, 1):
            for xb, _ in sampler.batches(epoch):
                for row in xb:
                    assert row[None].numpy().tobytes() not in held_rows
                    seen += 1
    assert seen == 2 * 3 * (180 // 16) * 16
    assert default_heldout_size(1437) == 143 and default_heldout_size(50000) == 256


@pytest.mark.mpi
def test_heldout_leader_score_in_a_real_run(tmp_path):
    """--leader-score heldout: the slice leaves the training set (fewer steps per epoch), the
    election scores the held-out loss (the leader, whom the election's pull does not move,
    scores exactly the loss of its model in the checkpoint of that step), and the evaluation
    time is measurement (probe_seconds, out of the training time)."""
    from lsgd_hpc.runtime import checkpoint as ck
    from lsgd_hpc.data.loaders import load_dataset
    from lsgd_hpc.data.splits import split_heldout
    from lsgd_hpc.models.zoo import build_model
    run = tmp_path / "ho"
    seed, size = 6, 100
    run_mpi(WORLD, [sys.executable, "-m", "lsgd_hpc.train", "--run-dir", str(run),
                    "--leader-score", "heldout", "--heldout-size", str(size), "--seed",
                    str(seed), "--tau-local", "4", "--tau-global", "4", "--max-steps", "16",
                    "--eval-every", "8", "--consensus-every", "0"], timeout=300)
    ranks = [read(run, r) for r in range(WORLD)]
    cfg = json.loads(ranks[0]["attrs"]["config"])
    # 1437 - 100 samples over 2 ranks, batches of 32: 669 // 32 = 20 steps (22 without)
    assert cfg["steps_per_epoch"] == 20 and cfg["leader_score"] == "heldout"
    last = [{k: v[-1] for k, v in m["leader"].items()} for m in ranks]
    assert [row["step"] for row in last] == [16, 16]
    leader = int(last[0]["leader_rank"])
    assert min(range(WORLD), key=lambda r: (last[r]["score"], r)) == leader
    ds = load_dataset("digits", seed=seed)
    _, idx = split_heldout(ds, size, seed)
    model = build_model("digits_cnn", ds.num_classes, ds.input_shape)
    model.load_state_dict(ck.load_rank(str(run), 16, leader)["objects"]["model"])
    model.eval()
    with torch.no_grad():
        want = float(torch.nn.functional.cross_entropy(
            model(ds.normalize(ds.x_train[idx])), ds.y_train[idx], reduction="sum")) / size
    assert last[leader]["score"] == pytest.approx(want, rel=1e-6)
    for m in ranks:
        t = m["train"]
        assert np.all(t["probe_seconds"][t["step"] < 4] == 0)      # no election yet
        assert np.all(t["probe_seconds"][t["step"] >= 4] > 0)      # 4 elections, measured
        assert np.all(np.diff(t["probe_seconds"]) >= 0)
        left_out = (t["eval_seconds"] + t["probe_seconds"] + t["checkpoint_seconds"]
                    + t["metrics_seconds"])
        assert np.allclose(t["training_time"], t["wall_time"] - left_out, atol=1e-9)
