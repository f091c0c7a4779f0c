"""Names Accelerate's own tests import from ``accelerate.utils``, under fnaccel.utils, with
Accelerate's behaviour; compared with Accelerate itself where it is installed (the bench
extra) and its semantics are subtle."""

from __future__ import annotations

import logging
import platform
from collections import namedtuple
from typing import Any, NamedTuple

import pytest
import torch

import fnaccel as fa
from fnaccel.utils import (
    DistributedOperationException,
    TorchDynamoPlugin,
    check_os_kernel,
    concatenate,
    convert_dict_to_env_variables,
    find_device,
    is_namedtuple,
    pad_input_tensors,
    recursively_apply,
    send_to_device,
    slice_tensors,
)


def _accelerate_utils() -> Any:
    return pytest.importorskip(
        "accelerate.utils", reason="accelerate is not installed (the bench extra has it)"
    )


class Quantized(NamedTuple):
    value: torch.Tensor
    scale: torch.Tensor | None


class Subclassed(Quantized):
    pass


Point = namedtuple("Point", ["x", "y"])


# is_namedtuple, and named tuples through the tree functions


def test_is_namedtuple_tells_named_tuples_from_other_tuples() -> None:
    assert is_namedtuple(Quantized(torch.ones(1), None))
    assert is_namedtuple(Subclassed(torch.ones(1), None))
    assert is_namedtuple(Point(1, y=2))
    assert not is_namedtuple((1, 2))
    assert not is_namedtuple("hey")
    assert not is_namedtuple(object())
    assert not is_namedtuple(torch.max(torch.ones(2, 2), 1))  # a torch structseq is a plain tuple here


def test_is_namedtuple_agrees_with_accelerate() -> None:
    au = _accelerate_utils()
    from accelerate.utils.operations import is_namedtuple as theirs

    del au
    values = [
        Quantized(torch.ones(1), None),
        Subclassed(torch.ones(1), None),
        Point(1, 2),
        (1, 2),
        "hey",
        object(),
        torch.max(torch.ones(2, 2), 1),
        [1, 2],
    ]
    assert [is_namedtuple(v) for v in values] == [theirs(v) for v in values]


@pytest.mark.parametrize(
    "tree",
    [
        Quantized(torch.arange(4.0), None),
        Subclassed(torch.arange(4.0), torch.ones(4)),
        Point(torch.arange(4), [torch.ones(4), 3]),
    ],
    ids=["typing.NamedTuple", "subclass", "collections.namedtuple"],
)
def test_named_tuples_are_rebuilt_with_their_own_type(tree: Any) -> None:
    doubled = recursively_apply(lambda t: t * 2, tree)
    assert type(doubled) is type(tree) and torch.equal(doubled[0], tree[0] * 2)
    sliced = slice_tensors(tree, slice(1, 3))
    assert type(sliced) is type(tree) and torch.equal(sliced[0], tree[0][1:3])
    joined = concatenate([tree, tree])
    assert type(joined) is type(tree) and torch.equal(joined[0], torch.cat([tree[0], tree[0]]))
    moved = send_to_device(tree, "cpu")
    assert type(moved) is type(tree)
    assert joined._fields == tree._fields and is_namedtuple(joined)


# recursively_apply(error_on_other_type=True)


def test_error_on_other_type_names_the_type_the_function_and_the_test() -> None:
    def tensor(
        t: torch.Tensor,
    ) -> torch.Tensor:  # Accelerate's test passes torch.tensor, which warns on a tensor
        return t

    with pytest.raises(TypeError) as info:
        recursively_apply(tensor, (torch.tensor(1), 1), error_on_other_type=True)
    assert str(info.value) == (  # Accelerate's message, word for word
        "Unsupported types (<class 'int'>) passed to `tensor`. Only nested list/tuple/dicts of objects that "
        "are valid for `is_torch_tensor` should be passed."
    )


# find_device


def test_find_device_returns_the_first_tensors_device_or_none() -> None:
    assert find_device([1, "a", torch.tensor([1, 2, 3])]) == torch.device("cpu")
    assert find_device({"a": 1, "b": torch.tensor([1, 2, 3])}) == torch.device("cpu")
    assert find_device(torch.ones(1, device="meta")) == torch.device("meta")
    assert find_device({"a": [torch.ones(1, device="meta"), torch.ones(1)]}) == torch.device("meta")
    assert find_device([1, "a"]) is None
    assert find_device(3) is None


