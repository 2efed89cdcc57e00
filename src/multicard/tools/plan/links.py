"""Links between GPUs (inside a node) and between nodes, with the bandwidth collectives get.

Bandwidth is per direction, in bytes/s, for one GPU's share of the link: NVLink and PCIe
connect each GPU; InfiniBand is taken as one adapter per GPU (rail-optimised nodes such as
NVIDIA's DGX, 8 adapters for 8 GPUs); Ethernet as one adapter per node, shared by its GPUs.
NCCL reaches about ACHIEVABLE_LINK of these on large messages.
"""

from __future__ import annotations

from dataclasses import dataclass

from multicard.base.errors import UserError

ACHIEVABLE_LINK = 0.8  # NCCL bus bandwidth on large messages as a share of the link's rate


@dataclass(frozen=True)
class Link:
    name: str
    label: str
    bandwidth: float  # bytes/s per direction
    per_gpu: bool  # one port per GPU (else one per node, shared)
    latency_s: float  # per collective step (NCCL ring hop)
    aliases: tuple[str, ...] = ()


LINKS: tuple[Link, ...] = (
    # NVIDIA Tesla V100 datasheet: NVLink (2nd generation) 300 GB/s per GPU, both directions together.
    Link("nvlink2", "NVLink 2 (V100)", 150e9, True, 8e-6),
    # NVIDIA A100 datasheet: NVLink (3rd generation) 600 GB/s per GPU, both directions together.
    Link("nvlink3", "NVLink 3 (A100)", 300e9, True, 8e-6),
    # NVIDIA H100 datasheet: NVLink (4th generation) 900 GB/s per GPU, both directions together.
    Link("nvlink4", "NVLink 4 (H100/H200)", 450e9, True, 8e-6, aliases=("nvlink",)),
    # PCI-SIG PCI Express Base Specification 3.0 / 4.0 / 5.0: 8 / 16 / 32 GT/s per lane, x16:
    # about 16 / 32 / 64 GB/s per direction.
    Link("pcie3", "PCIe 3.0 x16", 16e9, True, 10e-6),
    Link("pcie4", "PCIe 4.0 x16", 32e9, True, 10e-6, aliases=("pcie",)),
    Link("pcie5", "PCIe 5.0 x16", 64e9, True, 10e-6),
    # NVIDIA ConnectX-6 / Quantum HDR InfiniBand datasheets: 200 Gb/s per port.
    Link("ib-hdr", "InfiniBand HDR 200 Gb/s per GPU", 25e9, True, 5e-6, aliases=("hdr",)),
    # NVIDIA ConnectX-7 / Quantum-2 NDR InfiniBand datasheets: 400 Gb/s per port.
    Link("ib-ndr", "InfiniBand NDR 400 Gb/s per GPU", 50e9, True, 5e-6, aliases=("ndr", "infiniband")),
    # IEEE 802.3 (100GBASE, 200GBASE, 400GBASE): 100 / 200 / 400 Gb/s per port, one port per node.
    Link("eth-100g", "Ethernet 100 Gb/s per node", 12.5e9, False, 20e-6, aliases=("100g", "ethernet")),
    Link("eth-200g", "Ethernet 200 Gb/s per node", 25e9, False, 20e-6, aliases=("200g",)),
    Link("eth-400g", "Ethernet 400 Gb/s per node", 50e9, False, 20e-6, aliases=("400g",)),
)

DEFAULT_BETWEEN_NODES = "ib-ndr"


def find_link(name: str) -> Link:
    key = name.lower().replace("_", "-").replace(" ", "")
    for link in LINKS:
        if key in {link.name, *link.aliases}:
            return link
    raise UserError(f"--interconnect {name} is not a link multicard plan knows; use one of "
                    f"{', '.join(link.name for link in LINKS)}")  # fmt: skip


def per_gpu_bandwidth(link: Link, gpus_per_node: int) -> float:
    """What one GPU gets of `link` when all GPUs of its node talk at once (achievable)."""
    share = link.bandwidth if link.per_gpu else link.bandwidth / max(1, gpus_per_node)
    return share * ACHIEVABLE_LINK
