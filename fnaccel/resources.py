"""The run's live resources and the one object that owns them.

A `RunState` is a value, but a run also holds live things that must be
closed in order: the process group fnaccel started, the process group and
threads of its asynchronous saves, the experiment trackers' open files. Each
registers with the run's `Resources` (``state.resources``, shared by the run's
successive states); `fa.shutdown` closes them in reverse order of
registration, so the layer that opened a resource is the one that knows how
to close it and `fa.shutdown` names none of them.

Closing distinguishes two paths (principle 10: fail fast). On a clean end the
process group waits, boundedly, for every rank before it is destroyed. While
an exception is propagating (`fa.shutdown` in a ``finally``, or interpreter
exit after an uncaught exception) nothing waits for another rank: the group is
left to the process's exit, and under torchrun the failure is recorded with a
fine timestamp so that ``fnaccel launch`` names the rank that failed first.

Only those two calls end a group: `fa.shutdown` (every rank at the same point)
and interpreter exit (every rank ends the groups it still holds, in the same
order). A run dropped without `fa.shutdown` is not ended when its owner becomes
garbage: the collector frees it at a point of one rank's run that no other rank
shares, so a settle there would wait for ranks that never come (principle 10).
Its group stays on the process's list of things to end at exit (`atexit`).

A leaf module: it imports nothing from fnaccel.
"""

from __future__ import annotations

import atexit
import functools
import gc
import json
import os
import sys
import time
import traceback
import weakref
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Protocol, TypeVar

__all__ = ["GroupOwner", "Resource", "Resources", "exception_in_flight", "FAILED_AT_KEY"]

# The field of torchrun's error file where a failing rank records when it failed (ns).
FAILED_AT_KEY = "fnaccel_failed_at_ns"

# How long a clean end waits for every rank before tearing its group down anyway.
SETTLE_SECONDS = 60.0


class Resource(Protocol):
    """Something live a run holds: `close` releases it (and may be called twice)."""

    def close(self) -> None: ...


R = TypeVar("R", bound=Resource)


def exception_in_flight() -> bool:
    """True while an exception propagates (inside ``except``/``finally``) or when
    the interpreter is exiting because of an uncaught one (`sys.last_value`).

    >>> exception_in_flight()
    False
    >>> try:
    ...     raise ValueError("x")
    ... except ValueError:
    ...     exception_in_flight()
    True
    """
    return sys.exc_info()[1] is not None or getattr(sys, "last_value", None) is not None


class Resources(dict[str, Any]):  # values are `Resource`s; a reader knows which it asked for
    """The live resources of one run by name, closed in reverse order of registration.

    Read as a mapping: ``resources.get(name)`` is a dictionary lookup, which
    every `fa.step` and `fa.save` makes. `register` adds one, closing the one
    it replaces.

    >>> class File:
    ...     def __init__(self, name): self.name = name
    ...     def close(self): print("closed", self.name)
    >>> resources = Resources()
    >>> _ = resources.register("log", File("log"))
    >>> resources.get("saves") or resources.register("saves", File("saves"))  # doctest: +ELLIPSIS
    <...File object at ...>
    >>> resources.close()
    closed saves
    closed log
    >>> resources.get("log") is None
    True
    """

    __slots__ = ()

    def register(self, name: str, resource: R) -> R:
        """Hold ``resource`` under ``name``; one already there is closed and replaced."""
        old = self.pop(name, None)
        if old is not None and old is not resource:
            old.close()
        self[name] = resource
        return resource

    def close(self) -> None:
        """Close every resource, last registered first; the first error is raised
        after all of them were closed."""
        error: BaseException | None = None
        while self:
            _, resource = self.popitem()
            try:
                resource.close()
            except BaseException as exc:  # close the rest, then report the first
                error = error or exc
        if error is not None:
            raise error

    def __repr__(self) -> str:
        return f"Resources({list(self)})"


