"""RunState: frozen, slotted, and consumed by the calls that advance it."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import fnaccel as fa


def test_run_state_is_frozen_and_slotted() -> None:
    state = fa.init(seed=0, cpu=True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        state.step = 3  # type: ignore[misc]
    assert not hasattr(state, "__dict__")
    assert not hasattr(state.dist, "__dict__")


def test_replace_edits_fields_and_shares_the_lease() -> None:
    state = fa.init(seed=0, cpu=True)
    edited = state.replace(epoch=4)
    assert (edited.epoch, state.epoch) == (4, 0)
    fa.with_rng(edited, torch.rand, 1)
    # both describe the same live objects, so advancing one spends the other
    assert edited.is_spent and state.is_spent


def test_replace_refuses_the_lease() -> None:
    state = fa.init(seed=0, cpu=True)
    with pytest.raises(TypeError, match="lease"):
        state.replace(_lease=None)


def test_a_consumed_state_raises_naming_what_consumed_it_but_stays_readable() -> None:
    state = fa.init(seed=0, cpu=True).replace(step=7)
    new, _ = fa.with_rng(state, torch.rand, 1)
    with pytest.raises(fa.StaleStateError, match=r"consumed by fa.with_rng at step 7 \(micro-step 0\)"):
        fa.with_rng(state, torch.rand, 1)
    assert state.step == 7 and state.dist.num_processes == 1
    assert not new.is_spent
    fa.with_rng(new, torch.rand, 1)  # the successor is fresh


def test_advance_copies_every_field_applies_the_changes_and_gives_a_fresh_lease() -> None:
    state = fa.init(seed=3, cpu=True, project_dir="/tmp/p").replace(step=4, micro_step=9, trigger=True)
    new = state.advance("a test", step=5)
    for f in dataclasses.fields(fa.RunState):
        if f.name not in ("step", "_lease"):
            assert getattr(new, f.name) is getattr(state, f.name), f.name
    assert (new.step, state.step) == (5, 4)
    assert state.is_spent and not new.is_spent and new._lease is not state._lease
    assert repr(state._lease) == "<lease spent by a test at step 4 (micro-step 9)>"
    assert new._lease.spent_by is None and repr(new._lease) == "<lease>"
    with pytest.raises(dataclasses.FrozenInstanceError):
        new.step = 6  # type: ignore[misc]


def test_advance_refuses_an_unknown_field_without_spending_the_state() -> None:
    state = fa.init(seed=0, cpu=True)
    with pytest.raises(TypeError, match=r"no field\(s\) \['stepp'\]"):
        state.advance("a test", stepp=1)
    assert not state.is_spent
    with pytest.raises(TypeError, match="no field"):
        state.advance("a test", _lease=None)


def test_stale_state_error_is_an_fnaccel_error() -> None:
    assert issubclass(fa.StaleStateError, fa.FnaccelError)
    assert issubclass(fa.ConfigError, fa.FnaccelError)
    assert issubclass(fa.CollectiveMismatchError, fa.FnaccelError)
    assert issubclass(fa.CheckpointError, fa.FnaccelError)


def test_dist_context_flags() -> None:
    ctx = fa.DistContext(num_processes=4, rank=3, local_rank=1, num_local_processes=2)
    assert not ctx.is_main_process and not ctx.is_local_main_process and ctx.is_last_process
    assert fa.DistContext().is_main_process and fa.DistContext().is_local_main_process


def test_ops_reject_a_context_that_is_neither_state_nor_dist() -> None:
    with pytest.raises(TypeError, match="RunState or a DistContext"):
        fa.ops.gather(object(), torch.ones(1))
