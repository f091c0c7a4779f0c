"""What a checkpoint holds, read from its manifest and headers alone, and whether it is intact.

`summarize` answers `fnaccel checkpoint inspect`: counters, data position,
world size and layout, pipeline, precision, the model's size by dtype and by
top-level module, files and sizes, versions. It reads the manifest, the small
JSON files, the safetensors *headers* (`fnaccel.checkpoint.headers`) and a
sharded checkpoint's index (`fnaccel.checkpoint.storage.shardindex`), never a tensor,
so it costs the same for 6 MB and 600 GB; and it imports no torch, so a new
``fnaccel checkpoint inspect`` process answers in a fraction of a second
(`tests/commands/test_checkpoint_command.py` checks that torch stays out).

`verify` answers `fnaccel checkpoint verify`: every file the manifest lists,
read through the same verified readers a load uses (size checked before a
byte is read and checksummed; safetensors headers and JSON parsed), so it
runs at the speed of a load's reads and names the first bad file.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from fnaccel._errors import CheckpointError
from fnaccel.checkpoint.headers import TensorFile
from fnaccel.checkpoint.manifest import RUN_FILE, read_manifest, saved_config
from fnaccel.checkpoint.storage.files import ITEMSIZES, read_json, read_tensors, verify_file
from fnaccel.checkpoint.storage.shardindex import METADATA, read_index

__all__ = ["CheckpointSummary", "summarize", "verify"]


@dataclass(frozen=True, slots=True, kw_only=True)
class CheckpointSummary:
    """One checkpoint at a glance; ``str()`` is the screen, `to_dict` the ``--json``."""

    path: str
    step: int
    micro_step: int
    epoch: int
    num_batches: int | None  # into the epoch (rank 0's position)
    num_processes: int
    layout: str
    pipeline: str
    precision: str
    micro_steps: int | None
    fnaccel_version: str
    torch_version: str
    parameters: int
    bytes_by_dtype: dict[str, int] = field(default_factory=dict)
    parameters_by_dtype: dict[str, int] = field(default_factory=dict)
    parameters_by_module: dict[str, int] = field(default_factory=dict)
    files: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def __str__(self) -> str:
        position = "?" if self.num_batches is None else str(self.num_batches)
        lines = [
            f"checkpoint   {self.path}",
            f"step         {self.step} (micro step {self.micro_step}), epoch {self.epoch}, "
            f"{position} batches into it",
            f"world        {self.num_processes} process(es), {self.layout}",
            f"pipeline     {self.pipeline}",
            f"precision    {self.precision}, "
            f"{'?' if self.micro_steps is None else self.micro_steps} micro-step(s) per update",
            f"model        {self.parameters:,} parameters: "
            + ", ".join(
                f"{dtype} {n:,} ({_size(self.bytes_by_dtype[dtype])})"
                for dtype, n in self.parameters_by_dtype.items()
            ),
            "by module    " + ", ".join(f"{name} {n:,}" for name, n in self.parameters_by_module.items()),
            f"versions     fnaccel {self.fnaccel_version}, torch {self.torch_version}",
            f"files        {len(self.files)}, {_size(sum(self.files.values()))}:",
            *(f"  {_size(n):>10}  {name}" for name, n in self.files.items()),
        ]
        return "\n".join(lines)


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _model_tensors(directory: Path, manifest: dict[str, Any]) -> dict[str, tuple[str, tuple[int, ...]]]:
    """The model's tensors, ``name -> (dtype, shape)``, from headers or the sharded index."""
    files = manifest["files"]
    if "model.safetensors" in files:
        with TensorFile(directory, "model.safetensors", manifest) as f:
            return {key: (s.dtype, s.shape) for key, s in f.specs.items()}
    if METADATA in files:
        index = read_index(read_json(directory, METADATA, manifest), files, str(directory / METADATA))
        return {
            fqn.removeprefix("model."): (item.dtype, item.size)
            for fqn, item in index.keys.items()
            if fqn.startswith("model.")
        }
    return {}


