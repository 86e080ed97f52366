"""Data sets: the embedded digits, staged CIFAR-10, synthetic images, streamed image folders
(datasets, imagefolder), each described by its spec (specs: loader, default model, the
trainer's defaults on it, a preset of method options), and ``python -m lsgd_hpc.data`` to
stage and check them.

``lsgd_hpc.data.specs`` imports without torch; the loaders are imported on first use.
"""

__all__ = ["DATASETS", "Dataset", "DataError", "ShardedBatches", "load_dataset",
           "with_label_noise"]


def __getattr__(name):
    if name in __all__:
        from . import datasets
        return getattr(datasets, name)
    raise AttributeError(f"module 'lsgd_hpc.data' has no attribute {name!r}")
