"""purge_fnaccel_environment (alias purge_accelerate_environment) on functions and test classes."""

from __future__ import annotations

import io
import os
import unittest

import pytest

from fnaccel.utils import patch_environment, purge_accelerate_environment, purge_fnaccel_environment


def test_a_function_leaves_fnaccel_variables_as_it_found_them() -> None:
    @purge_fnaccel_environment
    def sets(value: str) -> str:
        os.environ["FNACCEL_PURGE_NEW"] = value
        os.environ["FNACCEL_PURGE_OLD"] = "changed"
        del os.environ["FNACCEL_PURGE_GONE"]
        os.environ["OTHER_PURGE_VAR"] = "kept"
        return value

    with patch_environment(fnaccel_purge_old="old", fnaccel_purge_gone="here", other_purge_var="x"):
        assert sets("v") == "v"
        assert "FNACCEL_PURGE_NEW" not in os.environ
        assert os.environ["FNACCEL_PURGE_OLD"] == "old" and os.environ["FNACCEL_PURGE_GONE"] == "here"
        assert os.environ["OTHER_PURGE_VAR"] == "kept"  # only FNACCEL_* is purged


def test_even_when_the_function_raises() -> None:
    @purge_accelerate_environment
    def fails() -> None:
        os.environ["FNACCEL_PURGE_RAISED"] = "1"
        raise KeyError("boom")

    with pytest.raises(KeyError):
        fails()
    assert "FNACCEL_PURGE_RAISED" not in os.environ


def test_a_unittest_class_is_purged_from_setup_through_teardown() -> None:
    seen: list[str | None] = []

    @purge_fnaccel_environment
    class Case(unittest.TestCase):
        def setUp(self) -> None:
            os.environ["FNACCEL_PURGE_SETUP"] = "1"

        def test_it(self) -> None:
            seen.append(os.environ.get("FNACCEL_PURGE_SETUP"))

    result = unittest.TextTestRunner(stream=io.StringIO()).run(unittest.TestSuite([Case("test_it")]))
    assert result.wasSuccessful() and seen == ["1"]
    assert "FNACCEL_PURGE_SETUP" not in os.environ


def test_a_plain_test_class_has_each_test_method_purged() -> None:
    @purge_fnaccel_environment
    class TestPlain:
        def test_sets(self) -> None:
            os.environ["FNACCEL_PURGE_PLAIN"] = "1"

        def helper(self) -> None:
            os.environ["FNACCEL_PURGE_HELPER"] = "1"

    TestPlain().test_sets()
    assert "FNACCEL_PURGE_PLAIN" not in os.environ
    TestPlain().helper()
    assert os.environ.pop("FNACCEL_PURGE_HELPER") == "1"  # not a test: left alone


def test_the_alias_is_the_same_decorator_and_junk_is_refused() -> None:
    assert purge_accelerate_environment is purge_fnaccel_environment
    with pytest.raises(TypeError, match="test function or class"):
        purge_fnaccel_environment(3)  # type: ignore[type-var]
