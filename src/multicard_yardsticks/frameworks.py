"""The same workload under Lightning and under Hugging Face Accelerate (the `bench` extra).

Each runs inside the processes torchrun's agent started, as their docs describe for torchrun,
with the plain loop's model, optimizer and on-device batches; only the training loop is theirs.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from multicard.base.config import Config
from multicard.runtime.clock import StepClock, summary_ms
from multicard.runtime.environment import detect_env
from multicard_yardsticks.plain import device_batches, device_for, model_for, optimizer_for, set_threads

LIGHTNING_PRECISION = {"fp32": "32-true", "bf16": "bf16-mixed", "fp16": "16-mixed", "fp64": "64-true"}
ACCELERATE_PRECISION = {"fp32": "no", "bf16": "bf16", "fp16": "fp16"}


def run_framework(
    runner: str, cfg: Config, strategy: str, world_size: int, warmup: int, steps: int
) -> dict[str, Any] | None:
    env = detect_env()
    processes = world_size if strategy == "ddp" else 1
    set_threads(cfg, processes)
    device = device_for(cfg, env.local_rank)
    batch = cfg.train.global_batch_size // processes
    clock = StepClock(device, warmup)
    run = _lightning if runner == "lightning" else _accelerate
    rank = run(cfg, device, strategy, processes, batch, env.rank, clock, warmup + steps)
    return {"step_ms": summary_ms(clock.times), "times": clock.times} if rank == 0 else None


def _lightning(
    cfg: Config, device: torch.device, strategy: str, processes: int, batch: int, rank: int,
    clock: StepClock, total: int,
) -> int:  # fmt: skip
    import lightning as L

    class Classifier(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = model_for(cfg, torch.device("cpu"))

        def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], index: int) -> torch.Tensor:
            x, y = batch
            return F.cross_entropy(self.model(x).float(), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return optimizer_for(cfg, self.model)

    class Clock(L.Callback):
        def on_train_batch_end(self, *args: Any) -> None:
            clock()

    trainer = L.Trainer(
        accelerator="gpu" if device.type == "cuda" else "cpu",
        devices=processes,
        strategy="ddp" if strategy == "ddp" else "auto",
        precision=LIGHTNING_PRECISION[cfg.precision],
        max_steps=total,
        callbacks=[Clock()],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
    )
    batches = device_batches(cfg, device, batch, rank)
    trainer.fit(Classifier(), train_dataloaders=_Epoch([next(batches) for _ in range(total)]))
    return trainer.global_rank


class _Epoch:
    """One epoch of ready batches (a plain list would be read as a list of dataloaders)."""

    def __init__(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.batches = batches

    def __iter__(self) -> Any:
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


def _accelerate(
    cfg: Config, device: torch.device, strategy: str, processes: int, batch: int, rank: int,
    clock: StepClock, total: int,
) -> int:  # fmt: skip
    from accelerate import Accelerator

    accelerator = Accelerator(mixed_precision=ACCELERATE_PRECISION.get(cfg.precision, "no"), cpu=device.type == "cpu")
    model = model_for(cfg, accelerator.device)
    model, optimizer = accelerator.prepare(model, optimizer_for(cfg, model))
    batches = device_batches(cfg, accelerator.device, batch, rank)
    for _ in range(total):
        x, y = next(batches)
        loss = F.cross_entropy(model(x).float(), y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        clock()
    process = accelerator.process_index
    accelerator.end_training()
    return process
