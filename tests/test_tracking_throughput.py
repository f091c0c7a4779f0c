"""fa.count_flops, fa.throughput_meter and fa.throughput: FLOPs exact against the
hand count, rates exact under a controlled clock, and no read of a device
value between two readings."""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import fnaccel as fa
from fnaccel.tracking.throughput import _peak_for_name


def _linear_stack(widths: tuple[int, ...], bias: bool) -> nn.Sequential:
    layers: list[nn.Module] = []
    for fan_in, fan_out in itertools.pairwise(widths):
        layers += [nn.Linear(fan_in, fan_out, bias=bias), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


@pytest.mark.parametrize("bias", [False, True])
def test_a_stack_of_linears_counts_the_hand_written_flops(bias: bool) -> None:
    widths, rows = (12, 32, 24, 5), 7
    model = _linear_stack(widths, bias)
    weights = sum(a * b for a, b in itertools.pairwise(widths))
    forward = 2 * rows * weights  # 2*m*k*n per product; the bias add is not a product
    first = 2 * rows * widths[0] * widths[1]
    x = torch.randn(rows, widths[0])
    assert fa.count_flops(model, x) == forward
    # backward: the weight's gradient and the input's, except the first layer's input (no grad)
    assert fa.count_flops(model, x, lambda m, b: m(b).sum()) == 3 * forward - first


class _Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)
        self.dropout = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, width = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(batch, seq, 3, self.heads, -1).transpose(1, 3).unbind(2)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.dropout(self.proj(attended.transpose(1, 2).reshape(batch, seq, width)))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class _TinyLM(nn.Module):
    def __init__(
        self, vocab: int = 50, width: int = 16, heads: int = 2, layers: int = 2, seq: int = 12
    ) -> None:
        super().__init__()
        self.tokens, self.positions = nn.Embedding(vocab, width), nn.Embedding(seq, width)
        self.blocks = nn.Sequential(*(_Block(width, heads) for _ in range(layers)))
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.tokens.weight  # tied, as GPT-2's

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.tokens(ids) + self.positions(torch.arange(ids.shape[1]))))


def _lm_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    ids, targets = batch
    return F.cross_entropy(model(ids).flatten(0, 1), targets.flatten())


def _lm_batch(batch: int = 3, seq: int = 12, vocab: int = 50) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, vocab, (batch, seq + 1), generator=torch.Generator().manual_seed(0))
    return ids[:, :-1], ids[:, 1:]


def test_a_transformer_step_counts_6_n_tokens_plus_attention() -> None:
    vocab, width, layers, batch, seq = 50, 16, 2, 3, 12
    model = _TinyLM(vocab, width, 2, layers, seq)
    tokens = batch * seq
    # the parameters of the matrix products: the blocks' Linear weights and the tied head
    matmul_params = layers * (3 * width * width + width * width + 8 * width * width) + vocab * width
    # attention's QK^T and AV: 2 products of 2*b*s*s*width each forward, twice that backward
    attention = 12 * layers * batch * seq * seq * width
    assert (
        fa.count_flops(model, _lm_batch(batch, seq, vocab), _lm_loss)
        == 6 * matmul_params * tokens + attention
    )


def test_counting_leaves_the_model_and_the_rng_as_they_were() -> None:
    model = nn.Sequential(_TinyLM(), nn.Identity())
    norm = nn.BatchNorm1d(4)
    model.append(norm)  # a buffer that a forward in train mode would update
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = (torch.get_rng_state(), random.getstate())

    def loss_fn(m: nn.Module, batch: Any) -> tuple[torch.Tensor, dict[str, int]]:
        out = m[1](m[0](batch[0]))
        return out.sum() + m[2](out[0, :, :4]).sum(), {"aux": 1}  # (loss, aux) as fa.prepare takes it

    assert fa.count_flops(model, _lm_batch(), loss_fn) > 0
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert all(v.device.type == "cpu" for v in model.state_dict().values())
    assert torch.equal(torch.get_rng_state(), rng[0]) and random.getstate() == rng[1]
    assert model[0].head.weight is model[0].tokens.weight


