"""From bytes to pixels: Pillow, simplejpeg and nvjpeg decoders, the choice among them, and the crop
plans made before decoding (large images)."""
