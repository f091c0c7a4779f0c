"""Surviving out-of-memory: `find_executable_batch_size` and the cache helpers it uses.

`find_executable_batch_size` runs a function with a batch size and, when it
fails for lack of memory (a CUDA or CPU allocator failure, a cuDNN or cuBLAS
allocation error), frees what it can and tries again with 90% of the batch
(Accelerate's current rule; it halved before 1.5), after Accelerate, itself
after `toma <https://github.com/BlackHC/toma>`_.
Anything else the function raises goes up unchanged, on the first try.
"""

from __future__ import annotations

import functools
import gc
import inspect
from collections.abc import Callable
from typing import Concatenate, ParamSpec, TypeVar, overload

import torch

from fnaccel.checks import is_int

__all__ = [
    "clear_device_cache",
    "find_executable_batch_size",
    "release_memory",
    "should_reduce_batch_size",
]

P = ParamSpec("P")
R = TypeVar("R")

# What the allocators say when they cannot allocate (torch.OutOfMemoryError aside).
_OUT_OF_MEMORY_MESSAGES = (
    " out of memory.",  # CUDA, ROCm (HIP) and XPU: "CUDA out of memory. Tried to allocate ..."
    "CUDA out of memory",
    "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED",  # cuDNN's answer when its workspace does not fit
    "CUBLAS_STATUS_ALLOC_FAILED",
    "DefaultCPUAllocator: can't allocate memory",  # CPU, POSIX
    "DefaultCPUAllocator: not enough memory",  # CPU, Windows
    "MODULE:PT_DEVMEM Allocation failed",  # Gaudi (HPU)
)


def clear_device_cache(garbage_collection: bool = False) -> None:
    """Hand the accelerator's cached, unused memory back to its driver.

    Empties torch's caching allocator on CUDA (when CUDA was initialised) and
    on Apple's MPS; a CPU-only run has no cache to empty.

    Args:
        garbage_collection: run Python's garbage collector first, so that
            tensors only reachable through reference cycles are freed too.

    >>> clear_device_cache(garbage_collection=True)
    """
    if garbage_collection:
        gc.collect()
    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()
    if torch.backends.mps.is_available():
        torch.mps.empty_cache()


def release_memory(*objects: object) -> list[None]:
    """Drop references to ``objects`` and free the memory they held.

    Python cannot clear the caller's variables, so rebind them to the
    result: ``model, optimizer = release_memory(model, optimizer)``.

    Args:
        *objects: models, tensors, optimizers... to release.

    Returns:
        One None per object, to assign back to the caller's names.

    >>> a, b = torch.ones(3), torch.ones(3)
    >>> a, b = release_memory(a, b)
    >>> a, b
    (None, None)
    """
    released: list[None] = [None] * len(objects)
    del objects  # the last reference this frame holds, before the collector runs
    clear_device_cache(garbage_collection=True)
    return released


def should_reduce_batch_size(exception: BaseException) -> bool:
    """Whether ``exception`` means the batch did not fit in memory.

    True for ``torch.OutOfMemoryError`` (``torch.cuda.OutOfMemoryError``) and
    for a ``RuntimeError`` whose message is an allocator's out-of-memory
    report: CUDA/ROCm/XPU out of memory, the CPU allocator's "can't allocate
    memory" / "not enough memory", cuDNN's ``CUDNN_STATUS_NOT_SUPPORTED``,
    cuBLAS's ``CUBLAS_STATUS_ALLOC_FAILED``.

    Args:
        exception: the exception the batch raised.

    >>> should_reduce_batch_size(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    True
    >>> should_reduce_batch_size(ValueError("shapes do not match"))
    False
    """
    if isinstance(exception, torch.OutOfMemoryError):
        return True
    if isinstance(exception, RuntimeError) and exception.args and isinstance(exception.args[0], str):
        message = exception.args[0]
        return any(known in message for known in _OUT_OF_MEMORY_MESSAGES)
    return False


@overload
def find_executable_batch_size(
    function: Callable[Concatenate[int, P], R],
    starting_batch_size: int = 128,
    reduce_batch_size_fn: Callable[[], int] | None = None,
) -> Callable[P, R]: ...


@overload
def find_executable_batch_size(
    function: None = None,
    starting_batch_size: int = 128,
    reduce_batch_size_fn: Callable[[], int] | None = None,
) -> Callable[[Callable[Concatenate[int, P], R]], Callable[P, R]]: ...


