"""`multicard plan`: per-device memory and step time of each strategy before any GPU is rented."""
