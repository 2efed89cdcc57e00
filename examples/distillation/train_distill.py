"""Knowledge distillation with multicard.Run: a small student learns from a frozen teacher's soft
labels and from the true labels; here on synthetic data, with a teacher that stands in for one
trained before (a fixed network that labels the data).

    python examples/distillation/train_distill.py
    multicard run --nproc-per-node 2 examples/distillation/train_distill.py --epochs 8

The teacher is set up without an optimizer: run.setup places it on the device and casts it to the
run's precision but, having nothing to train, does not wrap it for DDP (under fsdp it is sharded
like the student). The student's optimizer is the run's; checkpoints hold both models, the
student's as the run's model (what `multicard export` writes).
"""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

import multicard

parser = argparse.ArgumentParser()
parser.add_argument("--out", default="runs/distill")
parser.add_argument("--epochs", type=int, default=4)
parser.add_argument("--samples", type=int, default=1024)
parser.add_argument("--batch-size", type=int, default=32)
parser.add_argument("--lr", type=float, default=1e-2)
parser.add_argument("--temperature", type=float, default=2.0)
parser.add_argument("--precision", default="fp32")
parser.add_argument("--strategy", default="auto")
parser.add_argument("--checkpoint-every", type=int, default=0)
parser.add_argument("--keep-last", type=int, default=3)
args = parser.parse_args()
FEATURES, CLASSES = 16, 5


def mlp(width: int, depth: int) -> nn.Module:
    layers, size = [], FEATURES
    for _ in range(depth):
        layers += [nn.Linear(size, width), nn.LayerNorm(width), nn.GELU()]
        size = width
    return nn.Sequential(*layers, nn.Linear(size, CLASSES))


class Points(torch.utils.data.Dataset):
    """Sample i: FEATURES numbers drawn from i, and the label a fixed network gives them."""

    def __init__(self, count: int, labeller: nn.Module, offset: int = 0) -> None:
        self.count, self.labeller, self.offset = count, labeller, offset

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        x = torch.randn(FEATURES, generator=torch.Generator().manual_seed(self.offset + i))
        return x, int(self.labeller(x).argmax())


def correct(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> dict[str, torch.Tensor]:
    x, y = batch
    return {"correct": (model(x).argmax(dim=1) == y)}


run = multicard.Run(
    args.out, global_batch_size=args.batch_size, precision=args.precision, strategy=args.strategy, log_every=5,
    checkpoint_every=args.checkpoint_every, keep_last=args.keep_last, best="val_accuracy",
)
labeller = mlp(32, 2).requires_grad_(False)  # the same on every rank: Run(...) seeded the process
train_set, val_set = Points(args.samples, labeller), Points(args.samples // 4 + 1, labeller, offset=10**6)
teacher = mlp(64, 3)  # in a real script: loaded from the teacher's training
teacher.requires_grad_(False).eval()
teacher = run.setup(teacher)  # no optimizer: placed and cast, frozen
student = mlp(16, 1)
student, optimizer = run.setup(student, torch.optim.SGD(student.parameters(), lr=args.lr, momentum=0.9))
train = run.loader(train_set)
T = args.temperature

for epoch in run.epochs(args.epochs):
    for x, y in train:
        with torch.no_grad():
            soft = F.log_softmax(teacher(x) / T, dim=1)
        logits = student(x)
        distill = F.kl_div(F.log_softmax(logits / T, dim=1), soft, log_target=True, reduction="batchmean") * T * T
        loss = 0.5 * distill + 0.5 * F.cross_entropy(logits, y)
        run.backward(loss)
        run.step(optimizer)
        run.log(loss=loss)
    scores = run.evaluate(student, val_set, correct)
    run.log(val_accuracy=scores["correct"] / scores.samples)
