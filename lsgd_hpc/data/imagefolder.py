"""ImageNet-layout image folders, decoded lazily per image through a torch DataLoader.

``DIR/train/<class>/*.jpg|png|...`` and ``DIR/val/<class>/*``: the classes are train/'s
sub-folders, sorted; val/ holds the same classes or a subset (labels follow train/'s order).
Only the file names are held in memory (one numpy bytes array, relative to the split's
folder, so that forked workers share it without copy-on-write growth), never the pixels: a
data set larger than memory trains as well as a small one.

The objects here expose what the trainer uses of the in-memory data sets:
``ImageFolderData`` the data set side (``name``, ``num_classes``, ``input_shape``,
``n_train``, ``n_test``, ``test_batches``), ``ImageFolderBatches`` (what
``data.ShardedBatches`` builds for it) the per-rank side (``batches(epoch, start)``,
``steps_per_epoch``), with the same sharding as every other data set.

Augmentation (RandomResizedCrop + horizontal flip) of the sample at position j of batch i of
``epoch`` on ``rank`` runs under a torch RNG seeded from (seed, rank, epoch, i, j) inside
``__getitem__``, so a batch is the same whichever worker decodes it, with 0 workers or 8, and
``batches(epoch, start=k)`` resumes mid-epoch exactly.
"""

from __future__ import annotations

import os
from typing import Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torchvision.datasets import ImageFolder
from torchvision.datasets import folder as _folder
from torchvision.datasets.folder import IMG_EXTENSIONS, find_classes

from lsgd_hpc.data.errors import DataError
from lsgd_hpc.data.sampler import ShardedBatches
from lsgd_hpc.data.seeds import AUG_TAG

__all__ = ["IMAGENET_MEAN", "IMAGENET_STD", "DEFAULT_IMAGE_SIZE", "DEFAULT_WORKERS",
           "ImageFolderData", "ImageFolderBatches", "check_imagefolder_dir", "load_imagefolder",
           "unreadable_images"]

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
DEFAULT_IMAGE_SIZE = 32
DEFAULT_WORKERS = 2
LAYOUT = "train/<class>/ and val/<class>/ folders of images"


def _class_dirs(folder: str) -> List[str]:
    """Sub-folder names of ``folder``, sorted, as torchvision's ImageFolder finds them."""
    try:
        return list(find_classes(folder)[0])
    except FileNotFoundError:
        return []


def check_imagefolder_dir(data_dir: Optional[str], option: str = "--data-dir") -> None:
    """Cheap checks (directory listings, no image opened): raises a one-line DataError."""
    if data_dir is None or str(data_dir).strip() == "":
        raise DataError(f"--dataset imagefolder needs {option} DIR holding {LAYOUT}")
    root = os.path.abspath(os.path.expanduser(str(data_dir)))
    if not os.path.exists(root):
        raise DataError(f"{option} {root} does not exist (imagefolder needs {LAYOUT})")
    if not os.path.isdir(root):
        raise DataError(f"{option} {root} is not a directory (imagefolder needs {LAYOUT})")
    for split in ("train", "val"):
        if not os.path.isdir(os.path.join(root, split)):
            raise DataError(f"{option} {root} has no {split}/ folder (imagefolder needs {LAYOUT})")
    train = _class_dirs(os.path.join(root, "train"))
    if len(train) < 2:
        raise DataError(f"{root}/train has {len(train)} class folder(s); imagefolder needs at "
                        f"least 2 (train/<class>/<image>)")
    val = _class_dirs(os.path.join(root, "val"))
    if not val:
        raise DataError(f"{root}/val has no class folders (val/<class>/<image>)")
    extra = sorted(set(val) - set(train))
    if extra:
        shown = ", ".join(extra[:5]) + (f" and {len(extra) - 5} more" if len(extra) > 5 else "")
        raise DataError(f"{root}/val has classes that train/ lacks: {shown}")


class _Unreadable:
    """What a worker hands back instead of a batch holding an image it could not decode."""

    def __init__(self, path: str, why: str):
        self.path, self.why = path, why

    def error(self) -> DataError:
        return DataError(" ".join(f"cannot read image {self.path} ({self.why})".split()))


def _collate(items):
    for it in items:
        if isinstance(it, _Unreadable):
            return it
    xs, ys = zip(*items)
    return torch.stack(xs), torch.tensor(ys, dtype=torch.int64)


