"""What a checkpoint says about itself: its manifest (``fnaccel.json``), how the run
that wrote it was set up (``run.json``, ``config.yaml``), drift on resume, and what a
save may replace.

The manifest is the one file a load trusts first, so it is read bounded
(`MAX_MANIFEST_BYTES`), its schema version compared with the one this build
reads (`SCHEMA_VERSION`: an older or newer checkpoint is refused, naming both),
checked against its own sha256, and then every field against `_FIELDS` (types
and ranges; file names that stay inside the checkpoint; each file's blocksum
and size) before anything it says is used. Each failure is a
`CheckpointError` naming the file and the key.

A checkpoint's ``run.json`` (rank 0's, listed and checksummed in the manifest
like every file) holds the pipeline (each transform's name, options and
capabilities), the precision the model computes in, the accumulation count,
and the fnaccel and torch versions that wrote it; ``config.yaml`` holds the
resolved launch config. `resume_drift` compares them with the run that
loads: each difference is named (``pipeline/clip_grad_norm/max_norm: 1.0 ->
0.5``). `fa.load` warns once with all of them (`ResumeDriftWarning`), and
refuses those that make an exact resume impossible unless given
``strict=False``:

- another accumulation count (``accumulate(k)``): the saved step and
  micro-step counters and the gradient window mean something else;
- state saved for a transform this run lacks (a grad scaler's, going from
  fp16 to bf16): with ``strict=False`` that state is dropped.

Everything else (precision, clipping, the ``ddp``/``fsdp`` options, the
launch config) changes what the run does from here on, not what it resumes
from: a warning, not an error.

`target_problem` says whether a save may replace what is at its path: nothing,
an empty directory, or an fnaccel checkpoint holding only the files its
manifest lists. Anything else (a user's directory, a regular file) is refused:
a save never deletes a file that fnaccel did not write."""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from fnaccel._errors import CheckpointError
from fnaccel.checkpoint.storage.files import (
    CHECKSUM,
    CHECKSUM_PATTERN,
    LEFTOVER_MARKER,
    NAME_MAX,
    read_bounded,
    read_json,
    read_verified,
    safe_relative,
)
from fnaccel.constants import PrecisionType

if TYPE_CHECKING:
    from fnaccel.state import RunState

__all__ = [
    "describe_run",
    "Drift",
    "FORMAT",
    "MANIFEST",
    "manifest_hash",
    "MAX_MANIFEST_BYTES",
    "read_manifest",
    "resume_drift",
    "ResumeDriftWarning",
    "RUN_FILE",
    "saved_config",
    "SCHEMA_VERSION",
    "target_problem",
]


MANIFEST = "fnaccel.json"
# The one schema this build writes and reads. Raise it with any change to what a checkpoint holds
# or how (a reader for an older one is written when a user holds such checkpoints, not before).
# 5: files checked by blocksum ({"blocksum": ..., "size": ...}); run.json; registered objects keep
#    their types in extras.json (extras.py); the data position in rank<r>.json.
# 6: "finite": false when a save with allow_nonfinite=True wrote NaN or inf (finite.py).
SCHEMA_VERSION = 6
FORMAT = "fnaccel-checkpoint"
MAX_MANIFEST_BYTES = 64 * 2**20  # a manifest lists files: even 10,000 ranks stay far below this
_SHA256 = re.compile(r"[0-9a-f]{64}")


def manifest_hash(manifest: dict[str, Any]) -> str:
    """The manifest's sha256 over its own content (so a flipped digit in a counter shows)."""
    body = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def _count(value: object) -> bool:
    return type(value) is int and value >= 0  # JSON's integers: a bool is not one


def _files(value: object) -> bool:
    if not isinstance(value, dict):
        return False
    for name, entry in value.items():
        safe_relative(name, f"{MANIFEST}: key 'files'")
        if not (
            isinstance(entry, dict)
            and set(entry) == {CHECKSUM, "size"}
            and _count(entry["size"])
            and isinstance(entry[CHECKSUM], str)
            and CHECKSUM_PATTERN.fullmatch(entry[CHECKSUM])
        ):
            return False
    return True


