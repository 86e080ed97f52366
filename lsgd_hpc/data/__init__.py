"""Data sets: the embedded digits, staged CIFAR-10, synthetic images (loaders), streamed image
folders (imagefolder), each described by its spec (specs: loader, default model, the
trainer's defaults on it, a preset of method options), label noise and held-out slices
(splits), per-rank sharding (sampler), and ``python -m lsgd_hpc.data`` to stage and check
them (cli).

``lsgd_hpc.data.specs`` and ``lsgd_hpc.data.errors`` import without torch; the other names
are imported on first use.
"""

#: public name -> module of this package that defines it
_EXPORTS = {
    "DATASETS": "loaders", "Dataset": "dataset", "load_dataset": "loaders",
    "DataError": "errors", "ShardedBatches": "sampler", "with_label_noise": "splits",
}

__all__ = ["DATASETS", "Dataset", "DataError", "ShardedBatches", "load_dataset",
           "with_label_noise"]


def __getattr__(name):
    if name in _EXPORTS:
        import importlib
        value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'lsgd_hpc.data' has no attribute {name!r}")


def __dir__():
    return sorted(__all__)
