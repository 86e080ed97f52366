"""The data sets, one :class:`DatasetSpec` each: name, loader, default model, input shape, the
trainer's defaults on it (a budget in epochs or steps, learning rate, batch size, evaluation
interval) and an optional preset of method options. Importable without torch.

A preset exists for small data sets, where the library's defaults (the papers' periods: LSGD
tau 64/128, DiLoCo H = 500) would not communicate at all within the run. The trainer applies
the preset unless ``--no-preset``, prints which values came from it and records them in the
run's configuration; a library loop reproduces a trainer run with
``lsgd_hpc.DATASETS["digits"].preset("lsgd")``.

To add a data set: a loader returning an ``lsgd_hpc.data.Dataset`` and a spec here
(docs/library.md, "Adding a data set").
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Mapping, Optional, Tuple

__all__ = ["DatasetSpec", "DATASETS", "PLUGIN", "dataset_spec", "TRAINER_DEFAULT_KEYS"]

#: trainer options a data set gives defaults for (each must be a trainer option)
TRAINER_DEFAULT_KEYS = ("epochs", "max_steps", "batch_size", "lr", "eval_every", "lr_schedule")


@dataclass(frozen=True)
class DatasetSpec:
    """One data set.

    ``loader``: ``"module:function"`` of its loader (imported when used);
    ``defaults``: the trainer's options on it (a budget in ``epochs`` or ``max_steps``,
    ``batch_size``, ``lr``, ``eval_every``, ``lr_schedule``); ``presets``: method name ->
    method options that replace the library's defaults on this data set (unless
    ``--no-preset``); ``why_preset``: one line saying why.
    """

    name: str
    summary: str
    loader: str
    default_model: str
    input_shape: Optional[Tuple[int, int, int]]
    num_classes: Optional[int]
    defaults: Mapping[str, Any]
    presets: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    why_preset: str = ""
    needs_data_dir: bool = False

    def __post_init__(self):
        unknown = set(self.defaults) - set(TRAINER_DEFAULT_KEYS)
        if unknown:
            raise TypeError(f"data set {self.name}: defaults for unknown options {unknown}")
        if "epochs" in self.defaults and "max_steps" in self.defaults:
            raise TypeError(f"data set {self.name}: a budget in epochs or in steps, not both")

    def preset(self, method: str) -> Dict[str, Any]:
        """The method options this data set's preset sets for ``method`` (``--algorithm``
        name; none for a method it does not name)."""
        return dict(self.presets.get(method, {}))

    def load_function(self) -> Callable:
        module, _, name = self.loader.partition(":")
        return getattr(importlib.import_module(module), name)


_SHORT_PERIODS = {
    "lsgd": {"tau_local": 4, "tau_global": 8},
    "lsgd-async": {"tau_local": 4, "tau_global": 8},
    "diloco": {"local_steps": 8},
    "slowmo": {"local_steps": 8},
}
_WHY_SHORT = ("a run of a few hundred steps: the library's periods (LSGD 64/128, DiLoCo "
              "H = 500) would hardly communicate in it")

DIGITS = DatasetSpec(
    name="digits",
    summary="scikit-learn's handwritten digits, shipped inside the package (1,437 train / "
            "360 test, 8x8)",
    loader="lsgd_hpc.data.loaders:load_digits", default_model="digits_cnn",
    input_shape=(1, 8, 8), num_classes=10,
    # A step budget, not epochs: at 16 ranks an epoch of each rank's shard is 2 steps, and
    # 8 epochs (16 steps) ended near 68 % test accuracy; 120 steps reach 98 % there, and
    # about 11 epochs at 4 ranks.
    defaults=dict(max_steps=120, batch_size=32, lr=0.05, eval_every=40),
    presets=_SHORT_PERIODS, why_preset=_WHY_SHORT)

CIFAR10 = DatasetSpec(
    name="cifar10",
    summary="CIFAR-10 read with torchvision from --data-dir (never downloaded on a compute "
            "node); random crop and flip",
    loader="lsgd_hpc.data.loaders:load_cifar10_dir", default_model="resnet20",
    input_shape=(3, 32, 32), num_classes=10,
    defaults=dict(epochs=200, batch_size=128, lr=0.1, eval_every=390, lr_schedule="step"),
    needs_data_dir=True)

SYNTHETIC = DatasetSpec(
    name="synthetic",
    summary="seeded Gaussian classes of 3x32x32 images, for benchmarks",
    loader="lsgd_hpc.data.loaders:load_synthetic_set", default_model="mlp",
    input_shape=(3, 32, 32), num_classes=10,
    defaults=dict(epochs=2, batch_size=64, lr=0.05, eval_every=50),
    presets=_SHORT_PERIODS, why_preset=_WHY_SHORT)

IMAGEFOLDER = DatasetSpec(
    name="imagefolder",
    summary="an ImageNet-layout folder --data-dir DIR (DIR/train/<class>/*, DIR/val/<class>/*), "
            "streamed from disk",
    loader="lsgd_hpc.data.loaders:load_imagefolder_dir", default_model="resnet20",
    input_shape=None, num_classes=None,
    defaults=dict(epochs=90, batch_size=64, lr=0.1, eval_every=500, lr_schedule="cosine"),
    needs_data_dir=True)

#: a user's data set (``--dataset module:callable``): any shape, any class count
PLUGIN = DatasetSpec(
    name="module:callable",
    summary="your own: load(data_dir, seed) returning tensors or an lsgd_hpc.data.Dataset",
    loader="lsgd_hpc.data.loaders:load_plugin", default_model="mlp",
    input_shape=None, num_classes=None,
    defaults=dict(epochs=10, batch_size=64, lr=0.05, eval_every=100))

#: the built-in data sets by name (``--dataset``)
DATASETS: Dict[str, DatasetSpec] = {s.name: s for s in (DIGITS, CIFAR10, SYNTHETIC,
                                                         IMAGEFOLDER)}


def dataset_spec(name: str) -> DatasetSpec:
    """The spec of ``name``: a built-in data set, or PLUGIN for ``module:callable``."""
    if ":" in str(name):
        return PLUGIN
    try:
        return DATASETS[name]
    except KeyError:
        raise ValueError(f"must be one of {', '.join(DATASETS)}, or module:callable, "
                         f"got {name!r}") from None
