"""`fa.checkpoint_activations(..., offload=True)`: the checkpointed blocks' inputs wait in
host memory (`torch.autograd.graph.save_on_cpu`) and the results do not change.

One process, no process group: the offload is a per-process memory trade. The
plain checkpointing tests (bit-equal, fewer bytes saved) are in test_mesh.py.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fnaccel as fa
from fnaccel.transforms.plugins.fsdp import FullyShardedDataParallelPlugin
from tests.transforms import _mesh_fns as fns


def _train(pipeline: fa.Pipeline, num_steps: int = 3) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = fns.make_model()
    state = fa.prepare(
        fa.init(cpu=True, seed=0),
        model,
        torch.optim.SGD(model.parameters(), lr=fns.LR),
        pipeline=pipeline,
        loss_fn=fns.loss_fn,
    )
    x, y = fns.data().tensors
    losses = []
    for step in range(num_steps):
        batch = (x[step * 4 : (step + 1) * 4], y[step * 4 : (step + 1) * 4])
        state, metrics = fa.step(state, batch)
        losses.append(float(metrics["loss"]))
    assert state.model is not None
    return losses, {name: p.detach().clone() for name, p in state.model.named_parameters()}


def test_offloaded_checkpointing_trains_bit_for_bit_like_plain_checkpointing_and_none() -> None:
    plain_losses, plain = _train(fa.compose())
    for pipeline in (
        fa.compose(fa.checkpoint_activations()),
        fa.compose(fa.checkpoint_activations("Block", offload=True)),
    ):
        losses, weights = _train(pipeline)
        assert losses == plain_losses, pipeline
        for name, weight in plain.items():
            assert torch.equal(weights[name], weight), (pipeline, name)


def _bytes_seen_by_an_outer_hook(offload: bool) -> int:
    model = fns.make_model()
    state = fa.prepare(
        fa.init(cpu=True, seed=0),
        model,
        pipeline=fa.compose(fa.checkpoint_activations(offload=offload)),
        loss_fn=fns.loss_fn,
    )
    assert state.model is not None
    saved = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = fns.loss_fn(state.model, fns.data().tensors)
    loss.backward()
    return saved[0]


def test_offload_hands_the_blocks_saved_inputs_to_save_on_cpu() -> None:
    # save_on_cpu's hooks sit inside the outer ones, so the block inputs it packs are not seen outside
    x, _ = fns.data().tensors
    block_input = x.numel() * x.element_size()
    assert _bytes_seen_by_an_outer_hook(False) - _bytes_seen_by_an_outer_hook(True) >= 2 * block_input


@pytest.mark.parametrize("offload", [1, "true", None])
def test_an_offload_that_is_not_a_bool_is_refused(offload: object) -> None:
    with pytest.raises(TypeError, match="offload must be True or False, got"):
        fa.checkpoint_activations(offload=offload)  # type: ignore[arg-type]


def test_the_fsdp_plugin_field_builds_the_offload_and_needs_checkpointing() -> None:
    plugin = FullyShardedDataParallelPlugin.from_config(
        {
            "fsdp_activation_checkpointing": "true",
            "fsdp_activation_checkpointing_offload": True,
            "fsdp_transformer_layer_cls_to_wrap": "Block",
        }
    )
    assert plugin.checkpointing() == fa.checkpoint_activations("Block", offload=True)
    assert repr(plugin.checkpointing()) == "checkpoint_activations(classes=('Block',), offload=True)"
    with pytest.raises(
        fa.ConfigError,
        match="'fsdp_activation_checkpointing_offload': true needs fsdp_activation_checkpointing true",
    ):
        FullyShardedDataParallelPlugin.from_config({"fsdp_activation_checkpointing_offload": True})
    with pytest.raises(fa.ConfigError, match="'fsdp_activation_checkpointing_offload' must be true or false"):
        FullyShardedDataParallelPlugin.from_config({"fsdp_activation_checkpointing_offload": "maybe"})
    with pytest.raises(fa.ConfigError, match="activation_checkpointing_offload"):
        FullyShardedDataParallelPlugin(activation_checkpointing=True, activation_checkpointing_offload=1)  # type: ignore[arg-type]


class _Wide(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class _Stack(nn.Module):
    def __init__(self, dim: int, depth: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Wide(dim) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def _peak_bytes(offload: bool, tokens: int, dim: int, depth: int) -> int:
    torch.manual_seed(0)
    model = _Stack(dim, depth)
    state = fa.prepare(
        fa.init(seed=0), model, pipeline=fa.compose(fa.checkpoint_activations(offload=offload))
    )
    assert state.model is not None
    x = torch.randn(tokens, dim, device=next(state.model.parameters()).device, requires_grad=True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    state.model(x).square().mean().backward()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated()


@pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs CUDA: on the CPU, activations already live in "
    "host memory, so offloading cannot lower the peak",
)
def test_offload_lowers_the_gpu_peak() -> None:
    tokens, dim, depth = 8192, 512, 8
    block_input = tokens * dim * 4
    plain, offloaded = _peak_bytes(False, tokens, dim, depth), _peak_bytes(True, tokens, dim, depth)
    # plain checkpointing keeps every block's input on the GPU until backward; the offload keeps them on the host
    assert offloaded <= plain - (depth // 2) * block_input, (plain, offloaded, block_input)