def find_executable_batch_size(
    function: Callable[Concatenate[int, P], R] | None = None,
    starting_batch_size: int = 128,
    reduce_batch_size_fn: Callable[[], int] | None = None,
) -> Callable[P, R] | Callable[[Callable[Concatenate[int, P], R]], Callable[P, R]]:
    """Decorate ``function(batch_size, ...)`` to retry with smaller batches on out-of-memory.

    The decorated function is called *without* its batch size: the decorator
    passes it, starting at ``starting_batch_size``. When a try fails for lack
    of memory (`should_reduce_batch_size`), its exception is dropped, memory
    is freed (`clear_device_cache` with garbage collection) and the function
    runs again with a smaller batch: ``int(0.9 * batch_size)`` (so 128,
    115, 103, ... 2, 1), or what ``reduce_batch_size_fn`` returns. Any other exception
    propagates at once, unchanged. The batch size
    that worked is kept: a later call of the decorated function starts there.
    Build what holds device memory (model, optimizer, loaders) *inside*
    ``function``, so that a failed try's allocations can be freed.

    Usable bare (``@find_executable_batch_size``) or with arguments.

    Args:
        function: the function to decorate; its first parameter is the batch size.
        starting_batch_size: the first batch size tried.
        reduce_batch_size_fn: called with no argument after an out-of-memory
            failure, returns the next batch size to try (Accelerate's
            convention); it must be smaller than the one that failed.
            Default: 90% of the batch size, rounded down.

    Returns:
        The decorated function (or, without ``function``, the decorator).

    Raises:
        TypeError: the caller passed the batch size itself, or ``function``
            takes no batch size parameter.
        ValueError: ``starting_batch_size`` is not a non-negative integer, or
            ``reduce_batch_size_fn`` did not return a smaller one.
        RuntimeError: "No executable batch size found, reached zero." when
            the batch size came down to zero (even a batch of one did not
            fit), or at the call when ``starting_batch_size`` is 0 (as in
            Accelerate).

    >>> @find_executable_batch_size(starting_batch_size=64)
    ... def train(batch_size, limit):
    ...     if batch_size > limit:  # stands in for a real allocation that fails
    ...         raise torch.OutOfMemoryError(f"CUDA out of memory. ({batch_size} > {limit})")
    ...     return batch_size
    >>> train(20)  # 64, 57, 51, 45, 40, 36, 32, 28, 25, 22 fail
    19
    """
    if not is_int(starting_batch_size) or starting_batch_size < 0:
        raise ValueError(
            f"find_executable_batch_size: starting_batch_size must be a non-negative int, "
            f"got {starting_batch_size!r}"
        )
    if function is None:
        return functools.partial(
            find_executable_batch_size,
            starting_batch_size=starting_batch_size,
            reduce_batch_size_fn=reduce_batch_size_fn,
        )
    name = getattr(function, "__name__", repr(function))
    params = list(inspect.signature(function).parameters.values())
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    takes_varargs = any(p.kind is p.VAR_POSITIONAL for p in params)
    if not positional and not takes_varargs:
        raise TypeError(
            f"find_executable_batch_size: `{name}` must take the batch size as its first "
            f"parameter, e.g. `def {name}(batch_size, ...)`"
        )
    batch_size = starting_batch_size
    last_failure = ""  # the latest out-of-memory failure, for the final error

    def ninety_percent() -> int:
        return int(batch_size * 0.9)

    reduce = reduce_batch_size_fn or ninety_percent

    @functools.wraps(function)
    def decorated(*args: P.args, **kwargs: P.kwargs) -> R:
        nonlocal batch_size, last_failure
        _refuse_batch_size_argument(name, positional, takes_varargs, args, kwargs)
        clear_device_cache(garbage_collection=True)
        while True:
            if batch_size == 0:
                raise RuntimeError(
                    f"No executable batch size found, reached zero. (`{name}` last ran "
                    f"out of memory at {last_failure})"
                )
            try:
                return function(batch_size, *args, **kwargs)
            except Exception as exc:
                if not should_reduce_batch_size(exc):
                    raise
                last_failure = f"batch size {batch_size}: {type(exc).__name__}: {exc}"
            # out of the except block: the failed try's frames (and tensors) are unreachable now
            clear_device_cache(garbage_collection=True)
            smaller = reduce()
            if not is_int(smaller) or not 0 <= smaller < batch_size:
                raise ValueError(
                    f"find_executable_batch_size: reduce_batch_size_fn returned {smaller!r} "
                    f"after batch size {batch_size} ran out of memory; it must return a "
                    "smaller non-negative int"
                )
            batch_size = smaller

    return decorated


def _refuse_batch_size_argument(
    name: str,
    positional: list[inspect.Parameter],
    takes_varargs: bool,
    args: tuple[object, ...],
    kwargs: dict[str, object],
) -> None:
    """TypeError when a call passes the batch size that the decorator passes itself."""
    first = positional[0].name if positional else None
    too_many = not takes_varargs and len(args) + 1 > len(positional)
    if too_many or (first is not None and first in kwargs):
        rest = list(args[1:] if too_many else args)
        shown = ", ".join([repr(a) for a in rest] + [f"{k}={v!r}" for k, v in kwargs.items() if k != first])
        raise TypeError(
            f"Batch size was passed into `{name}` as the first argument when called. Remove this as "
            f"the decorator already does so: `{name}({shown})`"
        )
