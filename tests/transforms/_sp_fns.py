"""What the fa.sp tests run on every rank of a World (importable by the workers), the
small causal transformer they train, and the one-process reference."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset

import fnaccel as fa
from fnaccel.transforms.sequence import ulysses_attention

VOCAB, LENGTH, DIM, HEADS, LR, MAX_NORM = 32, 16, 16, 4, 0.5, 0.05
NUM_SAMPLES = 16


class Attention(nn.Module):
    def __init__(
        self, heads: int = HEADS, mask: bool = False, manual: bool = False, custom: bool = False
    ) -> None:
        super().__init__()
        self.heads, self.mask, self.manual, self.custom = heads, mask, manual, custom
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.out = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, length, _ = x.shape
        q, k, v = self.qkv(x).view(b, length, 3, self.heads, DIM // self.heads).permute(2, 0, 3, 1, 4)
        if self.manual:  # attention written out by hand: nothing fa.sp can find
            scores = (q @ k.transpose(-1, -2)).tril_() / (DIM // self.heads) ** 0.5
            y = torch.softmax(scores, dim=-1) @ v
        elif self.custom:  # the user's own attention function, marked for fa.sp
            y = causal_attention(q, k, v)
        elif self.mask:  # a sliding window, built from the local length
            window = torch.ones(length, length, dtype=torch.bool).tril().triu(-4)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=window)
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, length, DIM))


@ulysses_attention
def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention written out (a user's own function): over the whole sequence under fa.sp."""
    length = q.shape[-2]
    scores = (q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
    scores = scores.masked_fill(~torch.ones(length, length, dtype=torch.bool).tril(), float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


class Block(nn.Module):
    def __init__(self, **attention: Any) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.attn = Attention(**attention)
        self.mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    """Token and position embeddings, 2 causal SDPA blocks, an LM head."""

    def __init__(self, **attention: Any) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.position = nn.Embedding(LENGTH, DIM)
        self.blocks = nn.ModuleList([Block(**attention), Block(**attention)])
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids) + self.position(position_ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


class TinyLlama(nn.Module):
    """A transformers Llama from a config (no download): 4 query heads, 2 key/value heads, SDPA."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=DIM,
            intermediate_size=2 * DIM,
            num_hidden_layers=2,
            num_attention_heads=HEADS,
            num_key_value_heads=2,
            max_position_embeddings=LENGTH,
        )
        config._attn_implementation = "sdpa"
        self.lm = LlamaForCausalLM(config)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=input_ids, position_ids=position_ids).logits


def make_model(llama: bool = False, **attention: Any) -> nn.Module:
    torch.manual_seed(3)
    return TinyLlama() if llama else TinyLM(**attention)


def loss_fn(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    logits = model(batch["input_ids"], batch["position_ids"])
    return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())  # mean over labels != -100


class Tokens(Dataset[dict[str, torch.Tensor]]):
    """Rows of LENGTH tokens: right padding (label -100) of varied length, some labels -100
    inside, and the last quarter of every row padding (one sp=4 rank has no real token).
    ``packed``: two documents per row, position ids restarting at the second."""

    def __init__(self, packed: bool = False, length: int = LENGTH) -> None:
        generator = torch.Generator().manual_seed(4)
        self.ids = torch.randint(1, VOCAB, (NUM_SAMPLES, length), generator=generator)
        self.labels = torch.randint(0, VOCAB, (NUM_SAMPLES, length), generator=generator)
        self.labels[torch.rand(NUM_SAMPLES, length, generator=generator) < 0.2] = -100
        for row in range(NUM_SAMPLES):
            pad = length * 3 // 4 - row % 3
            self.ids[row, pad:] = 0
            self.labels[row, pad:] = -100
        self.packed = packed

    def __len__(self) -> int:
        return NUM_SAMPLES

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        item = {"input_ids": self.ids[index], "labels": self.labels[index]}
        if self.packed:
            first = 7  # the second document starts inside a sequence part (sp 2 and sp 4)
            length = self.ids.shape[1]
            item["position_ids"] = torch.cat([torch.arange(first), torch.arange(length - first)])
        return item


def with_positions(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    if "position_ids" in batch:
        return batch
    return {**batch, "position_ids": torch.arange(batch["input_ids"].shape[1]).expand_as(batch["input_ids"])}


def per_row_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Each row's summed token loss (the evaluation's per-sample output)."""
    batch = with_positions(batch)
    logits = model(batch["input_ids"], batch["position_ids"])
    return F.cross_entropy(logits.transpose(1, 2), batch["labels"], reduction="none").sum(1)


def reference(
    per_step: list[list[dict[str, torch.Tensor]]], clip: bool, naive_parts: int = 0, **attention: Any
) -> dict[str, Any]:
    """One process, plain PyTorch: each step averages the loss of each data-parallel
    rank's whole batch (what DDP averages), ``attention`` as in `train`. ``naive_parts``: each batch's loss is
    instead the mean of the per-part means over that many sequence parts (what a
    per-rank mean without token weighting computes)."""
    model = make_model(**attention)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    grads, losses = [], []
    for batches in per_step:
        optimizer.zero_grad()
        total = torch.zeros(())
        for batch in batches:
            batch = with_positions(batch)
            if naive_parts:
                step = batch["input_ids"].shape[1] // naive_parts
                parts = [
                    {k: v[:, i * step : (i + 1) * step] for k, v in batch.items()} for i in range(naive_parts)
                ]
                loss = torch.stack([loss_fn(model, part) for part in parts]).mean()
            else:
                loss = loss_fn(model, batch)
            total = total + loss / len(batches)
        total.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters()})
        losses.append(total.detach())
        optimizer.step()
    return {
        "grads": grads,
        "losses": losses,
        "weights": {n: p.detach().clone() for n, p in model.named_parameters()},
    }


