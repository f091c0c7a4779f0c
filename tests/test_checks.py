"""The one set of value checks (fnaccel/checks.py): each bad value raises one sentence that names the
field, what it must be and, where one helps, the fix."""

from __future__ import annotations

import pytest

from fnaccel.checks import check_choice, check_value, is_int, is_number, require


def test_a_bool_is_neither_an_int_nor_a_number() -> None:
    assert [is_int(v) for v in (3, True, 3.0, "3")] == [True, False, False, False]
    assert [is_number(v) for v in (3, 0.5, False, None)] == [True, True, False, False]


def test_check_value_names_the_field_the_expectation_and_the_fix() -> None:
    check_value("interval", 2, True, "an int >= 1")
    with pytest.raises(ValueError, match=r"^interval must be an int >= 1, got 0: try 1$"):
        check_value("interval", 0, False, "an int >= 1", "try 1")
    with pytest.raises(ValueError, match=r"^name must be a string, got None$"):
        check_value("name", None, False, "a string")


def test_check_choice_lists_the_choices() -> None:
    check_choice("fp8 opt_level", "O1", ("O1", "O2"))
    with pytest.raises(ValueError, match=r"^unknown fp8 opt_level 'O3': use one of O1, O2$"):
        check_choice("fp8 opt_level", "O3", ("O1", "O2"))


def test_require_raises_its_message() -> None:
    require(True, "never")
    with pytest.raises(ValueError, match="^the message$"):
        require(False, "the message")
