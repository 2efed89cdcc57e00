"""What every multi-process strategy shares: collectives over the process group, and BatchNorm
statistics over the global batch (sync_bn)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.nn as nn

from multicard.runtime.process_group import ProcessContext
from multicard.strategy.base import ModelSetup, Strategy
from multicard.strategy.precision import Precision
from multicard.strategy.syncbn import convert_global_batchnorm


class DistributedStrategy(Strategy):
    def __init__(self, ctx: ProcessContext, precision: Precision, setup: ModelSetup, sync_bn: bool) -> None:
        super().__init__(ctx, precision, setup)
        self.sync_bn = sync_bn
        # Control flags travel on the CPU: a gloo group beside NCCL (gloo's default group serves).
        # Every rank is a member of this group of all ranks: new_group returns a ProcessGroup, never NON_GROUP_MEMBER.
        self.control_group: dist.ProcessGroup | None = (
            cast(dist.ProcessGroup, dist.new_group(backend="gloo")) if dist.get_backend() != "gloo" else None
        )

    def convert(self, model: nn.Module) -> nn.Module:
        if not self.sync_bn:
            return model
        if self.ctx.device.type == "cuda":
            return nn.SyncBatchNorm.convert_sync_batchnorm(model)
        return convert_global_batchnorm(model)  # torch's SyncBatchNorm runs on GPUs only

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor

    def all_gather_object(self, obj: Any) -> list[Any]:
        return self.ctx.all_gather_object(obj)

    def broadcast_object(self, obj: Any) -> Any:
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def agree_buffers(self, bare: nn.Module) -> None:
        # Each rank's last training forward updated the running statistics from its own share of
        # the batch; evaluation and checkpoints must all see rank 0's (synced BatchNorm: equal already).
        # DDP and fsdp broadcast rank 0's before the next training forward anyway: nothing changes there.
        buffers = [b for b in bare.buffers() if b.numel()]
        if not self.sync_bn and buffers:
            broadcast_buffers(buffers)

    def start_max(self, value: int) -> Callable[[], int]:
        flag = torch.tensor([value], dtype=torch.int64)
        work = dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.control_group, async_op=True)
        assert work is not None  # async_op=True returns the Work to wait on

        def wait() -> int:
            work.wait()
            return int(flag.item())

        return wait


def broadcast_buffers(buffers: list[torch.Tensor]) -> None:
    """Rank 0's buffers on every rank, one broadcast per dtype (as DDP does before each forward)."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for b in buffers:
        by_dtype.setdefault(b.dtype, []).append(b)
    for group in by_dtype.values():
        flat = torch.cat([b.reshape(-1) for b in group])
        dist.broadcast(flat, src=0)
        offset = 0
        for b in group:
            b.copy_(flat[offset : offset + b.numel()].view_as(b))
            offset += b.numel()
