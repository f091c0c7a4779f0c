"""find_executable_batch_size against simulated limits and real allocator failures."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from fnaccel.modeling.memory import (
    clear_device_cache,
    find_executable_batch_size,
    release_memory,
    should_reduce_batch_size,
)

REFUSED_BYTES = (
    2**52
)  # 4 PiB: past every 64-bit machine's user address space, refused whatever the overcommit


@pytest.fixture(autouse=True)
def frozen_heap() -> Iterator[None]:
    """Every retry runs a full `gc.collect()`, whose cost grows with everything the test
    process holds (torch, and in the suite every module the earlier tests imported: over a
    second a test here). The heap from before the test is frozen (left out of collections);
    what the function under test allocates is collected as ever, the freed-before-the-next-try
    check included."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _simulated(limit: int, tried: list[int]) -> Any:
    """A step that needs ``batch_size`` units and has ``limit`` of them."""

    def step(batch_size: int, scale: float) -> float:
        tried.append(batch_size)
        if batch_size > limit:
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {batch_size} units")
        return batch_size * scale

    return step


def test_settles_on_the_largest_batch_under_a_simulated_limit() -> None:
    tried: list[int] = []
    train = find_executable_batch_size(_simulated(40, tried), starting_batch_size=128)
    assert train(0.5) == 18.0
    assert tried == [128, 115, 103, 92, 82, 73, 65, 58, 52, 46, 41, 36]  # 90% each time, rounded down
    tried.clear()
    odd = find_executable_batch_size(starting_batch_size=100)(_simulated(30, tried))
    assert odd(scale=1.0) == 28.0
    assert tried == [100, 90, 81, 72, 64, 57, 51, 45, 40, 36, 32, 28]


def test_the_default_start_is_128_and_a_later_call_starts_from_what_fitted() -> None:
    tried: list[int] = []
    train = find_executable_batch_size(_simulated(100, tried))  # bare, as @find_executable_batch_size
    assert train(1.0) == 92.0
    assert train(1.0) == 92.0
    assert tried == [128, 115, 103, 92, 92]


def test_settles_on_the_largest_batch_under_a_real_allocation_failure() -> None:
    with pytest.raises(RuntimeError) as info:
        torch.empty(REFUSED_BYTES, dtype=torch.uint8)
    assert should_reduce_batch_size(info.value), str(info.value)  # CPU allocator's own words
    assert type(info.value) is RuntimeError and "DefaultCPUAllocator" in str(info.value)

    tried: list[int] = []

    @find_executable_batch_size(starting_batch_size=128)
    def allocate(batch_size: int) -> int:
        tried.append(batch_size)
        # 1 MiB up to 36, 4 PiB (refused) above: a real allocation, only its growth is steep
        buffer = torch.empty(2**20 if batch_size <= 36 else REFUSED_BYTES, dtype=torch.uint8)
        return buffer.numel()

    assert allocate() == 2**20
    assert tried == [128, 115, 103, 92, 82, 73, 65, 58, 52, 46, 41, 36]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_settles_on_the_largest_batch_that_fits_on_a_real_gpu() -> None:
    clear_device_cache(garbage_collection=True)
    free, total = torch.cuda.mem_get_info()
    per_sample = 2**30
    tried: list[int] = []

    @find_executable_batch_size(starting_batch_size=1024)
    def allocate(batch_size: int) -> int:
        tried.append(batch_size)
        torch.empty(batch_size * per_sample, dtype=torch.uint8, device="cuda")
        return batch_size

    found = allocate()
    assert found * per_sample <= total and 2 * found * per_sample > free, (found, free, total)
    assert tried[-1] == found and len(tried) > 1  # at least one real torch.cuda.OutOfMemoryError


def test_a_failed_try_is_freed_before_the_next_one() -> None:
    alive: list[bool] = []
    previous: list[weakref.ref[torch.Tensor]] = []

    @find_executable_batch_size(starting_batch_size=4)
    def step(batch_size: int) -> int:
        alive.extend(ref() is not None for ref in previous)
        activations = torch.ones(batch_size, 1024)
        previous.append(weakref.ref(activations))
        if batch_size > 1:
            raise torch.OutOfMemoryError("CUDA out of memory.")
        return batch_size

    assert step() == 1
    assert alive == [False] * 6  # tries 3, 2 and 1 each saw every earlier try freed


def test_other_errors_propagate_unchanged_on_the_first_try() -> None:
    calls: list[int] = []
    error = ValueError("labels out of range")

    @find_executable_batch_size(starting_batch_size=64)
    def broken(batch_size: int) -> None:
        calls.append(batch_size)
        raise error

    with pytest.raises(ValueError) as info:
        broken()
    assert info.value is error and calls == [64]

    @find_executable_batch_size(starting_batch_size=64)
    def mismatched(batch_size: int) -> torch.Tensor:
        calls.append(batch_size)
        return torch.ones(batch_size, 3) @ torch.ones(4, 2)  # a real RuntimeError, not memory

    with pytest.raises(RuntimeError, match="cannot be multiplied"):
        mismatched()
    assert calls == [64, 64]


