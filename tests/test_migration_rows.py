"""Every row of docs/migration.md's tables is checked, or says why not (issue 37 point 10).

The page maps Accelerate onto fnaccel in tables. A row is checked here by what it names: each
fnaccel name (`fa.x`, `fa.ops.x`, `u.x`, `fnaccel.a.b`, `state.x`, `state.dist.x`, a bare name
of `fnaccel.utils` in the utilities tables) resolves; a documented call
(`fa.ops.reduce(ctx, tree, reduction="mean", scale=1.0)`) has those keyword parameters with
those defaults and takes that many positional arguments; a launch flag is one `fnaccel launch`
parses, a command one `fnaccel` has, an `FNACCEL_*` variable one fnaccel reads or sets, an FSDP
key one the FSDP plugin knows; "same" (names) means Accelerate's names of the first column exist
in fnaccel; "not provided" means they do not. A row that names nothing checkable must say
"not checked here" and why. Rows whose claim is a sentence about behaviour also have a behaviour
check below (the audit that would have caught a loop that "counts every sample once" and
did not).
"""

from __future__ import annotations

import ast
import inspect
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import fnaccel as fa
import fnaccel.utils
from fnaccel.commands.main import build_parser
from fnaccel.data.prepared import PreparedLoader
from fnaccel.train import StepPlan

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "migration.md"
NOT_CHECKED = "not checked here"
SOURCE = "\n".join(path.read_text() for path in (ROOT / "fnaccel").rglob("*.py"))


@dataclass(frozen=True, slots=True, kw_only=True)
class Row:
    section: str
    header: tuple[str, ...]
    cells: tuple[str, ...]
    line: int

    def __str__(self) -> str:
        return f"docs/migration.md:{self.line} ({self.section}): {self.cells[0][:60]}"


def rows(text: str) -> list[Row]:
    """Every table row of ``text`` (a `|` inside a code span is written `\\|`)."""
    lines, found, section, i = text.splitlines(), [], "", 0
    while i < len(lines):
        if lines[i].startswith("#"):
            section = lines[i].strip("# ")
        if lines[i].startswith("|") and i + 1 < len(lines) and re.fullmatch(r"\|[-| ]+\|", lines[i + 1]):
            header = tuple(c.strip() for c in lines[i].strip()[1:-1].split(" | "))
            i += 2
            while i < len(lines) and lines[i].startswith("|"):
                cells = tuple(
                    c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", lines[i].strip()[1:-1])
                )
                found.append(Row(section=section, header=header, cells=cells, line=i + 1))
                i += 1
            continue
        i += 1
    return found


# --------------------------------------------------------------------------- what a name means

_ATTRIBUTE_OWNERS: dict[str, Any] = {
    "state": fa.RunState,
    "ctx": fa.DistContext,
    "state.dist": fa.DistContext,
    "state.plan": StepPlan,
    "state.loader": PreparedLoader,
    "state.pipeline": fa.Pipeline,
}
_FACADES = {
    "fa": fnaccel,
    "fnaccel": fnaccel,
    "u": fnaccel.utils,
    "fa.utils": fnaccel.utils,
    "fnaccel.utils": fnaccel.utils,
    "fa.ops": fa.ops,
    "fnaccel.ops": fa.ops,
}


def _has_attribute(owner: Any, name: str) -> bool:
    fields = getattr(owner, "__dataclass_fields__", {})
    return name in fields or hasattr(owner, name)


