"""``fnaccel estimate-memory``: the memory a model needs, from its shapes alone.

The model is built on the meta device (`init_empty_weights`) or described by
the headers of its safetensors files, so nothing is allocated or downloaded:

- ``package.module:function``: a factory returning an ``nn.Module``, called
  with no arguments under `init_empty_weights`;
- a ``.safetensors`` file, a shard index (``model.safetensors.index.json``) or
  a directory holding either: only the headers (names, shapes, dtypes) are read;
- a transformers ``config.json`` (or a directory holding one, without
  safetensors): built with ``AutoModel.from_config``, which needs transformers;
- a timm model name with ``--library_name timm``, which needs timm.

Hub names need network access, which this command never uses.

The table follows ``accelerate estimate-memory``: per dtype, the largest layer
(or residual block, which is loaded whole), the total, and the peak of
training with Adam as Accelerate estimates it (float32: weights, gradients and
two Adam states, 4x the float32 size; float16 mixed precision: 2x the float32
size; int8 and int4 are not trained with Adam: N/A).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import re
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from types import MappingProxyType

import torch
from torch import nn

from fnaccel.checkpoint.storage.weightfiles import index_files, read_dtypes_and_shapes
from fnaccel.commands.main import CommandError, Subcommands
from fnaccel.modeling.empty import init_empty_weights
from fnaccel.modeling.sizes import compute_module_sizes, largest_layer, named_module_tensors

__all__ = ["create_empty_model", "register", "run"]

DTYPES = ("float32", "float16", "int8", "int4")
HEADERS = ("dtype", "Largest Layer or Residual Group", "Total Size", "Training using Adam (Peak vRAM)")
_AS: Mapping[str, str | torch.dtype] = MappingProxyType(
    {"float32": torch.float32, "float16": torch.float16, "int8": torch.int8, "int4": "int4"}
)
# Peak of Adam training, in float32 model sizes (Accelerate's estimate_training_usage).
_ADAM_PEAK = MappingProxyType({"float32": 4, "float16": 2})
_FACTORY = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*")


def register(subparsers: Subcommands) -> None:
    """Add ``fnaccel estimate-memory`` to the command line."""
    parser = subparsers.add_parser(
        "estimate-memory",
        help="Estimate the memory a model needs to load and to train, without loading it.",
        description="Estimate the memory needed to load a model, and to train it with Adam, from its "
        "shapes alone. Works offline on local models: a factory 'package.module:function', "
        "safetensors files (headers only) or a transformers config.json.",
    )
    parser.add_argument(
        "model_name",
        help="A factory 'package.module:function', a .safetensors file, a shard "
        "index, a directory of safetensors, or a config.json.",
    )
    parser.add_argument(
        "--library_name",
        choices=["timm", "transformers"],
        default=None,
        help="The library that builds the model, when the path does not say it.",
    )
    parser.add_argument(
        "--dtypes",
        nargs="+",
        choices=DTYPES,
        default=list(DTYPES),
        help="The dtypes to estimate for (default: all four).",
    )
    parser.add_argument(
        "--trust_remote_code",
        action="store_true",
        help="Let a transformers config run the modelling code it points to. Only for code "
        "you have read and trust.",
    )
    parser.set_defaults(handler=run, command_name="estimate-memory")


def run(args: argparse.Namespace) -> int:
    """Build the empty model and print the table."""
    model = create_empty_model(args.model_name, args.library_name, args.trust_remote_code)
    rows = _rows(model, args.dtypes)
    print(box_table(HEADERS, rows, f"Memory Usage for loading `{args.model_name}`"))
    return 0


def create_empty_model(
    model_name: str, library_name: str | None = None, trust_remote_code: bool = False
) -> nn.Module:
    """The model named by ``model_name`` on the meta device (see the module's docstring for the forms).

    Raises:
        CommandError: the model cannot be found or built locally; the message says why.
        CheckpointError: an unreadable safetensors file or shard index.
    """
    path = Path(model_name)
    if path.exists():
        return _local_model(path, library_name, trust_remote_code)
    if library_name == "timm":
        return _timm_model(model_name)
    if _FACTORY.fullmatch(model_name):
        return _factory_model(model_name)
    raise CommandError(
        f"{model_name!r} is neither a local path nor a factory 'package.module:function'. "
        "estimate-memory works offline, on local models only: pass a factory, a .safetensors file, "
        "a shard index or a directory of safetensors, or a transformers config.json "
        "(reading a model from the Hugging Face Hub needs network access, which this command does not use)"
    )


def _local_model(path: Path, library_name: str | None, trust_remote_code: bool) -> nn.Module:
    if path.is_dir():
        indexes = sorted(path.glob("*.safetensors.index.json"))
        files = sorted(path.glob("*.safetensors"))
        if (path / "config.json").is_file() and (library_name == "transformers" or not files):
            return _transformers_model(path, trust_remote_code)
        if len(indexes) == 1:
            return _header_model([file for file, _ in index_files(indexes[0])])
        if files:
            return _header_model(files)
        raise CommandError(f"{path} holds no *.safetensors file and no config.json: nothing to estimate")
    if path.suffix == ".safetensors":
        return _header_model([path])
    if path.suffix == ".json":
        data = _read_json(path)
        if "weight_map" in data:
            return _header_model([file for file, _ in index_files(path)])
        return _transformers_model(path, trust_remote_code)
    raise CommandError(f"{path} is not a .safetensors file, a shard index or a config.json")


def _read_json(path: Path) -> dict[str, object]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise CommandError(f"{path} is not readable JSON: {exc}") from None
    if not isinstance(data, dict):
        raise CommandError(f"{path} is not a shard index or a config: it holds no JSON object")
    return data


class _Block(nn.Module):
    """A numbered module (``layers.3``) of a header-only model: a residual block, kept whole."""


def _header_model(files: Sequence[Path]) -> nn.Module:
    """A meta-device model with one parameter per tensor of ``files``, in modules named as the tensors are."""
    root = nn.Module()
    for file in files:
        for name, (dtype, shape) in read_dtypes_and_shapes(file).items():
            *path, leaf = name.split(".")
            module = root
            for part in path:
                if part in module._parameters:
                    raise CommandError(f"{file} names {name!r} inside another tensor: not a model's weights")
                # the dicts directly: tensor names may clash with nn.Module attributes ("training")
                child = module._modules.get(part)
                if child is None:
                    child = module._modules[part] = _Block() if part.isdigit() else nn.Module()
                module = child
            if leaf in module._modules or leaf in module._parameters:
                raise CommandError(f"{file} names {name!r} twice, or as a tensor and a module")
            module._parameters[leaf] = nn.Parameter(
                torch.empty(shape, dtype=dtype, device="meta"), requires_grad=False
            )
    setattr(root, "_no_split_modules", ["_Block"])  # the transformers attribute that names such classes
    return root


@contextlib.contextmanager
def _cwd_importable() -> Iterator[None]:
    """The current directory on ``sys.path`` (the console script does not put it there)."""
    cwd = os.getcwd()
    added = cwd not in sys.path and "" not in sys.path
    if added:
        sys.path.insert(0, cwd)
    try:
        yield
    finally:
        if added and cwd in sys.path:
            sys.path.remove(cwd)


def _factory_model(spec: str) -> nn.Module:
    module_name, _, attr = spec.partition(":")
    with _cwd_importable():
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            raise CommandError(f"cannot import {module_name!r} for the factory {spec!r}: {exc}") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise CommandError(f"{module_name!r} has no function {attr!r}: pass 'package.module:function'")
    with init_empty_weights():
        model = factory()
    if not isinstance(model, nn.Module):
        raise CommandError(f"the factory {spec!r} returned a {type(model).__name__}, not an nn.Module")
    return model


def _transformers_model(path: Path, trust_remote_code: bool) -> nn.Module:
    try:
        import transformers
    except ImportError:
        raise CommandError(
            f"{path} is a transformers config: building the model from it needs transformers "
            "(pip install transformers), or pass the model's safetensors files, which need nothing more"
        ) from None
    try:
        config = transformers.AutoConfig.from_pretrained(str(path), trust_remote_code=trust_remote_code)
        with init_empty_weights():
            model: nn.Module = transformers.AutoModel.from_config(config, trust_remote_code=trust_remote_code)
        return model
    except (OSError, ValueError, KeyError) as exc:
        raise CommandError(f"transformers cannot build a model from {path}: {exc}") from None


def _timm_model(name: str) -> nn.Module:
    try:
        import timm
    except ImportError:
        raise CommandError(f"--library_name timm needs timm to build {name!r}: pip install timm") from None
    try:
        with init_empty_weights():
            model: nn.Module = timm.create_model(name, pretrained=False)
        return model
    except RuntimeError as exc:
        raise CommandError(f"timm cannot build {name!r}: {exc}") from None


def _sizes_as(model: nn.Module, dtype: str) -> tuple[int, int]:
    """``(largest layer, total)`` in bytes with every floating-point tensor stored as ``dtype``."""
    floats = {
        name: _AS[dtype]
        for name, tensor in named_module_tensors(model, recurse=True)
        if tensor.is_floating_point()
    }
    sizes = compute_module_sizes(model, special_dtypes=floats)
    return largest_layer(model, sizes)[0], sizes[""]


def _rows(model: nn.Module, dtypes: Sequence[str]) -> list[tuple[str, str, str, str]]:
    float32_total = _sizes_as(model, "float32")[1]
    rows = []
    for dtype in dtypes:
        largest, total = _sizes_as(model, dtype)
        peak = _ADAM_PEAK.get(dtype)
        training = "N/A" if peak is None else human_size(peak * float32_total)
        rows.append((dtype, human_size(largest), human_size(total), training))
    return rows


def human_size(size: float) -> str:
    """``size`` bytes in the largest unit (of 1024) under which it stays at least 1."""
    if size < 1024:
        return f"{int(size)} bytes"
    for unit in ("KB", "MB", "GB", "TB"):
        size /= 1024
        if size < 1024:
            return f"{size:.2f} {unit}"
    return f"{size / 1024:.2f} PB"


def box_table(headers: Sequence[str], rows: Sequence[Sequence[str]], title: str) -> str:
    """A box-drawn table, centred cells, the title across the top (Accelerate's layout)."""
    widths = [max(len(cell) for cell in column) + 2 for column in zip(headers, *rows, strict=True)]
    inner = sum(widths) + len(widths) - 1
    if len(title) + 2 > inner:
        widths[-1] += len(title) + 2 - inner
        inner = len(title) + 2

    def line(left: str, middle: str, right: str) -> str:
        return left + middle.join("─" * width for width in widths) + right

    def cells(values: Sequence[str]) -> str:
        return "│" + "│".join(value.center(width) for value, width in zip(values, widths, strict=True)) + "│"

    return "\n".join(
        [
            "┌" + "─" * inner + "┐",
            "│" + title.center(inner) + "│",
            line("├", "┬", "┤"),
            cells(headers),
            line("├", "┼", "┤"),
            *(cells(row) for row in rows),
            line("└", "┴", "┘"),
        ]
    )
