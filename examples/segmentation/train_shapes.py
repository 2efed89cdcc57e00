"""Semantic segmentation with multicard.Run: a small fully convolutional net labels every pixel of
synthetic images as background, disc or square; per-pixel cross-entropy, IoU per class.

    python examples/segmentation/train_shapes.py
    multicard run --nproc-per-node 2 examples/segmentation/train_shapes.py --epochs 8
    multicard run --nproc-per-node 2 examples/segmentation/train_shapes.py --strategy fsdp

The flip augmentation draws from the generator multicard passes (keyed by seed, epoch and sample),
so the run trains the same at any world size and resumes exactly after a stop.
"""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

import multicard

CLASSES = ("background", "disc", "square")

parser = argparse.ArgumentParser()
parser.add_argument("--out", default="runs/shapes")
parser.add_argument("--epochs", type=int, default=4)
parser.add_argument("--steps", type=int, default=0, help="stop after this many optimizer steps (0: the epochs)")
parser.add_argument("--samples", type=int, default=2048)
parser.add_argument("--size", type=int, default=32)
parser.add_argument("--batch-size", type=int, default=32)
parser.add_argument("--accum", type=int, default=1)
parser.add_argument("--lr", type=float, default=3e-3)
parser.add_argument("--precision", default="fp32")
parser.add_argument("--strategy", default="auto")
parser.add_argument("--checkpoint-every", type=int, default=0)
args = parser.parse_args()


class Shapes(torch.utils.data.Dataset):
    """Image i: noise, one disc and one square of random colours, places and sizes drawn from i."""

    def __init__(self, count: int, size: int, seed: int) -> None:
        self.count, self.size, self.seed = count, size, seed

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        s = self.size
        image = 0.3 * torch.rand(3, s, s, generator=g)
        mask = torch.zeros(s, s, dtype=torch.long)
        yy, xx = torch.meshgrid(torch.arange(s), torch.arange(s), indexing="ij")
        r = int(torch.randint(s // 8, s // 4, (), generator=g))
        cy, cx = torch.randint(r, s - r, (2,), generator=g).tolist()
        disc = (yy - cy) ** 2 + (xx - cx) ** 2 <= r * r
        side = int(torch.randint(s // 6, s // 3, (), generator=g))
        top, left = torch.randint(0, s - side, (2,), generator=g).tolist()
        square = (yy >= top) & (yy < top + side) & (xx >= left) & (xx < left + side)
        for label, where in ((1, disc), (2, square)):  # the square is drawn over the disc
            image[:, where] = torch.rand(3, 1, generator=g)
            mask[where] = label
        return image, mask


def flip(sample: tuple[torch.Tensor, torch.Tensor], g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    image, mask = sample
    if torch.rand((), generator=g) < 0.5:
        image, mask = image.flip(-1), mask.flip(-1)
    return image + 0.05 * torch.randn(image.shape, generator=g), mask


def net(classes: int) -> nn.Module:
    """Dilated convolutions: a receptive field of 31 pixels at full resolution, no normalisation."""
    layers, width = [], 3
    for dilation in (1, 1, 2, 4, 8):
        layers += [nn.Conv2d(width, 24, 3, padding=dilation, dilation=dilation), nn.ReLU()]
        width = 24
    return nn.Sequential(*layers, nn.Conv2d(width, classes, 1))


def iou_sums(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Sums over the batch: each class's intersection and union in pixels, and each image's loss."""
    images, masks = batch
    logits = model(images)
    predicted = logits.argmax(dim=1)
    sums = {"loss": F.cross_entropy(logits.float(), masks, reduction="none").mean(dim=(1, 2))}
    for c in range(1, len(CLASSES)):
        sums[f"inter_{c}"] = ((predicted == c) & (masks == c)).sum()
        sums[f"union_{c}"] = ((predicted == c) | (masks == c)).sum()
    return sums


run = multicard.Run(
    args.out, global_batch_size=args.batch_size, grad_accum=args.accum, precision=args.precision,
    strategy=args.strategy, max_steps=args.steps, checkpoint_every=args.checkpoint_every, log_every=5,
    best="val_miou",
)
model = net(len(CLASSES))
optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
model, optimizer = run.setup(model, optimizer)
scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.steps or 10_000)
train = run.loader(Shapes(args.samples, args.size, seed=0), transform=flip)
val_set = Shapes(args.samples // 4 + 3, args.size, seed=1)  # a size that no world size divides
run.state["loss_ema"] = torch.zeros((), dtype=torch.float64)  # the global batch's loss, averaged over steps

for epoch in run.epochs(args.epochs):
    for images, masks in train:
        loss = F.cross_entropy(model(images), masks)
        run.backward(loss)
        if run.step(optimizer, scheduler):
            global_loss = run.reduce_sum(loss.detach().double().clone()) / run.world_size
            run.state["loss_ema"] = 0.9 * run.state["loss_ema"] + 0.1 * global_loss.cpu()
        run.log(loss=loss)
    sums = run.evaluate(model, val_set, iou_sums)
    ious = [sums[f"inter_{c}"] / max(1.0, sums[f"union_{c}"]) for c in range(1, len(CLASSES))]
    run.log(val_loss=sums.mean("loss"), val_miou=sum(ious) / len(ious), val_samples=sums.samples)
    run.print(f"epoch {epoch}: IoU " + ", ".join(f"{n} {v:.3f}" for n, v in zip(CLASSES[1:], ious, strict=True)))
