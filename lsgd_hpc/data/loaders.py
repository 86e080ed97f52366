"""The data sets: digits (embedded), CIFAR-10 (staged files), synthetic images, a user's
factory (``module:callable``) and image folders (lsgd_hpc/data/imagefolder.py, streamed from
disk); ``load_dataset`` is the one entry, ``check_data_dir`` the cheap check before it."""

from __future__ import annotations

import os
import pickle
from typing import Optional, Tuple

import numpy as np
import torch

from lsgd_hpc.data.cifar10_files import (CIFAR10_FILES, CIFAR10_FOLDER, FETCH_HINT, cifar_root,
                                         looks_like_pickle)
from lsgd_hpc.data.dataset import Dataset
from lsgd_hpc.data.errors import DataError
from lsgd_hpc.data.seeds import SYNTH_TAG, generator
from lsgd_hpc.data.specs import DATASETS as _DATASET_SPECS
from lsgd_hpc.data.splits import with_label_noise

__all__ = ["DATASETS", "load_dataset", "check_data_dir",
           "load_plugin", "load_digits", "load_cifar10_dir", "load_synthetic_set",
           "load_imagefolder_dir", "CIFAR10_MEAN", "CIFAR10_STD"]

DATASETS = tuple(_DATASET_SPECS)   # the built-in data sets (lsgd_hpc.data.specs)

# The usual per-channel statistics of the CIFAR-10 training set, on pixels scaled to [0, 1].
CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)


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

#: scikit-learn's digits (1797 8x8 images), as its load_digits reads them
DIGITS_CSV = os.path.join("datasets", "data", "digits.csv.gz")
#: the fixed split of the digits: train_test_split(test_size=0.2, random_state=0,
#: stratify=y)'s training and test indices, in its order (tests check it against sklearn)
DIGITS_SPLIT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "digits_split.npz")


def digits_arrays() -> Tuple[np.ndarray, np.ndarray]:
    """(x float64 (1797, 64), y int64): scikit-learn's digits file read directly, without
    importing scikit-learn (its import is most of a rank's start-up otherwise)."""
    import importlib.util
    spec = importlib.util.find_spec("sklearn")      # located, not imported
    roots = list(spec.submodule_search_locations or []) if spec is not None else []
    path = next((os.path.join(r, DIGITS_CSV) for r in roots
                 if os.path.isfile(os.path.join(r, DIGITS_CSV))), None)
    if path is None:                    # another layout: through scikit-learn itself
        from sklearn.datasets import load_digits
        x, y = load_digits(return_X_y=True)
        return x, y.astype(np.int64)
    data = np.loadtxt(path, delimiter=",")
    return data[:, :-1], data[:, -1].astype(np.int64)


def _load_digits() -> Dataset:
    x, y = digits_arrays()
    # A fixed split, independent of the run's seed: every rank and every run sees the same one.
    with np.load(DIGITS_SPLIT) as split:
        train, test = split["train"].astype(np.int64), split["test"].astype(np.int64)
    x_tr, x_te, y_tr, y_te = x[train], x[test], y[train], y[test]
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
    g = generator(SYNTH_TAG, seed)
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
    root = cifar_root(data_dir)
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
    bad = [f for f in CIFAR10_FILES if not looks_like_pickle(os.path.join(folder, f))]
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
            return all(looks_like_pickle(os.path.join(folder, f))
                       for f, _ in self.train_list + self.test_list)

    return StagedCIFAR10


def _load_cifar10(data_dir: Optional[str]) -> Dataset:
    check_data_dir("cifar10", data_dir)
    root = cifar_root(str(data_dir))
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


# ------------------------------------------------------------------------------------ entry

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
