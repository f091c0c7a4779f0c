"""The ``fa.step`` loop against the same hand-written loop on one GPU: a model
of GPT-2 small's shape in bf16 autocast, eager and under ``torch.compile``
(issue 15, item 6: at least 0.98 of the hand-written loop's throughput).

The model: token and position embeddings, 12 pre-norm transformer blocks of
width 768 with 12 heads (causal ``scaled_dot_product_attention``), a final
LayerNorm and an output layer tied to the token embedding, a vocabulary of
50257: 124M parameters, as GPT-2 small. AdamW (lr 3e-4), batch 8 of 1024
tokens, the batches made on the device before timing, so both loops time the
step alone.

Each side is the same model (same initial weights), trained for ``--steps``
steps per block: the hand-written one under ``torch.autocast("cuda",
torch.bfloat16)``, ``backward``, ``optimizer.step``, ``zero_grad``; fnaccel's
``fa.step`` with ``fa.compose(fa.autocast(fa.bf16))`` (+ ``fa.compile()``, and
``torch.compile`` of the hand model, for the compiled rows). Blocks alternate
(which goes first alternates too), each ended by ``torch.cuda.synchronize``;
the figure is the median over ``--rounds`` of tokens per second, and the ratio
is fnaccel's throughput over the hand loop's (1.00: the same; the target is at
least 0.98). The last column is the largest difference between the two
models' weights after the same steps: 0 where both loops computed the same
thing (eager), small where compiled kernels round differently.

Run on a CUDA machine from the repository root::

    python benchmarks/gpu_step.py [--rounds 7] [--steps 20] [--no-compile]

``--tiny`` (2 blocks of width 64, vocabulary 512, batch 2 of 64 tokens) runs
the same code in seconds on a CPU (``--device cpu``), which is how the test
suite keeps it working; its figures mean nothing.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

import fnaccel as fa


@dataclass(frozen=True, slots=True, kw_only=True)
class Shape:
    layers: int
    width: int
    heads: int
    vocab: int
    seq: int
    batch: int


GPT2_SMALL = Shape(layers=12, width=768, heads=12, vocab=50257, seq=1024, batch=8)
TINY = Shape(layers=2, width=64, heads=4, vocab=512, seq=64, batch=2)


class Block(nn.Module):
    def __init__(self, shape: Shape) -> None:
        super().__init__()
        self.heads = shape.heads
        self.norm1 = nn.LayerNorm(shape.width)
        self.qkv = nn.Linear(shape.width, 3 * shape.width)
        self.proj = nn.Linear(shape.width, shape.width)
        self.norm2 = nn.LayerNorm(shape.width)
        self.mlp = nn.Sequential(
            nn.Linear(shape.width, 4 * shape.width),
            nn.GELU(approximate="tanh"),
            nn.Linear(4 * shape.width, shape.width),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, width = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(batch, seq, 3, self.heads, width // self.heads).unbind(2)
        attended = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, seq, width))
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    def __init__(self, shape: Shape) -> None:
        super().__init__()
        self.tokens = nn.Embedding(shape.vocab, shape.width)
        self.positions = nn.Embedding(shape.seq, shape.width)
        self.blocks = nn.ModuleList(Block(shape) for _ in range(shape.layers))
        self.norm = nn.LayerNorm(shape.width)
        self.head = nn.Linear(shape.width, shape.vocab, bias=False)
        self.head.weight = self.tokens.weight  # tied, as GPT-2's

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tokens(ids) + self.positions(torch.arange(ids.shape[1], device=ids.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    ids, targets = batch
    logits = model(ids)
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def make_model(shape: Shape, device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    return GPT(shape).to(device)


def make_batches(shape: Shape, device: torch.device, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        ids = torch.randint(0, shape.vocab, (shape.batch, shape.seq + 1), generator=g)
        out.append((ids[:, :-1].to(device), ids[:, 1:].to(device)))
    return out


def loops(
    shape: Shape, device: torch.device, batches: list[Any], compiled: bool, backend: str
) -> tuple[Callable[[], None], Callable[[], None], Callable[[], float]]:
    """The hand-written loop and the fnaccel loop over ``batches``, each one block,
    and a function giving the largest difference between the two models' weights
    (after as many blocks of each: 0.0 when both computed the same steps)."""
    hand_model = make_model(shape, device)
    hand_opt = torch.optim.AdamW(hand_model.parameters(), lr=3e-4)
    run_model = torch.compile(hand_model, backend=backend) if compiled else hand_model

    def hand() -> None:
        for batch in batches:
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = loss_fn(run_model, batch)
            loss.backward()
            hand_opt.step()
            hand_opt.zero_grad(set_to_none=True)

    model = make_model(shape, device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    pipeline = (
        fa.compose(fa.autocast(fa.bf16), fa.compile(backend=backend))
        if compiled
        else fa.compose(fa.autocast(fa.bf16))
    )
    state = fa.init(seed=0, cpu=device.type == "cpu")
    if state.dist.device != device:
        raise SystemExit(f"fa.init chose {state.dist.device}, the benchmark asked for {device}")
    holder = [fa.prepare(state, model, opt, loss_fn=loss_fn, pipeline=pipeline)]

    def fnaccel() -> None:
        s = holder[0]
        for batch in batches:
            s, _ = fa.step(s, batch)
        holder[0] = s

    def difference() -> float:
        return max(
            (a - b).abs().max().item()
            for a, b in zip(hand_model.parameters(), model.parameters(), strict=True)
        )

    return hand, fnaccel, difference


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(
    hand: Callable[[], None], ours: Callable[[], None], rounds: int, device: torch.device
) -> tuple[float, float]:
    """Median seconds per block of ``hand`` and ``ours`` (one warm-up block each, not timed)."""
    times: dict[str, list[float]] = {"hand": [], "ours": []}
    sides = {"hand": hand, "ours": ours}
    for fn in sides.values():  # compiles, autotunes, allocates
        fn()
        _sync(device)
    for r in range(rounds):
        for name in ("hand", "ours") if r % 2 == 0 else ("ours", "hand"):
            _sync(device)
            start = time.perf_counter()
            sides[name]()
            _sync(device)
            times[name].append(time.perf_counter() - start)
    return statistics.median(times["hand"]), statistics.median(times["ours"])


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=20, help="steps per timed block")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="a toy size, for checking the script on a CPU")
    parser.add_argument("--no-compile", action="store_true", help="only the eager rows")
    parser.add_argument("--backend", default="inductor", help="torch.compile backend")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device() if torch.cuda.is_available() else 0)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device here: run on a GPU machine, or pass --tiny --device cpu")
    shape = TINY if args.tiny else GPT2_SMALL
    batches = make_batches(shape, device, args.steps)
    tokens = args.steps * shape.batch * shape.seq
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(
        f"{name}, torch {torch.__version__}, {shape}, {args.steps} steps per block, median of {args.rounds}"
    )
    print(f"{'loop':24} {'hand tok/s':>12} {'fnaccel tok/s':>14} {'ratio':>6} {'max |w - w_hand|':>17}")
    rows = []
    for compiled in (False,) if args.no_compile else (False, True):
        hand, ours, difference = loops(shape, device, batches, compiled, args.backend)
        base, mine = measure(hand, ours, args.rounds, device)
        label = f"bf16 autocast{', compiled' if compiled else ''}"
        ratio = base / mine  # throughput of ours over hand's
        diff = difference()
        print(f"{label:24} {tokens / base:12.0f} {tokens / mine:14.0f} {ratio:6.3f} {diff:17.3g}", flush=True)
        rows.append(
            {
                "case": label,
                "hand_s": base,
                "fnaccel_s": mine,
                "throughput_ratio": ratio,
                "max_weight_difference": diff,
            }
        )
    return rows


if __name__ == "__main__":
    main()
