"""A small character-level GPT trained on Shakespeare's sonnets, resumable mid-run.

    python examples/char_gpt.py --stop-after 250   # stops after 250 steps, as a preempted job would
    python examples/char_gpt.py                    # resumes from the last save, finishes, writes verse
    fnaccel launch --cpu --num_processes 2 examples/char_gpt.py

The text (`examples/data/sonnets.txt`, eight sonnets, public domain) is cut into windows, one
starting at every character; the model learns to predict each next character from the ones before it (causal
self-attention). Every `--save-every` steps the whole run is saved, so a job stopped at any
point continues from its last save, with the same batches and dropout masks it would have had:
the verse printed at the end is the same whether or not the run was interrupted.
"""

from __future__ import annotations

import argparse
import os

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

import fnaccel as fa

TEXT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "sonnets.txt")


class Windows(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Windows of `length + 1` characters every `stride` characters: (input, input shifted by one)."""

    def __init__(self, tokens: torch.Tensor, length: int, stride: int) -> None:
        self.tokens, self.length, self.stride = tokens, length, stride

    def __len__(self) -> int:
        return (len(self.tokens) - self.length - 1) // self.stride + 1

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = self.tokens[index * self.stride : index * self.stride + self.length + 1]
        return chunk[:-1], chunk[1:]


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.attention_norm, self.mlp_norm = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.out = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim), nn.Dropout(0.1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, time, dim = x.shape
        q, k, v = (
            t.view(batch, time, self.heads, dim // self.heads).transpose(1, 2)
            for t in self.qkv(self.attention_norm(x)).split(dim, dim=2)
        )
        attended = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)  # no peeking ahead
        x = x + self.out(attended.transpose(1, 2).reshape(batch, time, dim))
        return x + self.mlp(self.mlp_norm(x))


class CharGPT(nn.Module):
    def __init__(self, vocab_size: int, context: int, dim: int, depth: int, heads: int = 4) -> None:
        super().__init__()
        self.context = context
        self.token, self.position = nn.Embedding(vocab_size, dim), nn.Embedding(context, dim)
        self.blocks = nn.Sequential(*[Block(dim, heads) for _ in range(depth)])
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab_size)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        return self.head(self.norm(self.blocks(self.token(tokens) + self.position(positions))))


@torch.no_grad()
def write(model: CharGPT, prompt: torch.Tensor, length: int, seed: int) -> torch.Tensor:
    """Sample `length` characters after `prompt`, from a generator of its own (reproducible)."""
    generator, tokens = torch.Generator().manual_seed(seed), prompt[None]
    model.eval()
    for _ in range(length):
        logits = model(tokens[:, -model.context :])[:, -1]
        tokens = torch.cat([tokens, torch.multinomial(logits.softmax(dim=-1), 1, generator=generator)], dim=1)
    model.train()
    return tokens[0]


def loss_fn(model: nn.Module, batch: list[torch.Tensor]) -> torch.Tensor:
    inputs, targets = batch
    return nn.functional.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=16, help="per process")
    parser.add_argument("--save-every", type=int, default=50, help="steps between checkpoints")
    parser.add_argument("--stop-after", type=int, default=None, help="end the process after this step")
    parser.add_argument("--output", default="runs/char_gpt")
    parser.add_argument("--tiny", action="store_true", help="a few steps of a smaller model, for tests")
    args = parser.parse_args()
    context, dim, depth = (16, 32, 1) if args.tiny else (64, 64, 2)
    if args.tiny:
        args.epochs = 1

    with open(TEXT, encoding="utf-8") as file:
        text = file.read()
    alphabet = sorted(set(text))
    tokens = torch.tensor([alphabet.index(c) for c in text])

    state = fa.init(seed=0)
    torch.manual_seed(0)
    model = CharGPT(len(alphabet), context, dim, depth)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    # Every window, so the model sees each character at every position of its context (with
    # fewer, it memorises where a character falls in a window and writes nonsense elsewhere).
    stride = context if args.tiny else 1  # tiny: windows that do not overlap, fewer steps
    loader = DataLoader(Windows(tokens, context, stride), batch_size=args.batch_size, shuffle=True)
    state = fa.prepare(
        state,
        model,
        optimizer,
        loader,
        loss_fn=loss_fn,
        pipeline=fa.compose(fa.default_pipeline(state), fa.clip_grad_norm(1.0)),
    )
    checkpoint = os.path.join(args.output, "checkpoint")
    if os.path.exists(os.path.join(checkpoint, "fnaccel.json")):
        state = fa.load(state, checkpoint)
        fa.print_on_main(state, f"resumed from {checkpoint} at step {state.step} (epoch {state.epoch})")

    for batch in fa.batches(state, epochs=args.epochs):
        state, metrics = fa.step(state, batch)
        if state.step % args.save_every == 0:
            fa.save(state, checkpoint)
            fa.print_on_main(state, f"step {state.step}: loss {metrics['loss'].item():.3f}, saved")
        if state.step == args.stop_after:
            fa.print_on_main(state, f"stopped after step {state.step}")
            fa.shutdown(state)
            return

    verse = write(model, tokens[:context], length=60 if args.tiny else 400, seed=0)
    fa.print_on_main(
        state,
        f"step {state.step}, loss {metrics['loss'].item():.3f}. It writes:\n"
        + "".join(alphabet[i] for i in verse.tolist()),
    )
    fa.shutdown(state)


if __name__ == "__main__":
    main()