def test_a_model_that_cannot_run_on_meta_says_how_to_count_instead() -> None:
    class ReadsAValue(nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x) * x.sum().item()

    with pytest.raises(ValueError, match="FlopCounterMode.*flops_per_batch"):
        fa.count_flops(ReadsAValue(3, 3), torch.randn(2, 3))


class _Clock:
    """A clock that advances only when told to."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _prepared(seed: int = 0) -> fa.RunState:
    torch.manual_seed(seed)
    model = _linear_stack((6, 8, 1), bias=True)
    return fa.prepare(
        fa.init(cpu=True, seed=seed),
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        loss_fn=lambda m, b: F.mse_loss(m(b[0]), b[1]),
    )


def _batches() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    while True:
        yield torch.randn(4, 6, generator=g), torch.randn(4, 1, generator=g)


def test_rates_over_each_window_are_exact_under_a_controlled_clock() -> None:
    state, clock, batches = _prepared(), _Clock(), _batches()
    meter = fa.throughput_meter(
        state,
        samples_per_batch=4,
        tokens_per_batch=4 * 10,
        flops_per_batch=3000,
        peak_flops=6000.0,
        clock=clock,
    )
    for seconds, steps in ((2.0, 5), (0.5, 3)):
        for _ in range(steps):
            state, _ = fa.step(state, next(batches))
        clock.now += seconds
        first = meter
        meter, rates = fa.throughput(meter, state)
        assert rates == {
            "samples_per_second": steps * 4 / seconds,
            "tokens_per_second": steps * 40 / seconds,
            "flops_per_second": steps * 3000 / seconds,
            "mfu": steps * 3000 / seconds / 6000,
        }
        assert (meter.micro_step, meter.time) == (state.micro_step, clock.now)
        assert (first.micro_step, first.time) != (meter.micro_step, meter.time)  # a value: the old one stays


def test_on_the_cpu_there_is_no_peak_so_no_mfu_unless_given() -> None:
    state, clock = _prepared(), _Clock()
    meter = fa.throughput_meter(state, flops_per_batch=10, clock=clock)
    assert meter.peak_flops is None
    state, _ = fa.step(state, next(_batches()))
    clock.now += 1.0
    assert fa.throughput(meter, state)[1] == {"flops_per_second": 10.0}


def test_peak_table_lookup_by_device_name() -> None:
    assert _peak_for_name("NVIDIA H100 80GB HBM3", "bf16") == 989e12  # SXM
    assert _peak_for_name("NVIDIA H100 PCIe", "bf16") == 756.5e12
    assert _peak_for_name("NVIDIA H100 NVL", "fp8") == 1670.5e12
    assert _peak_for_name("NVIDIA H200", "bf16") == 989e12
    assert _peak_for_name("NVIDIA A100-SXM4-80GB", "bf16") == 312e12
    assert _peak_for_name("NVIDIA A100-SXM4-80GB", "fp8") is None  # no fp8 on an A100
    assert _peak_for_name("NVIDIA GeForce RTX 4090", "bf16") is None
    assert fa.device_peak_flops("cpu", fa.bf16) is None


def test_bad_arguments_are_refused_with_the_fix() -> None:
    state = _prepared()
    with pytest.raises(ValueError, match="give samples_per_batch, tokens_per_batch or flops_per_batch"):
        fa.throughput_meter(state)
    with pytest.raises(ValueError, match="tokens_per_batch must be positive"):
        fa.throughput_meter(state, tokens_per_batch=0)
    with pytest.raises(ValueError, match="unknown precision 'int8'"):
        fa.throughput_meter(state, tokens_per_batch=1, peak_flops=1.0, precision="int8")
    meter = fa.throughput_meter(state, tokens_per_batch=1)
    with pytest.raises(ValueError, match="read it after stepping"):
        fa.throughput(meter, state)
    stepped, _ = fa.step(state, next(_batches()))
    with pytest.raises(ValueError, match="increasing clock"):
        fa.throughput(fa.throughput_meter(state, tokens_per_batch=1, clock=lambda: 1.0), stepped)


class _CountReads(TorchDispatchMode):
    """Counts reads of a tensor's value by the host (``.item()``, ``float(t)``, ...)."""

    def __init__(self) -> None:
        super().__init__()
        self.reads = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.ops.aten._local_scalar_dense.default:
            self.reads += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("read_each_step", [False, True], ids=["meter", "control-item-per-step"])