# every key of a manifest, what it must be, and the test
_FIELDS: Mapping[str, tuple[str, Callable[[object], bool]]] = MappingProxyType(
    {
        "format": (repr(FORMAT), lambda v: v == FORMAT),
        "schema_version": (str(SCHEMA_VERSION), lambda v: type(v) is int and v == SCHEMA_VERSION),
        "num_processes": ("an integer >= 1", lambda v: type(v) is int and v >= 1),
        "step": ("an integer >= 0", _count),
        "micro_step": ("an integer >= 0", _count),
        "epoch": ("an integer >= 0", _count),
        "seed": ("an integer or null", lambda v: v is None or type(v) is int),
        "pipeline": ("a string", lambda v: isinstance(v, str)),
        "finite": ("true or false", lambda v: type(v) is bool),
        "tied": (
            "an object of parameter names to parameter names",
            lambda v: isinstance(v, dict) and all(isinstance(x, str) for x in (*v, *v.values())),
        ),
        "files": ('an object of relative file names to {"blocksum": 64 hex digits, "size": bytes}', _files),
        "manifest_sha256": ("64 hex digits", lambda v: isinstance(v, str) and bool(_SHA256.fullmatch(v))),
    }
)


def read_manifest(directory: Path) -> dict[str, Any]:
    """A checkpoint's ``fnaccel.json``, checked: a regular file of bounded size, JSON,
    fnaccel's format, the schema version this build reads, its own sha256, then every field.

    Raises:
        CheckpointError: naming the file (and the key) and what is wrong with it; a
            checkpoint of another schema version names its version and this build's.
    """
    path = directory / MANIFEST
    if not os.path.lexists(path):
        hint = " (it is not a directory)" if directory.exists() and not directory.is_dir() else ""
        raise CheckpointError(f"{directory}: not a complete fnaccel checkpoint: {MANIFEST} is missing{hint}")
    data = read_bounded(directory, MANIFEST, limit=MAX_MANIFEST_BYTES)
    try:
        manifest = json.loads(data)
    except (ValueError, RecursionError):
        raise CheckpointError(f"{path}: corrupt (not valid JSON)") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not an fnaccel checkpoint manifest")
    version = manifest.get("schema_version")
    if type(version) is not int or version != SCHEMA_VERSION:
        age = ("older than" if version < SCHEMA_VERSION else "newer than") if type(version) is int else "not"
        raise CheckpointError(
            f"{path}: checkpoint schema version {version!r} is {age} the one this fnaccel reads "
            f"(schema version {SCHEMA_VERSION}); load it with the fnaccel that wrote it"
        )
    if manifest.get("manifest_sha256") != manifest_hash(manifest):
        raise CheckpointError(f"{path}: corrupt (its content does not match its own sha256)")
    unknown = sorted(set(manifest) - set(_FIELDS))
    if unknown:
        raise CheckpointError(
            f"{path}: key {unknown[0]!r} is not part of schema version {manifest['schema_version']}"
        )
    for key, (what, ok) in _FIELDS.items():
        if key not in manifest:
            raise CheckpointError(f"{path}: key {key!r} is missing")
        if not ok(manifest[key]):
            raise CheckpointError(f"{path}: key {key!r} must be {what}, not {_short(manifest[key])}")
    return manifest


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _foreign(directory: Path, listed: set[str]) -> list[str]:
    """What is inside ``directory`` that its manifest does not list (relative names);
    fnaccel's own leftover mark (a crash while the checkpoint was committed or deleted) is not."""
    known = listed | {MANIFEST, LEFTOVER_MARKER}
    folders = {"/".join(name.split("/")[:i]) for name in known for i in range(1, name.count("/") + 1)}
    out: list[str] = []
    for root, dirs, files in os.walk(directory):
        base = Path(root).relative_to(directory)
        for name in list(dirs):
            relative = (base / name).as_posix()
            if relative not in folders or os.path.islink(Path(root) / name):
                out.append(relative + "/")
                dirs.remove(name)
        out.extend(relative for name in files if (relative := (base / name).as_posix()) not in known)
    return sorted(out)


def target_problem(final: Path) -> str | None:
    """Why a save may not replace what is at ``final``, or None when it may.

    A save may create ``final``, fill an empty directory, or replace an fnaccel
    checkpoint that holds only the files its manifest lists, in a directory
    this process may write in (the one the save creates its temporary sibling
    in, or the nearest one above that exists).
    """
    size = len(os.fsencode(final.name))
    if size > NAME_MAX:
        return (
            f"{final}: its name is {size} bytes, more than the {NAME_MAX} a file name may have; "
            "choose a shorter name"
        )
    if not os.path.lexists(final):
        above = next((p for p in final.parents if os.path.lexists(p)), None)
        if above is not None and not above.is_dir():
            return (
                f"{final}: {above} is a file, not a directory a checkpoint can be written in; "
                "choose another path"
            )
        return None if above is None else _unwritable(final, above)
    problem = _replaceable(final)
    return problem if problem is not None else _unwritable(final, final.parent)


