"""Loads trust nothing: edited fields, other kinds and hostile files are refused before anything is restored.

Each edit is re-hashed (the file's blocksum and size in the manifest, the
manifest's own sha256), so the checksums pass and only the schema and the
checks against the live run can catch it.
"""

from __future__ import annotations

import ast
import contextlib
import copy
import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

import fnaccel as fa
from fnaccel.checkpoint.manifest import manifest_hash
from fnaccel.checkpoint.storage.files import Checksum
from tests.checkpoint.test_resume import fresh_run, train

HOSTILE_JOB = Path(__file__).with_name("_hostile_load.py")


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    state, _, _ = fresh_run(fa.init(seed=0, cpu=True), fa.compose(fa.accumulate(2)))
    state, _ = train(state, epochs=1, stop_after=3)  # between micro-steps: gradients saved too
    path = tmp_path_factory.mktemp("hostile") / "ckpt"
    fa.save(state, path)
    return path


@pytest.fixture
def checkpoint(saved: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(saved, tmp_path / "ckpt"))


CHECKPOINT_PACKAGE = Path(fa.__file__).parent / "checkpoint"


# Formats of fnaccel's own, not parts of the run: a manifest entry (the manifest's schema, _FIELDS)
# and the tagged encoding of a registered object's values (decoded, then checked against the live one).
OWN_FORMATS = frozenset({("manifest.py", "_files"), ("extras.py", "_decode")})


def key_set_checks(source: str, file: str = "") -> list[str]:
    """Where a part is held to a hand-written key set (``set(saved) != {"kind", ...}``) instead of
    to its live counterpart (`check_like` against what the live run would save), as
    ``function:line``; `OWN_FORMATS` aside."""
    found = []
    for function in ast.walk(ast.parse(source)):
        if not isinstance(function, ast.FunctionDef) or (file, function.name) in OWN_FORMATS:
            continue
        for node in ast.walk(function):
            if isinstance(node, ast.Compare):
                sides = [node.left, *node.comparators]
                literal = any(isinstance(s, ast.Set) for s in sides)
                keys = any(isinstance(s, ast.Call) and getattr(s.func, "id", "") == "set" for s in sides)
                if literal and keys:
                    found.append(f"{function.name}:{node.lineno}")
    return found


def test_each_part_is_checked_against_its_live_counterpart_not_a_key_set() -> None:
    """Issue 34 point 1: the live tree is the schema; six key-set checks were written out by hand."""
    found = {
        path.name: lines
        for path in sorted(CHECKPOINT_PACKAGE.rglob("*.py"))
        if (lines := key_set_checks(path.read_text(), path.name))
    }
    assert not found, found


@pytest.mark.parametrize(
    "planted",
    [
        'def f(saved):\n    if set(saved) != {"kind", "state_dict"}:\n        raise ValueError\n',
        'def g(own):\n    return {"rng", "data"} == set(own)\n',
        'def _files(entry):\n    return set(entry) == {"size"}\n',  # _files is manifest.py's only
    ],
)
def test_a_planted_key_set_check_is_caught(planted: str) -> None:
    assert key_set_checks(planted)


def _fresh() -> fa.RunState:
    return fresh_run(fa.init(seed=0, cpu=True), fa.compose(fa.accumulate(2)))[0]


def _rehash(checkpoint: Path, edit: Callable[[dict[str, Any]], None] | None = None) -> None:
    """Re-record every file's blocksum and size, apply ``edit`` to the manifest, re-hash it."""
    path = checkpoint / "fnaccel.json"
    manifest = json.loads(path.read_text())
    for name in manifest["files"]:
        data = (checkpoint / name).read_bytes()
        digest = Checksum()
        digest.update(data)
        manifest["files"][name] = {"blocksum": digest.hexdigest(), "size": len(data)}
    if edit is not None:
        edit(manifest)
    manifest["manifest_sha256"] = manifest_hash(manifest)
    path.write_text(json.dumps(manifest))