def summarize(path: str | Path) -> CheckpointSummary:
    """The checkpoint at ``path`` at a glance, without reading a tensor.

    Raises:
        CheckpointError: ``path`` is not a readable checkpoint (the file and key named).

    >>> import fnaccel as fa, torch, tempfile, pathlib
    >>> folder = pathlib.Path(tempfile.mkdtemp()) / "ckpt"
    >>> _ = fa.save(fa.prepare(fa.init(cpu=True), torch.nn.Linear(3, 2)), folder)
    >>> s = summarize(folder)
    >>> s.step, s.parameters, s.parameters_by_dtype, s.precision
    (0, 8, {'float32': 8}, 'fp32')
    """
    directory = Path(path).absolute()
    manifest = read_manifest(directory)
    files = manifest["files"]
    run = read_json(directory, RUN_FILE, manifest)
    run = run if isinstance(run, dict) else {}
    own = read_json(directory, "rank0.json", manifest) if "rank0.json" in files else {}
    data = own.get("data") if isinstance(own, dict) else None
    num_batches = data.get("num_batches") if isinstance(data, dict) else None
    tensors = _model_tensors(directory, manifest)
    by_dtype: dict[str, int] = {}
    bytes_by_dtype: dict[str, int] = {}
    by_module: dict[str, int] = {}
    for name, (dtype, shape) in tensors.items():
        count = math.prod(shape)
        by_dtype[dtype] = by_dtype.get(dtype, 0) + count
        bytes_by_dtype[dtype] = bytes_by_dtype.get(dtype, 0) + count * ITEMSIZES[dtype]
        top = name.split(".", 1)[0]
        by_module[top] = by_module.get(top, 0) + count
    pipeline = run.get("pipeline")
    if isinstance(pipeline, list):
        text = (
            "compose("
            + ", ".join(
                f"{t.get('name')}({', '.join(f'{k}={v}' for k, v in (t.get('options') or {}).items())})"
                for t in pipeline
                if isinstance(t, dict)
            )
            + ")"
        )
    else:
        text = manifest["pipeline"]
    layout = (
        "sharded (fsdp(): sharded/rank<r>.safetensors + index)"
        if METADATA in files
        else "one model.safetensors, optimizer.safetensors"
        if "model.safetensors" in files
        else "no model"
    )
    return CheckpointSummary(
        path=str(directory),
        step=manifest["step"],
        micro_step=manifest["micro_step"],
        epoch=manifest["epoch"],
        num_batches=num_batches if isinstance(num_batches, int) else None,
        num_processes=manifest["num_processes"],
        layout=layout,
        pipeline=text,
        precision=str(run.get("precision", "unknown")),
        micro_steps=run.get("micro_steps") if isinstance(run.get("micro_steps"), int) else None,
        fnaccel_version=str(run.get("fnaccel_version", "unknown")),
        torch_version=str(run.get("torch_version", "unknown")),
        parameters=sum(by_dtype.values()),
        bytes_by_dtype=bytes_by_dtype,
        parameters_by_dtype=by_dtype,
        parameters_by_module=by_module,
        files={name: entry["size"] for name, entry in sorted(files.items())},
    )


def verify(path: str | Path, progress: Callable[[str, int], None] | None = None) -> int:
    """Check every file of the checkpoint at ``path`` against its manifest: schema,
    sizes, checksums, safetensors headers, JSON and YAML. Returns the bytes checked.

    Args:
        path: the checkpoint directory.
        progress: called with each file's name and size once it checks out.

    Raises:
        CheckpointError: the first bad file, named (missing, truncated, corrupt, ...).

    >>> import fnaccel as fa, torch, tempfile, pathlib
    >>> folder = pathlib.Path(tempfile.mkdtemp()) / "ckpt"
    >>> _ = fa.save(fa.prepare(fa.init(cpu=True), torch.nn.Linear(3, 2)), folder)
    >>> verify(folder) > 0
    True
    """
    directory = Path(path).absolute()
    manifest = read_manifest(directory)
    files = manifest["files"]
    for name in sorted(files):
        if name.endswith(".safetensors"):
            read_tensors(directory, name, manifest)
        elif name == "config.yaml":
            saved_config(directory, manifest)
        elif name == METADATA:
            read_index(read_json(directory, name, manifest), files, str(directory / name))
        elif name.endswith(".json"):
            read_json(directory, name, manifest)
        else:
            verify_file(directory, name, manifest)
        if progress is not None:
            progress(name, files[name]["size"])
    if not files:
        raise CheckpointError(f"{directory}: the manifest lists no files")
    return sum(entry["size"] for entry in files.values())