def test_find_device_agrees_with_accelerate() -> None:
    au = _accelerate_utils()
    trees = [
        [1, "a", torch.ones(1)],
        {"a": 1, "b": [torch.ones(1, device="meta"), torch.ones(1)]},
        [1, "a"],
        Point(torch.ones(1, device="meta"), 1),
        (),
        {},
        5,
        torch.ones(1),
    ]
    assert [find_device(t) for t in trees] == [au.find_device(t) for t in trees]


# pad_input_tensors


@pytest.mark.parametrize(
    ("batch_size", "num_processes", "padded"),
    [
        (1, 2, 2),
        (3, 2, 4),
        (4, 3, 6),
        (3, 4, 4),
        (4, 6, 6),
        (1, 6, 6),
        (2, 6, 6),
        (61, 6, 66),
        (7, 2, 8),
        (8, 2, 8),
        (0, 3, 3),
    ],
)
def test_pad_input_tensors_pads_to_a_multiple_of_the_processes(
    batch_size: int, num_processes: int, padded: int
) -> None:
    batch = torch.rand(batch_size, 4, 4) + 1
    result = pad_input_tensors(batch, batch_size, num_processes)
    assert result.shape == (padded, 4, 4)
    assert torch.equal(result[:batch_size], batch)
    assert not result[batch_size:].any()  # zeros, as Accelerate pads


def test_pad_input_tensors_pads_every_tensor_of_a_tree_along_dim() -> None:
    tree: dict[str, Any] = {"ids": torch.ones(2, 3), "mask": [torch.ones(2, 3, dtype=torch.bool)]}
    result = pad_input_tensors(tree, 3, 2, dim=1)
    assert result["ids"].shape == (2, 4) and result["mask"][0].shape == (2, 4)
    assert result["mask"][0].dtype == torch.bool and not result["mask"][0][:, 3].any()
    with pytest.raises(TypeError, match="Unsupported types"):
        pad_input_tensors({"ids": torch.ones(2), "n": 2}, 2, 2)
    with pytest.raises(ValueError, match="num_processes must be a positive int"):
        pad_input_tensors(torch.ones(2), 2, 0)
    with pytest.raises(ValueError, match="longer than batch_size"):
        pad_input_tensors(torch.ones(5), 3, 2)


@pytest.mark.parametrize(
    ("batch_size", "num_processes"),
    [
        (1, 2),
        (3, 2),
        (4, 3),
        (3, 4),
        (4, 6),
        (1, 6),
        (2, 6),
        (61, 6),
        (5, 4),
        (10, 4),
    ],
)
def test_pad_input_tensors_agrees_with_accelerate_where_it_rounds_up(
    batch_size: int, num_processes: int
) -> None:
    """Accelerate's arithmetic gives the next multiple in these cases (its own tests' and two
    more); in most others it does not (8 on 2 processes gives 10, 9 on 4 gives 11), where
    fnaccel still pads to the next multiple: docs/migration.md."""
    au = _accelerate_utils()
    batch = torch.rand(batch_size, 3)
    assert torch.equal(
        pad_input_tensors(batch, batch_size, num_processes),
        au.pad_input_tensors(batch, batch_size, num_processes),
    )


# convert_dict_to_env_variables


def test_convert_dict_to_env_variables_keeps_the_safe_items_and_logs_the_others(
    caplog: pytest.LogCaptureFixture,
) -> None:
    env = {"FNACCEL_DEBUG_MODE": "1", "BAD_ENV_NAME": "<mything", "OTHER_ENV": "2", "EMPTY": "", "A B": "1"}
    with caplog.at_level(logging.WARNING, logger="fnaccel.environment"):
        assert convert_dict_to_env_variables(env) == ["FNACCEL_DEBUG_MODE=1\n", "OTHER_ENV=2\n"]
    skipped = [r.getMessage() for r in caplog.records if r.name == "fnaccel.environment"]
    assert len(skipped) == 3 and "BAD_ENV_NAME" in skipped[0] and "EMPTY" in skipped[1]


def test_convert_dict_to_env_variables_agrees_with_accelerate() -> None:
    au = _accelerate_utils()
    env = {"A": "1", "B": "x;y", "C": "", "": "v", "D": "a\nb", "E": "<", "F": ">", "G": "p q", "H": "ok=1"}
    logging.getLogger("accelerate.utils.environment").disabled = True  # its warnings are not what is compared
    try:
        assert convert_dict_to_env_variables(env) == au.convert_dict_to_env_variables(env)
    finally:
        logging.getLogger("accelerate.utils.environment").disabled = False


