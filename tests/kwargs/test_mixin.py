"""A user's own @dataclass inherits KwargsHandler (Accelerate documents exactly that)."""

from __future__ import annotations

import copy
import pickle
from dataclasses import dataclass, field

import pytest

import fnaccel as fa
from fnaccel.kwargs import KwargsHandler


@dataclass
class MyKwargs(KwargsHandler):
    """Failed before: 'cannot inherit non-frozen dataclass from a frozen one'."""

    a: int = 1
    b: bool = False
    c: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class MyFrozenKwargs(KwargsHandler):
    scale: float = 1.0


def test_a_plain_user_dataclass_inherits_to_kwargs() -> None:
    handler = MyKwargs(2)
    assert handler.to_kwargs() == {"a": 2}
    handler.c.append(3)  # mutable, as the user declared it
    assert handler.to_kwargs() == {"a": 2, "c": [3]}
    assert MyFrozenKwargs(scale=2.0).to_kwargs() == {"scale": 2.0}
    assert pickle.loads(pickle.dumps(handler)) == handler and copy.deepcopy(handler) == handler


def test_a_user_handler_gets_the_bool_field_check() -> None:
    with pytest.raises(ValueError, match="b must be True or False"):
        MyKwargs(b="yes")  # type: ignore[arg-type]


def test_a_user_handler_is_kept_by_init_under_its_class_name() -> None:
    state = fa.init(cpu=True, kwargs_handlers=[MyFrozenKwargs(scale=3.0)])
    assert state.kwargs_handlers["MyFrozenKwargs"].to_kwargs() == {"scale": 3.0}


def test_a_subclass_that_is_not_a_dataclass_is_told_so() -> None:
    class NotADataclass(KwargsHandler):
        pass

    with pytest.raises(TypeError, match="not a dataclass"):
        NotADataclass().to_kwargs()
