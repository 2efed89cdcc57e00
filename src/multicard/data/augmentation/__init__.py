"""Randomness keyed by (seed, epoch, sample index): per-image transforms in loader workers, batched
augmentation on the device, sample policies, progressive resizing, mixup/CutMix."""
