"""Data sets (digits, CIFAR-10, synthetic, image folders), deterministic per-rank sharding, and
the staging CLI. Image folders stream from disk: see lsgd_hpc/data/imagefolder.py."""

from __future__ import annotations

import argparse
import dataclasses
import operator
import os
import pickle
import struct
import sys
from dataclasses import dataclass, field
from typing import Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch

from lsgd_hpc.data.specs import DATASETS as _DATASET_SPECS

__all__ = ["DATASETS", "DataError", "Dataset", "ShardedBatches", "check_data_dir",
           "load_dataset", "loader_options", "split_heldout", "default_heldout_size",
           "split_validation",
           "random_crop_flip", "with_label_noise", "verify_cifar10_md5", "write_cifar10_python",
           "main"]

DATASETS = tuple(_DATASET_SPECS)   # the built-in data sets (lsgd_hpc.data.specs)

CIFAR10_FOLDER = "cifar-10-batches-py"
CIFAR10_TRAIN_FILES = tuple(f"data_batch_{i}" for i in range(1, 6))
CIFAR10_TEST_FILES = ("test_batch",)
CIFAR10_META_FILE = "batches.meta"
CIFAR10_FILES = CIFAR10_TRAIN_FILES + CIFAR10_TEST_FILES + (CIFAR10_META_FILE,)
# The usual per-channel statistics of the CIFAR-10 training set, on pixels scaled to [0, 1].
CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)
FETCH_HINT = "python -m lsgd_hpc.data fetch cifar10 --root {root}"

# Domain tags, so that the permutation and the augmentation streams never share a seed.
_PERM_TAG = 0x5045524D
_AUG_TAG = 0x41554721
_SYNTH_TAG = 0x53594E54
_NOISE_TAG = 0x4E4F4953
_HELDOUT_TAG = 0x484F4C44
_VALID_TAG = 0x56414C49


class DataError(ValueError):
    """A user-facing data problem; the message is one line (the CLI prints it and exits 2)."""


def _seed(*parts: int) -> int:
    """A 63-bit seed mixed from integers (numpy's SeedSequence: stable across platforms)."""
    words = [int(p) & 0xFFFFFFFFFFFFFFFF for p in parts]
    return int(np.random.SeedSequence(words).generate_state(1, np.uint64)[0]) & (2**63 - 1)


def _int(v) -> Optional[int]:
    """v as a Python int (numpy and torch integers included), or None; bools are not ints."""
    if isinstance(v, bool):
        return None
    try:
        return operator.index(v)
    except TypeError:
        return None


def _generator(*parts: int) -> torch.Generator:
    return torch.Generator().manual_seed(_seed(*parts))


@dataclass
class Dataset:
    """A whole data set in memory, train and test, with its normalization.

    x_* are stored NCHW in a compact form: uint8 pixels for cifar10 (150 MB at full size),
    float32 otherwise.  ``normalize`` turns a batch of the stored form into the model's float32
    input: ``(x / pixel_scale - mean) / std`` per channel.
    """

    name: str
    num_classes: int
    input_shape: Tuple[int, int, int]
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    augment: bool
    mean: Tuple[float, ...] = (0.0,)
    std: Tuple[float, ...] = (1.0,)
    pixel_scale: float = 1.0
    class_names: Tuple[str, ...] = field(default_factory=tuple)

    def normalize(self, xb: torch.Tensor) -> torch.Tensor:
        """Stored form (N,C,H,W) or (C,H,W) -> normalized float32 of the same shape."""
        c = self.input_shape[0]
        mean = torch.as_tensor(self.mean, dtype=torch.float32).expand(c).reshape(c, 1, 1)
        std = torch.as_tensor(self.std, dtype=torch.float32).expand(c).reshape(c, 1, 1)
        x = xb.to(torch.float32)
        if self.pixel_scale != 1.0:
            x = x / self.pixel_scale
        return ((x - mean) / std).contiguous()

    def test_batches(self, batch_size: int) -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
        """The whole test set in order, normalized, in batches of at most ``batch_size``."""
        if batch_size < 1:
            raise DataError(f"evaluation batch size must be >= 1, got {batch_size}")
        for i in range(0, len(self.y_test), batch_size):
            yield self.normalize(self.x_test[i:i + batch_size]), self.y_test[i:i + batch_size]

    @property
    def n_train(self) -> int:
        return int(self.y_train.shape[0])

    @property
    def n_test(self) -> int:
        return int(self.y_test.shape[0])


