"""The lazy public names of the package's faces (``lsgd_hpc``, ``lsgd_hpc.comm``,
``lsgd_hpc.data``, ``lsgd_hpc.runtime``): each ``__init__.py`` lists its names in
``_EXPORTS`` (name -> module that defines it) and takes its module ``__getattr__`` (and
``__dir__``) from here, so that importing the package loads none of them.

It imports nothing (not even typing: ``import lsgd_hpc`` loads it), so that every
sub-package may import it.
"""


def lazy_getattr(namespace: dict, exports: dict):
    """The module ``__getattr__`` of the package whose globals are ``namespace``: a name of
    ``exports`` is imported from its module on first use (relative to the package, unless
    the module is spelled ``lsgd_hpc.X``) and kept in the package's namespace."""
    package = namespace["__name__"]

    def __getattr__(name: str):
        if name in exports:
            import importlib
            where = exports[name]
            where = where if where.startswith("lsgd_hpc.") else f".{where}"
            value = getattr(importlib.import_module(where, package), name)
            namespace[name] = value
            return value
        raise AttributeError(f"module '{package}' has no attribute {name!r}")

    return __getattr__


def listed_dir(namespace: dict):
    """The module ``__dir__`` that lists the package's ``__all__``, sorted."""
    def __dir__() -> list:
        return sorted(namespace["__all__"])
    return __dir__
