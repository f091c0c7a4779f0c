"""`RunState`: the one value that holds every fact about a run.

A `RunState` is frozen; functions that advance a run return a new one. The
model and optimizer inside are live PyTorch objects updated in place (no
parameter copies), so a state may be *advanced* only once, like a donated
buffer in JAX: each state carries a lease, and advancing marks the lease spent
and hands the new state a fresh one. Advancing, saving or loading into a spent
state raises `StaleStateError` naming what spent it; reading its fields is
always fine. `state.replace(...)` edits fields without advancing, so the
result shares the lease with its source: they describe the same live objects.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Self

import torch

from fnaccel._errors import StaleStateError
from fnaccel.config.launch import LaunchConfig
from fnaccel.constants import PrecisionType
from fnaccel.dist import DistContext
from fnaccel.protocols import PipelineLike, StepPlanLike
from fnaccel.resources import Resources
from fnaccel.rng import STEP_KINDS, RNGState

__all__ = ["DataPosition", "RunState"]


@dataclass(frozen=True, slots=True, kw_only=True)
class DataPosition:
    """Where a run stands in its data: the batches of ``epoch`` already stepped.

    Advanced by `fa.step` (and `fa.backward`) when they consume a batch that
    `fa.batches` fetched, never by the fetch itself: a batch fetched and not
    stepped is fetched again after `fa.load`. The live loader is a cache that
    `fa.batches` positions from this value.

    Attributes:
        epoch: the epoch in progress (after an epoch's last batch of a sized
            loader, the next one, at ``num_batches=0``).
        num_batches: batches of ``epoch`` consumed.
        loader_state: the `StatefulDataLoader` snapshot taken right after the
            consumed batches (plain data), for loaders whose position is more
            than two integers (iterable datasets, samplers fnaccel does not
            own); None where ``epoch`` and ``num_batches`` locate it alone.

    >>> DataPosition(epoch=1, num_batches=3)
    DataPosition(epoch=1, num_batches=3, loader_state=None)
    """

    epoch: int = 0
    num_batches: int = 0
    loader_state: Mapping[str, Any] | None = None

    @property
    def key(self) -> tuple[int, int]:
        """``(epoch, num_batches)``: positions of one loader order by it."""
        return (self.epoch, self.num_batches)


class Lease:
    """Whether the state holding it may still be advanced, and what spent it: the
    call, and the step and micro-step of the state it spent. They are kept as they
    are and spelled out only for the error (a training step spends a lease every
    time, and the sentence is almost never read)."""

    __slots__ = ("by", "micro_step", "step")
    step: int
    micro_step: int

    def __init__(self) -> None:
        self.by: str | None = None

    @property
    def spent_by(self) -> str | None:
        """``"fa.step at step 3 (micro-step 3)"``, or None while unspent."""
        if self.by is None:
            return None
        return f"{self.by} at step {self.step} (micro-step {self.micro_step})"

    def __repr__(self) -> str:
        return f"<lease spent by {self.spent_by}>" if self.by else "<lease>"


@dataclass(frozen=True, slots=True, kw_only=True)
class RunState:
    """Every fact about a run, as one frozen value.

    Attributes:
        dist: the distributed context.
        rng: the run's generator states (Python's, torch's CPU one, each CUDA
            device's, NumPy's).
        step_rng_types: which of them a step installs and captures: torch's
            and CUDA's by default (what dropout and random init draw from);
            add "python" / "numpy" if the step itself draws from those (they
            cost about 12 and 80 us per step).
        seed: the seed the run started from, or None.
        step: optimizer steps taken.
        micro_step: batches stepped (counts accumulation micro-steps too).
        data_position: where the run stands in its data (`DataPosition`);
            ``state.epoch`` reads its epoch.
        mixed_precision: the precision the launch asked for.
        model, optimizer, scheduler, loader: live objects, once prepared.
        pipeline: the composed transforms, once prepared.
        loss_fn: ``loss_fn(model, batch) -> loss | (loss, aux)``, or None for
            the default (the model's scalar output or its ``.loss``).
        plan: the pipeline's hooks bound to the transform states, resolved by
            `fa.prepare` (so a step does not search the pipeline).
        extras: objects saved and loaded with the run
            (`fnaccel.utils.register_for_checkpointing`).
        transform_states: each transform's state record, keyed by its name.
        config: the launch configuration the run resolved.
        kwargs_handlers: the handlers passed to `fa.init`, keyed by class name.
        project_dir: where checkpoints and logs go by default.
        resources: the run's live resources (process group, saves in flight,
            trackers), shared by its successive states; `fa.shutdown` closes them.
        trigger: this rank asked the run to stop (`fnaccel.trigger.set_trigger`).
    """

    dist: DistContext
    rng: RNGState
    step_rng_types: tuple[str, ...] = STEP_KINDS
    seed: int | None = None
    step: int = 0
    micro_step: int = 0
    data_position: DataPosition = DataPosition()
    mixed_precision: PrecisionType = PrecisionType.NO
    model: torch.nn.Module | None = field(default=None, repr=False)
    optimizer: torch.optim.Optimizer | None = field(default=None, repr=False)
    scheduler: Any = field(default=None, repr=False)
    loader: Any = field(default=None, repr=False)
    pipeline: PipelineLike | None = None
    loss_fn: Callable[[Any, Any], Any] | None = field(default=None, repr=False)
    plan: StepPlanLike | None = field(default=None, repr=False)
    extras: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}), repr=False)
    transform_states: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}), repr=False)
    config: LaunchConfig = field(default_factory=LaunchConfig, repr=False)
    kwargs_handlers: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}), repr=False)
    project_dir: str | None = None
    resources: Resources = field(default_factory=Resources, repr=False, compare=False)
    trigger: bool = False
    _lease: Lease = field(default_factory=Lease, repr=False, compare=False)

    def replace(self, **changes: Any) -> Self:
        """A copy with ``changes`` applied, sharing this state's lease.

        >>> import fnaccel as fa
        >>> s = fa.init(seed=0, cpu=True)
        >>> s.replace(epoch=2).epoch
        2
        """
        if "_lease" in changes:
            raise TypeError("the lease is not a field a caller may replace")
        if "epoch" in changes:  # the epoch is the data position's: one truth
            changes["data_position"] = DataPosition(epoch=changes.pop("epoch"))
        return dataclasses.replace(self, **changes)

    @property
    def epoch(self) -> int:
        """The epoch in progress: ``data_position.epoch``."""
        return self.data_position.epoch

    @property
    def trackers(self) -> tuple[Any, ...]:
        """The experiment trackers `fnaccel.tracking.init_trackers` opened (main process only)."""
        trackers = self.resources.get("trackers", ())
        assert isinstance(trackers, tuple), "fnaccel.tracking registers its trackers as a tuple"
        return trackers

    @property
    def preempted(self) -> str | None:
        """The signal that ended the run's `fa.batches` on every rank (``"SIGTERM"``), or None.

        Set with `PreemptionKwargs` at `fa.init`, at the same micro-step on every
        rank; read from the run's live resources, so every state of the run says
        it (like `trackers`). See docs/training.md, "Preemption".
        """
        return getattr(self.resources.get("preemption"), "reason", None)

    @property
    def is_spent(self) -> bool:
        """True once a call has advanced this state; it can only be read now."""
        return self._lease.by is not None

    def check_fresh(self, action: str) -> None:
        """Raise `StaleStateError` if this state was already advanced.

        Args:
            action: what the caller wanted to do, for the message.
        """
        lease = self._lease
        if lease.by is not None:
            raise StaleStateError(
                f"{action} was given a RunState already consumed by {lease.spent_by}. Use the "
                "state that call returned (`state, metrics = fa.step(state, batch)` "
                "rebinds it); an old state's fields can still be read."
            )

    def advance(self, by: str, **changes: object) -> RunState:
        """Spend this state and return its successor with ``changes`` applied.

        Args:
            by: the call advancing it (e.g. ``"fa.step"``), recorded with this
                state's step and micro-step for the error a later use of this
                state raises.
        """
        lease = self._lease
        if lease.by is not None:
            self.check_fresh(by)  # raises, naming what spent it
        if not _FIELDS.issuperset(changes):
            raise TypeError(f"RunState has no field(s) {sorted(set(changes) - _FIELDS)}")
        lease.by, lease.step, lease.micro_step = by, self.step, self.micro_step
        new = _copy_with_fresh_lease(self)
        for name, value in changes.items():
            _set(new, name, value)
        return new


def _field_by_field_copy() -> Callable[[RunState], RunState]:
    """``copy(state)``: a new `RunState` with every field of ``state`` and a fresh lease.

    Every step advances a state, so the copy is written out field by field, the
    way `dataclasses` writes a class's ``__init__``: a loop over the field names
    (or ``dataclasses.replace``, which re-runs the frozen ``__init__``) costs
    several microseconds more, a few percent of a small model's step.
    """
    lines = "".join(f"    _set(new, {name!r}, state.{name})\n" for name in _SLOTS)
    source = (
        f"def copy(state):\n    new = _new(RunState)\n{lines}"
        "    _set(new, '_lease', Lease())\n    return new\n"
    )
    namespace: dict[str, Any] = {"_new": object.__new__, "_set": _set, "RunState": RunState, "Lease": Lease}
    exec(source, namespace)
    copy: Callable[[RunState], RunState] = namespace["copy"]
    return copy


_set = object.__setattr__
_SLOTS = tuple(name for name in RunState.__slots__ if name != "_lease")
_FIELDS = frozenset(_SLOTS)
_copy_with_fresh_lease = _field_by_field_copy()
