"""Data sets: the embedded digits, staged CIFAR-10, synthetic images (loaders), streamed image
folders (imagefolder), each described by its spec (specs: loader, default model, the
trainer's defaults on it, a preset of method options), label noise and held-out slices
(splits), per-rank sharding (sampler), and ``python -m lsgd_hpc.data`` to stage and check
them (cli).

``lsgd_hpc.data.specs`` and ``lsgd_hpc.data.errors`` import without torch; the other names
are imported on first use.
"""

from lsgd_hpc._exports import lazy_getattr as _lazy_getattr, listed_dir as _listed_dir

#: public name -> module of this package that defines it
_EXPORTS = {
    "DATASETS": "loaders", "Dataset": "dataset", "load_dataset": "loaders",
    "DataError": "errors", "ShardedBatches": "sampler", "with_label_noise": "splits",
}

__all__ = ["DATASETS", "Dataset", "DataError", "ShardedBatches", "load_dataset",
           "with_label_noise"]

__getattr__ = _lazy_getattr(globals(), _EXPORTS)
__dir__ = _listed_dir(globals())
del _lazy_getattr, _listed_dir
