"""A small transformer trained with FSDP x TP, launched by tests/commands/test_dry_run.py.

The mesh comes from the launch (``--parallelism_config_tp_size``); ``--wrong_plan``
plants a tp plan entry that names no submodule; ``--steps N`` trains N steps and
writes ``done`` into the directory given by ``--out`` (a real run's end).
`real_figures` runs the same preparation in a `fnaccel.testing.World` (real gloo
processes), for the dry run's fidelity test.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from torch.utils.data import DataLoader, TensorDataset

import fnaccel as fa

VOCAB, WIDTH, HEAD, SEQ = 250, 128, 8, 16  # 250: the embedding splits unevenly over 8 ranks


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.q, self.k, self.v, self.o = (nn.Linear(WIDTH, WIDTH) for _ in range(4))
        self.up, self.down = nn.Linear(WIDTH, 4 * WIDTH), nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        h = self.norm1(x)
        # -1 heads: under tp each rank holds its own share of the heads
        q, k, v = (f(h).view(b, t, -1, HEAD).transpose(1, 2) for f in (self.q, self.k, self.v))
        a = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, t, -1))
        return x + self.down(torch.relu(self.up(self.norm2(x))))


class Transformer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def loss_fn(model: nn.Module, batch: list[torch.Tensor]) -> torch.Tensor:
    (tokens,) = batch
    logits = model(tokens[:, :-1])
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def prepared(state: fa.RunState, *, wrong_plan: bool = False) -> fa.RunState:
    """The script's fa.prepare (a dry run's worker ends inside it, with its report)."""
    plan = {
        "blocks.*.q": ColwiseParallel(),
        "blocks.*.k": ColwiseParallel(),
        "blocks.*.v": ColwiseParallel(),
        "blocks.*.o": RowwiseParallel(),
        "blocks.*.up": ColwiseParallel(),
        "blocks.*.down": RowwiseParallel(),
    }
    if wrong_plan:
        plan["blocks.*.mlp.up"] = ColwiseParallel()  # the MLP is not a submodule of its own here
    torch.manual_seed(0)
    model = Transformer()
    loader = DataLoader(TensorDataset(torch.randint(0, VOCAB, (64, SEQ + 1))), batch_size=4)
    return fa.prepare(
        state,
        model,
        torch.optim.AdamW(model.parameters(), lr=1e-3),
        loader,
        pipeline=fa.compose(fa.tp(plan), fa.fsdp(transformer_cls_names_to_wrap=["Block"])),
        loss_fn=loss_fn,
    )


def real_figures(base: fa.RunState, layout: dict[str, int], wrong_plan: bool) -> dict[str, int] | str:
    """A `fnaccel.testing.World` task: this rank's bytes after one step of a real run on ``layout``,
    as a dry run measures them, or the refusal's last line as a traceback shows it."""
    from fnaccel.dryrun import figures

    state = fa.init(cpu=True, seed=0, parallelism=fa.ParallelismConfig(**layout))
    try:
        try:
            state = prepared(state, wrong_plan=wrong_plan)
        except ValueError as exc:
            return f"ValueError: {exc}"
        state, _ = fa.step(state, next(iter(fa.batches(state))))
        measured: dict[str, int] = figures(state)["measured"]
        return measured
    finally:
        fa.shutdown(state)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--wrong_plan", action="store_true")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    state = prepared(fa.init(seed=0), wrong_plan=args.wrong_plan)
    for batch in fa.batches(state):
        state, _ = fa.step(state, batch)
        if state.step == args.steps:
            break
    if args.out is not None and state.dist.is_main_process:
        (args.out / "done").write_text(str(state.step))
    fa.shutdown(state)


if __name__ == "__main__":
    main()