# ------------------------------------------------------------------------- user factories

def load_plugin(spec: str, data_dir: Optional[str], seed: int) -> Dataset:
    """``--dataset module:callable``: the user's factory, called as ``f(data_dir, seed)``.

    It returns a :class:`Dataset`, or the four tensors ``(x_train, y_train, x_test, y_test)``:
    x float (N, C, H, W) already normalized, y int64 class indices 0..K-1 (K is taken as the
    largest label + 1). Everything is checked here; a problem is one DataError line."""
    from lsgd_hpc.models.zoo import load_factory
    try:
        factory = load_factory(spec)
    except ValueError as exc:
        raise DataError(str(exc)) from None
    try:
        out = factory(data_dir, seed)
    except Exception as exc:
        raise DataError(f"{spec}({data_dir!r}, {seed}) failed: {type(exc).__name__}: {exc}") from None
    if isinstance(out, Dataset):
        return out
    if not (isinstance(out, (tuple, list)) and len(out) == 4
            and all(isinstance(t, torch.Tensor) for t in out)):
        raise DataError(f"{spec} returned {type(out).__name__}; it must return an "
                        "lsgd_hpc.data.Dataset or four tensors (x_train, y_train, x_test, y_test)")
    x_tr, y_tr, x_te, y_te = out
    for name, x, y in (("train", x_tr, y_tr), ("test", x_te, y_te)):
        if x.dim() != 4 or not x.is_floating_point():
            raise DataError(f"{spec}: x_{name} must be float (N, C, H, W), got "
                            f"{x.dtype} {tuple(x.shape)}")
        if y.dim() != 1 or y.dtype != torch.int64 or len(y) != len(x) or len(y) == 0:
            raise DataError(f"{spec}: y_{name} must be int64 (N,) matching x_{name}, got "
                            f"{y.dtype} {tuple(y.shape)}")
    if tuple(x_tr.shape[1:]) != tuple(x_te.shape[1:]):
        raise DataError(f"{spec}: train and test samples differ in shape "
                        f"({tuple(x_tr.shape[1:])} vs {tuple(x_te.shape[1:])})")
    k = int(max(y_tr.max(), y_te.max())) + 1
    if int(min(y_tr.min(), y_te.min())) < 0 or k < 2:
        raise DataError(f"{spec}: labels must be class indices 0..K-1 with K >= 2")
    return Dataset(spec, k, tuple(int(s) for s in x_tr.shape[1:]), x_tr.float(), y_tr,
                   x_te.float(), y_te, augment=False)


# ----------------------------------------------------------------------------------- digits

def _load_digits() -> Dataset:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    # A fixed split, independent of the run's seed: every rank and every run sees the same one.
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=0.2, random_state=0, stratify=y)
    x_tr = torch.from_numpy((x_tr / 16.0).astype(np.float32)).reshape(-1, 1, 8, 8)
    x_te = torch.from_numpy((x_te / 16.0).astype(np.float32)).reshape(-1, 1, 8, 8)
    mean, std = float(x_tr.mean()), float(x_tr.std())
    return Dataset("digits", 10, (1, 8, 8), x_tr.contiguous(), torch.from_numpy(y_tr).long(),
                   x_te.contiguous(), torch.from_numpy(y_te).long(), augment=False,
                   mean=(mean,), std=(std,), class_names=tuple(str(i) for i in range(10)))


# -------------------------------------------------------------------------------- synthetic