def full(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of the whole tensor (an FSDP shard gathered)."""
    gather = getattr(tensor, "full_tensor", None)
    return (gather() if gather else tensor).detach().clone()


def train(
    base: fa.RunState,
    layout: dict[str, int],
    num_steps: int,
    *,
    packed: bool = False,
    ddp: bool = False,
    fsdp: bool = False,
    accumulate: int = 1,
    clip: bool = False,
    batch_size: int = 2,
    checkpoint: str | None = None,
    **attention: Any,
) -> dict[str, Any]:
    """Train with fa.sp on the layout's mesh; what the reference needs, per rank.

    With ``checkpoint``: save after ``num_steps // 2`` steps, train on, then load and
    train the second half again: both second halves' weights are returned. ``attention``:
    the `Attention` options (``custom=True``: the user's own function)."""
    state = fa.init(cpu=True, seed=0, parallelism=fa.ParallelismConfig(**layout))
    try:
        model = make_model(**attention)
        transforms = [
            fa.sp(),
            *([fa.ddp()] if ddp else []),
            *([fa.fsdp()] if fsdp else []),
            *([fa.accumulate(accumulate)] if accumulate > 1 else []),
            *([fa.clip_grad_norm(MAX_NORM)] if clip else []),
        ]
        state = fa.prepare(
            state,
            model,
            torch.optim.SGD(model.parameters(), lr=LR),
            DataLoader(Tokens(packed), batch_size=batch_size),
            loss_fn=loss_fn,
            pipeline=fa.compose(*transforms),
        )
        batches, grads, losses, resumed = [], [], [], None
        saved_at = num_steps // 2 if checkpoint else None
        for batch in fa.batches(state, epochs=1):
            batches.append({k: v.clone() for k, v in batch.items()})
            state, metrics = fa.step(state, batch)
            losses.append(metrics["loss"])
            if state.micro_step % accumulate == 0:
                grads.append({n: full(p.grad) for n, p in state.model.named_parameters()})
            if saved_at is not None and state.step == saved_at and state.micro_step % accumulate == 0:
                fa.save(state, checkpoint)
            if state.step == num_steps:
                break
        weights = {n.removeprefix("module."): full(p) for n, p in state.model.named_parameters()}
        if checkpoint:
            state = fa.load(state, checkpoint)
            for batch in fa.batches(state, epochs=1):
                state, _ = fa.step(state, batch)
                if state.step == num_steps:
                    break
            resumed = {
                n.removeprefix("module."): p.detach().clone() for n, p in state.model.named_parameters()
            }
        evaluated = fa.evaluate(state, DataLoader(Tokens(packed), batch_size=4), per_row_loss)
        return {
            "batches": batches,
            "grads": [{n.removeprefix("module."): g for n, g in step.items()} for step in grads],
            "losses": losses,
            "weights": weights,
            "resumed": resumed,
            "evaluated": evaluated,
            "sp": fa.ParallelismConfig(**layout)
            .resolved(state.dist.num_processes)
            .coordinates(state.dist.rank)["sp"],
        }
    finally:
        fa.shutdown(state)


def resume(
    base: fa.RunState | None,
    layout: dict[str, int],
    checkpoint: str,
    num_steps: int,
    save_at: int | None = None,
    save_to: str | None = None,
) -> dict[str, torch.Tensor]:
    """Load ``checkpoint`` on this layout (on 1 process: ``base`` None), train on to
    ``num_steps`` (saving at ``save_at`` into ``save_to``); the weights."""
    state = fa.init(cpu=True, seed=0, parallelism=fa.ParallelismConfig(**layout) if layout else None)
    try:
        model = make_model()
        state = fa.prepare(
            state,
            model,
            torch.optim.SGD(model.parameters(), lr=LR),
            DataLoader(Tokens(), batch_size=2),
            loss_fn=loss_fn,
            pipeline=fa.sp(),
        )
        state = fa.load(state, checkpoint)
        for batch in fa.batches(state, epochs=1):
            state, _ = fa.step(state, batch)
            if state.step == save_at:
                fa.save(state, save_to)
            if state.step == num_steps:
                break
        return {n: p.detach().clone() for n, p in state.model.named_parameters()}
    finally:
        fa.shutdown(state)


def refusals(base: fa.RunState) -> list[str]:
    """The errors of a 2-rank sp run: each message, in order."""
    messages = []
    cases: list[tuple[dict[str, Any], Tokens, list[fa.Transform]]] = [
        ({"heads": 1}, Tokens(), [fa.sp()]),  # one head over sp 2
        ({}, Tokens(length=LENGTH - 1), [fa.sp()]),  # a sequence of 15 over sp 2
        ({"mask": True}, Tokens(), [fa.sp()]),  # a sliding-window mask
        ({"manual": True}, Tokens(), [fa.sp()]),  # no SDPA call
        ({}, Tokens(), [fa.ddp()]),  # sp_size 2 without fa.sp
        ({}, Tokens(), [fa.sp(), fa.accumulate(2, normalize="items")]),
        ({"own_forward": True}, Tokens(), [fa.sp()]),  # fa.backward on a loss fa.sp did not split
        ({"llama": True, "recompute": True}, Tokens(), [fa.sp()]),  # transformers' own checkpointing
    ]
    for attention, data, transforms in cases:
        own_forward = attention.pop("own_forward", False)
        state = fa.init(cpu=True, seed=0, parallelism=fa.ParallelismConfig(sp_size=2))
        try:
            recompute = attention.pop("recompute", False)
            model = make_model(**attention)
            if recompute:
                getattr(model.lm, "gradient_checkpointing_enable")()  # transformers' own method
            state = fa.prepare(
                state,
                model,
                torch.optim.SGD(model.parameters(), lr=LR),
                DataLoader(data, batch_size=2),
                loss_fn=loss_fn,
                pipeline=fa.compose(*transforms),
            )
            for batch in fa.batches(state, epochs=1):
                if own_forward:
                    state = fa.backward(state, loss_fn(state.model, with_positions(batch)))
                else:
                    state, _ = fa.step(state, batch)
                break
            messages.append("no error")
        except ValueError as exc:
            messages.append(str(exc))
        finally:
            fa.shutdown(state)
    return messages
