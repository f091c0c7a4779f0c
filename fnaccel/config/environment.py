"""What this machine offers, and scoped changes to the process environment.

The `is_*_available` checks look packages up with `importlib.util.find_spec` and
their installed metadata, so nothing heavy is imported until a check needs to
look at a device. Nothing is cached: each call answers for the present moment.

>>> is_torch_version(">=", "2.0")
True
>>> with patch_environment(fnaccel_example="1"):
...     parse_flag_from_env("FNACCEL_EXAMPLE")
True
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import logging
import operator
import os
import platform
import re
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from types import MappingProxyType
from typing import Any

import torch

from fnaccel.checks import str_to_bool

__all__ = [
    "check_os_kernel",
    "clear_environment",
    "convert_dict_to_env_variables",
    "is_bf16_available",
    "is_bitsandbytes_available",
    "is_bnb_available",
    "is_cuda_available",
    "is_deepspeed_available",
    "is_ipex_available",
    "is_mps_available",
    "is_msamp_available",
    "is_npu_available",
    "is_numpy_available",
    "is_tensorboard_available",
    "is_torch_version",
    "is_torch_xla_available",
    "is_torchao_available",
    "is_tpu_available",
    "is_transformer_engine_available",
    "is_xpu_available",
    "parse_flag_from_env",
    "patch_environment",
]

_LOG = logging.getLogger("fnaccel.environment")  # the name docs/utils.md gives users to filter by

_OPERATIONS: Mapping[str, Callable[[Any, Any], bool]] = MappingProxyType(
    {
        "<": operator.lt,
        "<=": operator.le,
        "==": operator.eq,
        "!=": operator.ne,
        ">=": operator.ge,
        ">": operator.gt,
    }
)
# PEP 440 in brief: release, then optional pre-release, post-release, dev-release, local label.
_VERSION = re.compile(
    r"v?(?P<release>\d+(?:\.\d+)*)"
    r"(?:[-_.]?(?P<pre>a|b|rc|alpha|beta|c)[-_.]?(?P<pre_n>\d*))?"
    r"(?:[-_.]?(?:post|rev|r)[-_.]?(?P<post>\d*))?"
    r"(?:[-_.]?dev[-_.]?(?P<dev>\d*))?"
    r"(?:\+[a-z0-9._]*)?",
    re.IGNORECASE,
)
_PRE_ORDER = MappingProxyType({"a": 0, "alpha": 0, "b": 1, "beta": 1, "c": 2, "rc": 2})


def _version_key(text: str) -> tuple[tuple[int, ...], tuple[int, int], int, float]:
    """Orders version strings the way PEP 440 does (1.0.dev0 < 1.0a1 < 1.0 < 1.0.post1)."""
    match = _VERSION.fullmatch(text.strip())
    if match is None:
        raise ValueError(f"{text!r} is not a version number: write one such as '2.4' or '2.4.1'")
    release = [int(part) for part in match["release"].split(".")]
    while len(release) > 1 and release[-1] == 0:
        release.pop()
    post = -1 if match["post"] is None else int(match["post"] or 0)
    dev = float("inf") if match["dev"] is None else float(match["dev"] or 0)
    if match["pre"] is not None:
        pre = (_PRE_ORDER[match["pre"].lower()], int(match["pre_n"] or 0))
    elif match["dev"] is not None and match["post"] is None:
        pre = (-1, 0)  # 1.0.dev0 comes before every pre-release of 1.0
    else:
        pre = (3, 0)
    return (tuple(release), pre, post, dev)


def _compare_versions(current: str, operation: str, reference: str) -> bool:
    if operation not in _OPERATIONS:
        raise ValueError(f"unknown comparison {operation!r}: use one of {', '.join(_OPERATIONS)}")
    return _OPERATIONS[operation](_version_key(current), _version_key(reference))


def _is_package_available(import_name: str, distribution_name: str | None = None) -> bool:
    """True when `import_name` is importable and installed (not merely a folder on the path)."""
    if importlib.util.find_spec(import_name) is None:
        return False
    try:
        importlib.metadata.metadata(distribution_name or import_name)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def _installed_version(distribution_name: str) -> str:
    return importlib.metadata.version(distribution_name)


def is_torch_version(operation: str, version: str) -> bool:
    """Compares the running torch's base version (no local or pre-release tag) with `version`.

    Args:
        operation: One of "<", "<=", "==", "!=", ">=", ">".
        version: The reference version, e.g. "2.4" or "2.4.1".

    Raises:
        ValueError: `operation` or `version` is not understood.

    >>> is_torch_version("<", "1.0")
    False
    """
    base = re.match(r"\d+(?:\.\d+)*", str(torch.__version__))
    assert base is not None, f"torch reports an unparsable version {torch.__version__!r}"
    return _compare_versions(base.group(0), operation, version)


def is_cuda_available() -> bool:
    """Whether a CUDA device is usable, asked through NVML so CUDA is not initialised (fork-safe)."""
    with patch_environment(PYTORCH_NVML_BASED_CUDA_CHECK="1"):
        return torch.cuda.is_available()


def is_mps_available() -> bool:
    """Whether Apple's Metal (MPS) backend is built into torch and usable here."""
    return torch.backends.mps.is_built() and torch.backends.mps.is_available()