def _record_failure() -> None:
    """Under torchrun, write this rank's uncaught exception to the error file the
    agent reads (its own format), with the time it failed to the nanosecond."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    exc = sys.exc_info()[1] or getattr(sys, "last_value", None)
    if not path or exc is None or os.path.exists(path):
        return
    now = time.time_ns()
    data = {
        "message": {
            "message": f"{type(exc).__name__}: {exc}",
            "extraInfo": {
                "py_callstack": "".join(traceback.format_exception(exc)),
                "timestamp": str(now // 1_000_000_000),
                FAILED_AT_KEY: str(now),
            },
        }
    }
    try:
        with open(path, "w", encoding="utf-8") as file:
            json.dump(data, file)
    except OSError:
        pass  # the agent then names the first failure by its own clock


def _settle(group: Any) -> None:
    """Wait, boundedly, until every rank is here before the group is torn down.

    A rank that destroys its group while another still exchanges data with it
    (FSDP2's last reduce-scatter completes lazily) leaves a gloo thread blocked
    in a receive that cannot be interrupted, and joining it aborts the process
    ("terminate called without an active exception": 8 exits in 50 of fsdp
    runs that ended without fa.shutdown, 0 in 35 with it). gloo's
    monitored_barrier gives up after a timeout, so a dead peer cannot make a
    clean exit hang; the error is reported and teardown goes on.
    """
    import torch.distributed as dist

    try:
        if dist.get_backend(group) == "gloo":
            dist.monitored_barrier(group=group, timeout=timedelta(seconds=SETTLE_SECONDS))
        else:
            dist.barrier(group=group)
    except Exception as exc:  # a peer is gone: tear down anyway, and say so
        print(f"fnaccel: not every rank reached the end of the run ({exc}); tearing down", file=sys.stderr)


class _DefaultGroupUsers:
    """How many of fnaccel's runs still use the default group fnaccel started."""

    __slots__ = ("count",)

    def __init__(self) -> None:
        self.count = 1

    def leave(self) -> bool:
        """One run is done with the group; True for the last one, which ends it."""
        self.count -= 1
        return self.count == 0


# torch's default group -> the runs using it, when fnaccel started it. Process-wide, as the
# group it describes is (torch keeps that in its own module state): a second fa.init in the
# process cannot see the first run's state, yet the first run to end must not destroy the
# group under the other (destroying the default group ends every group). Weak: the entry
# goes with the group, and it holds no run's values.
_DEFAULT_GROUP_USERS: weakref.WeakKeyDictionary[Any, _DefaultGroupUsers] = weakref.WeakKeyDictionary()


def _destroy_group(
    holder: list[Any],
    meshes: dict[str, Any],
    releases: list[Callable[[], None]],
    is_default: bool,
    users: _DefaultGroupUsers | None,
) -> None:
    """End the run's groups, once (a second call does nothing): on a clean end, settle, let
    the group's C++ holders go (the ``releases`` of `GroupOwner.release_before_destroy`),
    then destroy them while the interpreter
    is fully alive (left to finalization, gloo's threads releasing tensors take
    the GIL of a dying interpreter and the process aborts); while an exception
    propagates, wait for no one: record the failure and leave the group to the
    process's exit, which torchrun's agent turns into the end of every rank.
    A run ends only its own groups: its device mesh's, then its group unless that is the
    default group; the default group fnaccel started goes with the last run using it
    (``users``), whichever run that is."""
    import torch.distributed as dist

    if not holder:
        return  # ended already
    group = holder.pop()
    mesh_groups = _mesh_groups(meshes, group)
    if meshes:
        _forget_mesh_decisions()
    meshes.clear()
    last = users is not None and users.leave()
    if not dist.is_initialized():
        return
    if exception_in_flight():
        _record_failure()
        return
    _settle(group)
    while releases:
        releases.pop()()
    for mesh_group in mesh_groups:
        dist.destroy_process_group(mesh_group)
    if not is_default:
        dist.destroy_process_group(group)
    if last:
        dist.destroy_process_group(None)


def _forget_mesh_decisions() -> None:
    """Clear DTensor's process-wide caches of sharding decisions. They are keyed by mesh
    equality, which ignores the mesh's groups, so a later run on an equal mesh (the same
    layout, after this run's groups are gone) would be handed DTensors on this run's
    mesh and fail with "Could not resolve the process group".

    It imports nothing: at interpreter exit (a run that ends without `fa.shutdown`)
    the libraries registering torch's functional-collective ops are finalized before
    this, and importing ``torch.distributed.tensor.debug`` (torch's helper for the same
    two clears) then fails, which skipped the group's settle and destroy."""
    api = sys.modules.get("torch.distributed.tensor._api")
    redistribute = sys.modules.get("torch.distributed.tensor._redistribute")
    if api is None or redistribute is None:
        return  # no DTensor was ever made, nothing cached
    import torch

    api.DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()
    torch._C._clear_DTensor_sharding_propagator_cache()
    redistribute.clear_redistribute_planner_cache()


def _mesh_groups(meshes: dict[str, Any], own: Any) -> list[Any]:
    """The distinct process groups of the meshes, other than ``own`` and the default group."""
    import torch.distributed as dist

    found: dict[int, Any] = {}
    for mesh in meshes.values():
        for group in mesh.get_all_groups():
            if group is not own and group is not dist.group.WORLD:
                found.setdefault(id(group), group)
    return list(found.values())


def _collect_cycles_at_exit() -> None:
    """At interpreter exit, while it is still fully alive: free the objects kept only
    by reference cycles. An fsdp() model is one (its hooks refer back to it) and its
    device mesh holds the process group, so without this the group's C++ object is
    freed during finalization, where a gloo thread releasing a tensor needs the
    GIL and the process aborts ("terminate called without an active exception":
    4 runs in 12 with each process pinned to one core, 0 in 12 with this). Local
    work only, so the error path runs it too."""
    gc.collect()


class GroupOwner:
    """Owns a process group fnaccel started, and the run's device mesh over it, and is
    fnaccel's only holder of them: `close` (from `fa.shutdown`), or else interpreter
    exit, ends them (see `_destroy_group`). An owner that becomes garbage ends nothing
    then: its group waits for the exit (see the module docstring).

    ``is_default``: the group is torch's default group, which this owner started.
    ``shares_default``: the group is a run's own, formed over a default group, which,
    when fnaccel started it, stays until the last run using it has ended (runs end
    in any order).

    ``agreed`` is the group's record of the last collective call every rank
    agreed on (set and read by `fnaccel.ops`; plain values only, never the
    group or a context, which would keep the group alive).
    """

    __slots__ = ("_end", "_holder", "_meshes", "_releases", "agreed", "calls")

    def __init__(self, group: Any, *, is_default: bool, shares_default: bool = False) -> None:
        import torch.distributed as dist

        self.agreed: Any = None
        self.calls: Any = None  # the run's fnaccel.calls.Calls, set by fa.init
        self._holder = [group]
        self._meshes: dict[str, Any] = {}
        self._releases: list[Callable[[], None]] = []
        users = None
        if is_default:
            users = _DEFAULT_GROUP_USERS[group] = _DefaultGroupUsers()
        elif shares_default:
            users = _DEFAULT_GROUP_USERS.get(dist.group.WORLD)  # None: the user's own default group
            if users is not None:
                users.count += 1
        # Not a weakref.finalize: that also runs when the collector frees the owner, on one
        # rank at a time. The exit's list holds the group's parts, never the owner.
        self._end = functools.partial(
            _destroy_group, self._holder, self._meshes, self._releases, is_default, users
        )
        atexit.register(self._end)
        # once per process, however many groups: unregister first; atexit runs it before
        # the ends above (handlers run last-registered first)
        atexit.unregister(_collect_cycles_at_exit)
        atexit.register(_collect_cycles_at_exit)

    @property
    def group(self) -> Any:
        """The group, or None once closed."""
        return self._holder[0] if self._holder else None

    def hold_meshes(self, meshes: dict[str, Any]) -> None:
        """Keep the run's device mesh and its named sub-meshes (`fnaccel.config.parallelism.build_mesh`)."""
        self._meshes.update(meshes)

    def release_before_destroy(self, release: Callable[[], None]) -> None:
        """Call ``release`` on a clean end, after the settle and before the group is
        destroyed: for an object that holds the group from C++ and would otherwise be
        its last holder (`fnaccel.transforms.parallel.ddp`'s reducer).

        Whoever drops the last reference to a gloo group joins its worker threads. A
        Python reference lets the GIL go while joining; a C++ holder freed from Python
        (DDP's ``Reducer``) does not, and a worker still releasing a finished
        collective's tensors waits for the GIL: a deadlock. Letting such holders go
        here, while this owner still holds the group, makes the group's last holder
        a Python reference. Release functions run last registered first.
        """
        self._releases.append(release)

    def mesh(self, name: str) -> Any:
        """The mesh (``"mesh"``) or sub-mesh called ``name``; None when there is none or once closed."""
        return self._meshes.get(name)

    def close(self) -> None:
        """End the groups now (`fa.shutdown`); they leave the exit's list."""
        atexit.unregister(self._end)
        self._end()