def _unwritable(final: Path, directory: Path) -> str | None:
    """Why this process may not create entries in ``directory`` (as root too: a read-only
    file system or the immutable attribute), or None."""
    if os.access(directory, os.W_OK | os.X_OK):
        return None
    try:
        read_only = bool(os.statvfs(directory).f_flag & os.ST_RDONLY)
    except OSError:  # gone since: the save's own mkdir will say so
        return None
    why = (
        "on a read-only file system"
        if read_only
        else "not writable by this process (its permissions or its immutable attribute)"
    )
    return (
        f"{final}: cannot be written: {directory} is {why}; nothing was written; save to a directory "
        "this process may write in"
    )


def _replaceable(final: Path) -> str | None:
    """Why a save may not replace what exists at ``final``, or None."""
    if not final.is_dir():
        return (
            f"{final} is a file, not a checkpoint directory; fa.save writes a directory there and "
            "never deletes a file it did not write: choose another path"
        )
    entries = sorted(os.listdir(final))
    if not entries:
        return None
    refuse = (
        f"{final} is a directory that is not an fnaccel checkpoint; a save replaces the whole "
        "directory and never deletes files it did not write: save to a new or empty directory "
        f"(e.g. a subdirectory such as {final / 'checkpoint'})"
    )
    if MANIFEST not in entries:
        return f"{refuse} (it holds {entries[:5]})"
    try:
        listed = set(read_manifest(final)["files"])
    except CheckpointError as exc:
        return f"{refuse} ({exc})"
    foreign = _foreign(final, listed)
    if foreign:
        return (
            f"{final} is an fnaccel checkpoint that also holds files it did not write ({foreign[:5]}); "
            "a save would replace the directory and lose them: move them out, or save elsewhere"
        )
    return None


RUN_FILE = "run.json"
# where a machine is, not how it trains (differs between the machines and launches of one run),
# and the world's size, which fa.load itself checks (another size is resharded or refused there)
_NOT_COMPARED = frozenset(
    {"machine_rank", "main_process_ip", "main_process_port", "num_processes", "num_machines"}
)


class ResumeDriftWarning(UserWarning):
    """`fa.load` resumed a checkpoint into a run set up differently (named in the message)."""


@functools.cache  # the installed fnaccel does not change under a run; reading it costs 0.27 ms a save
def _version() -> str:
    try:
        return metadata.version("fnaccel")
    except metadata.PackageNotFoundError:
        return "unknown"


def describe_run(state: RunState) -> dict[str, Any]:
    """What ``run.json`` records for ``state``: plain JSON (options as their ``repr``).

    >>> import fnaccel as fa
    >>> run = describe_run(fa.prepare(fa.init(cpu=True), pipeline=fa.compose(fa.accumulate(2))))
    >>> run["pipeline"], run["precision"], run["micro_steps"]
    ([{'name': 'accumulate', 'options': {'num_steps': '2'}, 'capabilities': []}], 'fp32', 2)
    """
    import torch  # here, not at the top: reading run.json (`fnaccel checkpoint inspect`) needs no torch

    return {**_setup(state), "fnaccel_version": _version(), "torch_version": str(torch.__version__)}


def _setup(state: RunState) -> dict[str, Any]:
    """The part of `describe_run` a load compares (the versions are only recorded)."""
    held = () if state.pipeline is None else state.pipeline.transforms
    transforms = [t for t in held if hasattr(t, "capabilities")]  # fa.prepare refuses collectives
    pipeline = [
        {
            "name": t.name,
            "options": {key: repr(value) for key, value in t.options},
            "capabilities": sorted(c.name for c in t.capabilities),
        }
        for t in transforms
    ]
    # the precision a transform declares in its settings record (`Precision`: autocast's)
    cast = next(
        (t.settings for t in transforms if isinstance(getattr(t.settings, "precision", None), PrecisionType)),
        None,
    )
    precision = "fp32" if cast is None or cast.precision is PrecisionType.NO else cast.precision.value
    return {
        "pipeline": pipeline,
        "precision": precision,
        "mixed_precision": str(getattr(state.mixed_precision, "value", state.mixed_precision)),
        "micro_steps": 1 if state.plan is None else int(state.plan.micro_steps),
    }


