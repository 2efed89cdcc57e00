"""The yardstick: the classic CIFAR-10 recipe as a plain, hand-written PyTorch script.

No multicard code is imported. It reads an ImageFolder tree with torchvision's ImageFolder and
a DataLoader(num_workers=2), holds out a seeded validation split, and trains torchvision's
resnet18 with SGD (lr 0.01, momentum 0.9, nesterov, weight decay 1e-4), global batch 256,
random crop (padding 4) + horizontal flip. It prints one JSON line per epoch:
train accuracy, validation accuracy, epoch time.

    python benchmarks/plain_cifar10.py --root ../shared/data/cifar10 [--epochs 5] [--max-steps N]
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F
import torchvision
import torchvision.transforms as T

MEAN, STD = (0.4914, 0.4822, 0.4465), (0.2023, 0.1994, 0.2010)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--root", required=True, help="directory holding train/<class>/*.jpg")
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--max-steps", type=int, default=0, help="stop each epoch after this many steps (0 = all)")
    p.add_argument("--val-size", type=int, default=5000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workers", type=int, default=2)
    args = p.parse_args()

    torch.manual_seed(args.seed)
    train_tf = T.Compose([T.RandomCrop(32, padding=4), T.RandomHorizontalFlip(), T.ToTensor(), T.Normalize(MEAN, STD)])
    eval_tf = T.Compose([T.ToTensor(), T.Normalize(MEAN, STD)])
    train_full = torchvision.datasets.ImageFolder(f"{args.root}/train", transform=train_tf)
    eval_full = torchvision.datasets.ImageFolder(f"{args.root}/train", transform=eval_tf)
    perm = torch.randperm(len(train_full), generator=torch.Generator().manual_seed(args.seed)).tolist()
    val_set = torch.utils.data.Subset(eval_full, perm[: args.val_size])
    train_set = torch.utils.data.Subset(train_full, perm[args.val_size :])
    train_loader = torch.utils.data.DataLoader(
        train_set, batch_size=256, shuffle=True, num_workers=args.workers, drop_last=True, persistent_workers=True
    )
    val_loader = torch.utils.data.DataLoader(val_set, batch_size=500, num_workers=args.workers)

    model = torchvision.models.resnet18(num_classes=10)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, nesterov=True, weight_decay=1e-4)

    for epoch in range(args.epochs):
        start = time.perf_counter()
        model.train()
        correct = seen = 0
        for step, (x, y) in enumerate(train_loader):
            if args.max_steps and step == args.max_steps:
                break
            out = model(x)
            loss = F.cross_entropy(out, y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            correct += (out.argmax(1) == y).sum().item()
            seen += y.numel()
        train_s = time.perf_counter() - start
        model.eval()
        val_correct = val_seen = 0
        with torch.no_grad():
            for x, y in val_loader:
                val_correct += (model(x).argmax(1) == y).sum().item()
                val_seen += y.numel()
        print(
            json.dumps(
                {
                    "epoch": epoch + 1,
                    "train_top1": round(100 * correct / seen, 2),
                    "val_top1": round(100 * val_correct / val_seen, 2),
                    "train_s": round(train_s, 2),
                    "epoch_s": round(time.perf_counter() - start, 2),
                    "img_per_s": round(seen / train_s, 1),
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
