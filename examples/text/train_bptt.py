"""Truncated backpropagation through time with multicard.Run — the shape of pytorch/examples'
word_language_model: an LSTM reads the text as parallel streams, each batch continuing every
stream where the previous one stopped, the hidden state carried from batch to batch; here on
characters of this project's README (any text file will do).

    python examples/text/train_bptt.py
    multicard run --nproc-per-node 2 examples/text/train_bptt.py --epochs 6

`order="streams"` cuts the text into global_batch_size streams as the classic `batchify` does;
each rank reads its share of the streams, the same ones at every step, so it carries their hidden
state; `train.carry` keeps that state in the checkpoints (gathered in stream order), and a run
stopped in the middle of an epoch resumes every stream where it was, at any world size. Dropout
draws its masks per sample from the generator the transform gets, not from each rank's random
stream, so the run is the same at any world size.
"""

import argparse
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

import multicard

parser = argparse.ArgumentParser()
parser.add_argument("--text", default=str(Path(__file__).resolve().parents[2] / "README.md"))
parser.add_argument("--limit", type=int, default=0, help="read only this many characters (0: all)")
parser.add_argument("--out", default="runs/bptt")
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--bptt", type=int, default=16, help="characters per segment (the truncation length)")
parser.add_argument("--batch-size", type=int, default=16, help="streams read side by side")
parser.add_argument("--hidden", type=int, default=64)
parser.add_argument("--dropout", type=float, default=0.2)
parser.add_argument("--lr", type=float, default=3e-3)
parser.add_argument("--precision", default="fp32")
parser.add_argument("--strategy", default="auto")
parser.add_argument("--checkpoint-every", type=int, default=0)
parser.add_argument("--keep-last", type=int, default=3)
args = parser.parse_args()


class Segments(torch.utils.data.Dataset):
    """Segment i: characters i·bptt .. (i+1)·bptt of the text and the next ones (its targets)."""

    def __init__(self, tokens: torch.Tensor, bptt: int) -> None:
        self.tokens, self.bptt = tokens, bptt

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.bptt

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        piece = self.tokens[i * self.bptt : (i + 1) * self.bptt + 1]
        return piece[:-1], piece[1:]


def with_dropout_mask(sample: tuple[torch.Tensor, torch.Tensor], g: torch.Generator) -> tuple[torch.Tensor, ...]:
    """The sample and its dropout mask over the LSTM's outputs, drawn from the sample's generator."""
    keep = (torch.rand(args.bptt, args.hidden, generator=g) >= args.dropout).float() / (1 - args.dropout)
    return (*sample, keep)


class CharLSTM(nn.Module):
    def __init__(self, vocabulary: int, hidden: int) -> None:
        super().__init__()
        self.hidden = hidden
        self.embed = nn.Embedding(vocabulary, hidden)
        self.rnn = nn.LSTM(hidden, hidden, batch_first=True)
        self.head = nn.Linear(hidden, vocabulary)

    def init_hidden(self, streams: int) -> tuple[torch.Tensor, torch.Tensor]:
        weight = self.head.weight
        return weight.new_zeros(1, streams, self.hidden), weight.new_zeros(1, streams, self.hidden)

    def forward(self, tokens: torch.Tensor, hidden: tuple | None = None, keep: torch.Tensor | None = None) -> tuple:
        output, hidden = self.rnn(self.embed(tokens), hidden)
        if keep is not None:
            output = output * keep
        return self.head(output), hidden


def token_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> dict[str, torch.Tensor]:
    inputs, targets = batch
    logits, _ = model(inputs)
    return {"loss_sum": F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="sum"),
            "tokens": torch.tensor(targets.numel())}  # fmt: skip


text = Path(args.text).read_text(encoding="utf-8")
text = text[: args.limit] if args.limit else text
alphabet = sorted(set(text))
tokens = torch.tensor([alphabet.index(c) for c in text], dtype=torch.long)
cut = len(tokens) * 9 // 10  # the last tenth is held out

run = multicard.Run(
    args.out, global_batch_size=args.batch_size, strategy=args.strategy, precision=args.precision, log_every=10,
    clip_grad_norm=0.25, checkpoint_every=args.checkpoint_every, keep_last=args.keep_last,
)
model = CharLSTM(len(alphabet), args.hidden)
model, optimizer = run.setup(model, torch.optim.Adam(model.parameters(), lr=args.lr))
train = run.loader(Segments(tokens[:cut], args.bptt), transform=with_dropout_mask, order="streams")
held_out = Segments(tokens[cut:], args.bptt)

for epoch in run.epochs(args.epochs):
    hidden = train.carry(model.init_hidden(train.micro_batch), dim=1)  # this rank's streams, from the start
    for inputs, targets, keep in train:
        logits, hidden = model(inputs, hidden, keep)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        run.backward(loss)
        run.step(optimizer)
        hidden = train.carry(tuple(h.detach() for h in hidden), dim=1)  # what the next segments start from
        run.log(loss=loss)
    sums = run.evaluate(model, held_out, token_loss)
    run.log(val_perplexity=torch.exp(torch.tensor(sums["loss_sum"] / sums["tokens"])).item())
