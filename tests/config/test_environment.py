from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from fnaccel.checks import str_to_bool
from fnaccel.config import environment as env
from fnaccel.config.environment import (
    clear_environment,
    is_bf16_available,
    is_bitsandbytes_available,
    is_bnb_available,
    is_cuda_available,
    is_deepspeed_available,
    is_ipex_available,
    is_mps_available,
    is_msamp_available,
    is_npu_available,
    is_numpy_available,
    is_tensorboard_available,
    is_torch_version,
    is_torch_xla_available,
    is_torchao_available,
    is_tpu_available,
    is_transformer_engine_available,
    is_xpu_available,
    parse_flag_from_env,
    patch_environment,
)

# --- is_torch_version -------------------------------------------------------------


def test_is_torch_version_against_the_running_torch() -> None:
    base = torch.__version__.split("+")[0]
    major, minor = (int(part) for part in base.split(".")[:2])
    assert is_torch_version("==", base)
    assert is_torch_version(">=", base) and is_torch_version("<=", base)
    assert not is_torch_version("!=", base)
    assert not is_torch_version("<", base) and not is_torch_version(">", base)
    assert is_torch_version("==", f"{major}.{minor}.0") == base.endswith(".0")
    assert is_torch_version(">", f"{major}.{minor - 1}" if minor else f"{major - 1}.99")
    assert is_torch_version("<", f"{major}.{minor + 1}")
    assert is_torch_version("<", f"{major + 1}")


@pytest.mark.parametrize(
    ("torch_version", "operation", "reference", "expected"),
    [
        ("2.5.0a0+git1234", ">=", "2.5", True),  # a nightly counts as its base release
        ("2.5.0a0+git1234", "==", "2.5.0", True),
        ("2.4.0", "==", "2.4", True),
        ("2.4.0", "!=", "2.4", False),
        ("2.4.0", ">", "2.4.0rc1", True),
        ("2.4.0", ">", "2.4.0.dev20240601", True),
        ("2.4.0", "<", "2.4.0.post1", True),
        ("2.4.1", ">", "2.4", True),
        ("2.10.0", ">", "2.9.1", True),
        ("1.13.1", "<", "2.0", True),
    ],
)
def test_is_torch_version_compares_like_pep_440(
    monkeypatch: pytest.MonkeyPatch, torch_version: str, operation: str, reference: str, expected: bool
) -> None:
    monkeypatch.setattr(torch, "__version__", torch_version)
    assert is_torch_version(operation, reference) is expected


def test_is_torch_version_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="'=>'.*use one of <, <=, ==, !=, >=, >"):
        is_torch_version("=>", "2.0")
    with pytest.raises(ValueError, match="'two' is not a version number"):
        is_torch_version(">=", "two")


# --- device checks on this (CPU) machine ----------------------------------------------


def test_device_checks_agree_with_torch() -> None:
    assert is_cuda_available() == torch.cuda.is_available()
    assert is_mps_available() == (torch.backends.mps.is_built() and torch.backends.mps.is_available())
    assert is_xpu_available() == torch.xpu.is_available()
    assert is_xpu_available(check_device=True) == (torch.xpu.is_available() and torch.xpu.device_count() > 0)


def test_cuda_check_leaves_the_environment_alone() -> None:
    before = dict(os.environ)
    is_cuda_available()
    assert dict(os.environ) == before


@pytest.mark.skipif(
    torch.cuda.is_available() or torch.xpu.is_available() or is_mps_available() or is_torch_xla_available(),
    reason="CPU-only answer",
)
def test_bf16_is_available_on_cpu() -> None:
    assert is_bf16_available() is True
    assert is_bf16_available(ignore_tpu=True) is True


def test_numpy_check() -> None:
    assert is_numpy_available() == (importlib.util.find_spec("numpy") is not None)


def test_bitsandbytes_alias() -> None:
    assert is_bitsandbytes_available is is_bnb_available


