"""A GAN with multicard.Run — the shape of pytorch/examples' dcgan: two networks with BatchNorm,
two optimizers, the discriminator's update then the generator's in each batch; here on small
synthetic images (a bright blob on noise).

    python examples/gan/train_gan.py
    multicard run --nproc-per-node 2 examples/gan/train_gan.py --epochs 10
    multicard run --nproc-per-node 2 examples/gan/train_gan.py --strategy fsdp

Each network is set up by run.setup with its optimizer and stepped by run.step; a step of the run
is one global batch (both updates), so a checkpoint or a stop never falls between them. BatchNorm
statistics are summed over every rank (sync_bn): a global batch normalises as it would in one
process. The noise comes from the generator multicard passes the transform (keyed by seed,
epoch and sample), so the run is the same at any world size and resumes exactly after a stop.
"""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

import multicard

parser = argparse.ArgumentParser()
parser.add_argument("--out", default="runs/gan")
parser.add_argument("--epochs", type=int, default=4)
parser.add_argument("--samples", type=int, default=512)
parser.add_argument("--val-samples", type=int, default=64)
parser.add_argument("--batch-size", type=int, default=32)
parser.add_argument("--lr", type=float, default=2e-3)
parser.add_argument("--precision", default="fp32")
parser.add_argument("--strategy", default="auto")
parser.add_argument("--checkpoint-every", type=int, default=0)
parser.add_argument("--keep-last", type=int, default=3)
args = parser.parse_args()
NOISE = 8


class Blobs(torch.utils.data.Dataset):
    """Image i (1×8×8): a bright Gaussian blob at a place drawn from i, on faint noise."""

    def __init__(self, count: int) -> None:
        self.count = count

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(i)
        cy, cx = (torch.rand(2, generator=g) * 5 + 1.5).tolist()
        yy, xx = torch.meshgrid(torch.arange(8.0), torch.arange(8.0), indexing="ij")
        blob = torch.exp(-((yy - cy) ** 2 + (xx - cx) ** 2) / 2)
        return (blob + 0.1 * torch.rand(8, 8, generator=g)).unsqueeze(0) * 2 - 1


def with_noise(image: torch.Tensor, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return image, torch.randn(NOISE, generator=g)  # the generator's input for this sample


def generator() -> nn.Module:
    return nn.Sequential(
        nn.Linear(NOISE, 16 * 2 * 2, bias=False), nn.Unflatten(1, (16, 2, 2)), nn.BatchNorm2d(16), nn.ReLU(),
        nn.ConvTranspose2d(16, 8, 4, 2, 1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
        nn.ConvTranspose2d(8, 1, 4, 2, 1), nn.Tanh(),
    )  # fmt: skip


def discriminator() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 8, 4, 2, 1), nn.LeakyReLU(0.2),
        nn.Conv2d(8, 16, 4, 2, 1, bias=False), nn.BatchNorm2d(16), nn.LeakyReLU(0.2),
        nn.Flatten(), nn.Linear(16 * 2 * 2, 1),
    )  # fmt: skip


run = multicard.Run(
    args.out, global_batch_size=args.batch_size, precision=args.precision, strategy=args.strategy, log_every=5,
    checkpoint_every=args.checkpoint_every, keep_last=args.keep_last, options={"sync_bn": True},
)
netG, netD = generator(), discriminator()
netG, optimizerG = run.setup(netG, torch.optim.Adam(netG.parameters(), lr=args.lr, betas=(0.5, 0.999)))
netD, optimizerD = run.setup(netD, torch.optim.Adam(netD.parameters(), lr=args.lr, betas=(0.5, 0.999)))
train = run.loader(Blobs(args.samples), transform=with_noise)
every = Blobs(args.samples + args.val_samples)
held_out = torch.utils.data.Subset(every, range(args.samples, len(every)))  # images the training never sees


def bce(logits: torch.Tensor, label: float) -> torch.Tensor:
    return F.binary_cross_entropy_with_logits(logits, torch.full_like(logits, label))


def told_real(model: nn.Module, images: torch.Tensor) -> dict[str, torch.Tensor]:
    """How many held-out real images the discriminator takes for real."""
    return {"real": model(images) > 0}


for epoch in run.epochs(args.epochs):
    for real, noise in train:
        fake = netG(noise)
        loss_d = bce(netD(real), 1.0) + bce(netD(fake.detach()), 0.0)  # (1) the discriminator
        run.backward(loss_d)
        run.step(optimizerD)
        loss_g = bce(netD(fake), 1.0)  # (2) the generator, through the updated discriminator
        run.backward(loss_g)
        run.step(optimizerG)
        run.log(loss_d=loss_d, loss_g=loss_g)
    scores = run.evaluate(netD, held_out, told_real)  # images of other seeds
    run.log(d_real=scores["real"] / max(1, scores.samples), val_samples=scores.samples)

# Samples in eval mode on every rank: in train mode each forward would sum BatchNorm statistics
# over the ranks (sync_bn), and a forward on rank 0 alone would wait for the others.
netG.eval()
with torch.no_grad():
    dtype = torch.float64 if args.precision == "fp64" else torch.float32
    fixed = torch.randn(16, NOISE, generator=torch.Generator().manual_seed(1), dtype=dtype).to(run.device)
    brightest = netG(fixed).flatten(1).argmax(dim=1)
run.print(f"samples: brightest pixel of 16 generated images at {brightest.tolist()}")
