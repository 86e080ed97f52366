"""The names of the former grab-bag module, each now in a module of its own: loaders (the data
sets, load_dataset, check_data_dir), splits (label noise, held-out and validation slices),
sampler (ShardedBatches), augment (random_crop_flip), cifar10_files (CIFAR-10's files, the
md5 check, the fixture writer), errors (DataError), seeds (the random streams' seeds) and cli
(``python -m lsgd_hpc.data``). They stay importable from here for older callers."""

from lsgd_hpc.data.augment import _crop_flip, random_crop_flip
from lsgd_hpc.data.cifar10_files import (CIFAR10_FILES, CIFAR10_FOLDER, CIFAR10_META_FILE,
                                         CIFAR10_TEST_FILES, CIFAR10_TRAIN_FILES, FETCH_HINT,
                                         verify_cifar10_md5, write_cifar10_python)
from lsgd_hpc.data.cifar10_files import cifar_root as _cifar_root
from lsgd_hpc.data.cifar10_files import looks_like_pickle as _looks_like_pickle
from lsgd_hpc.data.cli import main
from lsgd_hpc.data.errors import DataError
# load_digits, load_cifar10_dir, load_synthetic_set, load_imagefolder_dir, load_plugin: the
# loaders lsgd_hpc.data.specs names by "lsgd_hpc.data.datasets:<function>"
from lsgd_hpc.data.loaders import (CIFAR10_MEAN, CIFAR10_STD, DATASETS, Dataset, check_data_dir,
                                   load_cifar10_dir, load_dataset, load_digits,
                                   load_imagefolder_dir, load_plugin, load_synthetic_set,
                                   loader_options)
from lsgd_hpc.data.sampler import ShardedBatches
from lsgd_hpc.data.seeds import AUG_TAG as _AUG_TAG
from lsgd_hpc.data.seeds import generator as _generator
from lsgd_hpc.data.seeds import mix_seed as _seed
from lsgd_hpc.data.splits import (default_heldout_size, split_heldout, split_validation,
                                  with_label_noise)

__all__ = ["DATASETS", "DataError", "Dataset", "ShardedBatches", "check_data_dir",
           "load_dataset", "loader_options", "split_heldout", "default_heldout_size",
           "split_validation",
           "random_crop_flip", "with_label_noise", "verify_cifar10_md5", "write_cifar10_python",
           "main",
           # not in the old __all__, but importable from here before the split
           "CIFAR10_FILES", "CIFAR10_FOLDER", "CIFAR10_META_FILE", "CIFAR10_TEST_FILES",
           "CIFAR10_TRAIN_FILES", "CIFAR10_MEAN", "CIFAR10_STD", "FETCH_HINT", "load_plugin",
           "load_digits", "load_cifar10_dir", "load_synthetic_set", "load_imagefolder_dir",
           "_crop_flip", "_cifar_root", "_looks_like_pickle", "_AUG_TAG", "_generator", "_seed"]