class _Split(ImageFolder):
    """torchvision's ImageFolder over a fixed class list, keeping only compact file names.

    An item is an index, or (index, seed): the transform then runs under a torch RNG
    seeded with ``seed`` (the caller's RNG state is left as it was). A file that cannot
    be decoded gives an _Unreadable, which the loading side raises as a DataError.
    """

    def __init__(self, root: str, classes: Sequence[str], transform):
        self._fixed_classes = list(classes)
        super().__init__(root, transform=transform)
        prefix = len(os.path.join(root, ""))
        self.paths = np.array([os.fsencode(p[prefix:]) for p, _ in self.samples],
                              dtype=np.bytes_)
        self.labels = np.asarray([t for _, t in self.samples], dtype=np.int64)
        del self.samples, self.imgs, self.targets   # lists of Python objects

    def find_classes(self, directory):
        return list(self._fixed_classes), {c: i for i, c in enumerate(self._fixed_classes)}

    @staticmethod
    def make_dataset(directory, class_to_idx, extensions=None, is_valid_file=None, **_):
        """torchvision's listing, one class at a time: a class without images (or without a
        folder, in val/) adds nothing instead of raising (allow_empty before torchvision 0.18)."""
        out = []
        for c in sorted(class_to_idx):
            try:
                out += _folder.make_dataset(directory, {c: class_to_idx[c]}, extensions,
                                            is_valid_file)
            except FileNotFoundError:
                pass
        return out

    def __len__(self) -> int:
        return len(self.paths)

    def path(self, index: int) -> str:
        return os.path.join(self.root, os.fsdecode(self.paths[index]))

    def __getitem__(self, item):
        index, seed = item if isinstance(item, tuple) else (item, None)
        path = self.path(index)
        try:
            img = self.loader(path)
            if seed is None:
                x = self.transform(img)
            else:
                with torch.random.fork_rng(devices=[]):
                    torch.manual_seed(int(seed))
                    x = self.transform(img)
        except Exception as exc:  # noqa: BLE001 - any decoding failure names the file
            from PIL import UnidentifiedImageError
            why = ("not an image format PIL can identify" if isinstance(exc, UnidentifiedImageError)
                   else f"{type(exc).__name__}: {exc}")
            return _Unreadable(path, why)
        return x, int(self.labels[index])


def _transforms(size: int, train: bool):
    from torchvision import transforms as T
    norm = [T.ToTensor(), T.Normalize(IMAGENET_MEAN, IMAGENET_STD)]
    if train:
        return T.Compose([T.RandomResizedCrop(size), T.RandomHorizontalFlip(), *norm])
    # the usual 224-of-256 evaluation crop, at any size
    return T.Compose([T.Resize(max(size, round(size * 256 / 224))), T.CenterCrop(size), *norm])


class ImageFolderData:
    """The data set side of an image folder: class names, sizes, the test batches.

    Holds file names and labels only. ``workers`` DataLoader worker processes decode images
    (0: in the calling process); ``pin_memory`` for CUDA runs.
    """

    name = "imagefolder"
    augment = True
    sharded_batches = property(lambda self: ImageFolderBatches)   # what ShardedBatches builds

    def __init__(self, root: str, image_size: int = DEFAULT_IMAGE_SIZE,
                 workers: int = DEFAULT_WORKERS, pin_memory: bool = False):
        self.root = root
        self.image_size = int(image_size)
        self.workers = int(workers)
        self.pin_memory = bool(pin_memory)
        classes = _class_dirs(os.path.join(root, "train"))
        self.train = _Split(os.path.join(root, "train"), classes, _transforms(image_size, True))
        self.val = _Split(os.path.join(root, "val"), classes, _transforms(image_size, False))
        self.class_names = tuple(classes)
        self.num_classes = len(classes)
        self.input_shape = (3, self.image_size, self.image_size)
        counts = np.bincount(self.train.labels, minlength=self.num_classes)
        empty = [c for c, n in zip(classes, counts) if n == 0]
        exts = " ".join(IMG_EXTENSIONS)
        if len(self.train) == 0:
            raise DataError(f"{root}/train holds no images (looked for {exts})")
        if empty:
            shown = ", ".join(empty[:5]) + (f" and {len(empty) - 5} more" if len(empty) > 5
                                            else "")
            raise DataError(f"{root}/train has class folders without images: {shown} "
                            f"(looked for {exts})")
        if len(self.val) == 0:
            raise DataError(f"{root}/val holds no images (looked for {exts})")

    @property
    def n_train(self) -> int:
        return len(self.train)

    @property
    def n_test(self) -> int:
        return len(self.val)

    @property
    def y_train(self) -> torch.Tensor:
        return torch.from_numpy(self.train.labels)

    @property
    def y_test(self) -> torch.Tensor:
        return torch.from_numpy(self.val.labels)

    def with_train_labels(self, y: torch.Tensor) -> "ImageFolderData":
        """This data set with other training labels (label noise); images are shared."""
        import copy
        out = copy.copy(self)
        out.train = copy.copy(self.train)
        out.train.labels = np.asarray(y, dtype=np.int64).copy()
        return out

    def loader(self, split, batches, persistent: bool = False) -> torch.utils.data.DataLoader:
        """A DataLoader over ``split`` whose batch sampler is ``batches`` (lists of items)."""
        w = self.workers
        # A generator of its own: the loader draws its workers' base seed from it, not from
        # torch's global RNG, which stays the trainer's (augmentation is seeded per sample).
        return torch.utils.data.DataLoader(
            split, batch_sampler=batches, num_workers=w, collate_fn=_collate,
            pin_memory=self.pin_memory, persistent_workers=persistent and w > 0,
            generator=torch.Generator().manual_seed(0))

    def test_batches(self, batch_size: int) -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
        """The whole val/ set in order, resized and centre-cropped, normalized."""
        if batch_size < 1:
            raise DataError(f"evaluation batch size must be >= 1, got {batch_size}")
        n = len(self.val)
        batches = [list(range(i, min(n, i + batch_size))) for i in range(0, n, batch_size)]
        return _raise_unreadable(self.loader(self.val, batches))


