"""Which strategy runs on which devices: decided once per process, before anything starts.

`resolve` is the only place that turns `strategy=auto` into a strategy and picks the GPUs; it has
the config check its options against them and the process count (`Config.check_run`, beside the
options). The launcher calls it before starting workers (so bad input costs no start-up), and each
worker once more for its own process.
"""

from __future__ import annotations

from dataclasses import dataclass

from multicard.base.config import Config, parse_devices
from multicard.base.errors import UserError
from multicard.runtime.process_group import resolve_gpus

ONE_PROCESS = ("single", "dp")  # strategies that run in one process


@dataclass(frozen=True)
class Topology:
    strategy: str  # single | dp | ddp
    gpus: list[int]  # GPU ids in use; [] = CPU
    world_size: int
    local_world_size: int

    @property
    def distributed(self) -> bool:
        """A process group is needed (ddp), even with one process."""
        return self.strategy not in ONE_PROCESS


def resolve_strategy(requested: str, launched: bool, world_size: int) -> str:
    """auto → ddp under a launcher (torchrun, srun, --nproc-per-node; even with one process),
    else single. single and dp cannot run as several processes."""
    if requested == "auto":
        return "ddp" if launched else "single"
    if requested in ONE_PROCESS and world_size > 1:
        raise UserError(
            f"strategy={requested} runs in one process but the launcher starts {world_size}; use strategy=ddp (or auto)"
        )
    return requested


def resolve(cfg: Config, world_size: int, local_world_size: int, launched: bool, training: bool = True) -> Topology:
    """The strategy and GPUs for `world_size` processes, or a one-line UserError saying what to change."""
    strategy = resolve_strategy(cfg.strategy, launched, world_size)
    gpus = resolve_gpus(parse_devices(cfg.devices))
    cfg.check_run(strategy, gpus, world_size, local_world_size, training)
    return Topology(strategy, gpus, world_size, local_world_size)
