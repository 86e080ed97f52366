"""One registry of methods: the CLI's choices, the public classes and the docs agree."""

import lsgd_hpc
from lsgd_hpc.cli import config
from lsgd_hpc.methods import METHODS


def test_cli_choices_are_the_registry():
    assert tuple(config.ALGORITHMS) == tuple(METHODS)


def test_every_method_is_exported_under_its_class_name():
    for cls in METHODS.values():
        assert getattr(lsgd_hpc, cls.__name__) is cls
        assert cls.__name__ in lsgd_hpc.__all__


def test_method_options_are_cli_options():
    """Each method's options are the CLI's options of the same names; only callables
    (score_fn) are the library's alone."""
    fields = set(config.Config.__dataclass_fields__)
    for name, cls in METHODS.items():
        assert cls.defaults == cls.spec.defaults
        unknown = set(cls.defaults) - fields
        assert unknown <= {"score_fn"}, (name, unknown)


def test_import_lsgd_hpc_loads_neither_torch_nor_mpi4py():
    import subprocess
    import sys
    code = ("import sys, lsgd_hpc, lsgd_hpc.aggregate, lsgd_hpc.summary; "
            "print('torch' in sys.modules, 'mpi4py' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "False"], out.stdout
