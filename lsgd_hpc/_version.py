"""The package's version (one place: the package's face, setup.cfg and the metrics files
read it)."""

__version__ = "0.2.0"