def _edit_json(checkpoint: Path, name: str, edit: Callable[[Any], None]) -> None:
    value = json.loads((checkpoint / name).read_text())
    edit(value)
    (checkpoint / name).write_text(json.dumps(value))
    _rehash(checkpoint)


def _edit_tensors(checkpoint: Path, name: str, edit: Callable[[dict[str, torch.Tensor]], None]) -> None:
    tensors = load_tensors((checkpoint / name).read_bytes())
    edit(tensors)
    (checkpoint / name).write_bytes(save_tensors(tensors))
    _rehash(checkpoint)


def _refused(checkpoint: Path, match: str, state: fa.RunState | None = None) -> None:
    """The load fails naming ``match``; the state is still fresh and its model untouched."""
    state = state if state is not None else _fresh()
    before = copy.deepcopy(state.model.state_dict())
    grads = [p.grad for p in state.model.parameters()]
    with pytest.raises(fa.CheckpointError, match=match):
        fa.load(state, checkpoint)
    state.check_fresh("the test")  # not spent
    assert all(torch.equal(v, before[k]) for k, v in state.model.state_dict().items())
    assert [p.grad for p in state.model.parameters()] == grads
    assert not state.optimizer.state  # nothing restored into the optimizer either


MANIFEST_EDITS: dict[str, Callable[[dict[str, Any]], None]] = {
    "step": lambda m: m.update(step="abc"),
    "micro_step": lambda m: m.update(micro_step=-1),
    "epoch": lambda m: m.update(epoch=1.5),
    "seed": lambda m: m.update(seed="zero"),
    "num_processes": lambda m: m.update(num_processes=True),
    "pipeline": lambda m: m.update(pipeline=["accumulate"]),
    "tied": lambda m: m.update(tied={"0.weight": 3}),
    "files": lambda m: m["files"].update({"../outside.json": m["files"]["scheduler.json"]}),
    "extra": lambda m: m.update(extra=1),
}


@pytest.mark.parametrize("key", sorted(MANIFEST_EDITS))
def test_every_manifest_field_edited_and_rehashed_is_refused(checkpoint: Path, key: str) -> None:
    _rehash(checkpoint, MANIFEST_EDITS[key])
    _refused(checkpoint, rf"fnaccel.json: key '{key}'")


def test_a_missing_manifest_key_and_bad_file_entries_are_named(checkpoint: Path) -> None:
    _rehash(checkpoint, lambda m: m.pop("epoch"))
    _refused(checkpoint, "fnaccel.json: key 'epoch' is missing")
    _rehash(checkpoint, lambda m: m.update(epoch=0) or m["files"]["config.yaml"].update(size=-1))
    _refused(checkpoint, "fnaccel.json: key 'files' must be")


def _set_scalar(tensors: dict[str, torch.Tensor], key: str, value: torch.Tensor) -> None:
    tensors[key] = value


def _deep_json(checkpoint: Path) -> None:
    (checkpoint / "scheduler.json").write_text("[" * 100_000 + "]" * 100_000)
    _rehash(checkpoint)


