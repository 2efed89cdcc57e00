"""The tools that drive the engine through the public API: bench, verify, plan, pack, input-split, report."""
