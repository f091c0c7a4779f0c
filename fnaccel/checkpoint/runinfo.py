"""How a run was set up, recorded beside its checkpoint (``run.json``), and drift on resume.

A checkpoint's ``run.json`` (rank 0's, listed and checksummed in the manifest
like every file) holds the pipeline (each transform's name, options and
capabilities), the
precision the model computes in, the accumulation count, and the fnaccel and
torch versions that wrote it; ``config.yaml`` holds the resolved launch
config.

`resume_drift` compares them with the run that loads: each difference is
named (``pipeline/clip_grad_norm/max_norm: 1.0 -> 0.5``). `fa.load` warns once
with all of them (`ResumeDriftWarning`), and refuses those that make an exact
resume impossible unless given ``strict=False``:

- another accumulation count (``accumulate(k)``): the saved step and
  micro-step counters and the gradient window mean something else;
- state saved for a transform this run lacks (a grad scaler's, going from
  fp16 to bf16): with ``strict=False`` that state is dropped.

Everything else (precision, clipping, the ``ddp``/``fsdp`` options, the
launch config) changes what the run does from here on, not what it resumes
from: a warning, not an error.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fnaccel._errors import CheckpointError
from fnaccel.checkpoint.storage.files import read_json, read_verified
from fnaccel.constants import PrecisionType

if TYPE_CHECKING:
    from fnaccel.state import RunState

__all__ = ["RUN_FILE", "Drift", "ResumeDriftWarning", "describe_run", "resume_drift", "saved_config"]

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
    saved: Any
    now: Any
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