# --- package checks, against fake installed packages --------------------------------


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., None]]:
    """Installs fake packages (a module plus, optionally, dist-info metadata) on sys.path."""
    monkeypatch.syspath_prepend(str(tmp_path))
    created: list[str] = []
    before = set(sys.modules)  # a real package already imported (torchao, by an fp8 test) stays

    def install(
        module: str,
        *,
        version: str | None = None,
        dist: str | None = None,
        files: dict[str, str] | None = None,
    ) -> None:
        package = tmp_path / module
        package.mkdir()
        (package / "__init__.py").write_text("")
        for name, text in (files or {}).items():
            (package / name).write_text(text)
        if version is not None:
            info = tmp_path / f"{(dist or module).replace('-', '_')}-{version}.dist-info"
            info.mkdir()
            (info / "METADATA").write_text(
                f"Metadata-Version: 2.1\nName: {dist or module}\nVersion: {version}\n"
            )
        created.append(module)
        importlib.invalidate_caches()

    yield install
    for name in list(sys.modules):
        if name.split(".")[0] in created and name not in before:  # only what a fake package imported
            del sys.modules[name]


def test_installed_packages_are_found(site: Callable[..., None]) -> None:
    site("deepspeed", version="0.14.0")
    site("transformer_engine", version="1.8.0", dist="transformer-engine")
    site("tensorboardX", version="2.6")
    site("torch_npu", version="2.1.0")
    assert is_deepspeed_available()
    assert is_transformer_engine_available()
    assert is_tensorboard_available()
    assert is_npu_available()


def test_a_bare_folder_is_not_a_package(site: Callable[..., None]) -> None:
    site("msamp")  # importable, but no installed metadata
    assert importlib.util.find_spec("msamp") is not None
    assert not is_msamp_available()
    site("ms_amp_other", version="0.4.0", dist="ms-amp")
    assert is_msamp_available()


def test_minimum_versions(site: Callable[..., None]) -> None:
    site("bitsandbytes", version="0.43.1")
    assert is_bnb_available()
    assert is_bnb_available(min_version="0.43.0")
    assert not is_bnb_available(min_version="0.44")
    site("torchao", version="0.5.0")
    assert not is_torchao_available()


def test_torchao_new_enough(site: Callable[..., None]) -> None:
    site("torchao", version="0.7.0")
    assert is_torchao_available()


@pytest.mark.parametrize(("ipex_version", "expected"), [("same", True), ("1.0.0", False)])
def test_ipex_must_match_torch(site: Callable[..., None], ipex_version: str, expected: bool) -> None:
    major_minor = ".".join(torch.__version__.split("+")[0].split(".")[:2])
    version = f"{major_minor}.100" if ipex_version == "same" else ipex_version
    site("intel_extension_for_pytorch", version=version)
    assert is_ipex_available() is expected


def test_torch_xla_checks(site: Callable[..., None], monkeypatch: pytest.MonkeyPatch) -> None:
    site("torch_xla", version="2.5.0", files={"runtime.py": "def device_type():\n    return 'TPU'\n"})
    assert is_torch_xla_available()
    assert is_torch_xla_available(check_is_tpu=True)
    assert not is_torch_xla_available(check_is_gpu=True)
    assert is_tpu_available() and is_tpu_available(check_device=False)
    assert is_bf16_available() is True
    assert is_bf16_available(ignore_tpu=True) is False
    with pytest.raises(ValueError, match="check_is_tpu and check_is_gpu"):
        is_torch_xla_available(check_is_tpu=True, check_is_gpu=True)
    monkeypatch.setenv("USE_TORCH_XLA", "0")
    assert not is_torch_xla_available()
    assert not is_tpu_available()


def test_checks_import_nothing_when_no_device_is_asked(site: Callable[..., None]) -> None:
    site("torch_npu", version="2.1.0", files={"marker.py": ""})
    site("torch_xla", version="2.5.0")
    assert is_npu_available() and is_torch_xla_available()
    assert "torch_npu" not in sys.modules and "torch_xla" not in sys.modules


