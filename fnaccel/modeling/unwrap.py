"""`extract_model_from_parallel`: the user's module out of the wrappers a pipeline put around it.

`fa.prepare` may wrap the model in `DistributedDataParallel` (``ddp()``), in
``torch.compile``'s ``OptimizedModule`` (``compile()``), and replace its
``forward`` by an autocast wrapper (``autocast()``). ``fsdp()`` wraps nothing:
FSDP2's ``fully_shard`` turns the module itself into an ``FSDPModule``, so a
sharded model is its own unwrapped model (its parameters stay sharded).
"""

from __future__ import annotations

from torch import nn
from torch.nn.parallel import DataParallel, DistributedDataParallel

from fnaccel.transforms.mixed_precision import AutocastForward
from fnaccel.transforms.parallel import unwrap_model

__all__ = ["extract_model_from_parallel"]


def _containers() -> tuple[type[nn.Module], ...]:
    """The wrapper classes that hold the user's module as ``.module``."""
    from torch.distributed.fsdp import FullyShardedDataParallel  # FSDP1, built by hand by some users

    return (DistributedDataParallel, DataParallel, FullyShardedDataParallel)


def _strip(model: nn.Module, keep_torch_compile: bool) -> nn.Module:
    """``model`` without its distributed containers (and compile wrapper, unless kept)."""
    from torch._dynamo.eval_frame import OptimizedModule

    compiled = isinstance(model, OptimizedModule)
    inner = unwrap_model(model)  # compile, then DDP
    containers = _containers()
    while isinstance(inner, containers):
        inner = unwrap_model(inner.module)
    if not (compiled and keep_torch_compile):
        return inner
    assert isinstance(model, OptimizedModule)
    if model._orig_mod is inner:
        return model
    # a new wrapper with the same compiler settings (as torch.compile builds one): the
    # prepared model's own wrapper keeps its DDP, for the training that goes on
    return OptimizedModule(inner, model.dynamo_ctx)


def _strip_children(module: nn.Module, keep_torch_compile: bool) -> None:
    """Replace, in place, every wrapped submodule by its unwrapped module."""
    for name, child in list(module.named_children()):
        unwrapped = _strip(child, keep_torch_compile)
        if unwrapped is not child:
            setattr(module, name, unwrapped)
        _strip_children(unwrap_model(unwrapped), keep_torch_compile)


def _remove_autocast(module: nn.Module) -> None:
    """Give ``module`` back the ``forward`` it had before `fa.autocast` wrapped it."""
    forward = module.__dict__.get("forward")
    if not isinstance(forward, AutocastForward):
        return
    while isinstance(forward, AutocastForward):
        forward = forward.forward
    own = getattr(forward, "__self__", None) is module and (
        getattr(forward, "__func__", None) is getattr(type(module), "forward", None)
    )
    if own:  # the class's forward: no instance attribute left behind
        del module.forward
    else:  # a forward the user had set on the instance
        module.forward = forward


def extract_model_from_parallel(
    model: nn.Module,
    keep_fp32_wrapper: bool = True,
    keep_torch_compile: bool = True,
    recursive: bool = False,
) -> nn.Module:
    """The user's model inside a prepared model's wrappers (Accelerate's ``unwrap_model``).

    Removes `DistributedDataParallel` (and ``DataParallel``, FSDP1) wrappers.
    An FSDP2 model (``fsdp()``) is returned as it is: sharding happened in
    place, the module is the user's own. A compiled model stays compiled
    unless ``keep_torch_compile`` is False; when the compiled wrapper wrapped
    DDP, the result is a new compiled wrapper (same compiler settings) around
    the user's module, and the prepared model is left as it was.

    Args:
        model: a prepared model (``state.model``) or any module.
        keep_fp32_wrapper: False removes `fa.autocast`'s forward wrapper from
            the module *in place*, as Accelerate does: the prepared model
            computes in full precision from then on (under ``fsdp()`` the
            precision lives in FSDP2's policy and is not removed).
        keep_torch_compile: False returns the module inside ``torch.compile``'s wrapper.
        recursive: also unwrap, in place, submodules wrapped in DDP /
            ``DataParallel`` / FSDP1 (and ``torch.compile`` unless kept), at
            any depth.

    Returns:
        The unwrapped module: the same object the user prepared (or a
        compiled wrapper around it).

    >>> import fnaccel as fa, torch
    >>> model = torch.nn.Linear(2, 2)
    >>> state = fa.prepare(fa.init(cpu=True), model, pipeline=fa.compose(fa.autocast(fa.bf16)))
    >>> "forward" in vars(model)  # autocast's wrapper
    True
    >>> extract_model_from_parallel(state.model, keep_fp32_wrapper=False) is model
    True
    >>> "forward" in vars(model)  # the class's own forward again
    False
    """
    unwrapped = _strip(model, keep_torch_compile)
    module = unwrap_model(unwrapped)
    if recursive:
        _strip_children(module, keep_torch_compile)
    if not keep_fp32_wrapper:
        _remove_autocast(module)
    return unwrapped
