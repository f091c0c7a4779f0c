"""`Phase`: the one table of where each transform and collective sits in a pipeline."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor.parallel import ColwiseParallel

import fnaccel as fa
from fnaccel.transforms import Collective, Transform
from fnaccel.transforms.phases import Phase


def _every_factory() -> list[tuple[Transform | Collective, Phase]]:
    """One transform or collective from each factory, with the phase the table gives it."""
    return [
        (fa.pad_across_processes(dim=1), Phase.PAD),
        (fa.gather(), Phase.COMMUNICATE),
        (fa.gather_for_metrics(), Phase.COMMUNICATE),
        (fa.reduce(), Phase.COMMUNICATE),
        (fa.broadcast(), Phase.COMMUNICATE),
        (fa.gather_object(), Phase.COMMUNICATE),
        (fa.broadcast_object_list(), Phase.COMMUNICATE),
        (fa.autocast(fa.bf16), Phase.AUTOCAST),
        (fa.grad_scaler(), Phase.GRAD_SCALER),
        (fa.pp(loss_fn=torch.nn.functional.mse_loss, num_microbatches=2), Phase.PIPELINE_PARALLEL),
        (fa.tp({"up": ColwiseParallel()}), Phase.TENSOR_PARALLEL),
        (fa.checkpoint_activations(), Phase.CHECKPOINT_ACTIVATIONS),
        (fa.ddp(), Phase.DATA_PARALLEL),
        (fa.fsdp(), Phase.DATA_PARALLEL),
        (fa.deepspeed(zero_stage=2), Phase.DATA_PARALLEL),
        (fa.local_sgd(4), Phase.LOCAL_SGD),
        (fa.accumulate(4), Phase.ACCUMULATE),
        (fa.accumulate(4, normalize="items"), Phase.ACCUMULATE),
        (fa.clip_grad_norm(1.0), Phase.CLIP),
        (fa.clip_grad_value(1.0), Phase.CLIP),
        (fa.skip_nonfinite(), Phase.SKIP_NONFINITE),
        (fa.compile(), Phase.COMPILE),
        (fa.profile(), Phase.PROFILE),
    ]


def test_every_factory_takes_its_place_from_the_table() -> None:
    placed = _every_factory()
    wrong = {
        repr(t): (t.phase, phase)
        for t, phase in placed
        if not isinstance(t.phase, Phase) or t.phase is not phase
    }
    assert not wrong, wrong


def test_the_table_reads_in_pipeline_order() -> None:
    """Members are written earliest first, so the table is read top to bottom."""
    assert list(Phase) == sorted(Phase)
    assert max(p for p in Phase if p <= Phase.COMMUNICATE) < min(p for p in Phase if p >= Phase.AUTOCAST)


def test_the_table_orders_a_pipeline_written_backwards() -> None:
    """compose names the first transform out of order and prints the call in the table's order."""
    written = (
        fa.compile(),
        fa.clip_grad_norm(1.0),
        fa.accumulate(4),
        fa.ddp(),
        fa.checkpoint_activations(),
        fa.autocast(fa.bf16),
    )
    with pytest.raises(ValueError) as info:
        fa.compose(*written)
    assert str(info.value) == (
        "compose: clip_grad_norm(max_norm=1.0) must come before compile(); write compose(autocast("
        "dtype=torch.bfloat16), checkpoint_activations(), ddp(), accumulate(num_steps=4), "
        "clip_grad_norm(max_norm=1.0), compile())"
    )
    merged = fa.compose(
        fa.compose(fa.accumulate(4), fa.compile()),
        fa.compose(fa.autocast(fa.bf16), fa.ddp()),
        fa.compose(fa.checkpoint_activations(), fa.clip_grad_norm(1.0)),
    )
    assert merged.names == (
        "autocast",
        "checkpoint_activations",
        "ddp",
        "accumulate",
        "clip_grad_norm",
        "compile",
    )


def test_a_transform_of_ones_own_takes_a_place_between_two() -> None:
    mine = Transform(name="mine", phase=Phase.DATA_PARALLEL + 2)
    pipeline = fa.compose(fa.compose(fa.autocast(fa.bf16), fa.ddp(), fa.accumulate(2)), mine)
    assert pipeline.names == ("autocast", "ddp", "mine", "accumulate")
    with pytest.raises(ValueError, match=r"mine\(\) must come before accumulate\(num_steps=2\)"):
        fa.compose(fa.ddp(), fa.accumulate(2), mine)