def test_convert_dict_to_env_variables_refuses_a_value_that_is_not_a_string() -> None:
    with pytest.raises(TypeError, match="'PORT'.*str"):
        convert_dict_to_env_variables({"PORT": 29500})  # type: ignore[dict-item]  # the misuse under test


# check_os_kernel


def test_check_os_kernel_is_quiet_on_this_machine_when_its_kernel_is_recent(
    caplog: pytest.LogCaptureFixture,
) -> None:
    release = platform.uname().release
    with caplog.at_level(logging.WARNING):
        check_os_kernel()
    digits = tuple(int(p) for p in release.split("-")[0].split(".")[:3] if p.isdigit())
    if platform.system() != "Linux" or digits >= (5, 5, 0):
        assert not caplog.records


@pytest.mark.parametrize(
    ("system", "release", "warns"),
    [
        ("Linux", "5.15.0-35-generic", False),
        ("Darwin", "5.4.0-35-generic", False),
        ("Linux", "5.4.0-35-generic", True),
        ("Linux", "4.19.112+", True),
        ("Linux", "6.1.0", False),
    ],
)
def test_check_os_kernel_warns_below_5_5_on_linux(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, system: str, release: str, warns: bool
) -> None:
    real = platform.uname()
    # the kernel cannot be changed under the test: what the OS reports is
    monkeypatch.setattr(platform, "uname", lambda: real._replace(system=system, release=release))
    with caplog.at_level(logging.WARNING):
        check_os_kernel()
    records = [r for r in caplog.records if r.name == "fnaccel.environment"]
    assert len(records) == int(warns)
    if warns:
        version = release.split("-")[0].rstrip("+")
        assert records[0].levelname == "WARNING" and version in records[0].getMessage()
        assert "5.5.0" in records[0].getMessage()


# TorchDynamoPlugin.to_kwargs


def test_torch_dynamo_plugin_to_kwargs_gives_torch_compiles_changed_arguments() -> None:
    assert TorchDynamoPlugin().to_kwargs() == {}
    assert TorchDynamoPlugin(backend="no").to_kwargs() == {}
    kwargs = TorchDynamoPlugin(backend="INDUCTOR", mode="reduce-overhead", fullgraph=True).to_kwargs()
    assert kwargs == {"backend": "inductor", "mode": "reduce-overhead", "fullgraph": True}
    assert TorchDynamoPlugin(backend="eager", dynamic=False, disable=True).to_kwargs() == {
        "backend": "eager",
        "dynamic": False,
        "disable": True,
    }
    compiled = torch.compile(torch.nn.Linear(2, 1), **TorchDynamoPlugin(backend="eager").to_kwargs())
    assert compiled(torch.ones(1, 2)).shape == (1, 1)


def test_torch_dynamo_plugin_to_kwargs_agrees_with_accelerate() -> None:
    au = _accelerate_utils()
    from fnaccel.utils import clear_environment

    cases = [
        {},
        {"backend": "inductor"},
        {"backend": "aot_eager", "mode": "max-autotune"},
        {"backend": "eager", "fullgraph": True, "dynamic": True},
        {"backend": "eager", "disable": True},
    ]
    with clear_environment():  # Accelerate's plugin reads ACCELERATE_DYNAMO_*; fnaccel's reads nothing
        for case in cases:
            theirs = au.TorchDynamoPlugin(**case).to_kwargs()
            assert TorchDynamoPlugin(**case).to_kwargs() == theirs, case


# DistributedOperationException


def test_collective_mismatch_error_is_accelerates_distributed_operation_exception() -> None:
    assert issubclass(fa.CollectiveMismatchError, DistributedOperationException)
    assert issubclass(fa.CollectiveMismatchError, fa.FnaccelError)


def gather_mismatched(state: fa.RunState) -> str:
    """Each rank gathers a tensor of another length; the mismatch is caught under Accelerate's name."""
    try:
        fa.ops.gather(state, {"x": torch.ones(2, 3 + state.dist.rank)})
    except DistributedOperationException as exc:
        return type(exc).__name__
    return "no error"


def test_a_mismatched_collective_is_caught_as_distributed_operation_exception(world2: Any) -> None:
    assert world2.run(gather_mismatched) == ["CollectiveMismatchError", "CollectiveMismatchError"]
