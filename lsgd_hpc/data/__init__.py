"""Data sets: the embedded digits, staged CIFAR-10, synthetic images, streamed image folders
(datasets, imagefolder), and ``python -m lsgd_hpc.data`` to stage and check them."""

from .datasets import (DATASETS, Dataset, DataError, ShardedBatches, load_dataset,
                       with_label_noise)

__all__ = ["DATASETS", "Dataset", "DataError", "ShardedBatches", "load_dataset",
           "with_label_noise"]
