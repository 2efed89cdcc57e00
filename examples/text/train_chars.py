"""A small autoregressive language model with multicard.Run: characters in, the next character out,
perplexity on held-out text. Any text file will do; the default is this project's README.

    python examples/text/train_chars.py
    multicard run --nproc-per-node 2 examples/text/train_chars.py --text my_corpus.txt --epochs 20

Evaluation sums the loss over every held-out token exactly once at any world size, so the
perplexity (exp of the mean token loss) is the same whatever the number of processes.
"""

import argparse
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

import multicard

parser = argparse.ArgumentParser()
parser.add_argument("--text", default=str(Path(__file__).resolve().parents[2] / "README.md"))
parser.add_argument("--out", default="runs/chars")
parser.add_argument("--epochs", type=int, default=10)
parser.add_argument("--steps", type=int, default=0, help="stop after this many optimizer steps (0: the epochs)")
parser.add_argument("--context", type=int, default=64, help="characters a sample holds")
parser.add_argument("--batch-size", type=int, default=64)
parser.add_argument("--lr", type=float, default=3e-3)
parser.add_argument("--strategy", default="auto")
parser.add_argument("--precision", default="fp32")
args = parser.parse_args()


class Windows(torch.utils.data.Dataset):
    """Sample i: `context` + 1 tokens of the text from position i × context (input and its shifted target)."""

    def __init__(self, tokens: torch.Tensor, context: int) -> None:
        self.tokens, self.context = tokens, context

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.context

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        piece = self.tokens[i * self.context : (i + 1) * self.context + 1]
        return piece[:-1], piece[1:]


class CharModel(nn.Module):
    def __init__(self, vocabulary: int, width: int = 128) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocabulary, width)
        self.rnn = nn.GRU(width, width, batch_first=True)
        self.head = nn.Linear(width, vocabulary)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden, _ = self.rnn(self.embed(tokens))
        return self.head(hidden)


def token_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> dict[str, torch.Tensor]:
    inputs, targets = batch
    logits = model(inputs).float()
    losses = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none")
    return {"loss_sum": losses, "tokens": torch.tensor(targets.numel())}


text = Path(args.text).read_text(encoding="utf-8")
alphabet = sorted(set(text))
tokens = torch.tensor([alphabet.index(c) for c in text], dtype=torch.long)
cut = len(tokens) * 9 // 10  # the last tenth is held out

run = multicard.Run(
    args.out, global_batch_size=args.batch_size, strategy=args.strategy, precision=args.precision,
    max_steps=args.steps, clip_grad_norm=1.0, log_every=10, best="val_perplexity", best_mode="min",
)
model = CharModel(len(alphabet))
optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
model, optimizer = run.setup(model, optimizer)
train = run.loader(Windows(tokens[:cut], args.context))
held_out = Windows(tokens[cut:], args.context)

for epoch in run.epochs(args.epochs):
    for inputs, targets in train:
        loss = F.cross_entropy(model(inputs).flatten(0, 1).float(), targets.flatten())
        run.backward(loss)
        run.step(optimizer)
        run.log(loss=loss)
    sums = run.evaluate(model, held_out, token_loss)
    run.log(val_perplexity=torch.exp(torch.tensor(sums["loss_sum"] / sums["tokens"])).item())

if run.is_main:  # a sample of what it learned: 80 characters drawn after the held-out text's start
    bare = model.module if hasattr(model, "module") else model
    with torch.no_grad():
        drawn = held_out[0][0][:16].tolist()
        for _ in range(80):
            logits = bare(torch.tensor([drawn], device=run.device))[0, -1].float()
            drawn.append(int(torch.multinomial(torch.softmax(logits, dim=-1), 1)))
    print("sample:", repr("".join(alphabet[t] for t in drawn)))