def test_reaching_zero_is_a_clear_error() -> None:
    tried: list[int] = []

    @find_executable_batch_size(starting_batch_size=8)
    def never_fits(batch_size: int) -> None:
        tried.append(batch_size)
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 1 bytes")

    final = (
        r"No executable batch size found, reached zero\. .*at batch size 1: RuntimeError: .*can't allocate"
    )
    with pytest.raises(RuntimeError, match=final):
        never_fits()
    assert tried == [8, 7, 6, 5, 4, 3, 2, 1]
    with pytest.raises(RuntimeError, match="reached zero"):  # and stays so, without another try
        never_fits()
    assert tried == [8, 7, 6, 5, 4, 3, 2, 1]


def test_a_start_of_zero_fails_at_the_call_as_in_accelerate() -> None:
    calls: list[int] = []
    train = find_executable_batch_size(calls.append, starting_batch_size=0)  # decorating is fine
    with pytest.raises(RuntimeError, match="No executable batch size found, reached zero"):
        train()
    assert calls == []


def test_passing_the_batch_size_is_a_type_error() -> None:
    @find_executable_batch_size(starting_batch_size=8)
    def train(batch_size: int, model: str, lr: float = 0.1) -> tuple[int, str, float]:
        return batch_size, model, lr

    assert train("mlp", lr=0.5) == (8, "mlp", 0.5)
    with pytest.raises(TypeError, match=r"Batch size was passed into `train`.*`train\('mlp', 0.5\)`"):
        train(16, "mlp", 0.5)  # type: ignore[call-arg, arg-type]  # the misuse under test
    with pytest.raises(TypeError, match=r"Batch size was passed into `train`.*`train\('mlp'\)`"):
        train("mlp", batch_size=16)  # type: ignore[call-arg]  # the misuse under test

    @find_executable_batch_size(starting_batch_size=8)
    def anything(*args: Any) -> tuple[Any, ...]:
        return args

    assert anything(1, 2) == (8, 1, 2)
    with pytest.raises(TypeError, match="must take the batch size as its first parameter"):
        find_executable_batch_size(lambda: None)  # type: ignore[arg-type, misc]  # the misuse under test
    for bad in (-4, 2.0, True):
        with pytest.raises(ValueError, match="starting_batch_size must be a non-negative int"):
            find_executable_batch_size(starting_batch_size=bad)  # type: ignore[arg-type]


def test_a_custom_reduction() -> None:
    tried: list[int] = []
    sizes = iter([96, 90, 12])

    @find_executable_batch_size(starting_batch_size=100, reduce_batch_size_fn=lambda: next(sizes))
    def step(batch_size: int) -> int:
        tried.append(batch_size)
        if batch_size > 50:
            raise torch.OutOfMemoryError("CUDA out of memory.")
        return batch_size

    assert step() == 12 and tried == [100, 96, 90, 12]

    @find_executable_batch_size(starting_batch_size=8, reduce_batch_size_fn=lambda: 8)
    def stuck(batch_size: int) -> None:
        raise torch.OutOfMemoryError("CUDA out of memory.")

    with pytest.raises(ValueError, match="reduce_batch_size_fn returned 8 after batch size 8"):
        stuck()


@pytest.mark.parametrize(
    ("exception", "expected"),
    [
        (torch.OutOfMemoryError("anything"), True),
        (torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB"), True),
        (RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 79.10 GiB total)"), True),
        (RuntimeError("HIP out of memory. Tried to allocate 2.00 GiB"), True),
        (RuntimeError("cuDNN error: CUDNN_STATUS_NOT_SUPPORTED. This error may appear if ..."), True),
        (RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"), True),
        (
            RuntimeError(
                "[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: not enough memory: "
                "you tried to allocate 1024 bytes."
            ),
            True,
        ),
        (RuntimeError("mat1 and mat2 shapes cannot be multiplied (2x3 and 4x2)"), False),
        (RuntimeError(), False),
        (MemoryError("CUDA out of memory."), False),  # not an allocator failure torch reports
        (ValueError("CUDA out of memory."), False),
    ],
)
def test_should_reduce_batch_size(exception: BaseException, expected: bool) -> None:
    assert should_reduce_batch_size(exception) is expected


def test_release_memory() -> None:
    tensor: torch.Tensor | None = torch.ones(4)
    model: torch.nn.Module | None = torch.nn.Linear(2, 2)
    ref = weakref.ref(tensor)
    tensor, model = release_memory(tensor, model)
    assert (tensor, model) == (None, None) and ref() is None
    assert release_memory() == []
    clear_device_cache()