FILE_EDITS: dict[str, tuple[str, Callable[[Path], None]]] = {
    "scheduler step": (
        r"scheduler.json: state_dict: key 'last_epoch' must be an integer",
        lambda c: _edit_json(c, "scheduler.json", lambda v: v["state_dict"].update(last_epoch="abc")),
    ),
    "scheduler kind": (
        r"scheduler.json: key 'kind'.*ExponentialLR",
        lambda c: _edit_json(
            c, "scheduler.json", lambda v: v.update(kind="torch.optim.lr_scheduler.ExponentialLR")
        ),
    ),
    "group lr": (
        r"optimizer.json: param_groups/0: key 'lr' must be a number",
        lambda c: _edit_json(c, "optimizer.json", lambda v: v["param_groups"][0].update(lr="fast")),
    ),
    # torch replaces a live group by the saved one: these failed at the first step, after the load
    "group lr missing": (
        r"optimizer.json: param_groups/0: key 'lr' is missing",
        lambda c: _edit_json(c, "optimizer.json", lambda v: v["param_groups"][0].pop("lr")),
    ),
    "group betas length": (
        r"optimizer.json: param_groups/0: key 'betas' holds 1 items",
        lambda c: _edit_json(c, "optimizer.json", lambda v: v["param_groups"][0]["betas"].pop()),
    ),
    "group beta range": (
        r"optimizer.json: param_groups/0: AdamW refuses these settings \(Invalid beta",
        lambda c: _edit_json(c, "optimizer.json", lambda v: v["param_groups"][0].update(betas=[-1.0, 0.999])),
    ),
    "group huge eps": (
        r"optimizer.json: param_groups/0: key 'eps' is 1180591620717411303424, out of any range",
        lambda c: _edit_json(c, "optimizer.json", lambda v: v["param_groups"][0].update(eps=2**70)),
    ),
    # settings whose state is missing or whose device lacks them: the first step failed, after the load
    "group amsgrad without its state": (
        r"optimizer.json: the state saved for \['exp_avg', 'exp_avg_sq', 'step'\] does not fit the group's "
        r"settings: AdamW's step fails with them \(KeyError: 'max_exp_avg_sq'\)",
        lambda c: _edit_json(c, "optimizer.json", lambda v: v["param_groups"][0].update(amsgrad=True)),
    ),
    "group capturable on cpu": (
        r"optimizer.json: the state saved for .* AdamW's step fails with them",
        lambda c: _edit_json(c, "optimizer.json", lambda v: v["param_groups"][0].update(capturable=True)),
    ),
    "python rng size": (
        r"rank0.json: rng: key 'python/1' holds 3 items",
        lambda c: _edit_json(c, "rank0.json", lambda v: v["rng"]["python"].__setitem__(1, [1, 2, 3])),
    ),
    # random.setstate refuses these only when fa.evaluate installs the state, after the load
    "python rng version": (
        r"rank0.json: key 'rng/python' is not a Python generator state of version 3",
        lambda c: _edit_json(c, "rank0.json", lambda v: v["rng"]["python"].__setitem__(0, -1)),
    ),
    "python rng gauss": (
        r"rank0.json: key 'rng/python' is not a Python generator state",
        lambda c: _edit_json(c, "rank0.json", lambda v: v["rng"]["python"].__setitem__(2, 1e400)),
    ),
    "numpy rng gauss": (
        r"rank0.json: key 'rng/numpy' is not a NumPy generator state",
        lambda c: _edit_json(c, "rank0.json", lambda v: v["rng"]["numpy"].__setitem__(4, float("nan"))),
    ),
    "transforms": (
        r"rank0.json: key 'transforms' must be an object",
        lambda c: _edit_json(c, "rank0.json", lambda v: v.update(transforms=[])),
    ),
    "rank keys": (
        r"rank0.json: holds keys that differ from this run's: missing \['rng'\]",
        lambda c: _edit_json(c, "rank0.json", lambda v: v.pop("rng")),
    ),
    "unknown transform": (
        r"rank0.json: state for transform 'ema'",
        lambda c: _edit_json(c, "rank0.json", lambda v: v["transforms"].update(ema={})),
    ),
    "torch rng size": (
        r"rank0.safetensors: rng/torch: has shape \(10,\)",
        lambda c: _edit_tensors(
            c, "rank0.safetensors", lambda t: _set_scalar(t, "rng/torch", torch.zeros(10, dtype=torch.uint8))
        ),
    ),
    "gradient shape": (
        r"rank0.safetensors: '0.weight' has shape \(8, 32\)",
        lambda c: _edit_tensors(
            c,
            "rank0.safetensors",
            lambda t: _set_scalar(t, "grad/0.weight", t["grad/0.weight"].T.contiguous()),
        ),
    ),
    "stray tensor": (
        r"rank0.safetensors: key 'payload' is not a generator state or a gradient",
        lambda c: _edit_tensors(c, "rank0.safetensors", lambda t: _set_scalar(t, "payload", torch.zeros(1))),
    ),
    "exp_avg shape": (
        r"optimizer.safetensors: key '0.weight/exp_avg' has shape \(8, 32\)",
        lambda c: _edit_tensors(
            c,
            "optimizer.safetensors",
            lambda t: _set_scalar(t, "0.weight/exp_avg", t["0.weight/exp_avg"].T.contiguous()),
        ),
    ),
    "exp_avg dtype": (
        r"optimizer.safetensors: key '0.weight/exp_avg' has shape \(32, 8\) and dtype torch.float64",
        lambda c: _edit_tensors(
            c,
            "optimizer.safetensors",
            lambda t: _set_scalar(t, "0.weight/exp_avg", t["0.weight/exp_avg"].double()),
        ),
    ),
    "model dtype": (
        r"model.safetensors: '0.bias' has dtype torch.float16 in the checkpoint but torch.float32",
        lambda c: _edit_tensors(
            c, "model.safetensors", lambda t: _set_scalar(t, "0.bias", t["0.bias"].half())
        ),
    ),
    "optimizer state name": (
        r"optimizer.safetensors: key 'nope/exp_avg': optimizer state for unknown parameter",
        lambda c: _edit_tensors(
            c, "optimizer.safetensors", lambda t: _set_scalar(t, "nope/exp_avg", torch.zeros(2))
        ),
    ),
    "deep json": (
        r"scheduler.json: not valid JSON \(or nested too deeply\)",
        _deep_json,
    ),
}


