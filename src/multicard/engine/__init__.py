"""The one training loop (loop.py) and the command line's classifier trainer on it, meters, phase timing,
the weights' EMA."""
