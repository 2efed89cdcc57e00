"""ResNet-18 on CIFAR-10. train_plain.py is a one-GPU script as the tutorials write it;
train_multicard.py is the same script with multicard: `diff` them, 10 lines differ.

    python examples/seed/train_plain.py                                        # one device
    python examples/seed/train_multicard.py                                    # one device
    multicard run --nproc-per-node 2 examples/seed/train_multicard.py          # DDP, 2 processes
    torchrun --standalone --nproc-per-node 2 examples/seed/train_multicard.py  # the same under torchrun
    srun --ntasks-per-node 8 python examples/seed/train_multicard.py           # Slurm, 8 GPUs a node
    python examples/seed/train_multicard.py --strategy dp                      # DataParallel over the GPUs

Stopped (Ctrl-C, SIGTERM, Slurm's SIGUSR1), the multicard version writes a checkpoint: run the same
command to continue, at any world size. Its checkpoints are in runs/seed/checkpoints.
"""

import argparse

import multicard
import torch
import torch.nn.functional as F
import torchvision
import torchvision.transforms as T
from torch.utils.data import DataLoader, Subset

parser = argparse.ArgumentParser()
parser.add_argument("--data", default="../shared/data/cifar10/train", help="an ImageFolder: <class>/<image>")
parser.add_argument("--out", default="runs/seed")
parser.add_argument("--epochs", type=int, default=30)
parser.add_argument("--batch-size", type=int, default=128)
parser.add_argument("--lr", type=float, default=0.1)
parser.add_argument("--limit", type=int, default=0, help="train on this many images only (0: all but validation)")
parser.add_argument("--val", type=int, default=5000, help="images held out for validation")
parser.add_argument("--strategy", default="auto")
args = parser.parse_args()

mean, std = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)
train_tf = T.Compose([T.RandomCrop(32, padding=4), T.RandomHorizontalFlip(), T.ToTensor(), T.Normalize(mean, std)])
val_tf = T.Compose([T.ToTensor(), T.Normalize(mean, std)])
order = torch.randperm(len(torchvision.datasets.ImageFolder(args.data)), generator=torch.Generator().manual_seed(0))
train_idx = order[args.val :][: args.limit or None].tolist()
train_set = Subset(torchvision.datasets.ImageFolder(args.data, transform=train_tf), train_idx)
val_set = Subset(torchvision.datasets.ImageFolder(args.data, transform=val_tf), order[: args.val].tolist())


def accuracy(model, batch):
    images, labels = batch
    return {"correct": (model(images).argmax(dim=1) == labels).sum()}


run = multicard.Run(args.out, global_batch_size=args.batch_size, strategy=args.strategy)
device = run.device
loader = run.loader(train_set, num_workers=2)
model = torchvision.models.resnet18(num_classes=10).to(device)
optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=5e-4)
model, optimizer = run.setup(model, optimizer)
scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, args.lr, total_steps=args.epochs * len(loader))

for epoch in run.epochs(args.epochs):
    model.train()
    for images, labels in loader:
        images, labels = images.to(device), labels.to(device)
        loss = F.cross_entropy(model(images), labels)
        optimizer.zero_grad()
        run.backward(loss)
        run.step(optimizer, scheduler)
    model.eval()
    with torch.no_grad():
        correct = run.evaluate(model, val_set, accuracy, batch_size=500)["correct"]
    run.print(f"epoch {epoch}: loss {loss.item():.4f}, val top-1 {100 * correct / len(val_set):.2f}%")
