"""What `multicard bench` measures multicard against: the same workload in loops that are not
multicard's — a plain hand-written PyTorch loop, and Lightning's and Accelerate's.

Kept apart from the `multicard` package on purpose: no multicard training code runs in these
loops (they borrow only its model registry, embedded dataset and clocks, all below its training loop), so the ratio of
multicard's step time to theirs is what multicard adds.
"""
