"""`fa.prepare`, `fa.step` and the checkpoint layer ask what a transform does, never its name.

A transform declares what it is (`fnaccel.transforms.kinds`): its
``capabilities`` (`Capability`), a typed ``settings`` record (`Precision`,
`GradientClipping`, `Accumulation`, found with `Pipeline.settings`) and a
``check`` hook that owns its contract at `fa.prepare`. The modules that decide behaviour from a pipeline
(the ones in `CORE` below) must use those, so that a transform written outside
fnaccel takes part as fnaccel's own do. This test parses them and fails on:

- a transform's name as a string constant (``"pp"``, ``"autocast"``, or
  ``"pipeline/ddp"`` as run.json's drift items spell one), wherever it
  stands: in a comparison (``"pp" in pipeline.names``), a set or tuple of
  names (``{"ddp", "fsdp"} & ...``, ``for name in ("accumulate", ...)``),
  a lookup (``pipeline.get("autocast")``, ``states["deepspeed"]``). The
  names are those fnaccel's factories give (``Transform(name="...")`` in
  fnaccel/transforms/). Not counted, because they are not a decision on a
  name: docstrings and the text of f-strings (error messages name the
  transform the user wrote), ``__all__``, the ``name=`` and ``conflicts=``
  of a ``Transform(...)`` call (a transform's own identity, and the pairs
  `compose` refuses), the argument of ``mesh_dim(...)`` (``"pp"`` and
  ``"tp"`` are also mesh dimensions), and a package's name given to
  ``sys.modules.get`` or ``find_spec`` (``"deepspeed"`` is also a package);
- any read of ``.names`` (`Pipeline.names`) and any ``pipeline.get(...)``
  (`Pipeline.get`): conveniences for users, not for fnaccel;
- any read of ``.options``: a transform's printed options are for printing,
  equality and the saved pipeline record, so the one function that writes
  that record (checkpoint/manifest.py ``_setup``) is the one place allowed.

A name that reaches a comparison through a variable is not visible to a
parser; it is caught where the name is written, as a constant in these files.
Each rule is planted into a copy of a real module below, so the parser is
shown to catch it there.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "fnaccel"
CORE = (
    "preparation.py",
    "train.py",
    "precision.py",  # autocast_context
    "transforms/deepspeed.py",  # an engine reading the other transforms' settings
    *sorted(str(p.relative_to(PACKAGE)) for p in (PACKAGE / "checkpoint").rglob("*.py")),
)
# (module, function) allowed to read .options: it writes the saved pipeline record (run.json)
OPTIONS_READERS = frozenset({("checkpoint/manifest.py", "_setup")})
# calls whose string arguments name something other than a transform (see the module docstring)
OTHER_NAMESPACES = frozenset({"mesh_dim", "find_spec", "modules.get"})


def transform_names() -> frozenset[str]:
    """The names fnaccel's factories give their transforms."""
    names: set[str] = set()
    for path in (PACKAGE / "transforms").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and _callee(node).endswith("Transform"):
                names.update(
                    kw.value.value
                    for kw in node.keywords
                    if kw.arg == "name"
                    and isinstance(kw.value, ast.Constant)
                    and isinstance(kw.value.value, str)
                )
    return frozenset(names)


def _callee(call: ast.Call) -> str:
    """``f`` for ``f(...)``, ``modules.get`` for ``sys.modules.get(...)``, ``get`` for ``x.get(...)``."""
    func = call.func
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):
        owner = func.value
        if isinstance(owner, ast.Attribute) and owner.attr == "modules" and func.attr == "get":
            return "modules.get"
        return func.attr
    return ""


def _unparse_tail(node: ast.AST) -> str:
    return ast.unparse(node).rsplit(".", 1)[-1]