@pytest.mark.parametrize("case", sorted(FILE_EDITS))
def test_every_file_edited_and_rehashed_is_refused_before_anything_is_restored(
    checkpoint: Path, case: str
) -> None:
    match, edit = FILE_EDITS[case]
    edit(checkpoint)
    _refused(checkpoint, match)


def test_another_optimizer_or_scheduler_kind_is_refused(checkpoint: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(32, 4)
    )
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    state = fa.prepare(fa.init(seed=0, cpu=True), model, sgd, pipeline=fa.compose(fa.accumulate(2)))
    with pytest.raises(
        fa.CheckpointError,
        match=r"optimizer.json: key 'kind': saved from 'torch.optim.adamw.AdamW', "
        r"but this run's is 'torch.optim.sgd.SGD'",
    ):
        fa.load(state, checkpoint)
    state.check_fresh("the test")
    assert not sgd.state


def test_group_settings_the_optimizer_class_fills_in_may_be_missing(checkpoint: Path) -> None:
    """A checkpoint from a torch without a newer option (AdamW's ``decoupled_weight_decay``,
    ``foreach``) loads: the class fills them in itself, as torch's own load does."""
    _edit_json(
        checkpoint,
        "optimizer.json",
        lambda v: [v["param_groups"][0].pop(k) for k in ("decoupled_weight_decay", "foreach")],
    )
    state = fa.load(_fresh(), checkpoint)
    assert state.optimizer.param_groups[0]["foreach"] is None


@pytest.mark.parametrize(
    "make",
    [
        lambda ps: torch.optim.AdamW(ps, lr=0.01, amsgrad=True),
        lambda ps: torch.optim.Adafactor(ps, lr=0.01),  # factored state: no one-element stand-in
        lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    ],
    ids=["amsgrad", "adafactor", "sgd"],
)
def test_states_that_fit_their_settings_load_and_resume_alike(
    tmp_path: Path, make: Callable[[Any], torch.optim.Optimizer]
) -> None:
    def run() -> fa.RunState:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.ReLU(), torch.nn.Linear(6, 2))
        return fa.prepare(
            fa.init(seed=0, cpu=True),
            model,
            make(model.parameters()),
            loss_fn=lambda m, b: torch.nn.functional.mse_loss(m(b["x"]), b["y"]),
        )

    batch = {"x": torch.randn(5, 4), "y": torch.randn(5, 2)}
    state = run()
    for _ in range(2):
        state, _ = fa.step(state, batch)
    fa.save(state, tmp_path / "ckpt")
    resumed = fa.load(run(), tmp_path / "ckpt")
    state, _ = fa.step(state, batch)
    resumed, _ = fa.step(resumed, batch)
    for a, b in zip(state.model.parameters(), resumed.model.parameters(), strict=False):
        assert torch.equal(a, b)


