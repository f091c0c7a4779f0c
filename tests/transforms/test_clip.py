"""fa.clip_grad_norm / fa.clip_grad_value against the hand loop's clip of ``model.parameters()``.

A floating-point norm depends on the order its parts are summed in; a hand loop
(nanoGPT's included) clips ``model.parameters()``, while an optimizer with
decay/no-decay groups holds the same parameters in another order. Bit-for-bit
equality over many clipped steps shows which order fnaccel sums in.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import fnaccel as fa

NUM_STEPS = 20  # the optimizer's order makes the weights differ from step 11 on
BATCH = 12  # divisible by 2 and 3 ranks


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.LayerNorm(64), nn.Tanh(), nn.Linear(64, 5))


def grouped_adamw(model: nn.Module) -> torch.optim.Optimizer:
    """The transformers scripts' split: weights decay, biases and LayerNorm weights do not."""
    decay = [p for n, p in model.named_parameters() if n.endswith("weight") and p.ndim == 2]
    no_decay = [p for n, p in model.named_parameters() if not (n.endswith("weight") and p.ndim == 2)]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}], lr=1e-2
    )


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [
        (torch.randn(BATCH, 16, generator=g) * 4, torch.randint(0, 5, (BATCH,), generator=g))
        for _ in range(NUM_STEPS)
    ]


def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


Clip = Callable[[Any], Any]
CLIPS: dict[str, tuple[Any, Clip]] = {
    "norm": (fa.clip_grad_norm(0.05), lambda params: nn.utils.clip_grad_norm_(params, 0.05)),
    "value": (fa.clip_grad_value(0.002), lambda params: nn.utils.clip_grad_value_(params, 0.002)),
}


def train_both(state: fa.RunState, clip: str) -> dict[str, Any]:
    """fnaccel's run and the hand loop (DDP-wrapped on several processes) on this rank's
    share of the same batches; the weights and the norms each reported."""
    rank, size = state.dist.rank, state.dist.num_processes
    transform, hand_clip = CLIPS[clip]
    model = make_model()
    reference = copy.deepcopy(model)
    optimizer = grouped_adamw(model)
    assert [id(p) for g in optimizer.param_groups for p in g["params"]] != [id(p) for p in model.parameters()]
    state = fa.prepare(state, model, optimizer, loss_fn=loss_fn, pipeline=fa.compose(fa.ddp(), transform))
    wrapped = (
        reference if size == 1 else DistributedDataParallel(reference, process_group=state.dist.process_group)
    )
    hand_optimizer = grouped_adamw(reference)
    norms, hand_norms = [], []
    for x, y in batches():
        part = slice(rank * BATCH // size, (rank + 1) * BATCH // size)
        state, metrics = fa.step(state, (x[part], y[part]))
        norms.append(metrics.get("grad_norm"))
        loss_fn(wrapped, (x[part], y[part])).backward()
        hand_norms.append(hand_clip(wrapped.parameters()))
        hand_optimizer.step()
        hand_optimizer.zero_grad()
    clipped = [n is not None and bool(n > 0.05) for n in hand_norms]
    return {
        "weights": [p.detach().clone() for p in model.parameters()],
        "hand": [p.detach().clone() for p in reference.parameters()],
        "norms": norms,
        "hand_norms": hand_norms,
        "clipped": clipped,
    }


def check(result: dict[str, Any], clip: str) -> None:
    if clip == "norm":
        assert all(result["clipped"]), "clipping must be active for the order to matter"
    if clip == "norm":
        assert all(torch.equal(a, b) for a, b in zip(result["norms"], result["hand_norms"], strict=False))
    for p, q in zip(result["weights"], result["hand"], strict=True):
        assert torch.equal(p, q), f"weights differ by {(p - q).abs().max().item():.3g}"


@pytest.mark.parametrize("clip", sorted(CLIPS))
def test_clipping_equals_the_hand_loop_bit_for_bit_with_decay_groups(clip: str) -> None:
    check(train_both(fa.init(seed=0, cpu=True), clip), clip)


def test_clipping_under_ddp_equals_the_hand_ddp_loop_bit_for_bit(world: Any) -> None:
    # clip_grad_value is elementwise (no order to get wrong): checked on one process only
    for result in world.run(train_both, "norm"):
        check(result, "norm")
