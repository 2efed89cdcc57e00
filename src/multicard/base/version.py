"""multicard's version: written into checkpoints and packs, shown by `multicard --version`."""

__version__ = "0.1.0"