def test_the_untouched_checkpoint_still_loads(checkpoint: Path) -> None:
    _rehash(checkpoint)  # re-hashing alone changes nothing
    assert fa.load(_fresh(), checkpoint).micro_step == 3


@pytest.fixture(scope="module")
def hostile_load() -> Iterator[Callable[[Path, str, str], dict[str, Any]]]:
    """``hostile_load(checkpoint, name, kind)``: load ``checkpoint`` in a child process
    (memory-limited, so a regression that reads a device whole fails there rather than eating
    the machine) with ``name`` made hostile. Each child is forked by one `_hostile_load.py serve`
    (torch imported once), in a session of its own so that a child stuck on a FIFO goes too."""
    server = subprocess.Popen(
        [sys.executable, str(HOSTILE_JOB), "serve"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parents[2])},
    )
    assert server.stdin is not None and server.stdout is not None
    stdin, stdout = server.stdin, server.stdout

    def load(checkpoint: Path, name: str, kind: str) -> dict[str, Any]:
        stdin.write(json.dumps([str(checkpoint), name, kind]) + "\n")
        stdin.flush()
        ready, _, _ = select.select([stdout], [], [], 120)
        assert ready, f"no answer in 120 s from the load of {name} made {kind}"
        line = stdout.readline()
        assert line, "the load server ended"
        return json.loads(line)

    try:
        yield load
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGKILL)
        server.wait(timeout=30)
        stdin.close()
        stdout.close()


@pytest.mark.parametrize(
    ("name", "kind", "match"),
    [
        ("model.safetensors", "zero", "model.safetensors: a symbolic link"),
        ("rank0.json", "fifo", "rank0.json: a FIFO"),
        ("optimizer.safetensors", "outside", "optimizer.safetensors: a symbolic link"),
        ("model.safetensors", "sparse", r"model.safetensors: truncated or extended \(8589934592 bytes"),
        ("fnaccel.json", "zero", "fnaccel.json: a symbolic link"),
    ],
)
def test_hostile_files_are_named_at_once_without_reading_them(
    checkpoint: Path,
    name: str,
    kind: str,
    match: str,
    hostile_load: Callable[[Path, str, str], dict[str, Any]],
) -> None:
    result = hostile_load(checkpoint, name, kind)
    assert result["error"] == "CheckpointError", result
    assert re.search(match, result["message"]), result["message"]
    # measured in milliseconds (docs/checkpoints.md); the bound only has to tell "named at
    # once" from "read a device or waited on a FIFO", so machine load cannot fail it
    assert result["seconds"] < 10.0, result
    assert result["grown_mb"] < 64, result  # nothing was read whole


def test_a_registered_object_gets_tensors_of_its_own_shape_or_an_error(tmp_path: Path) -> None:
    from tests.checkpoint.test_project import Ema

    def run(value: float) -> fa.RunState:
        return fa.utils.register_for_checkpointing(_fresh(), ema=Ema(value))

    fa.save(run(1.0), tmp_path / "ckpt")
    _edit_tensors(
        tmp_path / "ckpt", "extras.safetensors", lambda t: _set_scalar(t, "ema/shadow/w", torch.zeros(5))
    )
    state = run(2.0)
    with pytest.raises(fa.CheckpointError, match=r"extras.json: ema: key 'shadow/w' has shape \(5,\)"):
        fa.load(state, tmp_path / "ckpt")
    state.check_fresh("the test")
    assert torch.equal(state.extras["ema"].shadow["w"], torch.full((3,), 2.0))  # untouched
    _edit_json(
        tmp_path / "ckpt",
        "extras.json",
        lambda v: v["ema"]["dict"][0].__setitem__(1, {"dict": [["w", {"tensor": "gone"}]]}),
    )
    with pytest.raises(
        fa.CheckpointError, match=r"extras.json: ema: key 'shadow/w': tensor 'gone' is not in "
    ):
        fa.load(run(2.0), tmp_path / "ckpt")
