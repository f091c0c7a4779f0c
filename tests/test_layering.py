"""The core's imports point down (fnaccel/README.md, "Layers"), and no module reaches
into another package's private names.

Every import in fnaccel/, at module level, inside functions or under
``TYPE_CHECKING``, is read from the source (no import runs), mapped to the
layer of the module it names, and must not name a higher layer. The facades
(`fnaccel`, `fnaccel.utils`, `fnaccel.commands`) are imported by nothing
inside the package.

Within a layer, the same imports form no cycle, between modules (a deferred
import inside a function hides a cycle from Python, not from a reader) or
between folders (a root module counts as a folder of its own). A private
module (``ops/_shapes.py``) is imported only from inside its own package.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "fnaccel"

# (layer, module prefixes), lowest first; the longest matching prefix decides.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        "leaves",
        (
            "fnaccel._errors",
            "fnaccel._lazy",
            "fnaccel.dist",
            "fnaccel.rng",
            "fnaccel.constants",
            "fnaccel.kwargs",
            "fnaccel.checks",
            "fnaccel.config",
            "fnaccel.protocols",
            "fnaccel.resources",
            "fnaccel.atomic",
            "fnaccel.calls",
        ),
    ),
    ("state", ("fnaccel.state",)),
    (
        "parts",
        (
            "fnaccel.transforms",
            # the checkpoint's storage half: the transforms declare their layouts with it
            "fnaccel.checkpoint.storage",
            "fnaccel.ops",
            "fnaccel.seeding",
            "fnaccel.process",
            "fnaccel.precision",
            "fnaccel.trigger",
            "fnaccel.preemption",
        ),
    ),
    (
        "loop",
        (
            "fnaccel.preparation",
            "fnaccel.train",
            "fnaccel.data",
            "fnaccel.runtime",
            "fnaccel.dryrun",
            "fnaccel.evaluation",
        ),
    ),
    (
        "services",
        (
            "fnaccel.checkpoint",
            "fnaccel.tracking",
            "fnaccel.modeling",
            "fnaccel.launchers",
            "fnaccel.debug",
            "fnaccel.testing",
        ),
    ),
    ("facades", ("fnaccel.utils", "fnaccel.commands", "fnaccel.__main__", "fnaccel=")),
)
RANK = {name: i for i, (name, _) in enumerate(LAYERS)}


def layer_of(module: str) -> str:
    """The layer of ``module``: its longest matching prefix (``name=`` matches only itself)."""
    best, best_len = None, -1
    for name, prefixes in LAYERS:
        for prefix in prefixes:
            if prefix.endswith("="):
                matches = module == prefix[:-1]
            else:
                matches = module == prefix or module.startswith(prefix + ".")
            if matches and len(prefix) > best_len:
                best, best_len = name, len(prefix)
    assert best is not None, f"{module} is in no layer: add it to LAYERS"
    return best


def module_name(path: Path, root: Path = PACKAGE) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, root: Path = PACKAGE) -> list[tuple[int, str, tuple[str, ...]]]:
    """(line, imported module, imported names) for every fnaccel import in ``path``."""
    tree = ast.parse(path.read_text(), str(path))
    here = module_name(path, root)
    package = here if path.name == "__init__.py" else here.rpartition(".")[0]
    found: list[tuple[int, str, tuple[str, ...]]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name, ()) for a in node.names if a.name.split(".")[0] == "fnaccel"]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            if base.split(".")[0] != "fnaccel":
                continue
            names = tuple(a.name for a in node.names)
            # `from fnaccel.pkg import module` imports that module
            found.append((node.lineno, base, names))
    return found


def _targets(base: str, names: tuple[str, ...], root: Path) -> list[str]:
    """The modules an import names: ``from fnaccel.pkg import module`` names the module."""

    def exists(module: str) -> bool:
        path = root.parent / module.replace(".", "/")
        return path.with_suffix(".py").exists() or (path / "__init__.py").exists()

    return [f"{base}.{n}" for n in names if exists(f"{base}.{n}")] or [base]


def violations(root: Path = PACKAGE, allowed: frozenset[tuple[str, str]] = frozenset()) -> list[str]:
    found = []
    for path in sorted(root.rglob("*.py")):
        here = module_name(path, root)
        mine = layer_of(here)
        for line, base, names in imports(path, root):
            for target in _targets(base, names, root):
                theirs = layer_of(target)
                where = f"{path.relative_to(root.parent)}:{line}"
                if RANK[theirs] > RANK[mine] or (theirs == "facades" and mine != "facades"):
                    found.append(f"{where}: {here} ({mine}) imports {target} ({theirs})")
                same_package = target.rpartition(".")[0] == here.rpartition(".")[0]
                private = [n for n in names if n.startswith("_") and not n.startswith("__")]
                if private and not same_package and target == base:
                    found.append(f"{where}: {here} imports private {private} from {base}")
                owner = private_owner(target)
                if (
                    owner
                    and not (here == owner or here.startswith(owner + "."))
                    and (here, target) not in allowed
                ):
                    found.append(f"{where}: {here} imports {target}, private to {owner}")
    return found


def private_owner(module: str) -> str | None:
    """The package a private module belongs to (``fnaccel.ops`` for ``fnaccel.ops._shapes``)."""
    parts = module.split(".")
    for i, part in enumerate(parts):
        if part.startswith("_") and not part.startswith("__"):
            return ".".join(parts[:i])
    return None


def unit(module: str, root: Path = PACKAGE) -> str:
    """A folder of the package, or a module at its root: what folder-level cycles are made of."""
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 2 or (root / parts[-1]).is_dir() else module


def graph(root: Path = PACKAGE, *, folders: bool = False) -> dict[str, dict[str, str]]:
    """importer -> {imported: first file:line}, over every import (inside functions and under
    ``TYPE_CHECKING`` too); with ``folders``, between units (folders and root modules), self-imports
    left out."""
    edges: dict[str, dict[str, str]] = {}
    for path in sorted(root.rglob("*.py")):
        here = module_name(path, root)
        for line, base, names in imports(path, root):
            for target in _targets(base, names, root):
                a, b = (unit(here, root), unit(target, root)) if folders else (here, target)
                if a != b:
                    edges.setdefault(a, {}).setdefault(b, f"{path.relative_to(root.parent)}:{line}")
    return edges


def cycles(edges: dict[str, dict[str, str]], allowed: frozenset[tuple[str, str]] = frozenset()) -> list[str]:
    """One line per strongly connected set of more than one node (Tarjan), naming its edges."""
    kept = {a: {b: w for b, w in out.items() if (a, b) not in allowed} for a, out in edges.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[str] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in kept.get(node, {}):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            members: list[str] = []
            while not members or members[-1] != node:
                members.append(stack.pop())
            if len(members) > 1:
                inside = sorted(
                    f"{a} -> {b} ({w})" for a in members for b, w in kept.get(a, {}).items() if b in members
                )
                found.append("cycle: " + "; ".join(inside))

    for node in sorted(kept):
        if node not in index:
            visit(node)
    return found


# What the package still does against the rules above, after issue 27's regrouping (point 4):
# (importer, imported) -> why it is still here. An entry no longer needed fails.
ALLOWED_PRIVATE_IMPORTS: dict[tuple[str, str], str] = {}
ALLOWED_MODULE_CYCLE_EDGES = {
    (
        "fnaccel.transforms.plugins.deepspeed",
        "fnaccel.transforms.deepspeed",
    ): "DeepSpeedPlugin.zero3_init_context_manager (Accelerate's method) calls the engine's zero_init",
}
ALLOWED_FOLDER_CYCLE_EDGES: dict[tuple[str, str], str] = {}


def test_every_import_points_down_and_no_private_name_crosses_a_package() -> None:
    found = violations(allowed=frozenset(ALLOWED_PRIVATE_IMPORTS))
    assert not found, "\n".join(found)


def test_no_import_cycle_between_modules_or_folders() -> None:
    found = cycles(graph(), frozenset(ALLOWED_MODULE_CYCLE_EDGES))
    found += cycles(graph(folders=True), frozenset(ALLOWED_FOLDER_CYCLE_EDGES))
    assert not found, "\n".join(found)


def test_each_allowed_exception_is_still_needed() -> None:
    modules, folders = graph(), graph(folders=True)
    stale = [f"{a} -> {b}" for a, b in ALLOWED_MODULE_CYCLE_EDGES if b not in modules.get(a, {})]
    stale += [f"{a} -> {b}" for a, b in ALLOWED_FOLDER_CYCLE_EDGES if b not in folders.get(a, {})]
    stale += [f"{a} -> {b}" for a, b in ALLOWED_PRIVATE_IMPORTS if b not in modules.get(a, {})]
    assert not stale, f"no longer imported, remove the exception: {stale}"


def plant(root: Path, files: dict[str, str]) -> Path:
    package = root / "fnaccel"
    for name, text in {"__init__.py": "", **files}.items():
        (package / name).parent.mkdir(parents=True, exist_ok=True)
        (package / name).write_text(text)
    return package


def test_the_check_fails_on_a_planted_cycle_through_a_function_level_import(tmp_path: Path) -> None:
    package = plant(
        tmp_path,
        {
            "transforms/__init__.py": "",
            "transforms/engine.py": "from fnaccel.transforms.engine_config import Config\n",
            "transforms/engine_config.py": "class Config:\n    def start(self):\n"
            "        from fnaccel.transforms.engine import start\n",
        },
    )
    assert violations(package) == []  # same layer, private nothing: only the cycle is wrong
    assert cycles(graph(package)) == [
        "cycle: fnaccel.transforms.engine -> fnaccel.transforms.engine_config (fnaccel/transforms/engine.py:1); "
        "fnaccel.transforms.engine_config -> fnaccel.transforms.engine (fnaccel/transforms/engine_config.py:3)"
    ]


def test_the_check_fails_on_a_planted_folder_cycle_within_a_layer(tmp_path: Path) -> None:
    package = plant(
        tmp_path,
        {
            "checkpoint/__init__.py": "",
            "checkpoint/weights.py": "from fnaccel.modeling.index import read\n",
            "checkpoint/storage/files.py": "",
            "modeling/__init__.py": "",
            "modeling/index.py": "def read():\n    from fnaccel.checkpoint.storage.files import header\n",
        },
    )
    assert violations(package) == [] and cycles(graph(package)) == []  # no module imports itself back
    assert cycles(graph(package, folders=True)) == [
        "cycle: fnaccel.checkpoint -> fnaccel.modeling (fnaccel/checkpoint/weights.py:1); "
        "fnaccel.modeling -> fnaccel.checkpoint (fnaccel/modeling/index.py:2)"
    ]


def test_the_check_fails_on_a_planted_private_module_import(tmp_path: Path) -> None:
    package = plant(
        tmp_path,
        {
            "ops/__init__.py": "",
            "ops/_shapes.py": "",
            "ops/collectives.py": "from fnaccel.ops import _shapes\n",
            "transforms/__init__.py": "",
            "transforms/base.py": "from fnaccel.ops._shapes import ShapeTable\n",
            "state.py": "from fnaccel._errors import FnaccelError\n",
            "_errors.py": "",
        },
    )
    assert violations(package) == [
        "fnaccel/transforms/base.py:1: fnaccel.transforms.base imports fnaccel.ops._shapes, private to fnaccel.ops"
    ]
    assert violations(package, allowed=frozenset({("fnaccel.transforms.base", "fnaccel.ops._shapes")})) == []


def test_the_check_fails_on_a_planted_upward_import(tmp_path: Path) -> None:
    planted = tmp_path / "fnaccel"
    planted.mkdir()
    (planted / "__init__.py").write_text("")
    (planted / "state.py").write_text("def f():\n    from fnaccel.checkpoint.saveload import save\n")
    (planted / "dist.py").write_text("from fnaccel.ops.tree import _private_helper\n")
    found = violations(planted)
    assert any("fnaccel.state (state) imports fnaccel.checkpoint.saveload (services)" in f for f in found), (
        found
    )
    assert any("fnaccel.dist (leaves) imports fnaccel.ops.tree (parts)" in f for f in found), found
    assert any("imports private ['_private_helper']" in f for f in found), found


@pytest.mark.slow
def test_importing_the_state_loads_nothing_above_the_leaves() -> None:
    code = "import sys, fnaccel.state; print('\\n'.join(m for m in sys.modules if m.startswith('fnaccel')))"
    loaded = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=PACKAGE.parent
    ).stdout.split()
    above = [m for m in loaded if m != "fnaccel" and RANK[layer_of(m)] > RANK["state"]]
    assert not above, above
    assert "fnaccel.state" in loaded


@pytest.mark.parametrize(
    "module", ["fnaccel.state", "fnaccel.preparation", "fnaccel.train", "fnaccel.checkpoint.saveload"]
)
def test_modules_have_a_layer(module: str) -> None:
    assert layer_of(module) in RANK


def readme_layers(text: str) -> dict[str, str]:
    """fnaccel/README.md's layer block: each folder (``name/``) or module (``name.py``) it names ->
    the layer of its row."""
    block = text.split("**Layers", 1)[1].split("```", 2)[1]
    rows: dict[str, str] = {}
    layer = ""
    for line in block.strip().splitlines():
        if not line.startswith(" "):
            layer, line = (
                ("loop", line[len("the loop") :]) if line.startswith("the loop") else line.split(" ", 1)
            )
        for name in re.findall(r"[\w/]+/|[\w]+\.py", line.split("(nothing", 1)[0]):
            module = (
                "fnaccel"
                if name == "__init__.py"
                else "fnaccel." + name.removesuffix(".py").strip("/").replace("/", ".")
            )
            rows[module] = layer
    return rows


def test_the_readme_shows_every_folder_and_root_module_in_its_layer() -> None:
    rows = readme_layers((PACKAGE / "README.md").read_text())
    present = {f"fnaccel.{p.parent.name}" for p in PACKAGE.glob("*/__init__.py")}
    present |= {"fnaccel" if p.name == "__init__.py" else f"fnaccel.{p.stem}" for p in PACKAGE.glob("*.py")}
    assert sorted(present - set(rows)) == [], "missing from fnaccel/README.md's layer block"
    assert sorted(set(rows) - present - {"fnaccel.transforms.plugins", "fnaccel.checkpoint.storage"}) == [], (
        "named there but not in the package"
    )
    wrong = {m: (row, layer_of(m)) for m, row in rows.items() if layer_of(m) != row}
    assert not wrong, f"in the wrong row (README's, the test's): {wrong}"
