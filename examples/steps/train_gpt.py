"""A step-based loop with multicard.Run — the shape of nanoGPT's train.py: a small causal transformer
trained for a number of iterations on windows at random offsets of a text, evaluated every N
iterations, with the model's own methods (a FLOPs estimate, sampling) called on what run.setup
returns; here on characters of this project's README.

    python examples/steps/train_gpt.py
    multicard run --nproc-per-node 2 examples/steps/train_gpt.py --steps 2000 --precision bf16

`run.steps(N)` gives the batches of N optimizer steps, through as many passes over the data as it
takes; `run.every(K)` is true right after every K-th step. The learning rate decays once per pass
over the data (StepLR) and halves when the held-out loss stops improving (ReduceLROnPlateau); both
schedulers live in run.state, so a resumed run continues them exactly.
"""

import argparse
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

import multicard

parser = argparse.ArgumentParser()
parser.add_argument("--text", default=str(Path(__file__).resolve().parents[2] / "README.md"))
parser.add_argument("--limit", type=int, default=0, help="read only this many characters (0: all)")
parser.add_argument("--out", default="runs/gpt")
parser.add_argument("--steps", type=int, default=500, help="optimizer steps (nanoGPT's max_iters)")
parser.add_argument("--eval-every", type=int, default=100)
parser.add_argument("--block", type=int, default=32, help="context length")
parser.add_argument("--batch-size", type=int, default=32)
parser.add_argument("--accum", type=int, default=1)
parser.add_argument("--width", type=int, default=64)
parser.add_argument("--lr", type=float, default=3e-3)
parser.add_argument("--precision", default="fp32")
parser.add_argument("--strategy", default="auto")
parser.add_argument("--checkpoint-every", type=int, default=0)
parser.add_argument("--keep-last", type=int, default=3)
args = parser.parse_args()


class Windows(torch.utils.data.Dataset):
    """Window i: `block` tokens from offset i, and the next ones (its targets): every offset."""

    def __init__(self, tokens: torch.Tensor, block: int) -> None:
        self.tokens, self.block = tokens, block

    def __len__(self) -> int:
        return len(self.tokens) - self.block

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.tokens[i : i + self.block], self.tokens[i + 1 : i + self.block + 1]


class TinyGPT(nn.Module):
    def __init__(self, vocabulary: int, width: int, block: int) -> None:
        super().__init__()
        self.block = block
        self.embed = nn.Embedding(vocabulary, width)
        self.position = nn.Parameter(torch.zeros(block, width))
        self.attention = nn.MultiheadAttention(width, 4, bias=False, batch_first=True)  # a key bias gets no gradient
        self.mlp = nn.Sequential(
            nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
        )
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocabulary)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        x = self.embed(tokens) + self.position[:t]
        causal = torch.triu(torch.ones(t, t, dtype=torch.bool, device=tokens.device), diagonal=1)
        x = x + self.attention(x, x, x, attn_mask=causal, need_weights=False)[0]
        x = x + self.mlp(x)
        return self.head(self.norm(x))

    def flops_per_token(self) -> int:
        """nanoGPT's estimate: 6 × parameters (forward and backward), plus the attention's."""
        return 6 * sum(p.numel() for p in self.parameters()) + 12 * self.block * self.head.in_features

    @torch.no_grad()
    def generate(self, tokens: torch.Tensor, count: int) -> torch.Tensor:
        for _ in range(count):
            logits = self(tokens[:, -self.block :])[:, -1].float()
            tokens = torch.cat([tokens, logits.argmax(dim=-1, keepdim=True)], dim=1)
        return tokens


def token_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> dict[str, torch.Tensor]:
    inputs, targets = batch
    losses = F.cross_entropy(model(inputs).flatten(0, 1).float(), targets.flatten(), reduction="none")
    return {"loss_sum": losses, "tokens": torch.tensor(targets.numel())}


text = Path(args.text).read_text(encoding="utf-8")
text = text[: args.limit] if args.limit else text
alphabet = sorted(set(text))
tokens = torch.tensor([alphabet.index(c) for c in text], dtype=torch.long)
cut = len(tokens) * 9 // 10

run = multicard.Run(
    args.out, global_batch_size=args.batch_size, grad_accum=args.accum, strategy=args.strategy, log_every=10,
    precision=args.precision, clip_grad_norm=1.0, checkpoint_every=args.checkpoint_every, keep_last=args.keep_last,
)
model = TinyGPT(len(alphabet), args.width, args.block)
model, optimizer = run.setup(model, torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1))
train = run.loader(Windows(tokens[:cut], args.block))
held_out = Windows(tokens[cut:], args.block)
run.state["per_pass"] = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.8)
run.state["plateau"] = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, factor=0.5, patience=0)
raw_model = model.module if hasattr(model, "module") else model  # nanoGPT's idiom: the wrappers pass its methods on
started = time.perf_counter()

for inputs, targets in run.steps(args.steps):
    loss = F.cross_entropy(model(inputs).flatten(0, 1).float(), targets.flatten())
    run.backward(loss)
    run.step(optimizer)
    run.log(loss=loss)
    if run.every(train.steps_per_epoch):  # a pass over the training windows is done
        run.state["per_pass"].step()
    if run.every(args.eval_every):
        sums = run.evaluate(model, held_out, token_loss)
        val_loss = sums["loss_sum"] / sums["tokens"]
        run.state["plateau"].step(val_loss)
        tokens_per_s = run.position.global_step * args.batch_size * args.block / (time.perf_counter() - started)
        run.log(val_loss=val_loss, tflops=model.flops_per_token() * tokens_per_s / 1e12)  # the module's own method

prompt = tokens[cut : cut + 8].view(1, -1).to(run.device)
drawn = raw_model.generate(prompt, 40)[0].tolist()  # every rank: under fsdp each forward gathers the weights
run.print("sample:", repr("".join(alphabet[t] for t in drawn)))