def _resolve_dotted(ref: str) -> str | None:
    """None when ``ref`` (``fa.x``, ``fa.ops.x``, ``u.x``, ``fnaccel.a.b.c``, ``state.dist.x``)
    names something that exists; else what is missing."""
    parts = ref.split(".")
    if parts[0] in ("state", "ctx"):
        owner_key = ".".join(parts[:2]) if ".".join(parts[:2]) in _ATTRIBUTE_OWNERS else parts[0]
        owner = _ATTRIBUTE_OWNERS[owner_key]
        name = parts[len(owner_key.split("."))] if len(parts) > len(owner_key.split(".")) else None
        if name is None or (owner_key == parts[0] and name in ("dist", "plan", "loader", "pipeline")):
            return None if name is None or _has_attribute(owner, name) else f"{ref}: no {name}"
        return None if _has_attribute(owner, name) else f"{ref}: {owner.__name__} has no {name}"
    import importlib

    facade = max((key for key in _FACADES if ref == key or ref.startswith(key + ".")), key=len, default=None)
    if facade is None:
        return f"{ref}: not a name of fnaccel"
    obj: Any = _FACADES[facade]
    path = facade
    for part in ref[len(facade) + 1 :].split(".") if ref != facade else []:
        path = f"{path}.{part}"
        if hasattr(obj, part):
            obj = getattr(obj, part)
            continue
        try:  # fnaccel.checkpoint.weights: a module
            obj = importlib.import_module(
                path.replace("fa.", "fnaccel.", 1) if path.startswith("fa.") else path
            )
        except ImportError:
            return f"{ref}: {path} does not exist"
    return None


def _literal(node: ast.expr) -> Any:
    try:
        value = ast.literal_eval(node)
    except ValueError:
        return inspect.Parameter.empty  # not a literal (`state.dist.num_processes - 1`): name only
    if "..." in ast.unparse(node):  # `split_batches=...`, `[...]`: the name only
        return inspect.Parameter.empty
    return value