def test_reading_every_n_steps_reads_no_device_value_per_step(read_each_step: bool) -> None:
    state, batches = _prepared(), _batches()
    meter = fa.throughput_meter(state, tokens_per_batch=4, flops_per_batch=100, peak_flops=1e9)
    losses = []
    with _CountReads() as counter:
        for i in range(1, 11):
            state, metrics = fa.step(state, next(batches))
            losses.append(metrics["loss"])
            if read_each_step:  # the detector's control: what a per-step .item() looks like
                metrics["loss"].item()
            if i % 5 == 0:
                meter, rates = fa.throughput(meter, state)
                assert set(rates) == {"tokens_per_second", "flops_per_second", "mfu"}
    assert counter.reads == (10 if read_each_step else 0)
    assert all(isinstance(loss, torch.Tensor) for loss in losses)  # still unread


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (implicit syncs are CUDA's)")
def test_on_cuda_the_loop_and_the_readings_make_no_implicit_sync() -> None:
    torch.manual_seed(0)
    model = _linear_stack((64, 256, 1), bias=True)
    state = fa.init(seed=0)
    state = fa.prepare(
        state,
        model,
        torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True),
        loss_fn=lambda m, b: F.mse_loss(m(b[0]), b[1]),
    )
    batches = [
        (torch.randn(32, 64, device=state.dist.device), torch.randn(32, 1, device=state.dist.device))
        for _ in range(10)
    ]
    meter = fa.throughput_meter(
        state,
        tokens_per_batch=32,
        flops_per_batch=fa.count_flops(model, batches[0], lambda m, b: F.mse_loss(m(b[0]), b[1])),
    )
    torch.cuda.set_sync_debug_mode("error")  # an implicit sync (.item(), a pageable copy) raises
    try:
        for i, batch in enumerate(batches, 1):
            state, metrics = fa.step(state, batch)
            if i % 5 == 0:
                meter, rates = fa.throughput(meter, state)  # its explicit synchronize is allowed
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert rates["tokens_per_second"] > 0
    assert ("mfu" in rates) == (fa.device_peak_flops(state.dist.device) is not None)
    assert metrics["loss"].device.type == "cuda"


@pytest.mark.slow
def test_the_documented_loop_runs_and_logs_the_rates(tmp_path: Path) -> None:
    import json
    import re

    page = (Path(__file__).resolve().parents[1] / "docs" / "tracking.md").read_text()
    [block] = [
        code for code in re.findall(r"```python\n(.*?)```", page, re.S) if "fa.throughput_meter(" in code
    ]
    ids = torch.randint(0, 50, (40, 13), generator=torch.Generator().manual_seed(0))
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(ids[:, :-1], ids[:, 1:]), batch_size=2
    )
    model = _TinyLM()
    names: dict[str, Any] = {
        "fa": fa,
        "model": model,
        "loss_fn": _lm_loss,
        "optimizer": torch.optim.AdamW(model.parameters()),
        "loader": loader,
        "batch": next(iter(loader)),
        "batch_size": 2,
        "seq_len": 12,
        "state": fa.init_trackers(fa.init(cpu=True, seed=0, project_dir=tmp_path), "tp"),
    }
    exec(block, names)
    lines = [json.loads(line) for line in (tmp_path / "tp" / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [10, 20]
    assert all(
        line["values"]["tokens_per_second"] > 0 and "mfu" not in line["values"] for line in lines
    )  # no peak on the CPU
    fa.shutdown(names["state"])
