"""`find_divergence`: step two runs side by side on the same batches and say where they part.

Two `RunState` s live in one process without seeing each other (each holds
its own generators), so two runs set up alike (same seed, same weights) can
be stepped batch by batch: bf16 against fp32, ``ddp()`` against ``fsdp()``
inside one `fnaccel.testing.World`, the code before a change against after.
After each batch the losses and every parameter are compared (one tensor
at a time; a sharded parameter is gathered alone); the report names, per
step, the loss difference, the largest parameter difference, and the first
parameter (in the model's order) over the tolerance.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from fnaccel.debug.diff import compare_tensors
from fnaccel.state import RunState
from fnaccel.train import step as train_step
from fnaccel.transforms.parallel import unwrap_model

__all__ = ["Divergence", "StepDivergence", "find_divergence"]


@dataclass(frozen=True, slots=True, kw_only=True)
class StepDivergence:
    """How the two runs compare after one batch.

    Attributes:
        step: the batch's index (0 for the first batch stepped).
        loss_a, loss_b: each run's loss on it.
        loss_diff: ``|loss_a - loss_b|``.
        max_abs: the largest absolute parameter difference, over all parameters.
        parameter: the first parameter over the tolerance, in the model's order, or None.
        parameter_abs, parameter_rel: that parameter's largest absolute and relative difference.
        diverged: the loss or a parameter is over the tolerance.
    """

    step: int
    loss_a: float
    loss_b: float
    loss_diff: float
    max_abs: float
    parameter: str | None = None
    parameter_abs: float | None = None
    parameter_rel: float | None = None
    diverged: bool = False

    def __str__(self) -> str:
        where = (
            ""
            if self.parameter is None
            else (
                f", first over tolerance: {self.parameter} (abs {self.parameter_abs:.3g}, rel {self.parameter_rel:.3g})"
            )
        )
        return (
            f"step {self.step:>4}: loss {self.loss_a:.6g} vs {self.loss_b:.6g} (diff {self.loss_diff:.3g}), "
            f"max param diff {self.max_abs:.3g}{where}"
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class Divergence:
    """Per step, how the two runs compare; ``first`` is the first step that diverged.

    ``a`` and ``b`` are the runs' final states (the ones passed in are consumed).
    """

    steps: tuple[StepDivergence, ...]
    atol: float
    rtol: float
    a: RunState = field(repr=False, compare=False)
    b: RunState = field(repr=False, compare=False)

    @property
    def first(self) -> StepDivergence | None:
        return next((s for s in self.steps if s.diverged), None)

    def __str__(self) -> str:
        first = self.first
        head = (
            f"no divergence in {len(self.steps)} step(s)"
            if first is None
            else f"first divergence at step {first.step}"
            + (f" in {first.parameter}" if first.parameter else " (the loss)")
        )
        return "\n".join(
            [f"{head} (atol={self.atol:g}, rtol={self.rtol:g}):", *(f"  {s}" for s in self.steps)]
        )


def _parameters(state: RunState) -> dict[str, torch.nn.Parameter]:
    if state.model is None:
        raise ValueError("find_divergence: both states must be prepared with a model (fa.prepare)")
    return dict(unwrap_model(state.model).named_parameters())


def _full(tensor: torch.Tensor) -> torch.Tensor:
    full = getattr(tensor, "full_tensor", None)  # a sharded parameter: gathered alone
    return (full() if full is not None else tensor).detach().cpu()


def find_divergence(
    a: RunState,
    b: RunState,
    batches: Iterable[object],
    *,
    atol: float = 0.0,
    rtol: float = 0.0,
    stop_at_first: bool = False,
) -> Divergence:
    """Consumes ``a`` and ``b``: step both on each batch, and compare losses and parameters.

    The two runs should start equal (same seed, same initial weights) and
    differ only in what is under test. Each batch goes to both (``fa.step(a,
    batch)``, then ``fa.step(b, batch)``); each run draws dropout from its own
    generators, so equal seeds give equal masks. Inside a `World`, every rank
    calls it with its own batches.

    Args:
        a, b: the two prepared runs (same parameter names and shapes).
        batches: the batches to step, e.g. ``list(fa.batches(a, epochs=1))``
            taken from a third, identical run, or any iterable.
        atol, rtol: a parameter (or loss) diverges when some element has
            ``|a - b| > atol + rtol * |b|``; the default is bit-exact.
        stop_at_first: stop after the first step that diverges.

    Returns:
        A `Divergence`: per step the loss difference, the largest parameter
        difference and the first parameter over the tolerance.

    Raises:
        ValueError: a state without a model, or parameters that do not match by name and shape.

    >>> import fnaccel as fa, torch
    >>> from fnaccel.testing import find_divergence
    >>> def run(pipeline):
    ...     torch.manual_seed(0)
    ...     model = torch.nn.Linear(4, 1)
    ...     return fa.prepare(fa.init(seed=0, cpu=True), model, torch.optim.SGD(model.parameters(), lr=0.1),
    ...                       pipeline=pipeline, loss_fn=lambda m, x: m(x).pow(2).mean())
    >>> batches = [torch.randn(8, 4) for _ in range(3)]
    >>> report = find_divergence(run(fa.compose()), run(fa.compose(fa.autocast(fa.bf16))), batches)
    >>> len(report.steps), report.first.step, report.first.parameter
    (3, 0, 'weight')
    """
    if atol < 0 or rtol < 0:
        raise ValueError(f"find_divergence: atol and rtol must be >= 0, got atol={atol}, rtol={rtol}")
    names_a, names_b = _parameters(a), _parameters(b)
    shapes_a = {n: tuple(p.shape) for n, p in names_a.items()}
    shapes_b = {n: tuple(p.shape) for n, p in names_b.items()}
    if shapes_a != shapes_b:
        odd = sorted(set(shapes_a.items()) ^ set(shapes_b.items()))[:5]
        raise ValueError(
            f"find_divergence: the two models' parameters differ in name or shape ({odd}); "
            "compare two runs of the same model"
        )
    reports: list[StepDivergence] = []
    for index, batch in enumerate(batches):
        a, metrics_a = train_step(a, batch)
        b, metrics_b = train_step(b, batch)
        loss_a, loss_b = float(metrics_a["loss"]), float(metrics_b["loss"])
        loss_diff = abs(loss_a - loss_b)
        first, max_abs = None, 0.0
        params_b = _parameters(b)
        for name, p in _parameters(a).items():
            x, y = _full(p), _full(params_b[name])
            if torch.equal(x, y):
                continue
            max_abs = max(max_abs, float((x.double() - y.double()).abs().max()))
            if first is None:
                found = compare_tensors(name, x, y, atol=atol, rtol=rtol)
                first = found if found is not None and found.count else None
        loss_over = not (loss_diff <= atol + rtol * abs(loss_b)) and not (
            loss_a != loss_a and loss_b != loss_b
        )
        reports.append(
            StepDivergence(
                step=index,
                loss_a=loss_a,
                loss_b=loss_b,
                loss_diff=loss_diff,
                max_abs=max_abs,
                parameter=None if first is None else first.item,
                parameter_abs=None if first is None else first.max_abs,
                parameter_rel=None if first is None else first.max_rel,
                diverged=first is not None or loss_over,
            )
        )
        if stop_at_first and reports[-1].diverged:
            break
    return Divergence(steps=tuple(reports), atol=atol, rtol=rtol, a=a, b=b)