def _check_call(span: str, accelerate: str) -> str | None:
    """A documented call: its function exists, takes that many positional arguments and has
    each keyword parameter; where the row maps Accelerate's signature onto it (the first
    column shows a call of the same name), each literal shown is the default."""
    try:
        call = ast.parse(span, mode="eval").body
    except SyntaxError:
        return None
    if not isinstance(call, ast.Call) or not re.fullmatch(r"[\w.]+", ast.unparse(call.func)):
        return None  # `Plugin(...).transform()`: its names are resolved one by one
    name = ast.unparse(call.func)
    signature_row = re.search(rf"`{re.escape(name.rsplit('.', 1)[-1])}\(", accelerate) is not None
    if (missing := _resolve_dotted(name)) is not None:
        return missing
    function = eval(name, {"fa": fa, "u": fnaccel.utils, "fnaccel": fnaccel})
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):
        return None
    params = signature.parameters
    positional = [p for p in params.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    shown_args = [a for a in call.args if "..." not in ast.unparse(a)]
    if len(shown_args) > len(positional) and not any(p.kind == p.VAR_POSITIONAL for p in params.values()):
        return (
            f"{span}: {name} takes {len(positional)} positional arguments, the page shows {len(shown_args)}"
        )
    for keyword in call.keywords:
        if keyword.arg is None:
            continue
        if keyword.arg not in params:
            if any(p.kind == p.VAR_KEYWORD for p in params.values()):
                continue
            return f"{span}: {name} has no parameter {keyword.arg}"
        shown, default = _literal(keyword.value), params[keyword.arg].default
        if signature_row and shown is not inspect.Parameter.empty and shown != default:
            return f"{span}: {name}'s {keyword.arg} defaults to {default!r}, the page shows {shown!r}"
    return None


_DOTTED = re.compile(r"(?<![\w.\"'])((?:fa|u|fnaccel|state|ctx)\.[A-Za-z_][\w.]*)")


def _launch_flags() -> set[str]:
    parser = build_parser(["launch"])
    launch = parser._subparsers._group_actions[0].choices["launch"]  # type: ignore[union-attr]
    return {flag for action in launch._actions for flag in action.option_strings}


LAUNCH_FLAGS = _launch_flags()
COMMANDS = set(build_parser()._subparsers._group_actions[0].choices)  # type: ignore[union-attr]


def _spans(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


def _bare_names(cell: str) -> list[str]:
    """The identifiers a cell lists (`gather`, `save(state, obj, f, ...)`, `attach_*` left out)."""
    return [m.group(1) for span in _spans(cell) if (m := re.fullmatch(r"([A-Za-z_]\w*)(\(.*\))?", span))]


def _exists_in_fnaccel(name: str) -> bool:
    return hasattr(fnaccel.utils, name) or hasattr(fnaccel, name) or hasattr(fa.ops, name)


def _without_parentheses(text: str) -> str:
    while (shorter := re.sub(r"\s*\([^()]*\)", "", text)) != text:
        text = shorter
    return text


def _leading_names(cell: str) -> list[str]:
    """The names each clause of a prose cell is about: its leading code spans
    ("`load_state_dict`, `load_checkpoint_in_model` read safetensors only; `save` writes ...")."""
    found = []
    for clause in _without_parentheses(cell).split("; "):
        if lead := re.match(r"`[^`]+`(?:(?:, | / )`[^`]+`)*", clause.strip()):
            found += _bare_names(lead.group(0))
    return found


def _in_source(name: str) -> str | None:
    """A string fnaccel's code holds (an environment variable, a logger or file name)."""
    if name in SOURCE:
        return None
    prefix, _, key = name.partition("_")[2].partition("_")  # FNACCEL_FSDP_<KEY>: the prefix and the key
    if name.startswith("FNACCEL_") and f"FNACCEL_{prefix}_" in SOURCE and f"{prefix}_{key}".lower() in SOURCE:
        return None
    return f"{name}: fnaccel's code never names it"


def checks(row: Row) -> Iterator[str | None]:
    """One item per thing checked in ``row``: None when it holds, else what is wrong."""
    accelerate, *ours = row.cells
    if row.header[0] == "fnaccel":  # the environment variables: fnaccel's first
        ours, accelerate = list(row.cells[:2]), row.cells[-1]
    fnaccel_text = " ".join(ours)
    for span in _spans(fnaccel_text):
        if re.fullmatch(r"(?:fa|u)\.[\w.]+\(.*\)", span):
            yield _check_call(span, accelerate)
        for ref in _DOTTED.findall(span):
            ref = ref.rstrip(".")
            missing = _resolve_dotted(ref)
            yield (
                None
                if missing is None or (ref.startswith("fnaccel.") and _in_source(ref) is None)
                else missing
            )
        for key in re.findall(r"metrics\[\"(\w+)\"\]", span):
            yield None if f'"{key}"' in SOURCE else f"metrics[{key!r}]: no step reports it"
        if row.section == "Environment variables":  # (the flags table's second column names torchrun's too)
            for flag in re.findall(r"--[\w-]+", span):
                yield None if flag in LAUNCH_FLAGS else f"{flag}: not parsed by fnaccel launch"
    for span in _spans(" ".join(row.cells)):
        for variable in re.findall(r"FNACCEL_[A-Z0-9_]+[A-Z0-9]", span):
            yield _in_source(variable)
    if row.section == "Environment variables" and re.fullmatch(r"`[A-Z_]+`", row.cells[0]):
        yield _in_source(row.cells[0].strip("`"))
    first = _spans(accelerate)
    if row.section == "`accelerate launch` flags":  # the first column's flags, whatever fnaccel does
        unknown = fnaccel_text.startswith("unknown")
        for flag in (f for span in first for f in re.findall(r"--[\w-]+", span) if not f.endswith("_")):
            yield (
                None
                if (flag in LAUNCH_FLAGS) != unknown
                else (f"{flag}: {'parsed' if unknown else 'not parsed'} by fnaccel launch")
            )
        for prefix in re.findall(r"(--[\w]+_)\*", accelerate):
            yield None if any(f.startswith(prefix) for f in LAUNCH_FLAGS) else f"{prefix}*: no such flags"
    if row.section == "Commands":
        command = first[0].split()[0]
        yield None if command in COMMANDS else f"fnaccel has no command {command}"
    if row.section.startswith("Plugins"):
        for key in (k for span in first for k in re.findall(r"\b(?:fsdp|dynamo)_\w+", span)):
            yield None if key in SOURCE else f"{key}: no plugin reads it"
    if row.section in ("`fnaccel.utils`", "Kwargs handlers"):
        kind = row.cells[0]
        if row.section == "Kwargs handlers":
            listed = _bare_names(kind)
        elif kind == "changed":
            listed = _leading_names(row.cells[1])
        else:
            listed = _bare_names(_without_parentheses(row.cells[1]))
        absent = kind == "not provided"
        for name in listed:
            yield (
                None
                if _exists_in_fnaccel(name) != absent
                else (f"{name}: {'provided' if absent else 'not in fnaccel.utils'}")
            )
    said_same = re.match(r"(`u\.` )?same\b", fnaccel_text) is not None
    not_provided = fnaccel_text.startswith(("not provided", "not needed:"))
    if (said_same or not_provided) and row.section not in ("`accelerate launch` flags", "Commands"):
        for name in _bare_names(accelerate):
            yield (
                None
                if _exists_in_fnaccel(name) != not_provided
                else (f"{name}: {'provided' if not_provided else 'missing'} in fnaccel")
            )


TABLE_ROWS = rows(PAGE.read_text())


def test_the_page_has_its_tables() -> None:
    assert len(TABLE_ROWS) > 200
    assert {row.section for row in TABLE_ROWS} >= {
        "Methods",
        "Properties",
        "Commands",
        "Environment variables",
    }


def test_every_row_names_what_exists_or_says_why_it_is_not_checked() -> None:
    wrong, unchecked = [], []
    for row in TABLE_ROWS:
        results = list(checks(row))
        wrong += [f"{row}: {problem}" for problem in results if problem is not None]
        text = " | ".join(row.cells)
        if not results and NOT_CHECKED not in text and not any(claim in text for claim in BEHAVIOUR.values()):
            unchecked.append(str(row))
    assert wrong == []
    assert unchecked == [], (
        f"rows checking nothing: name the fnaccel counterpart or write '{NOT_CHECKED}: why'"
    )


def test_the_row_checks_see_a_wrong_name_a_wrong_default_and_an_unmarked_row() -> None:
    def problems(*cells: str, section: str = "Methods") -> list[str]:
        results = list(checks(Row(section=section, header=("a", "b"), cells=cells, line=1)))
        assert results, "nothing was checked"
        return [problem for problem in results if problem is not None]

    assert problems('`reduce(tensor, reduction="sum")`', '`fa.ops.reduce(ctx, tree, reduction="mean")`') == []
    assert problems('`reduce(tensor, reduction="sum")`', '`fa.ops.reduce(ctx, tree, reduction="sum")`') == [
        "fa.ops.reduce(ctx, tree, reduction=\"sum\"): fa.ops.reduce's reduction defaults to 'mean', "
        "the page shows 'sum'"
    ]
    assert problems("`x()`", "`fa.ops.reduce(ctx, tree, 1, 2, 3, 4)`") == [
        "fa.ops.reduce(ctx, tree, 1, 2, 3, 4): fa.ops.reduce takes 4 positional arguments, the page shows 6"
    ]
    assert problems("`x()`", "`fa.no_such(state)`") == ["fa.no_such: fa.no_such does not exist"] * 2
    assert problems("`x`", "`state.dist.nonsense`") == ["state.dist.nonsense: DistContext has no nonsense"]
    assert problems("`on_last_process(fn)`", "not provided; `fa.utils.on_process(ctx, fn, 1)`") == []
    assert problems("`gather(x)`", "not provided") == ["gather: provided in fnaccel"]
    assert problems("`--mpirun_hostfile`", "unknown", section="`accelerate launch` flags") == []
    assert problems("`--cpu`", "unknown", section="`accelerate launch` flags") == [
        "--cpu: parsed by fnaccel launch"
    ]
    assert problems("`x`", "`FNACCEL_NO_SUCH_THING`") == [
        "FNACCEL_NO_SUCH_THING: fnaccel's code never names it"
    ]
    assert list(checks(Row(section="Methods", header=("a", "b"), cells=("`x`", "a sentence"), line=1))) == []


# --------------------------------------------------------------------------- claims that are sentences

# each behaviour test below -> the text of the row whose sentence it checks
BEHAVIOUR = {
    "test_data_order_is_randperm_of_seed_plus_epoch_and_ignores_the_users_generator": (
        "a pure function of (seed, epoch)"
    ),
    "test_accumulation_boundaries_run_across_epoch_ends": (
        "an epoch of 25 batches with `accumulate(4)` carries one batch into the next epoch"
    ),
    "test_sync_gradients_is_lr_in_the_metrics_at_a_boundary_only": '`"lr" in metrics` after `fa.step`',
    "test_an_old_state_passed_again_raises_naming_its_consumer": "**consume** their state",
    "test_no_fnaccel_call_moves_the_process_generators": "which your code outside the run draws from",
    "test_save_refuses_a_directory_holding_files_it_did_not_write": "refuses one holding files it did not write",
    "test_reduce_defaults_to_mean_where_accelerates_method_sums": '`fa.ops.reduce`: `"mean"`',
    "test_two_runs_in_one_process_never_interact": "two runs in one process never interact",
    "test_a_mid_epoch_resume_is_automatic": "automatic and O(1): the position is in the checkpoint",
    "test_gather_for_metrics_keeps_padding_without_num_valid_and_drops_it_with": "you pass `num_valid`",
    "test_jsonl_is_the_default_tracker_and_tensorboard_is_built_in": "JSONL (default) and TensorBoard built in",
    "test_a_checkpoint_holds_no_pickle": "pickle-free, atomic, checksummed",
}


def test_each_behaviour_check_names_a_test_here_and_one_row() -> None:
    for name, claim in BEHAVIOUR.items():
        assert callable(globals().get(name)), name
        _row(claim)


def _row(containing: str) -> Row:
    found = [row for row in TABLE_ROWS if containing in " | ".join(row.cells)]
    assert len(found) == 1, f"{len(found)} rows contain {containing!r}"
    return found[0]


def _run(num_samples: int = 100, batch_size: int = 4, pipeline: Any = None, seed: int = 0) -> fa.RunState:
    torch.manual_seed(0)
    model = torch.nn.Linear(1, 1)
    data = DataLoader(
        TensorDataset(torch.arange(float(num_samples)).view(-1, 1)),
        batch_size=batch_size,
        shuffle=True,
        generator=torch.Generator().manual_seed(123),
    )
    return fa.prepare(
        fa.init(seed=seed, cpu=True),
        model,
        torch.optim.SGD(model.parameters(), lr=0.01),
        data,
        pipeline=pipeline,
        loss_fn=lambda m, b: m(b[0]).mean(),
    )


def test_data_order_is_randperm_of_seed_plus_epoch_and_ignores_the_users_generator() -> None:
    _row("a pure function of (seed, epoch)")
    state = _run(num_samples=12, batch_size=4, seed=5)
    for epoch in range(2):
        seen = [int(v) for batch in fa.batches(state, epochs=epoch + 1) for v in batch[0].flatten()]
        assert seen == torch.randperm(12, generator=torch.Generator().manual_seed(5 + epoch)).tolist()
        for batch in fa.batches(state, epochs=epoch + 1):
            state, _ = fa.step(state, batch)


def test_accumulation_boundaries_run_across_epoch_ends() -> None:
    _row("an epoch of 25 batches with `accumulate(4)` carries one batch into the next epoch")
    state = _run(num_samples=100, batch_size=4, pipeline=fa.compose(fa.accumulate(4)))
    for batch in fa.batches(state, epochs=1):
        state, _ = fa.step(state, batch)
    assert (state.micro_step, state.step) == (25, 6)  # the 25th batch waits for 3 of epoch 1
    for batch in fa.batches(state, epochs=2):
        state, _ = fa.step(state, batch)
    assert (state.micro_step, state.step) == (50, 12)


def test_sync_gradients_is_lr_in_the_metrics_at_a_boundary_only() -> None:
    _row('`"lr" in metrics` after `fa.step`')
    state = _run(num_samples=16, pipeline=fa.compose(fa.accumulate(2)))
    seen = []
    for batch in fa.batches(state, epochs=1):
        state, metrics = fa.step(state, batch)
        seen.append(("lr" in metrics, state.micro_step % state.plan.micro_steps == 0))
    assert seen == [(False, False), (True, True)] * 2


def test_an_old_state_passed_again_raises_naming_its_consumer() -> None:
    _row("**consume** their state")
    state = _run(num_samples=8)
    batch = next(iter(fa.batches(state)))
    fa.step(state, batch)
    with pytest.raises(fa.StaleStateError, match="fa.step"):
        fa.step(state, batch)


def test_no_fnaccel_call_moves_the_process_generators(tmp_path: Path) -> None:
    _row("which your code outside the run draws from")
    before = torch.get_rng_state()
    state = _run(num_samples=8)
    for batch in fa.batches(state, epochs=1):
        state, _ = fa.step(state, batch)
    fa.save(state, tmp_path / "ckpt")
    fa.load(state, tmp_path / "ckpt")
    assert torch.equal(torch.get_rng_state(), before)


def test_save_refuses_a_directory_holding_files_it_did_not_write(tmp_path: Path) -> None:
    _row("refuses one holding files it did not write")
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(fa.CheckpointError):
        fa.save(_run(num_samples=8), tmp_path)
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_reduce_defaults_to_mean_where_accelerates_method_sums() -> None:
    _row('`fa.ops.reduce`: `"mean"`')
    assert inspect.signature(fa.ops.reduce).parameters["reduction"].default == "mean"


def _trained(state: fa.RunState, steps: int) -> fa.RunState:
    for batch in fa.batches(state, epochs=10):
        state, _ = fa.step(state, batch)
        if state.micro_step == steps:
            break
    return state


def test_two_runs_in_one_process_never_interact() -> None:
    alone = _trained(_run(num_samples=16, seed=1), 6)
    first, second = _run(num_samples=16, seed=1), _run(num_samples=16, seed=2)
    for _ in range(6):  # interleaved, one step each
        first, second = _trained(first, first.micro_step + 1), _trained(second, second.micro_step + 1)
    assert torch.equal(first.model.weight, alone.model.weight)
    assert not torch.equal(first.model.weight, second.model.weight)


def test_a_mid_epoch_resume_is_automatic(tmp_path: Path) -> None:
    state = _trained(_run(num_samples=40, seed=3), 3)  # inside epoch 0 (10 batches)
    fa.save(state, tmp_path / "ckpt")
    expected = next(iter(fa.batches(state)))
    resumed = fa.load(_run(num_samples=40, seed=3), tmp_path / "ckpt")
    assert resumed.data_position == state.data_position
    assert torch.equal(next(iter(fa.batches(resumed)))[0], expected[0])


def test_gather_for_metrics_keeps_padding_without_num_valid_and_drops_it_with() -> None:
    state = _run(num_samples=8)
    loader = DataLoader(TensorDataset(torch.arange(10.0)), batch_size=4)
    pairs = list(fa.eval_batches(state, loader))
    assert [num_valid for _, num_valid in pairs] == [4, 4, 2]  # one process: nothing padded
    gathered = [fa.ops.gather_for_metrics(state, batch[0], num_valid=num_valid) for batch, num_valid in pairs]
    assert torch.cat(gathered).tolist() == list(range(10))


def test_jsonl_is_the_default_tracker_and_tensorboard_is_built_in(tmp_path: Path) -> None:
    state = fa.init_trackers(_run(num_samples=8).replace(project_dir=str(tmp_path)), "run")
    fa.log(state, {"loss": 1.0})
    fa.end_training(state)
    assert list(tmp_path.rglob("metrics.jsonl"))
    assert inspect.signature(fa.init_trackers).parameters["log_with"].default == "jsonl"
    assert "tensorboard" in SOURCE


def test_a_checkpoint_holds_no_pickle(tmp_path: Path) -> None:
    state = fa.utils.register_for_checkpointing(
        _trained(_run(num_samples=16), 3), extra=torch.nn.Linear(1, 1)
    )
    fa.save(state, tmp_path / "ckpt")
    files = {path.name for path in (tmp_path / "ckpt").rglob("*") if path.is_file()}
    assert {"fnaccel.json", "model.safetensors", "extras.safetensors", "rank0.json"} <= files
    assert all(name.endswith((".json", ".safetensors", ".yaml")) for name in files), files
