"""`local_sgd(local_sgd_steps)`: each rank trains on its own, parameters averaged every k steps.

Local SGD (Accelerate's ``LocalSGD``; Lin et al., "Don't use large
mini-batches, use local SGD") trades the all-reduce of every step's gradients
for one all-reduce of the parameters every ``local_sgd_steps`` optimizer steps.
Composed after `ddp()`, it replaces DDP's gradient all-reduce with a
communication hook that keeps each rank's own gradients (DDP still broadcasts
the initial parameters, so the replicas start equal), and after every
``local_sgd_steps``-th optimizer step averages the parameters with
``torch.distributed.algorithms.model_averaging.utils.average_parameters`` (one
all-reduce of all of them, flattened). Between averages the ranks do not
communicate at all. Optimizer states stay local, as in Accelerate.
"""

from typing import Any

import torch
from torch.distributed.algorithms.model_averaging.utils import average_parameters
from torch.nn.parallel import DistributedDataParallel

from fnaccel.checks import is_int
from fnaccel.dist import DistContext
from fnaccel.transforms.kinds import Transform, options
from fnaccel.transforms.parallel import unwrap_compiled
from fnaccel.transforms.phases import Phase

__all__ = ["LocalSGDState", "local_sgd"]


class LocalSGDState:
    """The live part of `local_sgd`: the model to average, and steps since the last average.

    Saved with the run (``state_dict``), so a resumed run averages at the same steps.
    """

    __slots__ = ("ctx", "local_sgd_steps", "parameters", "steps_since_average")

    def __init__(self, ctx: DistContext, local_sgd_steps: int) -> None:
        self.ctx, self.local_sgd_steps = ctx, local_sgd_steps
        self.parameters: list[torch.nn.Parameter] = []
        self.steps_since_average = 0

    def state_dict(self) -> dict[str, int]:
        return {"steps_since_average": self.steps_since_average}

    def load_state_dict(self, saved: dict[str, int]) -> None:
        self.steps_since_average = int(saved["steps_since_average"])


# No `from __future__ import annotations` here: DDP checks a hook's annotations as types.
def _keep_local_gradients(
    process_group: Any, bucket: torch.distributed.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """A DDP communication hook that communicates nothing: each rank keeps its gradients."""
    done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    done.set_result(bucket.buffer())
    return done


def local_sgd(local_sgd_steps: int) -> Transform:
    """Average the parameters across ranks every ``local_sgd_steps`` optimizer steps, and only then.

    Compose it with `ddp()` (``fa.compose(fa.ddp(), fa.local_sgd(8))``); in a
    world of one it changes nothing.

    Args:
        local_sgd_steps: optimizer steps between two averages (1 averages
            after every step).

    Raises:
        ValueError: ``local_sgd_steps`` is not a positive int; at `fa.prepare`,
            the model is not wrapped by `ddp()` in a larger world, or its
            DDP already has a communication hook (``comm_hook=...``).

    >>> import fnaccel as fa
    >>> from fnaccel.transforms.local_sgd import local_sgd
    >>> fa.compose(fa.ddp(), local_sgd(8))
    compose(ddp(), local_sgd(local_sgd_steps=8))
    """
    if not is_int(local_sgd_steps) or local_sgd_steps < 1:
        raise ValueError(f"local_sgd: local_sgd_steps must be an int >= 1, got {local_sgd_steps!r}")

    def init(ctx: DistContext) -> LocalSGDState:
        return LocalSGDState(ctx, local_sgd_steps)

    def prepare_model(ctx: DistContext, model: torch.nn.Module, sgd: LocalSGDState) -> torch.nn.Module:
        sgd.parameters = [p for p in model.parameters() if p.requires_grad]
        if ctx.num_processes == 1:
            return model
        inner = unwrap_compiled(model)
        if not isinstance(inner, DistributedDataParallel):
            raise ValueError(
                f"local_sgd: the model is a {type(inner).__name__}, not DDP; compose "
                "fa.ddp() before fa.local_sgd(...) (it does not combine with fa.fsdp())"
            )
        try:
            inner.register_comm_hook(ctx.process_group, _keep_local_gradients)
        except RuntimeError:
            raise ValueError(
                "local_sgd replaces DDP's gradient communication, but this ddp() already has a "
                "comm_hook; drop comm_hook=... from fa.ddp(...)"
            ) from None
        return model

    def after_step(sgd: LocalSGDState) -> None:
        sgd.steps_since_average += 1
        if sgd.steps_since_average < sgd.local_sgd_steps:
            return
        sgd.steps_since_average = 0
        group = sgd.ctx.process_group
        if sgd.ctx.num_processes > 1 and group is not None:
            with torch.no_grad():
                average_parameters(iter(sgd.parameters), group)

    return Transform(
        name="local_sgd",
        options=options(local_sgd_steps=local_sgd_steps),
        phase=Phase.LOCAL_SGD,
        conflicts=frozenset({"fsdp"}),
        init=init,
        prepare_model=prepare_model,
        after_step=after_step,
    )
