"""--dataset imagefolder: a train/<class>/, val/<class>/ folder streamed through a DataLoader,
sharded and augmented deterministically like the in-memory data sets."""

import os
import shutil
import sys

import h5py
import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw

from lsgd_hpc.data import cli as data_cli
from lsgd_hpc.data.errors import DataError
from lsgd_hpc.data.imagefolder import ImageFolderBatches, ImageFolderData
from lsgd_hpc.data.loaders import check_data_dir, load_dataset
from lsgd_hpc.data.sampler import ShardedBatches
from lsgd_hpc.data.splits import with_label_noise
from mpi_util import run_mpi

CLASSES = ("circle", "square", "triangle")
N_TRAIN, N_VAL = 50, 8          # per class


def _draw(path, cls: str, rng) -> None:
    w, h = (int(v) for v in rng.integers(16, 41, 2))
    bg = tuple(int(v) for v in rng.integers(0, 80, 3))
    fg = tuple(int(v) for v in rng.integers(150, 256, 3))
    img = Image.new("RGB", (w, h), bg)
    d = ImageDraw.Draw(img)
    box = (w // 5, h // 5, w - w // 5, h - h // 5)
    if cls == "circle":
        d.ellipse(box, fill=fg)
    elif cls == "square":
        d.rectangle(box, fill=fg)
    else:
        d.polygon([(box[0], box[3]), (box[2], box[3]), ((box[0] + box[2]) // 2, box[1])], fill=fg)
    img.save(path)


def make_folder(root, n_train=N_TRAIN, n_val=N_VAL, seed=0):
    rng = np.random.default_rng(seed)
    for split, n in (("train", n_train), ("val", n_val)):
        for cls in CLASSES:
            os.makedirs(root / split / cls)
            for i in range(n):
                _draw(root / split / cls / f"{i:03d}.{'png' if i % 2 else 'jpg'}", cls, rng)
    return root


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_folder(tmp_path_factory.mktemp("imgs") / "shapes")


@pytest.fixture(scope="module")
def ds(folder):
    return load_dataset("imagefolder", str(folder), image_size=16, data_workers=0)


def epoch(sb, e, start=0):
    return [(x.clone(), y.clone()) for x, y in sb.batches(e, start)]


def same(a, b):
    return len(a) == len(b) and all(torch.equal(x1, x2) and torch.equal(y1, y2)
                                    for (x1, y1), (x2, y2) in zip(a, b))


def test_the_data_set_side(ds):
    assert isinstance(ds, ImageFolderData)
    assert (ds.name, ds.num_classes, ds.input_shape) == ("imagefolder", 3, (3, 16, 16))
    assert ds.class_names == CLASSES
    assert (ds.n_train, ds.n_test) == (3 * N_TRAIN, 3 * N_VAL)
    xs, ys = zip(*ds.test_batches(10))
    assert [len(y) for y in ys] == [10, 10, 4]
    assert all(x.shape[1:] == (3, 16, 16) and x.dtype == torch.float32 for x in xs)
    assert torch.cat(ys).tolist() == sorted(torch.cat(ys).tolist())   # val in order
    assert 0.2 < float(torch.cat(xs).std()) < 5   # normalized with ImageNet statistics
    assert same(list(ds.test_batches(10)), list(zip(xs, ys)))


def test_only_file_names_are_held(folder, monkeypatch):
    opened = []
    import PIL.Image
    real = PIL.Image.open
    monkeypatch.setattr(PIL.Image, "open", lambda *a, **k: opened.append(a[0]) or real(*a, **k))
    d = load_dataset("imagefolder", str(folder), image_size=16, data_workers=0)
    assert opened == []                                  # listing opens no image
    tensors = [k for k, v in vars(d).items() if isinstance(v, torch.Tensor)]
    tensors += [k for k, v in vars(d.train).items() if isinstance(v, torch.Tensor)]
    assert tensors == []
    assert d.train.paths.dtype.kind == "S" and d.train.paths.nbytes < 64 * d.n_train
    assert not hasattr(d.train, "samples")               # no list of Python tuples per image
    sb = ShardedBatches(d, 0, 1, 8, seed=0)
    next(iter(sb.batches(0)))
    assert len(opened) == 8                              # one decode per sample, on demand


def test_shards_are_disjoint_and_cover_each_epoch(ds):
    world, b = 3, 7
    sbs = [ShardedBatches(ds, r, world, b, seed=5) for r in range(world)]
    assert all(isinstance(s, ImageFolderBatches) for s in sbs)
    assert sbs[0].steps_per_epoch == (3 * N_TRAIN // world) // b
    for e in (0, 1):
        shards = [s.indices(e) for s in sbs]
        everything = torch.cat(shards)
        assert len(set(everything.tolist())) == len(everything) == ds.n_train   # 150 / 3
        got = torch.cat([y for s in sbs for _, y in s.batches(e)])
        assert len(got) == world * sbs[0].steps_per_epoch * b
    assert not torch.equal(sbs[0].indices(0), sbs[0].indices(1))   # reshuffled per epoch


def test_same_seed_same_batches_and_exact_resume(ds):
    a = ShardedBatches(ds, 1, 2, 8, seed=3)
    b = ShardedBatches(ds, 1, 2, 8, seed=3)
    full = epoch(a, 1)
    assert len(full) == a.steps_per_epoch == 9
    assert same(full, epoch(b, 1))
    assert same(full[4:], epoch(b, 1, start=4))            # resume mid-epoch, bit for bit
    assert epoch(b, 1, start=9) == []
    assert not same(full, epoch(ShardedBatches(ds, 1, 2, 8, seed=4), 1))
    assert not same(epoch(a, 0), full)
    # augment=False: val/'s resize and centre crop on the same shards, the same every time
    plain = ShardedBatches(ds, 1, 2, 8, seed=3, augment=False)
    p0 = epoch(plain, 1)
    assert same(p0, epoch(plain, 1)) and not same(p0, full)
    assert all(torch.equal(y1, y2) for (_, y1), (_, y2) in zip(p0, full))
    # the transform leaves the caller's RNG alone
    torch.manual_seed(0)
    state = torch.get_rng_state()
    epoch(a, 0)
    assert torch.equal(state, torch.get_rng_state())


def test_workers_give_the_same_batches(folder, ds):
    two = load_dataset("imagefolder", str(folder), image_size=16, data_workers=2)
    s0, s2 = ShardedBatches(ds, 0, 2, 16, seed=1), ShardedBatches(two, 0, 2, 16, seed=1)
    assert same(epoch(s0, 2), epoch(s2, 2))
    assert same(epoch(s0, 3, start=2), epoch(s2, 3, start=2))   # persistent workers, again
    assert same(list(ds.test_batches(16)), list(two.test_batches(16)))
    # a pass opened inside another (BatchNorm statistics during an evaluation) is independent
    outer = s2.batches(0)
    first = next(outer)
    inner = epoch(s2, 1)
    rest = [first] + list(outer)
    assert same(rest, epoch(s0, 0)) and same(inner, epoch(s0, 1))


def test_label_noise_changes_labels_only(ds):
    noisy = with_label_noise(ds, 0.2, seed=0)
    assert int((noisy.y_train != ds.y_train).sum()) == round(0.2 * ds.n_train)
    assert torch.equal(ds.y_test, noisy.y_test) and noisy.train.paths is ds.train.paths


def test_val_may_hold_a_subset_of_the_classes(tmp_path):
    root = make_folder(tmp_path / "d", n_train=3, n_val=2)
    shutil.rmtree(root / "val" / "circle")
    d = load_dataset("imagefolder", str(root), data_workers=0)
    assert d.num_classes == 3 and d.input_shape == (3, 32, 32)
    assert sorted(set(d.y_test.tolist())) == [1, 2]          # train/'s numbering


@pytest.mark.parametrize("case, words", [
    ("none", "needs --data-dir DIR"),
    ("missing", "does not exist"),
    ("no-val", "has no val/ folder"),
    ("no-train", "has no train/ folder"),
    ("one-class", "needs at least 2"),
    ("extra-val", "val has classes that train/ lacks: hexagon"),
    ("no-images", "train holds no images"),
    ("empty-class", "class folders without images: square"),
    ("empty-val", "val holds no images"),
])
def test_bad_folders_are_one_line_data_errors(tmp_path, case, words):
    root = tmp_path / "d"
    if case != "missing":
        make_folder(root, n_train=2, n_val=1)
    if case == "no-val":
        shutil.rmtree(root / "val")
    elif case == "no-train":
        shutil.rmtree(root / "train")
    elif case == "one-class":
        for c in CLASSES[1:]:
            shutil.rmtree(root / "train" / c)
    elif case == "extra-val":
        (root / "val" / "hexagon").mkdir()
    elif case in ("no-images", "empty-class", "empty-val"):
        split = "val" if case == "empty-val" else "train"
        for c in (CLASSES if case != "empty-class" else ["square"]):
            for f in (root / split / c).iterdir():
                f.rename(root / split / c / (f.name + ".txt"))
    with pytest.raises(DataError) as err:
        load_dataset("imagefolder", None if case == "none" else str(root), data_workers=0)
    msg = str(err.value)
    assert words in msg and "\n" not in msg, msg
    if case in ("none", "missing", "no-val", "no-train", "one-class", "extra-val"):
        with pytest.raises(DataError):      # the cheap check before MPI finds these too
            check_data_dir("imagefolder", None if case == "none" else str(root))


@pytest.mark.parametrize("workers", [0, 2])
def test_an_unreadable_image_is_named(tmp_path, workers):
    root = make_folder(tmp_path / "d", n_train=4, n_val=2)
    bad = root / "train" / "square" / "001.png"
    bad.write_bytes(b"not a png at all")
    d = load_dataset("imagefolder", str(root), image_size=16, data_workers=workers)
    with pytest.raises(DataError) as err:
        for _ in ShardedBatches(d, 0, 1, 12, seed=0).batches(0):
            pass
    msg = str(err.value)
    assert f"cannot read image {bad}" in msg and "\n" not in msg, msg
    assert data_cli.main(["check", "imagefolder", "--root", str(root)]) == 2


def test_check_command(folder, capsys):
    assert data_cli.main(["check", "imagefolder", "--root", str(folder)]) == 0
    out = capsys.readouterr().out
    assert "imagefolder in" in out and "150 train, 24 test images, 3 classes" in out


def test_config_options():
    from lsgd_hpc.cli.config import ConfigError, parse_config
    from lsgd_hpc.data.specs import dataset_spec
    assert dataset_spec("imagefolder").default_model == "resnet20"
    with pytest.raises(ConfigError, match="--data-dir: --dataset imagefolder needs --data-dir"):
        parse_config(["--dataset", "imagefolder"], env={})
    for bad, opt in ((["--image-size", "4"], "--image-size"),
                     (["--data-workers", "-1"], "--data-workers")):
        with pytest.raises(ConfigError, match=opt):
            parse_config(["--dataset", "synthetic", *bad], env={})


@pytest.mark.mpi
def test_cli_run_on_two_ranks(folder, tmp_path):
    run = tmp_path / "run"
    proc = run_mpi(2, [sys.executable, "-m", "lsgd_hpc.train", "--dataset", "imagefolder",
                       "--data-dir", str(folder), "--image-size", "16", "--data-workers", "1",
                       "--model", "mlp", "--algorithm", "allreduce", "--batch-size", "8",
                       "--max-steps", "5", "--eval-every", "5", "--lr", "0.01",
                       "--run-dir", str(run)], timeout=240)
    assert proc.returncode == 0
    for r in range(2):
        with h5py.File(run / "metrics" / f"rank{r:05d}.h5", "r") as f:
            assert list(f["train"]["step"][()]) == [1, 2, 3, 4, 5]
            assert np.all(np.isfinite(f["train"]["loss"][()]))
            assert list(f["eval"]["step"][()])[-1] == 5


def test_doctor_checks_the_image_folder_on_every_rank():
    from test_doctor import fact, judge
    ok = judge([fact(data_dir="/d"), fact(data_dir="/d")], dataset="imagefolder",
               data_dir="/d")["data folder"]
    assert ok == ("ok", "imagefolder readable on every rank in /d")
    bad = fact(data_dir="/d", data_error="--data-dir /d has no val/ folder")
    status, detail = judge([fact(data_dir="/d"), bad], dataset="imagefolder",
                           data_dir="/d")["data folder"]
    assert status == "FAIL" and "ranks 1" in detail and "no val/" in detail
