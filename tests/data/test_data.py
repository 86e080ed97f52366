"""Data sets, sharding, augmentation, CIFAR-10 staging and the data CLI (single process)."""

import os
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from lsgd_hpc.data import cli as data_cli
from lsgd_hpc.data.augment import _crop_flip, random_crop_flip
from lsgd_hpc.data.cifar10_files import (CIFAR10_FILES, CIFAR10_TEST_FILES, CIFAR10_TRAIN_FILES,
                                         verify_cifar10_md5, write_cifar10_python)
from lsgd_hpc.data.errors import DataError
from lsgd_hpc.data.loaders import (CIFAR10_MEAN, CIFAR10_STD, check_data_dir, digits_arrays,
                                   load_dataset)
from lsgd_hpc.data.sampler import ShardedBatches

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def digits():
    return load_dataset("digits")


@pytest.fixture(scope="module")
def cifar_root(tmp_path_factory):
    """A CIFAR-10-format folder of 5 x 20 training and 20 test images (Python-2 style pickles)."""
    root = tmp_path_factory.mktemp("cifar")
    write_cifar10_python(str(root), per_batch=20, n_test=20, seed=3)
    return root


@pytest.fixture(scope="module")
def cifar(cifar_root):
    return load_dataset("cifar10", str(cifar_root))


def _py3_cifar_folder(root: Path, n: int = 4) -> dict:
    """CIFAR-10-format files written by this test with plain pickle; known pixels per file."""
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    raw = {}
    for k, name in enumerate(CIFAR10_TRAIN_FILES + CIFAR10_TEST_FILES):
        x = np.zeros((n, 3072), dtype=np.uint8)
        x[:, :] = np.arange(3072, dtype=np.int64) % 251  # a recognizable ramp
        x[1, 2 * 1024 + 5 * 32 + 7] = 200 + k            # image 1, channel 2 (blue), row 5, col 7
        labels = [(k + i) % 10 for i in range(n)]
        with open(folder / name, "wb") as f:
            pickle.dump({"data": x, "labels": labels, "batch_label": name}, f, protocol=2)
        raw[name] = (x, labels)
    with open(folder / "batches.meta", "wb") as f:
        pickle.dump({"label_names": [f"c{i}" for i in range(10)], "num_vis": 3072}, f, protocol=2)
    return raw


# -------------------------------------------------------------------------------- digits

def test_digits_sizes_split_and_normalization(digits):
    assert digits.num_classes == 10 and digits.input_shape == (1, 8, 8)
    assert digits.n_train + digits.n_test == 1797
    assert (digits.n_train, digits.n_test) == (1437, 360)
    assert digits.x_train.dtype == torch.float32 and digits.y_train.dtype == torch.int64
    assert digits.x_train.shape == (1437, 1, 8, 8) and digits.x_test.shape == (360, 1, 8, 8)
    assert float(digits.x_train.min()) >= 0.0 and float(digits.x_train.max()) <= 1.0  # pixel/16
    counts = torch.bincount(digits.y_test, minlength=10)
    assert int(counts.min()) >= 35 and int(counts.max()) <= 37  # stratified
    xn = digits.normalize(digits.x_train)
    assert xn.dtype == torch.float32
    assert abs(float(xn.mean())) < 1e-4 and abs(float(xn.std()) - 1.0) < 1e-3
    assert not digits.augment


