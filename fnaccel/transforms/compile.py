"""`compile(...)`: the model through `torch.compile`, after DDP / FSDP2 wrapping
(the order torch recommends: DDP's optimizer then splits graphs at buckets)."""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from fnaccel.constants import DynamoBackend
from fnaccel.dist import DistContext
from fnaccel.transforms.kinds import Transform, options
from fnaccel.transforms.phases import Phase

__all__ = ["compile"]

COMPILE_MODES = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def compile(
    backend: str | DynamoBackend = "inductor",
    mode: str | None = None,
    fullgraph: bool = False,
    dynamic: bool | None = None,
) -> Transform:
    """Compile the prepared model with ``torch.compile`` (the TorchDynamo plugin's options).

    >>> import fnaccel as fa
    >>> fa.compile(backend="aot_eager")
    compile(backend='aot_eager')
    """
    name = str(backend).lower()
    if name == "no":
        raise ValueError("compile: backend 'no' means no compilation; leave fa.compile() out")
    if name not in torch._dynamo.list_backends(exclude_tags=()):
        raise ValueError(
            f"compile: unknown backend {backend!r}; torch has "
            f"{', '.join(sorted(torch._dynamo.list_backends()))}"
        )
    if mode not in COMPILE_MODES:
        raise ValueError(f"compile: unknown mode {mode!r}; use one of {COMPILE_MODES[1:]}")

    def prepare_model(ctx: DistContext, model: nn.Module, state: object) -> nn.Module:
        compiled = torch.compile(model, backend=name, mode=mode, fullgraph=fullgraph, dynamic=dynamic)
        return cast(nn.Module, compiled)  # a module compiles to its OptimizedModule, typed as a callable

    opts = (
        (options(backend=name) if name != "inductor" else ())
        + (options(mode=mode) if mode is not None else ())
        + (options(fullgraph=True) if fullgraph else ())
        + (options(dynamic=dynamic) if dynamic is not None else ())
    )
    return Transform(name="compile", options=opts, phase=Phase.COMPILE, prepare_model=prepare_model)
