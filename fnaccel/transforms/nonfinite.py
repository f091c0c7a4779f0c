"""`skip_nonfinite(max_consecutive)`: an update whose loss or gradients are not
finite is skipped on every rank, counted, and tolerated up to a limit.

The ranks must agree without a collective of their own, so the verdict is
taken from what the data-parallel reduction already made equal on every rank:

- A loss is local to its rank. Before backward (``scale_loss``) a non-finite
  loss is divided by 0 (a finite one by 1, which changes no bit, in backward
  either), so its gradients are inf or NaN; `ddp`'s all-reduce, or `fsdp`'s
  reduce-scatter, carries them to every rank. Under `accumulate` they stay in
  this rank's accumulated gradients until the boundary's reduction.
- At the update (``check_update``), after unscaling and clipping, one fused
  check: the global norm `clip_grad_norm` computed when it is in the pipeline
  (no second pass or reduction), else torch's fused non-finite check over
  every gradient (the grad scaler's kernel). Gradients sharded as DTensors
  (`fsdp`, `tp`) have their max-norm reduced over the mesh, as clipping does:
  one scalar all-reduce per update when no clipping has already paid for it.
  Reading the verdict is the update's one host sync.
- Under an ``optimizer_step`` hook (`grad_scaler`, which unscales and checks
  every gradient for inf/NaN and skips the step itself), its ``skipped``
  verdict is taken as it is: no second check, and the scaler keeps lowering its
  scale on overflows. Its skips count, loss-scale search included: each halves
  the scale, so from the default ``init_scale`` of 2**16 at most 16 come in a
  row for gradients that fit fp16 at scale 1.

A skipped update takes no optimizer or scheduler step and clears the
gradients; ``metrics["skipped"]`` says so at every update, and
`SkipNonfiniteState` (checkpointed with the run) counts skips in all and in a
row. The ``max_consecutive``-th skip in a row raises `NonFiniteUpdateError`
and is not counted: the state the caller still holds (`fa.step` returned no
successor) is the one before that update, and its counts say so, so that a
save of it resumes from there (at an update boundary, where no checkpoint
holds gradients). Between accumulation micro-steps its gradients also hold
the failed micro-step's NaN or inf: a save of it resumes into a window that
skips again.
"""

from __future__ import annotations

import torch
from torch import nn

from fnaccel._errors import FnaccelError
from fnaccel.checks import is_int
from fnaccel.dist import DistContext
from fnaccel.state import DataPosition
from fnaccel.transforms.clip import dtensor_class, global_grad_norm
from fnaccel.transforms.kinds import StepTransform, options
from fnaccel.transforms.phases import Phase

__all__ = ["NonFiniteUpdateError", "SkipNonfiniteState", "skip_nonfinite"]

# Above the fp16 scaler's longest start-up run of skips from its default scale (16, see above).
DEFAULT_MAX_CONSECUTIVE = 20


class NonFiniteUpdateError(FnaccelError, RuntimeError):
    """`skip_nonfinite` skipped ``max_consecutive`` updates in a row: the loss or
    gradients stayed NaN or inf. The message names the last skipped update's step
    and data position. Also a ``RuntimeError``, as torch's anomaly errors are."""


class SkipNonfiniteState:
    """`skip_nonfinite`'s state: ``num_skipped`` updates skipped in all,
    ``num_consecutive`` of them in a row up to the last update (0 after a
    finite one). Saved and restored by `fa.save` / `fa.load`.

    >>> SkipNonfiniteState().state_dict()
    {'num_skipped': 0, 'num_consecutive': 0}
    """

    __slots__ = ("num_consecutive", "num_skipped")

    def __init__(self) -> None:
        self.num_skipped = 0
        self.num_consecutive = 0

    def state_dict(self) -> dict[str, int]:
        return {"num_skipped": self.num_skipped, "num_consecutive": self.num_consecutive}

    def load_state_dict(self, saved: dict[str, int]) -> None:
        skipped, consecutive = saved["num_skipped"], saved["num_consecutive"]
        if not all(is_int(n) and n >= 0 for n in (skipped, consecutive)) or consecutive > skipped:
            raise ValueError(
                f"skip_nonfinite: saved counts must be integers with 0 <= num_consecutive <= "
                f"num_skipped, got num_skipped={skipped!r}, num_consecutive={consecutive!r}"
            )
        self.num_skipped, self.num_consecutive = skipped, consecutive


def _poison_nonfinite(loss: torch.Tensor, state: SkipNonfiniteState) -> torch.Tensor:
    """``loss`` divided by 1.0 when finite (bit for bit the same, in backward too), by 0.0
    otherwise, so that this rank's gradients, and after the reduction everyone's, are
    inf or NaN (two small ops; a ``torch.where`` factor costs a third)."""
    return loss / torch.isfinite(loss.detach())