# --- patch_environment / clear_environment ------------------------------------------


def test_patch_environment_sets_and_restores(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FNACCEL_TEST_OLD", "old")
    monkeypatch.delenv("FNACCEL_TEST_NEW", raising=False)
    with patch_environment(fnaccel_test_old=1, FNACCEL_TEST_NEW=True):
        assert os.environ["FNACCEL_TEST_OLD"] == "1"
        assert os.environ["FNACCEL_TEST_NEW"] == "True"
    assert os.environ["FNACCEL_TEST_OLD"] == "old"
    assert "FNACCEL_TEST_NEW" not in os.environ


def test_patch_environment_restores_on_exception(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FNACCEL_TEST_OLD", "old")
    monkeypatch.delenv("FNACCEL_TEST_NEW", raising=False)
    with (
        pytest.raises(RuntimeError, match="boom"),
        patch_environment(FNACCEL_TEST_OLD="x", FNACCEL_TEST_NEW="y"),
    ):
        os.environ["FNACCEL_TEST_OLD"] = "changed inside"
        raise RuntimeError("boom")
    assert os.environ["FNACCEL_TEST_OLD"] == "old"
    assert "FNACCEL_TEST_NEW" not in os.environ


def test_patch_environment_rejects_keys_equal_up_to_case() -> None:
    before = dict(os.environ)
    with (
        pytest.raises(ValueError, match="FNACCEL_TEST_DUP twice"),
        patch_environment(fnaccel_test_dup="a", FNACCEL_TEST_DUP="b"),
    ):
        pass
    assert dict(os.environ) == before


def test_clear_environment_empties_and_restores_exactly(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FNACCEL_TEST_OLD", "old")
    before = dict(os.environ)
    with pytest.raises(RuntimeError, match="boom"), clear_environment():
        assert dict(os.environ) == {}
        os.environ["FNACCEL_TEST_OLD"] = "new"
        os.environ["FNACCEL_TEST_INSIDE"] = "1"
        raise RuntimeError("boom")
    assert dict(os.environ) == before


# --- flags --------------------------------------------------------------------------------


@pytest.mark.parametrize("text", ["1", "true", "TRUE", "Yes", "on", " y ", "t"])
def test_truthy_strings(text: str) -> None:
    assert str_to_bool(text) == 1 and str_to_bool(text, to_bool=True) is True


@pytest.mark.parametrize("text", ["0", "false", "No", "OFF", "n", "f"])
def test_falsy_strings(text: str) -> None:
    assert str_to_bool(text) == 0 and str_to_bool(text, to_bool=True) is False


def test_str_to_bool_rejects_other_strings() -> None:
    with pytest.raises(ValueError, match="'maybe' is not a yes/no value"):
        str_to_bool("maybe")


def test_parse_flag_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FNACCEL_TEST_FLAG", raising=False)
    assert parse_flag_from_env("FNACCEL_TEST_FLAG") is False
    assert parse_flag_from_env("FNACCEL_TEST_FLAG", default=True) is True
    monkeypatch.setenv("FNACCEL_TEST_FLAG", "")
    assert parse_flag_from_env("FNACCEL_TEST_FLAG", default=True) is True
    monkeypatch.setenv("FNACCEL_TEST_FLAG", "On")
    assert parse_flag_from_env("FNACCEL_TEST_FLAG") is True
    monkeypatch.setenv("FNACCEL_TEST_FLAG", "0")
    assert parse_flag_from_env("FNACCEL_TEST_FLAG", default=True) is False
    monkeypatch.setenv("FNACCEL_TEST_FLAG", "sometimes")
    with pytest.raises(ValueError, match="FNACCEL_TEST_FLAG='sometimes' is not a flag"):
        parse_flag_from_env("FNACCEL_TEST_FLAG")


def test_module_exports() -> None:
    for name in env.__all__:
        assert callable(getattr(env, name))
