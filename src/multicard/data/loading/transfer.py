"""Host-to-device copies that let the host run ahead of the GPU."""

from __future__ import annotations

import torch


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Copy a CPU tensor to `device`.

    On CUDA the copy goes through pinned memory with non_blocking=True: from pageable memory
    CUDA may wait for the queued kernels before copying, which would keep the host from
    preparing the next batch while the GPU trains on this one. torch's pinned-memory cache
    keeps the staging buffer alive until the copy has run.
    """
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)
