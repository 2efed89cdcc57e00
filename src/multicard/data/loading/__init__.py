"""Batches for each rank: the sampler (the order of an epoch, independent of the world size), the
device and worker loaders, host-to-device copies, a user's dataset read by key."""
