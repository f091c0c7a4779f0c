"""`register_tracker` (and `register_tracker_class`, Accelerate 1.15's spelling): a user's tracker
class, named in ``log_with`` like a built-in one.

The registry is a value of the run (a `TrackerClasses` record among the
state's kwargs handlers), not a process-wide table: two runs in one process
register apart, and a state from before the call does not know the name.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING

from fnaccel.constants import LoggerType
from fnaccel.kwargs.mixin import KwargsHandler

if TYPE_CHECKING:
    from fnaccel.state import RunState

__all__ = ["TrackerClasses", "register_tracker", "register_tracker_class", "registered_trackers"]


@dataclass(frozen=True, slots=True, kw_only=True)
class TrackerClasses(KwargsHandler):
    """Tracker classes by the name ``log_with`` uses for them.

    Args:
        classes: name -> class, each made as ``cls(project_name, logging_dir, **init_kwargs[name])``.
    """

    _not_kwargs = frozenset({"classes"})
    classes: Mapping[str, type] = field(default_factory=lambda: MappingProxyType({}))

    def _validate(self) -> None:
        object.__setattr__(self, "classes", MappingProxyType(dict(self.classes)))


def registered_trackers(state: RunState) -> Mapping[str, type]:
    """The tracker classes registered on ``state``."""
    found = state.kwargs_handlers.get("TrackerClasses")
    return found.classes if found is not None else MappingProxyType({})


def register_tracker(state: RunState, name: str, tracker_class: type) -> RunState:
    """Returns ``state`` knowing ``tracker_class`` as ``log_with=name``; consumes nothing.

    Args:
        state: the run's `RunState`.
        name: the name for ``log_with`` and ``init_kwargs`` (not a built-in tracker's).
        tracker_class: a class whose instances follow `GeneralTracker`, made as
            ``tracker_class(project_name, logging_dir, **init_kwargs.get(name, {}))``.

    Raises:
        ValueError: ``name`` is empty, a built-in tracker's or ``"all"``.
        TypeError: ``tracker_class`` is not a class.

    >>> import fnaccel as fa
    >>> from fnaccel.tracking.registry import register_tracker, registered_trackers
    >>> class Mine:
    ...     name = "mine"
    ...     def __init__(self, run_name, logging_dir): self.tracker = []
    ...     def store_init_configuration(self, values): pass
    ...     def log(self, values, step): self.tracker.append((step, dict(values)))
    ...     def finish(self): pass
    >>> state = register_tracker(fa.init(cpu=True), "mine", Mine)
    >>> state = fa.init_trackers(state, "demo", log_with="mine", logging_dir=".")
    >>> fa.log(state, {"loss": 0.5}, step=1)
    >>> state.trackers[0].tracker
    [(1, {'loss': 0.5})]
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"register_tracker: name must be a non-empty string, got {name!r}")
    if name.lower() in {t.value for t in LoggerType}:
        raise ValueError(f"register_tracker: {name!r} is a built-in tracker's name (or 'all'); pick another")
    if not isinstance(tracker_class, type):
        raise TypeError(
            f"register_tracker takes a class (made per run by init_trackers), got "
            f"{type(tracker_class).__name__}; pass an object in log_with instead"
        )
    classes = {**registered_trackers(state), name: tracker_class}
    return state.replace(
        kwargs_handlers={**state.kwargs_handlers, "TrackerClasses": TrackerClasses(classes=classes)}
    )


def register_tracker_class(state: RunState, tracker_class: type) -> RunState:
    """Returns ``state`` knowing ``tracker_class`` as ``log_with=tracker_class.name``; consumes nothing.

    Accelerate 1.15's ``accelerate.tracking.register_tracker_class``, with the
    state it registers on first: the name is the class's own ``name``
    attribute, as Accelerate's ``GeneralTracker`` subclasses declare it. The
    rest is `register_tracker`'s.

    Raises:
        TypeError: ``tracker_class`` is not a class, or has no string ``name``.
        ValueError: its name is empty, a built-in tracker's or ``"all"``.

    >>> import fnaccel as fa
    >>> class Mine:
    ...     name = "mine"
    >>> sorted(registered_trackers(register_tracker_class(fa.init(cpu=True), Mine)))
    ['mine']
    """
    name = getattr(tracker_class, "name", None)
    if isinstance(tracker_class, type) and not isinstance(name, str):
        raise TypeError(
            f"register_tracker_class: {tracker_class.__name__} has no string class attribute 'name' "
            "(the name log_with uses); add one, or call register_tracker(state, name, cls)"
        )
    return register_tracker(state, name, tracker_class)
