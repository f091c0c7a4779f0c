"""The one set of value checks (fnaccel/checks.py): each bad value raises one sentence that names the
field, what it must be and, where one helps, the fix."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from fnaccel._errors import ConfigError
from fnaccel.checks import (
    check_choice,
    check_value,
    config_bool,
    config_choice,
    config_int,
    config_names,
    config_str,
    is_int,
    is_number,
    require,
    require_bools,
    require_count,
    require_number,
    str_to_bool,
)


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


def test_str_to_bool_reads_yes_and_no_words() -> None:
    assert [str_to_bool(t) for t in ("1", " Yes", "on", "0", "OFF", "f")] == [1, 1, 1, 0, 0, 0]
    assert str_to_bool("true", to_bool=True) is True
    with pytest.raises(ValueError, match="'maybe' is not a yes/no value"):
        str_to_bool("maybe")


def test_config_readers_take_yaml_values_and_the_launchers_text() -> None:
    what = "fsdp_config: key 'fsdp_min_num_params'"
    assert config_int(3, what) == 3 and config_int("-3", what) == -3
    assert config_bool(False, what) is False and config_bool("yes", what) is True
    assert config_bool(None, what, optional=True) is None and config_bool(1, what, optional=True) is True
    assert config_names("A, B,", what) == ("A", "B") and config_names(["A"], what) == ("A",)
    assert config_choice("full_shard", what, ("FULL_SHARD",)) == "FULL_SHARD"
    for call, message in (
        (lambda: config_int(True, what), "must be an integer, got True"),
        (lambda: config_bool(1, what), "must be true or false, got 1"),
        (lambda: config_str(3, what), "must be a string, got 3"),
        (lambda: config_names([1], what), r"must be class names \(a list or a comma"),
        (lambda: config_choice("x", what, ("A", "B")), "must be one of A, B, got 'x'"),
    ):
        with pytest.raises(ConfigError, match=f"^{what} {message}"):
            call()


def test_plugin_field_checks_name_the_record_and_refuse_bools_as_numbers() -> None:
    @dataclass
    class Plugin:
        flag: object = True
        maybe: object = None

    require_bools(Plugin(), ("maybe",), ("flag",))
    with pytest.raises(ConfigError, match=r"^Plugin: key 'flag': must be True or False, got 'no'$"):
        require_bools(Plugin(flag="no"), ("maybe",), ("flag",))
    require_count("Plugin", "steps", None)
    with pytest.raises(ConfigError, match="^Plugin: steps must be a positive int, got True$"):
        require_count("Plugin", "steps", True)
    with pytest.raises(ConfigError, match="^Plugin: steps must be a non-negative int, got -1$"):
        require_count("Plugin", "steps", -1, least=0)
    with pytest.raises(ConfigError, match="^Plugin: clip must be a non-negative number, got False$"):
        require_number("Plugin", "clip", False)