@dataclass(frozen=True, slots=True, kw_only=True)
class Drift:
    """One way the loading run differs from the saved one."""

    item: str  # e.g. "pipeline/accumulate/steps", "precision", "config/mixed_precision"
    saved: object
    now: object
    exact: bool  # False: the run cannot resume exactly (refused unless strict=False)

    def __str__(self) -> str:
        return f"{self.item}: {self.saved!r} -> {self.now!r}"


def _pipeline_drift(saved: list[dict[str, Any]], now: list[dict[str, Any]]) -> list[Drift]:
    before = {t["name"]: t["options"] for t in saved}
    after = {t["name"]: t["options"] for t in now}
    out = []
    for name in [*before, *(n for n in after if n not in before)]:
        if name not in after:
            out.append(Drift(item=f"pipeline/{name}", saved="present", now="absent", exact=True))
        elif name not in before:
            out.append(Drift(item=f"pipeline/{name}", saved="absent", now="present", exact=True))
        else:
            for key in sorted({*before[name], *after[name]}):
                a, b = before[name].get(key, "(default)"), after[name].get(key, "(default)")
                if a != b:
                    out.append(Drift(item=f"pipeline/{name}/{key}", saved=a, now=b, exact=True))
    if not out and [t["name"] for t in saved] != [t["name"] for t in now]:
        out.append(
            Drift(
                item="pipeline/order",
                saved=[t["name"] for t in saved],
                now=[t["name"] for t in now],
                exact=True,
            )
        )
    return out


def _averages_gradients(entry: dict[str, Any]) -> bool:
    """Whether a recorded transform declared `Capability.AVERAGES_GRADIENTS`."""
    recorded = entry.get("capabilities")
    return isinstance(recorded, list) and "AVERAGES_GRADIENTS" in recorded


def saved_config(directory: Path, manifest: dict[str, Any]) -> dict[str, Any]:
    """The checkpoint's ``config.yaml`` (verified), as a mapping."""
    import yaml

    data = read_verified(directory, "config.yaml", manifest)
    try:  # libyaml's parser where PyYAML has it: the same documents, 5x faster
        config = yaml.load(data, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    except (yaml.YAMLError, RecursionError):
        raise CheckpointError(f"{directory / 'config.yaml'}: not valid YAML (or nested too deeply)") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{directory / 'config.yaml'}: must hold a mapping of config keys")
    return config


def resume_drift(state: RunState, directory: Path, manifest: dict[str, Any]) -> list[Drift]:
    """Every difference between the run that saved ``directory`` and ``state``, which loads it."""
    now = _setup(state)
    out: list[Drift] = []
    saved = read_json(directory, RUN_FILE, manifest)
    if (
        not isinstance(saved, dict)
        or not isinstance(saved.get("pipeline"), list)
        or not all(
            isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("options"), dict)
            for t in saved["pipeline"]
        )
    ):
        raise CheckpointError(
            f"{directory / RUN_FILE}: key 'pipeline' must be a list of {{'name': ..., 'options': {{...}}}}"
        )
    drift = _pipeline_drift(saved["pipeline"], now["pipeline"])
    if manifest["num_processes"] != state.dist.num_processes:
        # another number of processes: fa.load reshards between data-parallel layouts (ddp, fsdp,
        # a world of one), so a data-parallel transform present on one side only is expected
        data_parallel = {
            f"pipeline/{t['name']}" for t in [*saved["pipeline"], *now["pipeline"]] if _averages_gradients(t)
        }
        drift = [d for d in drift if d.item not in data_parallel]
    out += drift
    for key in ("precision", "mixed_precision", "micro_steps"):
        if saved.get(key) != now[key]:
            out.append(Drift(item=key, saved=saved.get(key), now=now[key], exact=key != "micro_steps"))
    config, live = saved_config(directory, manifest), state.config.to_dict()
    for key in sorted({*config, *live} - _NOT_COMPARED):
        a, b = config.get(key), live.get(key)
        if json.dumps(a, sort_keys=True, default=str) != json.dumps(b, sort_keys=True, default=str):
            out.append(Drift(item=f"config/{key}", saved=a, now=b, exact=True))
    return out