def is_npu_available(check_device: bool = False) -> bool:
    """Whether `torch_npu` is installed and, with `check_device`, an Ascend NPU is visible."""
    if not _is_package_available("torch_npu"):
        return False
    if not check_device:
        return True
    import torch_npu  # noqa: F401  (registers torch.npu)

    try:
        return bool(torch.npu.is_available())  # type: ignore[attr-defined]
    except RuntimeError:
        return False


def is_xpu_available(check_device: bool = False) -> bool:
    """Whether torch can use an Intel XPU and, with `check_device`, one is counted."""
    if not hasattr(torch, "xpu"):
        return False
    try:
        return torch.xpu.is_available() and (not check_device or torch.xpu.device_count() > 0)
    except RuntimeError:
        return False


def is_torch_xla_available(check_is_tpu: bool = False, check_is_gpu: bool = False) -> bool:
    """Whether `torch_xla` is installed (and not disabled by `USE_TORCH_XLA=0`).

    Args:
        check_is_tpu: Also require the XLA device to be a TPU.
        check_is_gpu: Also require the XLA device to be a GPU.

    Raises:
        ValueError: Both checks are asked for.
    """
    if check_is_tpu and check_is_gpu:
        raise ValueError("check_is_tpu and check_is_gpu cannot both be True: ask for one device kind")
    if not (parse_flag_from_env("USE_TORCH_XLA", default=True) and _is_package_available("torch_xla")):
        return False
    if not (check_is_tpu or check_is_gpu):
        return True
    import torch_xla.runtime

    device_type = torch_xla.runtime.device_type()
    return device_type == "TPU" if check_is_tpu else device_type in ("GPU", "CUDA")


def is_tpu_available(check_device: bool = True) -> bool:
    """Whether `torch_xla` is installed and, with `check_device`, its device is a TPU."""
    return is_torch_xla_available(check_is_tpu=check_device)


def is_bf16_available(ignore_tpu: bool = False) -> bool:
    """Whether bf16 is supported by the device torch would use; on a TPU, `not ignore_tpu`."""
    if is_torch_xla_available(check_is_tpu=True):
        return not ignore_tpu
    if is_cuda_available():
        return bool(torch.cuda.is_bf16_supported())
    if is_xpu_available():
        return torch.xpu.is_bf16_supported()
    if is_mps_available():
        return torch.backends.mps.is_macos_or_newer(14, 0)
    return True


def is_ipex_available() -> bool:
    """Whether Intel Extension for PyTorch is installed for this torch's major.minor version."""
    if not _is_package_available("intel_extension_for_pytorch"):
        return False
    ipex = _version_key(_installed_version("intel_extension_for_pytorch"))[0]
    here = _version_key(re.sub(r"\+.*", "", str(torch.__version__)))[0]
    return ((*ipex, 0))[:2] == ((*here, 0))[:2]


def is_numpy_available() -> bool:
    """Whether numpy is installed."""
    return _is_package_available("numpy")


def is_tensorboard_available() -> bool:
    """Whether tensorboard or tensorboardX is installed."""
    return _is_package_available("tensorboard") or _is_package_available("tensorboardX")


def is_bnb_available(min_version: str | None = None) -> bool:
    """Whether bitsandbytes is installed, at least at `min_version` when given.

    >>> is_bnb_available() in (True, False)
    True
    """
    if not _is_package_available("bitsandbytes"):
        return False
    return min_version is None or _compare_versions(_installed_version("bitsandbytes"), ">=", min_version)


is_bitsandbytes_available = is_bnb_available


def is_deepspeed_available() -> bool:
    """Whether DeepSpeed is installed."""
    return _is_package_available("deepspeed")


def is_transformer_engine_available() -> bool:
    """Whether NVIDIA TransformerEngine is installed."""
    return _is_package_available("transformer_engine", "transformer-engine")


def is_msamp_available() -> bool:
    """Whether Microsoft's MS-AMP is installed."""
    return _is_package_available("msamp", "ms-amp")


def is_torchao_available() -> bool:
    """Whether torchao 0.6.1 or newer (the first with a usable FP8 API) is installed."""
    if not _is_package_available("torchao"):
        return False
    return _compare_versions(_installed_version("torchao"), ">=", "0.6.1")


