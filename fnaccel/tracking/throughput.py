"""Throughput and model FLOPs utilisation (MFU) to log: `count_flops`, `throughput_meter`, `throughput`.

A meter is a frozen value holding the last reading (clock time and the
state's ``micro_step``); `throughput` reads the clock once, returns the rates
over the batches stepped since, and a new meter. Nothing is recorded per
step, so the loop between two readings runs exactly as without a meter.

Timing: the host clock (``time.perf_counter`` unless a clock is given). On
CUDA the host runs ahead of the device, so a reading first waits for the
device's queued work (``torch.cuda.synchronize``): the window between two
readings is then the device's time for its batches. That wait happens only
at a reading, i.e. when the user logs, where `fa.log`'s read of the loss waits
for the same work anyway. CUDA events would time the device without that
wait, but they must be recorded in the loop, at every step.

The FLOPs of a batch are counted once, by `torch.utils.flop_counter`, on a
copy of the model on the ``meta`` device: no memory, no compute, nothing of
the real model or the process's RNG touched, and the same count on every
device (on the CPU the counter does not see the fused attention kernel; on
``meta`` attention runs as matrix products it does see).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map
from torch.utils.flop_counter import FlopCounterMode

from fnaccel.state import RunState

__all__ = [
    "PEAK_FLOPS",
    "ThroughputMeter",
    "count_flops",
    "device_peak_flops",
    "throughput",
    "throughput_meter",
]


def _dense(**figures: float) -> Mapping[str, float]:
    return MappingProxyType(figures)


# Dense peak FLOP/s of one device, from NVIDIA's datasheets: their tensor-core
# figures are "with sparsity", so each is halved here; fp32 is the plain
# (non-tensor-core) figure. H100 and H200 SXM: 1,979 TFLOP/s bf16/fp16 and
# 3,958 fp8 with sparsity, 989 tf32, 67 fp32. H100 PCIe: 1,513 / 3,026 / 756 /
# 51. H100 NVL and H200 NVL: 1,671 / 3,341 / 835 / 60. A100 (SXM4 and PCIe):
# 624 bf16/fp16 and 312 tf32 with sparsity, 19.5 fp32, no fp8. Matched in this
# order against torch.cuda.get_device_name, the first that the name contains.
PEAK_FLOPS: Mapping[str, Mapping[str, float]] = MappingProxyType(
    {
        "H100 NVL": _dense(fp8=1670.5e12, bf16=835.5e12, fp16=835.5e12, tf32=417.5e12, fp32=60e12),
        "H100 PCIe": _dense(fp8=1513e12, bf16=756.5e12, fp16=756.5e12, tf32=378e12, fp32=51e12),
        "H100": _dense(fp8=1979e12, bf16=989e12, fp16=989e12, tf32=494.5e12, fp32=67e12),
        "H200 NVL": _dense(fp8=1670.5e12, bf16=835.5e12, fp16=835.5e12, tf32=417.5e12, fp32=60e12),
        "H200": _dense(fp8=1979e12, bf16=989e12, fp16=989e12, tf32=494.5e12, fp32=67e12),
        "A100": _dense(bf16=312e12, fp16=312e12, tf32=156e12, fp32=19.5e12),
    }
)

_PRECISIONS = MappingProxyType(
    {
        torch.bfloat16: "bf16",
        torch.float16: "fp16",
        torch.float32: "fp32",
        "no": "fp32",
        "bf16": "bf16",
        "fp16": "fp16",
        "fp32": "fp32",
        "tf32": "tf32",
        "fp8": "fp8",
    }
)


def device_peak_flops(device: torch.device | str, precision: str | torch.dtype = "bf16") -> float | None:
    """The dense peak FLOP/s of ``device`` in ``precision`` from `PEAK_FLOPS`, or None
    where the table has none (the CPU, a device not listed, fp8 on an A100).

    Args:
        device: a CUDA device (its name is looked up), or any other device.
        precision: ``"bf16"``, ``"fp16"``, ``"fp8"``, ``"tf32"`` (fp32 matrix
            products on tensor cores), ``"fp32"``, or ``fa.bf16`` / ``fa.fp16``
            / ``fa.fp32`` / ``fa.fp8``.

    Raises:
        ValueError: ``precision`` is none of these.

    >>> import fnaccel as fa
    >>> fa.device_peak_flops("cpu", fa.bf16) is None
    True
    """
    name = _precision(precision)
    device = torch.device(device)
    if device.type != "cuda":
        return None
    return _peak_for_name(torch.cuda.get_device_name(device), name)


def _peak_for_name(device_name: str, precision: str) -> float | None:
    """The first `PEAK_FLOPS` row whose key ``device_name`` contains, in ``precision``."""
    for key, figures in PEAK_FLOPS.items():
        if key in device_name:
            return figures.get(precision)
    return None


def _precision(precision: str | torch.dtype) -> str:
    name = _PRECISIONS.get(precision)
    if name is None:
        raise ValueError(
            f"unknown precision {precision!r} for the peak FLOP/s: use one of 'bf16', 'fp16', 'fp8', "
            "'tf32', 'fp32' (or fa.bf16, fa.fp16, fa.fp32, fa.fp8)"
        )
    return name


def count_flops(model: nn.Module, batch: Any, loss_fn: Callable[[nn.Module, Any], Any] | None = None) -> int:
    """The FLOPs of one batch through ``model``, counted by `torch.utils.flop_counter`:
    forward and backward when ``loss_fn`` is given, else forward only.

    The count runs on a copy of ``model`` and ``batch`` on the ``meta``
    device, so it allocates nothing, computes nothing, and leaves the model
    (weights, gradients, buffers) and the process's RNG as they were. It
    follows the counter's conventions: a matrix product of ``(m, k)`` by
    ``(k, n)`` is ``2*m*k*n``; a ``Linear`` counts its product but not its
    bias; the backward of a product is its two products (one where its input
    needs no gradient, as a first layer's); attention counts full ``seq**2``
    products even when causal; embeddings, norms, activations and the
    optimizer count 0. For a dense transformer that is ``6 * tokens *`` (the
    parameters of its matrix products) plus ``12 * layers * batch * seq**2 *
    width`` for attention (``tests/test_tracking_throughput.py`` checks it).

    Args:
        model: the bare model (not one returned by `fa.prepare`, which may be
            wrapped, compiled or sharded).
        batch: one batch, as ``loss_fn`` (or ``model``) takes it; tensors
            anywhere in it are copied to ``meta``.
        loss_fn: ``loss_fn(model, batch) -> loss | (loss, aux)``, as given to
            `fa.prepare`; None counts ``model(batch)`` under ``no_grad``.

    Returns:
        The FLOPs of the batch (an int).

    Raises:
        ValueError: the model cannot run on ``meta`` (an operation that reads
            a value, such as ``.item()``); the message says how to count
            without this function.

    >>> import torch, fnaccel as fa
    >>> model = torch.nn.Linear(8, 4, bias=False)
    >>> fa.count_flops(model, torch.randn(16, 8))  # 2 * 16 * 8 * 4
    1024
    >>> fa.count_flops(model, torch.randn(16, 8), lambda m, x: m(x).sum())  # and the weight's gradient
    2048
    """
    meta_model = _meta_copy(model)
    meta_batch = tree_map(lambda x: x.to("meta") if isinstance(x, torch.Tensor) else x, batch)
    counter = FlopCounterMode(display=False)
    try:
        with counter:
            if loss_fn is None:
                with torch.no_grad():
                    meta_model(meta_batch)
            else:
                loss = loss_fn(meta_model, meta_batch)
                (loss[0] if isinstance(loss, tuple) else loss).backward()
    except (NotImplementedError, RuntimeError) as exc:
        raise ValueError(
            f"count_flops: the model could not run on the 'meta' device ({type(exc).__name__}: {exc}); "
            "count on the real model with torch.utils.flop_counter.FlopCounterMode and give "
            "flops_per_batch to fa.throughput_meter yourself"
        ) from exc
    return int(counter.get_total_flops())


def _meta_copy(model: nn.Module) -> nn.Module:
    """``model`` deep-copied with every parameter and buffer replaced by an empty
    ``meta`` tensor (tied parameters stay tied: the copy's memo maps each once)."""
    memo: dict[int, object] = {}  # deepcopy's: id -> the copy
    for param in model.parameters():
        memo[id(param)] = nn.Parameter(
            torch.empty_like(param, device="meta"), requires_grad=param.requires_grad
        )
    for buffer in model.buffers():
        memo[id(buffer)] = torch.empty_like(buffer, device="meta")
    return copy.deepcopy(model, memo)


@dataclass(frozen=True, slots=True, kw_only=True)
class ThroughputMeter:
    """The last reading of a run's throughput and what a batch holds; made by
    `throughput_meter`, advanced by `throughput`.

    Attributes:
        samples_per_batch: samples in one batch on this process, or None.
        tokens_per_batch: tokens in one batch on this process, or None.
        flops_per_batch: FLOPs of one batch (forward and backward), or None.
        peak_flops: the device's peak FLOP/s used for MFU, or None (no MFU).
        device: the device whose queued work a reading waits for.
        clock: the clock read (seconds).
        time: the clock at the last reading.
        micro_step: the state's ``micro_step`` at the last reading.
    """

    samples_per_batch: int | None
    tokens_per_batch: int | None
    flops_per_batch: int | None
    peak_flops: float | None
    device: torch.device
    clock: Callable[[], float]
    time: float
    micro_step: int


def throughput_meter(
    state: RunState,
    *,
    samples_per_batch: int | None = None,
    tokens_per_batch: int | None = None,
    flops_per_batch: int | None = None,
    peak_flops: float | None = None,
    precision: str | torch.dtype = "bf16",
    clock: Callable[[], float] = time.perf_counter,
) -> ThroughputMeter:
    """A meter whose first window starts now, at ``state``'s batch count; consumes nothing.

    On CUDA it waits for the device's queued work first (a window holds only
    the batches stepped after it).

    Args:
        state: the run's state (its device and ``micro_step`` are read).
        samples_per_batch: samples per batch on this process (for
            ``samples_per_second``).
        tokens_per_batch: tokens per batch on this process (for
            ``tokens_per_second``), e.g. ``batch_size * seq_len``.
        flops_per_batch: FLOPs of one batch's forward and backward, e.g. from
            `count_flops` (for ``flops_per_second`` and ``mfu``).
        peak_flops: the device's peak FLOP/s for ``mfu``; None looks it up
            (`device_peak_flops`): none on the CPU or an unlisted device, so no
            ``mfu`` there.
        precision: the precision whose peak is looked up (the matrix
            products', e.g. ``fa.bf16`` under ``fa.autocast(fa.bf16)``).
        clock: seconds, increasing (``time.perf_counter``).

    Raises:
        ValueError: none of the three counts is given, or a count or
            ``peak_flops`` is not positive, or ``precision`` is unknown.

    >>> import fnaccel as fa
    >>> state = fa.init(cpu=True)
    >>> meter = fa.throughput_meter(state, tokens_per_batch=8 * 128, flops_per_batch=10**9, peak_flops=1e12)
    >>> meter.micro_step, meter.peak_flops
    (0, 1000000000000.0)
    """
    counts = {
        "samples_per_batch": samples_per_batch,
        "tokens_per_batch": tokens_per_batch,
        "flops_per_batch": flops_per_batch,
    }
    if all(value is None for value in counts.values()):
        raise ValueError(
            "throughput_meter: give samples_per_batch, tokens_per_batch or flops_per_batch "
            "(what one batch holds); without one there is no rate to report"
        )
    for name, value in {**counts, "peak_flops": peak_flops}.items():
        if value is not None and not value > 0:
            raise ValueError(f"throughput_meter: {name} must be positive, got {value!r}")
    device = state.dist.device
    if peak_flops is None:
        peak_flops = device_peak_flops(device, precision)
    else:
        _precision(precision)
    _wait_for(device)
    return ThroughputMeter(
        samples_per_batch=samples_per_batch,
        tokens_per_batch=tokens_per_batch,
        flops_per_batch=flops_per_batch,
        peak_flops=peak_flops,
        device=device,
        clock=clock,
        time=clock(),
        micro_step=state.micro_step,
    )


def throughput(meter: ThroughputMeter, state: RunState) -> tuple[ThroughputMeter, dict[str, float]]:
    """The rates over the batches stepped since ``meter``'s reading, and the meter
    read now; consumes nothing. Call it when you log, not every step.

    On CUDA it waits for the device's queued work before reading the clock;
    no tensor is read and nothing is recorded between readings.

    Args:
        meter: the last reading (`throughput_meter`, or this function's).
        state: the run's state now (its ``micro_step`` is read).

    Returns:
        ``(meter, rates)``: ``rates`` holds, per process, ``samples_per_second``,
        ``tokens_per_second`` and ``flops_per_second`` for the counts the
        meter was given, and ``mfu`` (achieved over peak FLOP/s, a fraction
        of 1) when it has both ``flops_per_batch`` and a peak.

    Raises:
        ValueError: no batch was stepped since the reading (or ``state`` is
            older than it), or the clock did not advance.

    >>> import fnaccel as fa
    >>> state = fa.init(cpu=True)
    >>> ticks = iter([0.0, 2.0])  # a clock for the example: 2 s between readings
    >>> meter = fa.throughput_meter(state, tokens_per_batch=1024, flops_per_batch=10**12,
    ...                             peak_flops=2e12, clock=lambda: next(ticks))
    >>> state = state.replace(micro_step=3)  # as three fa.step calls would leave it
    >>> meter, rates = fa.throughput(meter, state)
    >>> rates
    {'tokens_per_second': 1536.0, 'flops_per_second': 1500000000000.0, 'mfu': 0.75}
    """
    batches = state.micro_step - meter.micro_step
    if batches <= 0:
        raise ValueError(
            f"fa.throughput: the state is at micro-step {state.micro_step} and the meter read at "
            f"{meter.micro_step}; read it after stepping, with the state the loop advanced"
        )
    _wait_for(meter.device)
    now = meter.clock()
    seconds = now - meter.time
    if not seconds > 0:
        raise ValueError(
            f"fa.throughput: the clock went from {meter.time} to {now}; give an increasing "
            "clock (time.perf_counter)"
        )
    rates: dict[str, float] = {}
    if meter.samples_per_batch is not None:
        rates["samples_per_second"] = batches * meter.samples_per_batch / seconds
    if meter.tokens_per_batch is not None:
        rates["tokens_per_second"] = batches * meter.tokens_per_batch / seconds
    if meter.flops_per_batch is not None:
        rates["flops_per_second"] = batches * meter.flops_per_batch / seconds
        if meter.peak_flops is not None:
            rates["mfu"] = rates["flops_per_second"] / meter.peak_flops
    return replace(meter, time=now, micro_step=state.micro_step), rates


def _wait_for(device: torch.device) -> None:
    """Wait for ``device``'s queued work (CUDA), so the host clock reads the device's time."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