def _nonfinite(optimizer: torch.optim.Optimizer, metrics: dict[str, torch.Tensor]) -> torch.Tensor:
    """A bool tensor: some gradient is NaN or inf."""
    norm = metrics.get("grad_norm")  # clip_grad_norm's global norm: already reduced
    if norm is not None:
        return ~torch.isfinite(norm)
    grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    if not grads:
        return torch.tensor(False)
    if any(isinstance(g, dtensor_class()) for g in grads):  # sharded: a rank sees its shards only
        return ~torch.isfinite(global_grad_norm(grads, float("inf")))
    # torch's fused check, the grad scaler's own: one kernel per device and dtype that sets
    # ``found`` on a NaN or inf (and multiplies by 1.0: no bit changes); on the CPU a
    # tenth of the cost of _foreach_norm and a stack
    by_kind: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for g in grads:
        by_kind.setdefault((g.device, g.dtype), []).append(g)
    found: dict[torch.device, torch.Tensor] = {}
    for (device, _), group in by_kind.items():
        if device not in found:
            found[device] = torch.zeros((), device=device)
        torch._amp_foreach_non_finite_check_and_unscale_(group, found[device], torch.ones((), device=device))
    first, *others = found.values()
    for flag in others:  # a model spread over several devices of this process
        first = first + flag.to(first.device)
    return first.bool()


def skip_nonfinite(max_consecutive: int = DEFAULT_MAX_CONSECUTIVE) -> StepTransform:
    """Skip, on every rank, an update whose loss or gradients are NaN or inf.

    A skipped update takes no optimizer or scheduler step and its gradients are
    cleared; the ranks decide alike from the reduced gradients, with no
    collective of their own (see `fnaccel.transforms.nonfinite`). Metrics at
    an update gain ``skipped`` (a bool tensor); the run's count is
    ``state.transform_states["skip_nonfinite"]`` (`SkipNonfiniteState`).
    Under `grad_scaler` the scaler's own skips (inf gradients while it searches
    its scale) are the verdict and count too.

    Args:
        max_consecutive: the number of skips in a row that ends the run: the
            last of them raises `NonFiniteUpdateError` naming its step and data
            position (a bad batch there, or a learning rate that diverged).

    Raises:
        ValueError: ``max_consecutive`` is not a positive integer.
        NonFiniteUpdateError: in `fa.step` / `fa.apply_gradients`, at the
            ``max_consecutive``-th skip in a row.

    >>> import fnaccel as fa, torch
    >>> model = torch.nn.Linear(2, 1)
    >>> state = fa.prepare(fa.init(seed=0, cpu=True), model, torch.optim.SGD(model.parameters(), 0.1),
    ...                    loss_fn=lambda m, b: m(b).pow(2).mean(),
    ...                    pipeline=fa.compose(fa.skip_nonfinite(max_consecutive=3)))
    >>> state, metrics = fa.step(state, torch.full((4, 2), float("nan")))
    >>> bool(metrics["skipped"]), state.step, state.transform_states["skip_nonfinite"].num_skipped
    (True, 1, 1)
    >>> bool(torch.isfinite(model.weight).all())
    True
    """
    if not is_int(max_consecutive) or max_consecutive < 1:
        raise ValueError(
            f"skip_nonfinite: max_consecutive must be a positive int (the skips in a row "
            f"that end the run), got {max_consecutive!r}"
        )

    def init(ctx: DistContext) -> SkipNonfiniteState:
        return SkipNonfiniteState()

    def check_update(
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        metrics: dict[str, torch.Tensor],
        state: SkipNonfiniteState,
        step: int,
        position: DataPosition,
    ) -> bool:
        flag = metrics.get("skipped")  # an optimizer_step hook (the fp16 scaler) already decided
        if flag is None:
            flag = metrics["skipped"] = _nonfinite(optimizer, metrics)
        if not bool(flag):  # the update's one host sync
            state.num_consecutive = 0
            return False
        if state.num_consecutive + 1 >= max_consecutive:
            # the counts stay as they were: the state the caller still holds (fa.step raised, so it
            # has no successor) is the one before this update, and a save of it must resume as such
            raise NonFiniteUpdateError(
                f"skip_nonfinite: {state.num_consecutive + 1} updates in a row had a NaN or inf loss or "
                f"gradients (max_consecutive={max_consecutive}); the last was update {step} "
                f"(state.step), whose last batch ends at data position {position}. Inspect the data there "
                "(fa.load a checkpoint from before it and step its batches), lower the learning rate, "
                "or raise max_consecutive"
            )
        state.num_skipped += 1
        state.num_consecutive += 1
        return True

    return StepTransform(
        name="skip_nonfinite",
        options=options(max_consecutive=max_consecutive)
        if max_consecutive != DEFAULT_MAX_CONSECUTIVE
        else (),
        phase=Phase.SKIP_NONFINITE,
        conflicts=frozenset({"deepspeed", "pp", "local_sgd"}),
        conflict_fix=(
            "skip_nonfinite decides from gradients reduced alike on every rank: an engine that owns "
            "its step (deepspeed), a pipeline whose stages each hold their own gradients (pp) or "
            "local SGD (no gradient reduction) would let ranks disagree; drop skip_nonfinite"
        ),
        init=init,
        scale_loss=_poison_nonfinite,
        check_update=check_update,
    )
