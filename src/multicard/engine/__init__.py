"""The one training step (loop.py: micro-steps, backward, clip, step, schedule; stateful, with
callbacks), its phase timing, and what records are made of (meters.py)."""