def violations(source: str, module: str, names: frozenset[str]) -> list[str]:
    """Every name check and options read in ``source`` (the text of fnaccel/``module``)."""
    tree = ast.parse(source)
    exempt: set[int] = set()  # ids of constants that are not a decision on a name
    function_of: dict[int, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Module)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                exempt.add(id(body[0].value))  # the docstring
            if not isinstance(node, ast.Module):
                for inner in ast.walk(node):
                    function_of.setdefault(id(inner), node.name)
        elif isinstance(node, ast.JoinedStr):
            exempt.update(id(part) for part in ast.walk(node))
        elif isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            exempt.update(id(part) for part in ast.walk(node.value))
        elif isinstance(node, ast.Call):
            callee = _callee(node)
            if callee in OTHER_NAMESPACES:
                exempt.update(id(part) for arg in node.args for part in ast.walk(arg))
            if callee.endswith("Transform"):  # Transform, EngineTransform
                exempt.update(
                    id(part)
                    for kw in node.keywords
                    if kw.arg in ("name", "conflicts")
                    for part in ast.walk(kw.value)
                )
    found = []
    for node in ast.walk(tree):
        where = f"fnaccel/{module}:{getattr(node, 'lineno', '?')}"
        if (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and id(node) not in exempt
            and (node.value in names or node.value.removeprefix("pipeline/") in names)
        ):
            found.append(f"{where}: the transform name {node.value!r}; ask a Capability or a settings record")
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
            if node.attr == "names":
                found.append(f"{where}: reads Pipeline.names; ask pipeline.capabilities")
            elif node.attr == "options" and (module, function_of.get(id(node))) not in OPTIONS_READERS:
                found.append(
                    f"{where}: reads a transform's printed options; read its typed settings "
                    "(pipeline.settings(Precision), ...)"
                )
        elif (
            isinstance(node, ast.Call)
            and _callee(node) == "get"
            and isinstance(node.func, ast.Attribute)
            and _unparse_tail(node.func.value) == "pipeline"
        ):
            found.append(
                f"{where}: Pipeline.get looks a transform up by name; ask pipeline.capabilities "
                "or pipeline.settings(...)"
            )
    return found


@pytest.fixture(scope="module")
def names() -> frozenset[str]:
    found = transform_names()
    # the harvest itself works: a broken one would let every name through
    assert {
        "ddp",
        "fsdp",
        "pp",
        "tp",
        "autocast",
        "grad_scaler",
        "deepspeed",
        "accumulate",
        "clip_grad_norm",
    } <= found, found
    return found


@pytest.mark.parametrize("module", CORE)
def test_the_core_asks_what_a_transform_does_never_its_name(module: str, names: frozenset[str]) -> None:
    found = violations((PACKAGE / module).read_text(), module, names)
    assert not found, "\n".join(found)


# What this round removed, written back into a copy of the module it came from.
PLANTED = [
    (
        "preparation.py",
        'if num_replicas > 1 and not {"ddp", "fsdp", "pp", "deepspeed"} & set(pipeline.names):\n    pass\n',
    ),
    ("preparation.py", 'if "pp" in pipeline.names:\n    pass\n'),
    ("preparation.py", 'cast = pipeline.get("autocast")\n'),
    ("preparation.py", 'dtype = dict(cast.options)["dtype"]\n'),
    ("preparation.py", 'skip = [t for t in pipeline.transforms if t.name == "fsdp"]\n'),
    ("preparation.py", 'engine = state.transform_states["deepspeed"]\n'),
    ("train.py", 'taken = frozenset({"clip_grad_norm"})\n'),
    ("precision.py", "cast = state.pipeline.get(name)\n"),
    (
        "transforms/deepspeed.py",
        "accumulate, clip, cast = (request.pipeline.get(name) for name in "
        '("accumulate", "clip_grad_norm", "autocast"))\n',
    ),
    ("transforms/deepspeed.py", 'max_norm = float(dict(clip.options)["max_norm"])\n'),
    ("checkpoint/manifest.py", 'autocast = next((e for e in pipeline if e["name"] == "autocast"), None)\n'),
    ("checkpoint/manifest.py", '_LAYOUT_ITEMS = frozenset({"pipeline/ddp", "pipeline/fsdp"})\n'),
    ("checkpoint/saveload.py", 'def f(state):\n    return "fsdp" in state.pipeline.names\n'),
]


@pytest.mark.parametrize(
    ("module", "planted"), PLANTED, ids=[f"{m}:{p.split(chr(10))[0][:40]}" for m, p in PLANTED]
)
def test_a_name_check_planted_into_a_core_module_fails(
    module: str, planted: str, names: frozenset[str]
) -> None:
    source = (PACKAGE / module).read_text()
    assert not violations(source, module, names)
    assert violations(source + "\n\n" + planted, module, names), planted


def test_what_is_not_a_name_check_passes(names: frozenset[str]) -> None:
    """Messages, docstrings, mesh dimensions, package names and a factory's own
    identity are not decisions on a transform's name."""
    source = '''
"""Under "pp" and "tp" the stages..."""
__all__ = ["deepspeed"]
def f(pipeline, ctx, name):
    """Like fa.pp: "pp"."""
    mesh = mesh_dim(ctx, "pp")
    ds = sys.modules.get("deepspeed")
    spec = importlib.util.find_spec("deepspeed")
    state = transform_states.get(name)
    raise ValueError(f"fa.prepare: {name} next to fa.pp; drop {'pp'}")
def deepspeed():
    return Transform(name="deepspeed", conflicts=frozenset({"ddp", "fsdp"}))
'''
    assert violations(source, "preparation.py", names) == []