@contextmanager
def patch_environment(**kwargs: object) -> Iterator[None]:
    """Sets environment variables for the duration of a `with` block.

    Keys are upper-cased and values converted with `str`. On exit, even by an
    exception, each variable gets its prior value back, or is removed if it did
    not exist before.

    Raises:
        ValueError: Two keys differ only by case.

    >>> with patch_environment(fnaccel_doc_var=3):
    ...     os.environ["FNACCEL_DOC_VAR"]
    '3'
    >>> "FNACCEL_DOC_VAR" in os.environ
    False
    """
    values: dict[str, str] = {}
    for key, value in kwargs.items():
        if key.upper() in values:
            raise ValueError(
                f"patch_environment got {key.upper()} twice (keys are upper-cased): pass it once"
            )
        values[key.upper()] = str(value)
    previous = {key: os.environ.get(key) for key in values}
    try:
        os.environ.update(values)
        yield
    finally:
        for key, old in previous.items():
            if old is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = old


@contextmanager
def clear_environment() -> Iterator[None]:
    """Empties `os.environ` for the duration of a `with` block, then restores it exactly.

    Restoration happens even on an exception; changes made inside are discarded.

    >>> os.environ["FNACCEL_DOC_VAR"] = "bar"
    >>> with clear_environment():
    ...     print(dict(os.environ))
    ...     os.environ["FNACCEL_DOC_VAR"] = "new_bar"
    {}
    >>> os.environ.pop("FNACCEL_DOC_VAR")
    'bar'
    """
    saved = dict(os.environ)
    os.environ.clear()
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def parse_flag_from_env(key: str, default: bool = False) -> bool:
    """Reads the yes/no environment variable `key`; `default` when unset or empty.

    Raises:
        ValueError: The variable holds something other than a yes/no value.

    >>> parse_flag_from_env("FNACCEL_SURELY_UNSET", default=True)
    True
    """
    value = os.environ.get(key, "")
    if not value.strip():
        return default
    try:
        return str_to_bool(value, to_bool=True)
    except ValueError as error:
        raise ValueError(f"environment variable {key}={value!r} is not a flag: {error}") from None


MIN_KERNEL_VERSION = (5, 5, 0)  # older Linux kernels can hang a distributed run (Accelerate's issue #1929)


def check_os_kernel() -> None:
    """Log a warning (logger ``fnaccel.environment``) when this machine runs a Linux kernel
    older than 5.5.0, which can make a process hang; elsewhere, and on newer kernels, nothing.

    Accelerate's name; it logs on its main process only, read from its global state.
    fnaccel has none, so every process that calls this logs.

    >>> check_os_kernel()  # quiet on this machine's kernel
    """
    info = platform.uname()
    found = re.search(r"\d+(?:\.\d+){0,2}", info.release)
    if info.system != "Linux" or found is None:
        return
    version = tuple(int(part) for part in found.group().split("."))
    version += (0,) * (3 - len(version))
    if version < MIN_KERNEL_VERSION:
        minimum = ".".join(map(str, MIN_KERNEL_VERSION))
        # formatted here, not by the logger: handlers and tests that read `record.msg` see the versions
        _LOG.warning(
            f"Detected kernel version {found.group()}, which is below the recommended minimum of {minimum}: "
            f"processes can hang in collectives on it; upgrade the kernel to {minimum} or newer."
        )


_UNSAFE_IN_ENV_LINE = (";", "\n", "<", ">", " ")


def convert_dict_to_env_variables(current_env: Mapping[str, str]) -> list[str]:
    """The items of ``current_env`` as ``"KEY=VALUE\\n"`` lines for an environment file,
    leaving out (with a warning on the logger ``fnaccel.environment``) each item whose key
    or value is empty or holds a character a shell would read (``;``, a newline, ``<``,
    ``>``, a space). Accelerate's name and rule.

    Raises:
        TypeError: a key or value is not a string.

    >>> convert_dict_to_env_variables({"FNACCEL_DEBUG_MODE": "1", "BAD": "<x", "OTHER": "2"})
    ['FNACCEL_DEBUG_MODE=1\\n', 'OTHER=2\\n']
    """
    lines = []
    for key, value in current_env.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise TypeError(
                f"convert_dict_to_env_variables: {key!r}={value!r} is not a str=str item; "
                "environment variables are strings: convert the value with str()"
            )
        if key and value and not any(char in key + value for char in _UNSAFE_IN_ENV_LINE):
            lines.append(f"{key}={value}\n")
        else:
            _LOG.warning(
                "Skipping %s=%s: an empty key or value, or one of ; < > a space or a newline in it",
                key,
                value,
            )
    return lines