def _raise_unreadable(loader) -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
    for batch in loader:
        if isinstance(batch, _Unreadable):
            raise batch.error()
        yield batch


class _Batches(torch.utils.data.Sampler):
    """A batch sampler whose batches are set before each pass (persistent workers reuse it)."""

    def __init__(self):
        self.batches: List[list] = []

    def __iter__(self):
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


class ImageFolderBatches(ShardedBatches):
    """``ShardedBatches`` for an ImageFolderData: the same shards, decoded by a DataLoader.

    One DataLoader with persistent workers serves the epochs; a pass started while another
    is still open (BatchNorm statistics read during an evaluation mid-epoch) gets a loader
    of its own, so neither disturbs the other.
    """

    def __init__(self, ds: ImageFolderData, rank: int, world_size: int, batch_size: int,
                 seed: int, drop_last: bool = True, augment: Optional[bool] = None):
        super().__init__(ds, rank, world_size, batch_size, seed, drop_last, augment)
        self._sampler = _Batches()
        self._loader = None
        self._busy = False

    def items(self, epoch: int, i: int) -> list:
        """Batch ``i`` of ``epoch``: (index, augmentation seed) per sample, or plain indices."""
        b = self.batch_size
        idx = self.indices(epoch)[i * b:(i + 1) * b].tolist()
        if not self.augment:
            return idx
        words = [AUG_TAG, self.seed, self.rank, epoch, i]
        seeds = np.random.SeedSequence(words).generate_state(len(idx), np.uint64)
        return [(j, int(s) & (2**63 - 1)) for j, s in zip(idx, seeds)]

    def _iter(self, epoch: int, start: int) -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
        batches = [self.items(epoch, i) for i in range(start, self.steps_per_epoch)]
        split = self.ds.train
        if not self.augment:   # evaluation-style transform on the training images
            split = _split_view(self.ds.train, self.ds.val.transform)
        if self._busy or split is not self.ds.train:
            sampler = _Batches()
            sampler.batches = batches
            yield from _raise_unreadable(self.ds.loader(split, sampler))
            return
        if self._loader is None:
            self._loader = self.ds.loader(split, self._sampler, persistent=True)
        self._sampler.batches = batches
        self._busy = True
        try:
            yield from _raise_unreadable(self._loader)
        finally:
            self._busy = False


def _split_view(split, transform):
    import copy
    out = copy.copy(split)
    out.transform = transform
    return out


def load_imagefolder(data_dir: str, image_size: int = DEFAULT_IMAGE_SIZE,
                     workers: int = DEFAULT_WORKERS, pin_memory: bool = False) -> ImageFolderData:
    """Check ``data_dir`` and list its images (none is opened here)."""
    check_imagefolder_dir(data_dir)
    if isinstance(image_size, bool) or not isinstance(image_size, int) or image_size < 8:
        raise DataError(f"--image-size must be an integer >= 8, got {image_size!r}")
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 0:
        raise DataError(f"--data-workers must be an integer >= 0, got {workers!r}")
    root = os.path.abspath(os.path.expanduser(str(data_dir)))
    return ImageFolderData(root, image_size, workers, pin_memory)


def unreadable_images(ds: ImageFolderData) -> List[str]:
    """Every image of both splits that does not decode, as 'path (why)' (reads them all)."""
    bad: List[str] = []
    for split in (ds.train, ds.val):
        loader = torch.utils.data.DataLoader(split, batch_size=64, num_workers=ds.workers,
                                             collate_fn=_collect_unreadable)
        for found in loader:
            bad += found
    return bad


def _collect_unreadable(items) -> List[str]:
    return [f"{it.path} ({' '.join(it.why.split())})" for it in items
            if isinstance(it, _Unreadable)]
