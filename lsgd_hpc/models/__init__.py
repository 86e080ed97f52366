"""The built-in networks (zoo) and BatchNorm helpers (batchnorm)."""

from .zoo import MODELS, build_model, load_factory

__all__ = ["MODELS", "build_model", "load_factory"]
