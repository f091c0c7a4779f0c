"""Token-normalised gradient accumulation for a causal language model.

    python examples/gradient_accumulation_causal_lm.py
    fnaccel launch --cpu --num_processes 2 examples/gradient_accumulation_causal_lm.py

Sequences have different lengths, so micro-batches hold different numbers of tokens. Averaging
each micro-batch's mean loss (`fa.accumulate(k)`) would give a token of a short micro-batch
more weight than a token of a long one, and the result would depend on how the tokens fall into
micro-batches and processes. With `normalize="items"` the loss function returns the *sum* of
its token losses and how many tokens it counted; at each update fnaccel adds the counts of every
micro-batch on every process (one all-reduce of one number) and scales the gradients so that
the update is the mean over every token of the global batch, exactly as one big batch would be.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader

import fnaccel as fa

VOCAB, PAD, IGNORE = 17, 16, -100  # 16 real tokens and a padding token


def make_sequences(num_sequences: int, max_len: int) -> list[torch.Tensor]:
    """Counting sequences (start, start + stride, ...) mod 16, of random lengths."""
    generator = torch.Generator().manual_seed(0)
    sequences = []
    for _ in range(num_sequences):
        length = int(torch.randint(3, max_len + 1, (), generator=generator))
        start, stride = torch.randint(0, 16, (2,), generator=generator).tolist()
        sequences.append((start + stride * torch.arange(length)) % 16)
    return sequences


def collate(sequences: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Right-pad to the longest sequence; padded positions get no label."""
    longest = max(len(s) for s in sequences)
    tokens = torch.full((len(sequences), longest), PAD)
    for row, sequence in enumerate(sequences):
        tokens[row, : len(sequence)] = sequence
    labels = tokens[:, 1:].masked_fill(tokens[:, 1:] == PAD, IGNORE)  # predict the next token
    return {"input_ids": tokens[:, :-1], "labels": labels}


class TinyCausalLM(nn.Module):
    """Predicts each next token from the current one and the one before (a causal window of 2)."""

    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.mix = nn.Conv1d(dim, dim, kernel_size=2)
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids).transpose(1, 2)  # (batch, dim, time)
        x = nn.functional.pad(x, (1, 0))  # pad on the left only: position t never sees t + 1
        return self.head(torch.relu(self.mix(x)).transpose(1, 2))


def loss_fn(model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    logits = model(batch["input_ids"])
    loss_sum = nn.functional.cross_entropy(
        logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=IGNORE, reduction="sum"
    )
    return loss_sum, {"num_items": (batch["labels"] != IGNORE).sum()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--accumulation-steps", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per process and micro-step")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--tiny", action="store_true", help="a few steps, for tests")
    args = parser.parse_args()

    state = fa.init(seed=0)
    torch.manual_seed(0)
    model = TinyCausalLM()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sequences = make_sequences(64 if args.tiny else 1024, max_len=24)
    loader = DataLoader(sequences, batch_size=args.batch_size, shuffle=True, collate_fn=collate)
    pipeline = fa.compose(
        fa.default_pipeline(state), fa.accumulate(args.accumulation_steps, normalize="items")
    )
    state = fa.prepare(state, model, optimizer, loader, loss_fn=loss_fn, pipeline=pipeline)

    for epoch in range(args.epochs):
        for batch in fa.batches(state, epochs=epoch + 1):
            state, metrics = fa.step(state, batch)
        # At an update, metrics["loss"] is the mean loss per token of the whole accumulation window.
        fa.print_on_main(
            state, f"epoch {epoch}: update {state.step}, loss per token {metrics['loss'].item():.3f}"
        )
    fa.shutdown(state)


if __name__ == "__main__":
    main()
