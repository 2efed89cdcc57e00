"""multicard's version: written into checkpoints and packs, shown by `multicard --version`;
the package's version too (pyproject.toml reads it from here)."""

__version__ = "0.2.0"