def _load_synthetic(seed: int, size: int) -> Dataset:
    """Gaussian images around 10 smooth class means (3x8x8 patterns upsampled to 32x32).

    Signal 0.1 per pixel against unit noise: weak per pixel, separable over the whole image.
    With 4096 images the default MLP (SGD lr 0.05, momentum 0.9, batch 32) reaches about 84 %
    test accuracy after one epoch and 92 % after three, so curves rise over a few epochs.
    """
    if isinstance(size, bool) or not isinstance(size, int) or size < 8:
        raise DataError(f"synthetic data set size must be an integer >= 8, got {size!r}")
    g = _generator(_SYNTH_TAG, seed)
    k, shape = 10, (3, 32, 32)
    means = torch.randn(k, 3, 8, 8, generator=g)
    means = 0.1 * means.repeat_interleave(4, dim=2).repeat_interleave(4, dim=3)

    def make(n: int) -> Tuple[torch.Tensor, torch.Tensor]:
        y = torch.arange(n) % k
        y = y[torch.randperm(n, generator=g)]
        x = torch.randn(n, *shape, generator=g)
        x += means[y]
        return x.contiguous(), y.long()

    x_tr, y_tr = make(size)
    x_te, y_te = make(max(1, size // 4))
    return Dataset("synthetic", k, shape, x_tr, y_tr, x_te, y_te, augment=False,
                   mean=(0.0, 0.0, 0.0), std=(1.0, 1.0, 1.0),
                   class_names=tuple(f"class{i}" for i in range(k)))


# --------------------------------------------------------------------------------- CIFAR-10

def _cifar_root(data_dir: str) -> str:
    """Accept either the root holding cifar-10-batches-py/ or that folder itself."""
    d = os.path.abspath(os.path.expanduser(str(data_dir)))
    if os.path.basename(d.rstrip(os.sep)) == CIFAR10_FOLDER and \
            os.path.isfile(os.path.join(d, CIFAR10_META_FILE)):
        return os.path.dirname(d.rstrip(os.sep))
    return d


def _looks_like_pickle(path: str) -> bool:
    """CIFAR-10's python files are pickles of protocol 2: they start with PROTO (0x80)."""
    try:
        with open(path, "rb") as f:
            return f.read(1) == b"\x80"
    except OSError:
        return False


def check_data_dir(name: str, data_dir: Optional[str], option: str = "--data-dir") -> None:
    """Cheap validation (no loading) of where ``name``'s data would come from; raises DataError.

    Meant to run on every rank before the first MPI collective, so that a bad --data-dir stops
    all ranks with one line instead of a hang or a traceback.  digits and synthetic need no
    files (a given data_dir is ignored).  ``option`` is the option named in messages.
    imagefolder: the folder, train/ and val/, their class folders (no image is opened).
    """
    if ":" in name:                   # a user's factory checks its own folder
        return
    if name not in DATASETS:
        raise DataError(f"unknown --dataset {name!r}; choose from {', '.join(DATASETS)}")
    if name == "imagefolder":
        from lsgd_hpc.data.imagefolder import check_imagefolder_dir
        return check_imagefolder_dir(data_dir, option)
    if name != "cifar10":
        return
    if data_dir is None or str(data_dir).strip() == "":
        raise DataError(f"--dataset cifar10 needs {option} DIR holding cifar-10-batches-py/; "
                        "stage it on a login node with internet: " + FETCH_HINT.format(root="DIR"))
    root = _cifar_root(data_dir)
    hint = "stage it on a login node with internet: " + FETCH_HINT.format(root=root)
    if not os.path.exists(root):
        raise DataError(f"{option} {root} does not exist; {hint}")
    if not os.path.isdir(root):
        raise DataError(f"{option} {root} is not a directory; {hint}")
    folder = os.path.join(root, CIFAR10_FOLDER)
    if not os.path.isdir(folder):
        raise DataError(f"{option} {root} has no {CIFAR10_FOLDER}/ folder; {hint}")
    missing = [f for f in CIFAR10_FILES if not os.path.isfile(os.path.join(folder, f))]
    if missing:
        raise DataError(f"CIFAR-10 in {folder} is incomplete, missing {', '.join(missing)}; {hint}")
    unreadable = [f for f in CIFAR10_FILES if not os.access(os.path.join(folder, f), os.R_OK)]
    if unreadable:
        raise DataError(f"CIFAR-10 files in {folder} are not readable: {', '.join(unreadable)}")
    bad = [f for f in CIFAR10_FILES if not _looks_like_pickle(os.path.join(folder, f))]
    if bad:
        raise DataError(f"CIFAR-10 files in {folder} are not in the CIFAR-10 python format: "
                        f"{', '.join(bad)}; {hint}")


def _staged_cifar10_class():
    """torchvision's CIFAR10 with md5 checks replaced by presence-and-format checks.

    The loading itself (pickle.load of each batch, reshape to N x 32 x 32 x 3, meta file) is
    torchvision's code.  The md5 check stays on in the fetch and check commands
    (verify_cifar10_md5), where the data is staged once, not on every job start.
    """
    from torchvision.datasets import CIFAR10

    class StagedCIFAR10(CIFAR10):
        meta = dict(CIFAR10.meta, md5=None)  # _load_meta: check_integrity(path, None) = exists

        def _check_integrity(self) -> bool:
            folder = os.path.join(self.root, self.base_folder)
            return all(_looks_like_pickle(os.path.join(folder, f))
                       for f, _ in self.train_list + self.test_list)

    return StagedCIFAR10


def _load_cifar10(data_dir: Optional[str]) -> Dataset:
    check_data_dir("cifar10", data_dir)
    root = _cifar_root(str(data_dir))
    staged = _staged_cifar10_class()
    hint = "re-stage it: " + FETCH_HINT.format(root=root)
    splits = []
    for train in (True, False):
        try:
            ds = staged(root=root, train=train, download=False)
        except (OSError, RuntimeError, KeyError, ValueError, EOFError, TypeError, IndexError,
                AttributeError, pickle.UnpicklingError) as e:
            what = "training" if train else "test"
            msg = " ".join(str(e).split()) or type(e).__name__
            raise DataError(f"cannot read the CIFAR-10 {what} files in {root}/{CIFAR10_FOLDER} "
                            f"({type(e).__name__}: {msg}); {hint}") from None
        data = np.asarray(ds.data)
        if data.dtype != np.uint8 or data.ndim != 4 or data.shape[1:] != (32, 32, 3):
            raise DataError(f"CIFAR-10 images in {root}/{CIFAR10_FOLDER} have shape "
                            f"{data.shape} {data.dtype}, expected N x 32 x 32 x 3 uint8; {hint}")
        y = torch.as_tensor(np.asarray(ds.targets, dtype=np.int64))
        if y.shape[0] != data.shape[0]:
            raise DataError(f"CIFAR-10 in {root}/{CIFAR10_FOLDER} has {data.shape[0]} images but "
                            f"{y.shape[0]} labels; {hint}")
        # torchvision keeps HWC; back to the files' own CHW layout (a view, then one copy).
        x = torch.from_numpy(np.ascontiguousarray(data.transpose(0, 3, 1, 2)))
        splits.append((x, y, tuple(str(c) for c in ds.classes)))
    (x_tr, y_tr, classes), (x_te, y_te, _) = splits
    k = len(classes)
    for y in (y_tr, y_te):
        if len(y) and (int(y.min()) < 0 or int(y.max()) >= k):
            raise DataError(f"CIFAR-10 labels in {root}/{CIFAR10_FOLDER} fall outside 0..{k - 1} "
                            f"(batches.meta names {k} classes); {hint}")
    if len(y_tr) == 0 or len(y_te) == 0:
        raise DataError(f"CIFAR-10 in {root}/{CIFAR10_FOLDER} has an empty split; {hint}")
    return Dataset("cifar10", k, (3, 32, 32), x_tr, y_tr, x_te, y_te, augment=True,
                   mean=CIFAR10_MEAN, std=CIFAR10_STD, pixel_scale=255.0, class_names=classes)


def verify_cifar10_md5(data_dir: str) -> List[str]:
    """Names of the staged CIFAR-10 files whose md5 differs from the published data set."""
    from torchvision.datasets import CIFAR10
    from torchvision.datasets.utils import check_integrity

    folder = os.path.join(_cifar_root(data_dir), CIFAR10_FOLDER)
    expected = list(CIFAR10.train_list) + list(CIFAR10.test_list) + \
        [[CIFAR10.meta["filename"], CIFAR10.meta["md5"]]]
    return [name for name, md5 in expected if not check_integrity(os.path.join(folder, name), md5)]


class _Py2Pickler(pickle._Pickler):  # type: ignore[name-defined]
    """Pickles str and bytes as Python 2 byte strings (BINSTRING), like CIFAR-10's own files.

    The real files were written by Python 2's cPickle; torchvision reads them with
    encoding='latin1', so their b"data"/b"labels" keys come back as the str keys it indexes.
    """

    dispatch = dict(pickle._Pickler.dispatch)  # type: ignore[attr-defined]

    def save_py2_string(self, obj):
        data = obj.encode("latin1") if isinstance(obj, str) else bytes(obj)
        if len(data) < 256:
            self.write(pickle.SHORT_BINSTRING + bytes([len(data)]) + data)
        else:
            self.write(pickle.BINSTRING + struct.pack("<i", len(data)) + data)
        self.memoize(obj)

    dispatch[str] = save_py2_string
    dispatch[bytes] = save_py2_string


def write_cifar10_python(root: str, per_batch: int = 20, n_test: int = 20, seed: int = 0,
                         files: Sequence[str] = CIFAR10_FILES) -> str:
    """Write a small, random data set in CIFAR-10's python format under root/cifar-10-batches-py.

    For tests and dry runs on machines without the real data: five training batches of
    ``per_batch`` images, a test batch of ``n_test``, and batches.meta, each a protocol-2
    pickle of a dict with b"data" (N x 3072 uint8, channel-major rows), b"labels",
    b"batch_label", b"filenames" (b"label_names" etc. in batches.meta).  ``files`` selects which
    files to write.  Returns the folder.  Not md5-identical to CIFAR-10, of course.
    """
    folder = os.path.join(root, CIFAR10_FOLDER)
    os.makedirs(folder, exist_ok=True)
    rng = np.random.default_rng(seed)
    names = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship",
             "truck"]
    for fname in files:
        if fname == CIFAR10_META_FILE:
            obj = {"num_cases_per_batch": per_batch, "label_names": names, "num_vis": 3072}
        else:
            n = n_test if fname == "test_batch" else per_batch
            obj = {"batch_label": f"{fname} (synthetic)",
                   "labels": [int(v) for v in rng.integers(0, 10, n)],
                   "data": rng.integers(0, 256, (n, 3072), dtype=np.uint8),
                   "filenames": [f"img_{fname}_{i}.png" for i in range(n)]}
        with open(os.path.join(folder, fname), "wb") as f:
            _Py2Pickler(f, protocol=2).dump(obj)
    return folder


# ------------------------------------------------------------------------------------ entry

def loader_options(cfg) -> dict:
    """The keyword arguments of ``load_dataset`` that come from a training Config besides the
    positional ones: image size, DataLoader workers, pinned memory for CUDA."""
    return dict(image_size=cfg.image_size, data_workers=cfg.data_workers,
                pin_memory=cfg.device == "cuda")


# Each built-in data set's loader (named by its spec, lsgd_hpc.data.specs) takes the same
# keyword arguments and uses the ones that concern it.
def load_digits(data_dir=None, seed: int = 0, **_) -> "Dataset":
    return _load_digits()


def load_cifar10_dir(data_dir=None, seed: int = 0, **_) -> "Dataset":
    return _load_cifar10(data_dir)


def load_synthetic_set(data_dir=None, seed: int = 0, synthetic_size: int = 4096, **_):
    return _load_synthetic(seed, synthetic_size)


def load_imagefolder_dir(data_dir=None, seed: int = 0, image_size: int = 32,
                         data_workers: int = 2, pin_memory: bool = False, **_):
    from lsgd_hpc.data.imagefolder import load_imagefolder
    return load_imagefolder(data_dir, image_size, data_workers, pin_memory)


def load_dataset(name: str, data_dir: Optional[str] = None, seed: int = 0,
                 synthetic_size: int = 4096, label_noise: float = 0.0, *,
                 image_size: int = 32, data_workers: int = 2, pin_memory: bool = False):
    """Load a whole data set into memory, or, for imagefolder, list its files.

    digits: scikit-learn's 1,797 8x8 digits, a fixed stratified 80/20 split (1437/360).
    cifar10: from ``data_dir``/cifar-10-batches-py through torchvision (never downloads).
    synthetic: ``synthetic_size`` training and ``synthetic_size // 4`` test images, 3x32x32,
    10 classes, generated from ``seed`` (all ranks must pass the same seed).
    imagefolder: ``data_dir``/train/<class>/* and val/<class>/*, decoded per image by a
    DataLoader of ``data_workers`` processes at ``image_size`` pixels square (an
    ImageFolderData, not a Dataset: same interface, see lsgd_hpc/data/imagefolder.py).
    ``label_noise`` > 0: see ``with_label_noise`` (training labels only, from ``seed``).
    """
    from lsgd_hpc.data.specs import PLUGIN, dataset_spec
    try:
        spec = dataset_spec(name)
    except ValueError:
        raise DataError(f"unknown --dataset {name!r}; choose from {', '.join(DATASETS)}") \
            from None
    if spec is PLUGIN:
        ds = load_plugin(name, data_dir, seed)
    else:
        ds = spec.load_function()(data_dir=data_dir, seed=seed, synthetic_size=synthetic_size,
                                  image_size=image_size, data_workers=data_workers,
                                  pin_memory=pin_memory)
    return with_label_noise(ds, label_noise, seed) if label_noise else ds


def with_label_noise(ds: Dataset, p: float, seed: int) -> Dataset:
    """``ds`` with symmetric label noise of rate ``p`` on its training set; the test set is kept.

    Exactly ``round(p * n_train)`` training samples, a uniformly random subset, get a label
    drawn uniformly from the other ``k - 1`` classes, so a fraction ``p`` of the training
    labels is wrong and a wrong label carries no information about the true class. Both draws
    come from a generator seeded by ``seed`` alone: every rank of a run (same ``--seed``)
    trains on the same noisy labels, and each seed of an experiment on its own. For p below
    (k - 1) / k the true class stays the most frequent label of its images, so the Bayes
    classifier is unchanged and test accuracy measures how well training resists the noise.
    """
    p = float(p)
    if not 0.0 <= p < 1.0:
        raise DataError(f"label noise must be in [0, 1), got {p}")
    n, k = ds.n_train, ds.num_classes
    flip = int(round(p * n))
    if flip == 0:
        return ds
    g = _generator(_NOISE_TAG, seed)
    idx = torch.randperm(n, generator=g)[:flip]
    # adding 1..k-1 modulo k moves a label to a uniformly chosen other class
    shift = torch.randint(1, k, (flip,), generator=g)
    y = ds.y_train.clone()
    y[idx] = (y[idx] + shift) % k
    if not isinstance(ds, Dataset):    # an image folder: same files, other labels
        return ds.with_train_labels(y)
    return dataclasses.replace(ds, y_train=y)


def default_heldout_size(n_train: int) -> int:
    """--heldout-size when unset: 10% of the training set, at most 256, at least 1."""
    return max(1, min(256, n_train // 10))


def split_heldout(ds: Dataset, size: int, seed: int, option: str = "--heldout-size",
                  tag: int = _HELDOUT_TAG) -> Tuple[Dataset, torch.Tensor]:
    """Take a held-out slice of ``size`` training samples out of the training set.

    The slice is a uniformly random subset drawn from a generator seeded by ``seed`` alone,
    so every rank of a run (same ``--seed``) holds out the same samples. Returns the data
    set without them (training order otherwise kept; the test set untouched) and the sorted
    indices of the slice in the original training set (``ds.x_train[idx]``). ``option`` names
    the size in the error message; ``tag`` keeps the draws of different slices apart.
    """
    n = ds.n_train
    if isinstance(size, bool) or not isinstance(size, int) or not 1 <= size < n:
        raise DataError(f"{option} must be in 1..{n - 1} for {ds.name} ({n} training "
                        f"samples), got {size!r}")
    perm = torch.randperm(n, generator=_generator(tag, seed))
    held, keep = perm[:size].sort().values, perm[size:].sort().values
    train = dataclasses.replace(ds, x_train=ds.x_train[keep].contiguous(),
                                y_train=ds.y_train[keep].contiguous())
    return train, held


def split_validation(ds: Dataset, size: int, seed: int) -> Tuple[Dataset, torch.Tensor]:
    """Take a validation slice of ``size`` training samples out of the training set, for
    choosing settings without looking at the test set (--validation-size). Like
    :func:`split_heldout` (the same samples on every rank of a run, drawn from ``seed``) but
    from a stream of its own, and taken first: the leader score's held-out slice comes from
    what is left. Labels are the training set's, label noise included (what a user has)."""
    return split_heldout(ds, size, seed, option="--validation-size", tag=_VALID_TAG)


# ----------------------------------------------------------------------------- augmentation

def random_crop_flip(x: torch.Tensor, generator: torch.Generator, padding: int = 4) -> torch.Tensor:
    """Random crop back to H x W from the zero-padded batch, and a random horizontal flip.

    Vectorized over the batch (one gather); works on the stored form (uint8 or float), so the
    padding is black pixels as in torchvision's RandomCrop(32, padding=4).  Draws, in order,
    the N row offsets, N column offsets and N flips from ``generator``.
    """
    n, c, h, w = x.shape
    p = int(padding)
    rows0 = torch.randint(0, 2 * p + 1, (n,), generator=generator)
    cols0 = torch.randint(0, 2 * p + 1, (n,), generator=generator)
    flip = torch.randint(0, 2, (n,), generator=generator).bool()
    return _crop_flip(x, rows0, cols0, flip, p)


def _crop_flip(x: torch.Tensor, rows0: torch.Tensor, cols0: torch.Tensor, flip: torch.Tensor,
               p: int) -> torch.Tensor:
    n, c, h, w = x.shape
    padded = x.new_zeros((n, h + 2 * p, w + 2 * p, c))
    padded[:, p:p + h, p:p + w, :] = x.permute(0, 2, 3, 1)
    rows = rows0[:, None] + torch.arange(h)                       # (n, h)
    cols = cols0[:, None] + torch.arange(w)                       # (n, w)
    cols = torch.where(flip[:, None], cols.flip(1), cols)
    out = padded[torch.arange(n)[:, None, None], rows[:, :, None], cols[:, None, :]]  # n,h,w,c
    return out.permute(0, 3, 1, 2).contiguous()


# --------------------------------------------------------------------------------- sharding

class ShardedBatches:
    """This rank's share of every epoch, as in torch's DistributedSampler, plus augmentation.

    Epoch e: one permutation of the training indices from a generator seeded by (seed, e), the
    same on every rank, padded by wrapping to a multiple of world_size; rank r takes
    perm[r::world_size].  Batches of batch_size in that order (drop_last drops the short tail).
    Training batches of an augmenting data set (cifar10) are augmented with a generator seeded
    by (seed, rank, epoch, batch index).  Same (seed, rank, world_size, epoch, start) ->
    bit-identical batches, so ``batches(epoch, start=k)`` resumes exactly mid-epoch.

    A data set that streams from disk names its own subclass (``ds.sharded_batches``, an
    image folder's ImageFolderBatches): ``ShardedBatches(ds, ...)`` builds that one.
    """

    def __new__(cls, ds, *args, **kwargs):
        sub = getattr(ds, "sharded_batches", None)
        if cls is ShardedBatches and sub is not None:
            cls = sub
        return super().__new__(cls)

    def __init__(self, ds: Dataset, rank: int, world_size: int, batch_size: int, seed: int,
                 drop_last: bool = True, augment: Optional[bool] = None):
        w, r, b = _int(world_size), _int(rank), _int(batch_size)
        if w is None or w < 1:
            raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}")
        if r is None or not 0 <= r < w:
            raise ValueError(f"rank must be in 0..{w - 1}, got {rank!r}")
        if b is None or b < 1:
            raise DataError(f"--batch-size must be an integer >= 1, got {batch_size!r}")
        rank, world_size, batch_size = r, w, b
        n = ds.n_train
        if n == 0:
            raise DataError(f"data set {ds.name} has no training samples")
        self.ds = ds
        self.rank = rank
        self.world_size = world_size
        self.batch_size = batch_size
        if _int(seed) is None:
            raise ValueError(f"seed must be an integer, got {seed!r}")
        self.seed = _int(seed)
        self.drop_last = bool(drop_last)
        self.augment = ds.augment if augment is None else bool(augment)
        self.samples_per_rank = -(-n // world_size)
        self.total_size = self.samples_per_rank * world_size
        if self.drop_last:
            self.steps_per_epoch = self.samples_per_rank // batch_size
        else:
            self.steps_per_epoch = -(-self.samples_per_rank // batch_size)
        if self.steps_per_epoch == 0:
            raise DataError(
                f"--batch-size {batch_size} is larger than the {self.samples_per_rank} training "
                f"samples each of the {world_size} ranks gets from {ds.name} ({n} in all); "
                f"use --batch-size <= {self.samples_per_rank}")

    def __len__(self) -> int:
        return self.steps_per_epoch

    def indices(self, epoch: int) -> torch.Tensor:
        """This rank's training indices for ``epoch`` (samples_per_rank of them)."""
        n = self.ds.n_train
        perm = torch.randperm(n, generator=_generator(_PERM_TAG, self.seed, epoch))
        pad = self.total_size - n
        if pad:
            reps = -(-pad // n)
            perm = torch.cat([perm, perm.repeat(reps)[:pad]])
        return perm[self.rank:self.total_size:self.world_size]

    def batches(self, epoch: int, start: int = 0) -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
        """Yield (x, y) for batch indices start..steps_per_epoch-1 of ``epoch``.

        x is normalized (and, for training of an augmenting data set, augmented) float32 NCHW,
        y int64.  Bad arguments raise at the call, not at the first ``next``.
        """
        s, e = _int(start), _int(epoch)
        if s is None or not 0 <= s <= self.steps_per_epoch:
            raise ValueError(f"start must be in 0..{self.steps_per_epoch}, got {start!r}")
        if e is None or e < 0:
            raise ValueError(f"epoch must be an integer >= 0, got {epoch!r}")
        return self._iter(e, s)

    def _iter(self, epoch: int, start: int) -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
        idx = self.indices(epoch)
        b = self.batch_size
        for i in range(start, self.steps_per_epoch):
            sel = idx[i * b:(i + 1) * b]
            x = self.ds.x_train[sel]
            if self.augment:
                x = random_crop_flip(x, _generator(_AUG_TAG, self.seed, self.rank, epoch, i))
            yield self.ds.normalize(x), self.ds.y_train[sel]


# -------------------------------------------------------------------------------------- CLI

class _OneLineParser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2, no usage block
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())}\n")


def _fail(msg: str, code: int = 2) -> int:
    print(f"lsgd_hpc.data: error: {' '.join(str(msg).split())}", file=sys.stderr)
    return code


def _cmd_fetch(args) -> int:
    root = os.path.abspath(os.path.expanduser(args.root))
    try:
        os.makedirs(root, exist_ok=True)
    except OSError as e:
        return _fail(f"cannot create --root {root}: {e.strerror or e}")
    try:
        from torchvision.datasets import CIFAR10
        CIFAR10(root=root, train=True, download=True)
    except Exception as e:  # noqa: BLE001 - any network/IO failure is one line, exit 1
        msg = " ".join(str(e).split()) or type(e).__name__
        return _fail(f"downloading CIFAR-10 into {root} failed ({type(e).__name__}: {msg}); "
                     f"fetch needs internet: run it on a login node", 1)
    bad = verify_cifar10_md5(root)
    if bad:
        return _fail(f"downloaded CIFAR-10 in {root} fails its md5 check: {', '.join(bad)}; "
                     f"delete {os.path.join(root, CIFAR10_FOLDER)} and fetch again", 1)
    ds = _load_cifar10(root)
    print(f"cifar10 staged in {root}: {ds.n_train} train, {ds.n_test} test images, "
          f"{ds.num_classes} classes, md5 ok; train with --dataset cifar10 --data-dir {root}")
    return 0


def _cmd_check(args) -> int:
    if args.dataset == "cifar10":
        if args.root is None:
            return _fail("check cifar10 needs --root DIR (the folder holding cifar-10-batches-py/)")
        root = _cifar_root(args.root)
        check_data_dir("cifar10", root, option="--root")
        ds = load_dataset("cifar10", root)
        if args.no_md5:
            md5 = "md5 not checked"
        else:
            bad = verify_cifar10_md5(root)
            if bad:
                return _fail(f"CIFAR-10 in {root} loads, but {', '.join(bad)} differ from the "
                             f"published files (md5); re-stage it with "
                             f"{FETCH_HINT.format(root=root)}, or pass --no-md5 for a hand-made "
                             f"folder")
            md5 = "md5 ok"
        where = f" in {root}"
    elif args.dataset == "imagefolder":
        if args.root is None:
            return _fail("check imagefolder needs --root DIR (the folder holding train/ and val/)")
        from lsgd_hpc.data.imagefolder import unreadable_images
        check_data_dir("imagefolder", args.root, option="--root")
        ds = load_dataset("imagefolder", args.root)
        bad = unreadable_images(ds)
        if bad:
            more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
            return _fail(f"{len(bad)} of {ds.n_train + ds.n_test} images in {ds.root} do not "
                         f"decode: {'; '.join(bad[:3])}{more}")
        md5, where = "every image decodes", f" in {ds.root}"
    else:
        ds = load_dataset(args.dataset)
        md5, where = "built in", ""
    print(f"{ds.name}{where}: {ds.n_train} train, {ds.n_test} test images, {ds.num_classes} "
          f"classes, shape {'x'.join(map(str, ds.input_shape))}, {md5}")
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m lsgd_hpc.data {fetch,check} DATASET --root DIR``; returns the exit status."""
    parser = _OneLineParser(prog="python -m lsgd_hpc.data",
                            description="Stage and check the data sets of lsgd_hpc.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_OneLineParser)
    p = sub.add_parser("fetch", help="download CIFAR-10 (needs internet: run on a login node), "
                                     "then verify its md5 sums")
    p.add_argument("dataset", choices=["cifar10"])
    p.add_argument("--root", required=True, help="folder that will hold cifar-10-batches-py/")
    p = sub.add_parser("check", help="verify a staged data set and print its sizes")
    p.add_argument("dataset", choices=list(DATASETS))
    p.add_argument("--root", help="folder holding cifar-10-batches-py/ (cifar10), or train/ "
                                  "and val/ (imagefolder: every image is decoded once)")
    p.add_argument("--no-md5", action="store_true",
                   help="skip the md5 comparison with the published CIFAR-10 files")
    args = parser.parse_args(argv)
    try:
        return _cmd_fetch(args) if args.command == "fetch" else _cmd_check(args)
    except DataError as e:
        return _fail(str(e))
    except OSError as e:
        return _fail(f"{type(e).__name__}: {e}")


if __name__ == "__main__":
    sys.exit(main())
