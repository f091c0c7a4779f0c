"""Building models without memory: `init_empty_weights` and `init_on_device`.

Inside these context managers ``nn.Module.register_parameter`` (and, with
``include_buffers``, ``register_buffer``) is patched so that every tensor a
module registers lands on the target device; on the ``meta`` device that
costs no memory at all, so a model of any size is built in an instant and can
be sized, mapped over devices and loaded shard by shard afterwards.

The patch is the one thing here that is process-wide (it changes a method of
``nn.Module`` for the duration of the block, as Accelerate does, so modules
built by other threads meanwhile are affected too). Blocks nest, the inner
one deciding the device; each block removes exactly its own patch, and the
methods are the original ones once every block has exited, even when a block
raised or blocks were exited out of order by hand (``include_buffers`` aside:
it uses torch's default-device mode, which must be exited in order).

A module still creates each parameter where it asks to (usually as an
uninitialised CPU tensor, which reserves but never touches memory) before it
is moved, one at a time; a single tensor larger than the machine lets a
process reserve needs ``include_buffers=True``, under which even that
creation happens on the target device.

>>> with init_empty_weights():
...     model = nn.Sequential(*[nn.Linear(8192, 8192) for _ in range(64)])  # 4.3e9 parameters
>>> model[0].weight.device, sum(p.numel() for p in model.parameters())
(device(type='meta'), 4295491584)
"""

from __future__ import annotations

import types
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import torch
from torch import nn
from torch.nn.parameter import is_lazy

from fnaccel.config.environment import parse_flag_from_env

__all__ = ["init_empty_weights", "init_on_device"]

INCLUDE_BUFFERS_ENV = "FNACCEL_INIT_INCLUDE_BUFFERS"  # Accelerate's ACCELERATE_INIT_INCLUDE_BUFFERS


class _ModulePatch:
    """A stand-in for one ``nn.Module`` method: registers the tensor, then moves it.

    The innermost active patch decides the device: it calls the original
    method beneath any patches it replaced. After its block exits it may still
    be reachable (a block opened later and still open replaced it); it then
    just passes calls down.
    """

    def __init__(self, replaced: Callable[..., None], move: Callable[[nn.Module, str], None]) -> None:
        self.replaced = replaced
        self.move = move
        self.active = True

    def __get__(self, instance: object, owner: type | None = None) -> Any:
        return self if instance is None else types.MethodType(self, instance)

    def __call__(
        self, module: nn.Module, name: str, tensor: torch.Tensor | None, *args: Any, **kwargs: Any
    ) -> None:
        if not self.active:
            return self.replaced(module, name, tensor, *args, **kwargs)
        original = self.replaced
        while isinstance(original, _ModulePatch):
            original = original.replaced
        original(module, name, tensor, *args, **kwargs)
        if tensor is not None:
            self.move(module, name)


@contextmanager
def _patch_module_method(method: str, move: Callable[[nn.Module, str], None]) -> Iterator[None]:
    patch = _ModulePatch(vars(nn.Module)[method], move)
    setattr(nn.Module, method, patch)
    try:
        yield
    finally:
        patch.active = False
        # Unwind every finished patch from the top; a patch still active above
        # ours (a block exited out of order) will unwind ours when it finishes.
        current = vars(nn.Module)[method]
        while isinstance(current, _ModulePatch) and not current.active:
            current = current.replaced
        setattr(nn.Module, method, current)


def _moved(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    # A meta tensor (made under an outer include_buffers block) has no values to copy: the
    # module's own initialisation, which runs after registration, gives them.
    return torch.empty_like(tensor, device=device) if tensor.is_meta else tensor.to(device)


def _parameter_mover(device: torch.device) -> Callable[[nn.Module, str], None]:
    def move(module: nn.Module, name: str) -> None:
        param = module._parameters[name]
        if param is None or param.device == device or is_lazy(param):
            return
        data = _moved(param.detach(), device)
        if type(param) is nn.Parameter:
            moved = nn.Parameter(data, requires_grad=param.requires_grad)
            moved.__dict__.update(param.__dict__)
        else:  # subclasses (quantized weights) take their attributes back as keyword arguments
            moved = type(param)(data, **{**param.__dict__, "requires_grad": param.requires_grad})
        module._parameters[name] = moved

    return move


def _buffer_mover(device: torch.device) -> Callable[[nn.Module, str], None]:
    def move(module: nn.Module, name: str) -> None:
        buffer = module._buffers[name]
        if buffer is not None and buffer.device != device:
            module._buffers[name] = _moved(buffer, device)

    return move


@contextmanager
def init_on_device(device: torch.device | str | int, include_buffers: bool | None = None) -> Iterator[None]:
    """Build every parameter (and, with ``include_buffers``, buffer) of new modules on ``device``.

    Args:
        device: where the tensors go (``"meta"``, ``"cpu"``, ``"cuda:0"``, ``0``...).
        include_buffers: also put buffers, and every tensor created inside the
            block by a factory function (``torch.zeros``, ``torch.arange``...),
            on ``device``. ``None`` reads the environment variable
            ``FNACCEL_INIT_INCLUDE_BUFFERS`` (default no). Without it, buffers
            stay where the module creates them, so their values (a causal mask,
            position ids) are real.

    >>> with init_on_device("meta"):
    ...     layer = nn.BatchNorm1d(4)
    >>> layer.weight.device.type, layer.running_mean.device.type
    ('meta', 'cpu')
    """
    if include_buffers is None:
        include_buffers = parse_flag_from_env(INCLUDE_BUFFERS_ENV, default=False)
    target = torch.device(device)
    with ExitStack() as stack:
        stack.enter_context(_patch_module_method("register_parameter", _parameter_mover(target)))
        if include_buffers:
            stack.enter_context(_patch_module_method("register_buffer", _buffer_mover(target)))
            stack.enter_context(target)  # torch's own default-device mode catches the factory functions
        yield


@contextmanager
def init_empty_weights(include_buffers: bool | None = None) -> Iterator[None]:
    """Build models with every parameter on the ``meta`` device: no memory, no time.

    The model has the right structure, shapes and dtypes but no values: size
    it (`compute_module_sizes`), map it (`infer_auto_device_map`), then load
    real weights into it. Same as ``init_on_device("meta", include_buffers)``.

    Args:
        include_buffers: also put buffers on ``meta`` (see `init_on_device`).

    >>> with init_empty_weights():
    ...     model = nn.Sequential(*[nn.Linear(10_000, 10_000) for _ in range(10)])  # 4 GB in float32
    >>> {p.device.type for p in model.parameters()}
    {'meta'}
    """
    with init_on_device(torch.device("meta"), include_buffers=include_buffers):
        yield
