"""The one place the package version is written: pyproject.toml reads it, ``osdp.__version__`` and
``osdp --version`` report it, and the split op's build cache is keyed by it."""

__version__ = "0.1.0"
