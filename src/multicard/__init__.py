"""multicard: train image classifiers on one device, DataParallel or DDP, from one config."""

__version__ = "0.1.0"
