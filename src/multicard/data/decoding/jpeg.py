"""Optional faster JPEG decoding through simplejpeg (`pip install multicard[jpeg]`).

simplejpeg drives libjpeg-turbo with Pillow's settings (identical pixels on the ImageNet sample)
but decodes straight into a numpy array, skipping Pillow's 4-byte-per-pixel image and the copy
out of it: benchmarks/loader_throughput.py gets about a third more images per CPU-second with it.
Without it, or for any file it declines, Pillow decodes.
"""

from __future__ import annotations

import math

import numpy as np

try:
    import simplejpeg
except ImportError:  # the extra is not installed: Pillow decodes every file
    simplejpeg = None

AVAILABLE = simplejpeg is not None


def decode_scaled(data: bytes, width: int, height: int, reduce: int) -> np.ndarray | None:
    """(H, W, 3) uint8 RGB at 1/`reduce` of the full size (DCT scaling), or None to fall back.

    None when simplejpeg is absent, rejects the data (Pillow then decides whether it is
    readable: it tolerates what libjpeg only warns about), or scales differently than asked.
    """
    if simplejpeg is None:
        return None
    rows, cols = math.ceil(height / reduce), math.ceil(width / reduce)
    try:
        pixels = simplejpeg.decode_jpeg(data, "RGB", min_height=rows, min_width=cols)
    except ValueError:
        return None
    return pixels if pixels.shape[:2] == (rows, cols) else None
