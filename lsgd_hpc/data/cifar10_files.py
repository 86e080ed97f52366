"""CIFAR-10's python files on disk: their names, where a staged copy lives, the md5
comparison with the published files, and a writer of small look-alike folders for tests and
dry runs (write_cifar10_python)."""

from __future__ import annotations

import os
import pickle
import struct
from typing import List, Sequence

import numpy as np

__all__ = ["CIFAR10_FOLDER", "CIFAR10_TRAIN_FILES", "CIFAR10_TEST_FILES", "CIFAR10_META_FILE",
           "CIFAR10_FILES", "FETCH_HINT", "cifar_root", "looks_like_pickle",
           "verify_cifar10_md5", "write_cifar10_python"]

CIFAR10_FOLDER = "cifar-10-batches-py"
CIFAR10_TRAIN_FILES = tuple(f"data_batch_{i}" for i in range(1, 6))
CIFAR10_TEST_FILES = ("test_batch",)
CIFAR10_META_FILE = "batches.meta"
CIFAR10_FILES = CIFAR10_TRAIN_FILES + CIFAR10_TEST_FILES + (CIFAR10_META_FILE,)
FETCH_HINT = "python -m lsgd_hpc.data fetch cifar10 --root {root}"


def cifar_root(data_dir: str) -> str:
    """Accept either the root holding cifar-10-batches-py/ or that folder itself."""
    d = os.path.abspath(os.path.expanduser(str(data_dir)))
    if os.path.basename(d.rstrip(os.sep)) == CIFAR10_FOLDER and \
            os.path.isfile(os.path.join(d, CIFAR10_META_FILE)):
        return os.path.dirname(d.rstrip(os.sep))
    return d


def looks_like_pickle(path: str) -> bool:
    """CIFAR-10's python files are pickles of protocol 2: they start with PROTO (0x80)."""
    try:
        with open(path, "rb") as f:
            return f.read(1) == b"\x80"
    except OSError:
        return False


def verify_cifar10_md5(data_dir: str) -> List[str]:
    """Names of the staged CIFAR-10 files whose md5 differs from the published data set."""
    from torchvision.datasets import CIFAR10
    from torchvision.datasets.utils import check_integrity

    folder = os.path.join(cifar_root(data_dir), CIFAR10_FOLDER)
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