def test_digits_are_sklearns_with_its_stratified_split(digits):
    """The digits read from scikit-learn's file without importing it, and the stored split,
    are exactly load_digits() and train_test_split(test_size=0.2, random_state=0,
    stratify=y)."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
    x, y = load_digits(return_X_y=True)
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=0.2, random_state=0, stratify=y)
    assert torch.equal(digits.x_train, torch.from_numpy((x_tr / 16.0).astype(np.float32))
                       .reshape(-1, 1, 8, 8))
    assert torch.equal(digits.x_test, torch.from_numpy((x_te / 16.0).astype(np.float32))
                       .reshape(-1, 1, 8, 8))
    assert torch.equal(digits.y_train, torch.from_numpy(y_tr).long())
    assert torch.equal(digits.y_test, torch.from_numpy(y_te).long())
    fx, fy = digits_arrays()
    assert np.array_equal(fx, x) and np.array_equal(fy, y)


def test_digits_split_is_stable_and_seed_independent(digits):
    other = load_dataset("digits", seed=123)
    assert torch.equal(other.x_train, digits.x_train) and torch.equal(other.y_test, digits.y_test)


def test_test_batches_cover_the_test_set(digits):
    ys = [y for _, y in digits.test_batches(100)]
    assert [len(y) for y in ys] == [100, 100, 100, 60]
    assert torch.equal(torch.cat(ys), digits.y_test)


# ------------------------------------------------------------------------------ sharding

@pytest.mark.parametrize("world", [1, 3, 4])
def test_shards_disjoint_and_covering(digits, world):
    shards = [ShardedBatches(digits, r, world, 16, seed=5) for r in range(world)]
    idx = [s.indices(2) for s in shards]
    n = digits.n_train
    assert len({len(i) for i in idx}) == 1 and len(idx[0]) == -(-n // world)
    allidx = torch.cat(idx)
    assert set(allidx.tolist()) == set(range(n))                  # covering
    pad = len(allidx) - n
    assert pad == (-n) % world
    assert len(set(allidx.tolist())) == n and len(allidx) == n + pad
    # disjoint apart from the wrap-around padding: the first n of the interleaving are distinct
    interleaved = torch.stack(idx, 1).reshape(-1)
    assert len(set(interleaved[:n].tolist())) == n
    assert all(s.steps_per_epoch == len(idx[0]) // 16 for s in shards)


def test_batches_are_the_shards_samples(digits):
    s = ShardedBatches(digits, 1, 3, 32, seed=0)
    idx = s.indices(0)
    got = list(s.batches(0))
    assert len(got) == s.steps_per_epoch == len(idx) // 32
    for i, (x, y) in enumerate(got):
        sel = idx[i * 32:(i + 1) * 32]
        assert x.shape == (32, 1, 8, 8) and x.dtype == torch.float32 and y.dtype == torch.int64
        assert torch.equal(y, digits.y_train[sel])
        assert torch.equal(x, digits.normalize(digits.x_train[sel]))


def test_epochs_differ_and_seeds_reproduce(digits):
    a = ShardedBatches(digits, 0, 2, 16, seed=7)
    b = ShardedBatches(digits, 0, 2, 16, seed=7)
    c = ShardedBatches(digits, 0, 2, 16, seed=8)
    assert not torch.equal(a.indices(0), a.indices(1))
    assert torch.equal(a.indices(3), b.indices(3))
    assert not torch.equal(a.indices(3), c.indices(3))
    for (xa, ya), (xb, yb) in zip(a.batches(4), b.batches(4)):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)


def test_resume_mid_epoch_is_bit_identical(cifar):
    s = ShardedBatches(cifar, 1, 2, 8, seed=11)
    assert s.augment  # cifar10 augments its training batches
    full = list(s.batches(3))
    k = 3
    tail = list(ShardedBatches(cifar, 1, 2, 8, seed=11).batches(3, start=k))
    assert len(full) == s.steps_per_epoch == 6 and len(tail) == len(full) - k
    for (xf, yf), (xt, yt) in zip(full[k:], tail):
        assert torch.equal(xf, xt) and torch.equal(yf, yt)
    assert list(s.batches(3, start=s.steps_per_epoch)) == []
    with pytest.raises(ValueError):
        s.batches(3, start=s.steps_per_epoch + 1)          # raises at the call
    tail_np = list(s.batches(np.int64(3), start=np.int64(k)))  # numpy integers are fine
    assert all(torch.equal(a[0], b[0]) for a, b in zip(tail_np, tail))


def _ids(batches):
    return [tuple(x.flatten(1).sum(1).tolist()) for x, _ in batches]


def test_survivors_reshard_at_the_next_epoch_and_resume_exactly(digits):
    """Rank 1 of 4 lost mid-epoch: the 3 survivors keep their shards to the epoch's end, then
    share the whole training set (their shards disjoint and covering it, more steps per
    epoch); a checkpoint taken while the reshard waits resumes in a 3-rank job exactly."""
    b, world = 16, 4
    old = [ShardedBatches(digits, r, world, b, seed=2) for r in range(world)]
    spe = old[0].steps_per_epoch
    fail = spe + 3                                  # mid-epoch 1
    survivors = [0, 2, 3]
    for new_rank, r in enumerate(survivors):
        s = old[r]
        assert s.position(fail) == (1, 3)
        s.reshard(new_rank, 3)
        assert s.next_boundary(fail) == 2 * spe and s.next_boundary(2 * spe) == 2 * spe
        before = _ids(s.from_step(fail))            # the rest of epoch 1: the old shard
        assert before == _ids(ShardedBatches(digits, r, world, b, seed=2).batches(1, 3))
        assert s.steps_per_epoch == spe and s.world_size == world
        # a checkpoint now, resumed by a 3-rank job's rank new_rank
        state = s.sampler.state_dict()
        resumed = ShardedBatches(digits, new_rank, 3, b, seed=2)
        resumed.sampler.load_state_dict(state)
        assert _ids(resumed.from_step(fail)) == before
        boundary = 2 * spe
        assert s.position(boundary) == (2, 0) == resumed.position(boundary)
        assert (s.rank, s.world_size) == (new_rank, 3) and s.steps_per_epoch > spe
        assert s.epoch_of(boundary + s.steps_per_epoch // 2) == pytest.approx(
            2 + (s.steps_per_epoch // 2) / s.steps_per_epoch)
        assert _ids(resumed.from_step(boundary)) == _ids(s.from_step(boundary))
    # epoch 2 over the survivors: disjoint shards that cover the training set
    idx = [set(old[r].indices(2).tolist()) for r in survivors]
    assert sum(map(len, idx)) == len(set().union(*idx)) + (3 * old[0].samples_per_rank
                                                            - digits.n_train)
    assert set().union(*idx) == set(range(digits.n_train))
    # the resumed job refuses a checkpoint written for another rank
    with pytest.raises(ValueError, match="written for rank 0 of 3"):
        ShardedBatches(digits, 1, 3, b, seed=2).sampler.load_state_dict(
            ShardedBatches(digits, 0, 4, b, seed=2).sampler.state_dict() | dict(
                rank=0, next_rank=0, next_size=3))


def test_a_full_size_resume_of_the_survivors_sampler(digits):
    """The set of 3 survivors (rank 1 of 4 lost) resumed by a 4-rank job. While the epoch of
    the loss is under way its 4-rank shards hold: every rank, the rejoined rank 1 too, goes
    on with its own shard of it. After the survivors resharded, a new 4-rank epoch begins
    at the set's step (the rest of the survivors' epoch is skipped), on every rank alike."""
    from lsgd_hpc.runtime.checkpoint import Rejoin
    b, world, survivors = 16, 4, [0, 2, 3]
    old = [ShardedBatches(digits, r, world, b, seed=2) for r in range(world)]
    spe = old[0].steps_per_epoch
    for new_rank, r in enumerate(survivors):
        old[r].reshard(new_rank, 3)
    # (a) the set of step spe + 3, mid-epoch 1 (the reshard still waits)
    at = spe + 3
    states = {r: old[r].sampler.state_dict() for r in survivors}
    for r in range(world):
        joined = r not in survivors
        full = ShardedBatches(digits, r, world, b, seed=2)
        full.sampler.load_rejoined(states[0 if joined else r],
                                   Rejoin(at, survivors, [1], not joined))
        assert _ids(full.from_step(at)) == _ids(ShardedBatches(digits, r, world, b,
                                                               seed=2).batches(1, 3))
        assert full.epoch_of(2 * spe) == 2 and full.steps_per_epoch == spe
    # (b) the set of step 2 * spe + 5: epoch 2 sharded over the 3 survivors
    at = 2 * spe + 5
    for r in survivors:
        old[r].position(2 * spe)                     # the survivors reshard at the boundary
    states = {r: old[r].sampler.state_dict() for r in survivors}
    assert states[0]["size"] == 3
    epochs = set()
    for r in range(world):
        joined = r not in survivors
        full = ShardedBatches(digits, r, world, b, seed=2)
        full.sampler.load_rejoined(states[0 if joined else r],
                                   Rejoin(at, survivors, [1], not joined))
        assert full.position(at) == (3, 0) and full.epoch_of(at) == 3
        assert _ids(full.from_step(at)) == _ids(ShardedBatches(digits, r, world, b,
                                                               seed=2).batches(3, 0))
        # its state is a plain 4-rank sampler's from then on
        assert full.sampler.state_dict() == dict(
            ShardedBatches(digits, r, world, b, seed=2).sampler.state_dict(),
            base_step=at, base_epoch=3)
        epochs.add(full.epoch_of(at + spe + 1))
    assert len(epochs) == 1 and epochs.pop() == pytest.approx(4 + 1 / spe)
    with pytest.raises(ValueError, match="sharding differs .*seed 2 -> 5"):
        ShardedBatches(digits, 1, world, b, seed=5).sampler.load_rejoined(
            states[0], Rejoin(at, survivors, [1], False))


def test_batch_too_large_names_batch_size(digits):
    with pytest.raises(DataError, match="--batch-size"):
        ShardedBatches(digits, 0, 4, 400, seed=0)   # 360 samples per rank
    with pytest.raises(DataError, match="--batch-size"):
        ShardedBatches(digits, 0, 1, 0, seed=0)
    assert ShardedBatches(digits, 0, 4, 360, seed=0).steps_per_epoch == 1
    assert ShardedBatches(digits, 0, 4, 100, seed=0, drop_last=False).steps_per_epoch == 4
    with pytest.raises(ValueError):
        ShardedBatches(digits, 4, 4, 10, seed=0)


# -------------------------------------------------------------------------- augmentation

def test_crop_flip_geometry():
    x = torch.arange(2 * 3 * 6 * 5, dtype=torch.uint8).reshape(2, 3, 6, 5)
    p = 2
    same = _crop_flip(x, torch.tensor([p, p]), torch.tensor([p, p]),
                        torch.tensor([False, True]), p)
    assert torch.equal(same[0], x[0]) and torch.equal(same[1], x[1].flip(-1))
    shifted = _crop_flip(x, torch.tensor([0, 2 * p]), torch.tensor([0, p]),
                           torch.tensor([False, False]), p)
    # offset 0: the image moves down/right by p, zero (black) border on top/left
    assert torch.equal(shifted[0, :, p:, p:], x[0, :, :-p, :-p])
    assert int(shifted[0, :, :p, :].abs().sum()) == 0 and int(shifted[0, :, :, :p].abs().sum()) == 0
    assert torch.equal(shifted[1, :, :-p, :], x[1, :, p:, :])
    assert int(shifted[1, :, -p:, :].abs().sum()) == 0


def test_random_crop_flip_changes_keeps_shape_and_is_deterministic(cifar):
    x = cifar.x_train[:16]
    a = random_crop_flip(x, torch.Generator().manual_seed(1))
    b = random_crop_flip(x, torch.Generator().manual_seed(1))
    c = random_crop_flip(x, torch.Generator().manual_seed(2))
    assert a.shape == x.shape and a.dtype == torch.uint8
    assert torch.equal(a, b) and not torch.equal(a, c) and not torch.equal(a, x)
    # every output image is one of the 9*9*2 crops/flips of its zero-padded input
    padded = torch.nn.functional.pad(x, (4, 4, 4, 4))
    for i in range(4):
        cands = [padded[i, :, r:r + 32, q:q + 32] for r in range(9) for q in range(9)]
        cands += [t.flip(-1) for t in cands]
        assert any(torch.equal(a[i], t) for t in cands)


def test_sharded_cifar_batches_are_augmented_and_normalized(cifar):
    aug = list(ShardedBatches(cifar, 0, 1, 10, seed=0).batches(0))
    plain = list(ShardedBatches(cifar, 0, 1, 10, seed=0, augment=False).batches(0))
    assert all(torch.equal(ya, yp) for (_, ya), (_, yp) in zip(aug, plain))
    assert any(not torch.equal(xa, xp) for (xa, _), (xp, _) in zip(aug, plain))
    x = aug[0][0]
    assert x.dtype == torch.float32 and x.shape == (10, 3, 32, 32)
    lo = (0 - torch.tensor(CIFAR10_MEAN)) / torch.tensor(CIFAR10_STD)
    hi = (1 - torch.tensor(CIFAR10_MEAN)) / torch.tensor(CIFAR10_STD)
    assert bool((x.amin(dim=(0, 2, 3)) >= lo - 1e-5).all())
    assert bool((x.amax(dim=(0, 2, 3)) <= hi + 1e-5).all())


# ------------------------------------------------------------------------------ CIFAR-10

def test_cifar_loads_files_through_torchvision(tmp_path, monkeypatch):
    import torchvision.datasets.cifar as tvc

    raw = _py3_cifar_folder(tmp_path, n=4)
    calls = []
    orig = tvc.CIFAR10.__init__

    def spy(self, *a, **kw):
        calls.append(kw.get("train"))
        assert kw.get("download") is False
        return orig(self, *a, **kw)

    monkeypatch.setattr(tvc.CIFAR10, "__init__", spy)
    ds = load_dataset("cifar10", str(tmp_path))
    assert sorted(calls) == [False, True]                 # both splits through torchvision
    assert ds.x_train.shape == (20, 3, 32, 32) and ds.x_train.dtype == torch.uint8
    assert ds.x_test.shape == (4, 3, 32, 32) and ds.num_classes == 10
    assert ds.class_names[3] == "c3" and ds.augment
    # data_batch_3 is the third file: its image 1 is training image 2*4+1
    assert int(ds.x_train[9, 2, 5, 7]) == 202 and int(ds.x_test[1, 2, 5, 7]) == 205
    assert int(ds.x_train[9, 0, 1, 2]) == (32 + 2) % 251           # channel 0, row 1, col 2
    assert ds.y_train.tolist() == sum((raw[f][1] for f in CIFAR10_TRAIN_FILES), [])
    assert ds.y_test.tolist() == raw["test_batch"][1]
    # the folder itself is accepted as --data-dir too
    assert load_dataset("cifar10", str(tmp_path / "cifar-10-batches-py")).n_train == 20


def test_cifar_python2_format_round_trip(cifar_root, cifar):
    with open(cifar_root / "cifar-10-batches-py" / "data_batch_2", "rb") as f:
        raw = pickle.load(f, encoding="bytes")        # the way the CIFAR-10 page reads them
    assert raw[b"data"].shape == (20, 3072) and raw[b"data"].dtype == np.uint8
    assert torch.equal(cifar.x_train[20:40].reshape(20, -1), torch.from_numpy(raw[b"data"]))
    assert cifar.y_train[20:40].tolist() == raw[b"labels"]
    assert (cifar.n_train, cifar.n_test, cifar.num_classes) == (100, 20, 10)
    x = cifar.x_train[:2].clone()
    x[0, :, 0, 0] = 0
    x[0, :, 0, 1] = 255
    xn = cifar.normalize(x)
    mean, std = torch.tensor(CIFAR10_MEAN), torch.tensor(CIFAR10_STD)
    assert torch.allclose(xn[0, :, 0, 0], -mean / std)
    assert torch.allclose(xn[0, :, 0, 1], (1 - mean) / std)


def test_cifar_missing_folder_or_file_is_a_one_line_data_error(tmp_path, cifar_root):
    with pytest.raises(DataError, match="lsgd_hpc.data fetch") as e:
        load_dataset("cifar10", str(tmp_path / "nowhere"))
    assert "\n" not in str(e.value) and "does not exist" in str(e.value)
    with pytest.raises(DataError, match="lsgd_hpc.data fetch"):
        check_data_dir("cifar10", str(tmp_path))                 # no cifar-10-batches-py/
    with pytest.raises(DataError, match="--data-dir"):
        check_data_dir("cifar10", None)
    partial = tmp_path / "partial"
    write_cifar10_python(str(partial), files=[f for f in CIFAR10_FILES if f != "test_batch"])
    with pytest.raises(DataError, match="lsgd_hpc.data fetch") as e:
        load_dataset("cifar10", str(partial))
    assert "test_batch" in str(e.value) and "data_batch" not in str(e.value)
    check_data_dir("cifar10", str(cifar_root))                   # complete: no error
    check_data_dir("digits", None)
    with pytest.raises(DataError, match="unknown --dataset"):
        check_data_dir("mnist", None)


def test_cifar_corrupt_file_is_a_data_error(tmp_path):
    write_cifar10_python(str(tmp_path))
    with open(tmp_path / "cifar-10-batches-py" / "data_batch_4", "wb") as f:
        f.write(b"\x80\x02garbage")
    with pytest.raises(DataError, match="cannot read") as e:
        load_dataset("cifar10", str(tmp_path))
    assert "\n" not in str(e.value)
    with open(tmp_path / "cifar-10-batches-py" / "data_batch_4", "wb") as f:
        f.write(b"not a pickle")
    with pytest.raises(DataError, match="format"):
        check_data_dir("cifar10", str(tmp_path))


# ----------------------------------------------------------------------------- synthetic

def test_synthetic_is_seeded_and_learnable():
    a = load_dataset("synthetic", seed=1, synthetic_size=2000)
    b = load_dataset("synthetic", seed=1, synthetic_size=2000)
    c = load_dataset("synthetic", seed=2, synthetic_size=2000)
    assert (a.n_train, a.n_test, a.input_shape, a.num_classes) == (2000, 500, (3, 32, 32), 10)
    assert torch.equal(a.x_train, b.x_train) and not torch.equal(a.x_train, c.x_train)
    assert torch.bincount(a.y_train).tolist() == [200] * 10
    # nearest class mean of the training set classifies the test set far above chance (10 %)
    means = torch.stack([a.x_train[a.y_train == k].mean(0) for k in range(10)]).flatten(1)
    pred = torch.cdist(a.x_test.flatten(1), means).argmin(1)
    assert float((pred == a.y_test).float().mean()) > 0.6
    with pytest.raises(DataError):
        load_dataset("synthetic", synthetic_size=3)
    with pytest.raises(DataError, match="unknown --dataset"):
        load_dataset("imagenet")


# ----------------------------------------------------------------------------------- CLI

def _cli(*args):
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "lsgd_hpc.data", *args], capture_output=True,
                          text=True, env=env, timeout=120, cwd=str(REPO))


def test_cli_check_subprocess(cifar_root, tmp_path, capsys):
    ok = _cli("check", "cifar10", "--root", str(cifar_root), "--no-md5")
    assert ok.returncode == 0, ok.stderr
    assert "100 train, 20 test" in ok.stdout
    # the refusal from the same main() in this process (one torch import less)
    assert data_cli.main(["check", "cifar10", "--root", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert "lsgd_hpc.data fetch cifar10 --root" in err


def test_cli_check_md5_and_usage_errors(cifar_root, capsys):
    # md5 is checked by default: a hand-made folder loads, but is not the published data set
    assert data_cli.main(["check", "cifar10", "--root", str(cifar_root)]) == 2
    err = capsys.readouterr().err
    assert "md5" in err and "--no-md5" in err and len(err.strip().splitlines()) == 1
    assert len(verify_cifar10_md5(str(cifar_root))) == 7
    assert data_cli.main(["check", "digits"]) == 0
    assert "1437 train, 360 test" in capsys.readouterr().out
    assert data_cli.main(["check", "cifar10"]) == 2                       # no --root
    assert "--root" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        data_cli.main(["fetch", "digits", "--root", "x"])                 # fetch is for cifar10 only
    assert e.value.code == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


# ------------------------------------------------------------------------------ label noise

def test_label_noise_flips_exactly_p_of_the_training_labels_to_other_classes(digits):
    noisy = load_dataset("digits", seed=4, label_noise=0.4)
    wrong = noisy.y_train != digits.y_train
    assert int(wrong.sum()) == round(0.4 * digits.n_train)
    # a wrong label is one of the other classes, and every class receives some
    assert torch.bincount(noisy.y_train[wrong], minlength=10).min() > 0
    assert torch.equal(noisy.x_train, digits.x_train)
    assert torch.equal(noisy.y_test, digits.y_test) and torch.equal(noisy.x_test, digits.x_test)


def test_label_noise_depends_on_the_seed_only(digits):
    a = load_dataset("digits", seed=4, label_noise=0.3)
    b = load_dataset("digits", seed=4, label_noise=0.3)   # another rank of the same run
    c = load_dataset("digits", seed=5, label_noise=0.3)   # another seed
    assert torch.equal(a.y_train, b.y_train)
    assert not torch.equal(a.y_train, c.y_train)
    assert torch.equal(load_dataset("digits", seed=4, label_noise=0.0).y_train, digits.y_train)


@pytest.mark.parametrize("bad", ["1", "-0.1", "nan"])
def test_label_noise_outside_0_1_is_a_usage_error(bad):
    from lsgd_hpc.cli.config import ConfigError, parse_config
    with pytest.raises(ConfigError, match="--label-noise"):
        parse_config(["--label-noise", bad], env={})
    assert parse_config(["--label-noise", "0.25"], env={}).label_noise == 0.25
