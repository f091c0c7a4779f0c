"""The core's imports point down (fnaccel/README.md, "Layers"), and no module reaches
into another package's private names.

Every import in fnaccel/, at module level, inside functions or under
``TYPE_CHECKING``, is read from the source (no import runs), mapped to the
layer of the module it names, and must not name a higher layer. The facades
(`fnaccel`, `fnaccel.utils`, `fnaccel.commands`) are imported by nothing
inside the package.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "fnaccel"

# (layer, module prefixes), lowest first; the longest matching prefix decides.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("leaves", ("fnaccel._errors", "fnaccel._lazy", "fnaccel.dist", "fnaccel.rng", "fnaccel.constants",
                "fnaccel.kwargs", "fnaccel.kwargs_handler", "fnaccel.profile_kwargs",
                "fnaccel.config", "fnaccel.config_schema", "fnaccel.protocols",
                "fnaccel.resources", "fnaccel.atomic", "fnaccel.environment", "fnaccel.numa", "fnaccel.purge",
                "fnaccel.parallelism")),
    ("state", ("fnaccel.state",)),
    ("parts", ("fnaccel.transforms", "fnaccel.ops", "fnaccel.seeding", "fnaccel.process", "fnaccel.plugins",
               "fnaccel.mixed_precision", "fnaccel.trigger", "fnaccel.autocasting")),
    ("loop", ("fnaccel.preparation", "fnaccel.train", "fnaccel.data", "fnaccel.runtime",
              "fnaccel.evaluation")),
    ("services", ("fnaccel.checkpoint", "fnaccel.tracking", "fnaccel.modeling", "fnaccel.launchers",
                  "fnaccel.engines", "fnaccel.debug", "fnaccel.testing")),
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
    found = []
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


def violations(root: Path = PACKAGE) -> list[str]:
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
    return found


def test_every_import_points_down_and_no_private_name_crosses_a_package() -> None:
    found = violations()
    assert not found, "\n".join(found)


def test_the_check_fails_on_a_planted_upward_import(tmp_path: Path) -> None:
    planted = tmp_path / "fnaccel"
    planted.mkdir()
    (planted / "__init__.py").write_text("")
    (planted / "state.py").write_text("def f():\n    from fnaccel.checkpoint.run import save\n")
    (planted / "dist.py").write_text("from fnaccel.ops.tree import _private_helper\n")
    found = violations(planted)
    assert any("fnaccel.state (state) imports fnaccel.checkpoint.run (services)" in f for f in found), found
    assert any("fnaccel.dist (leaves) imports fnaccel.ops.tree (parts)" in f for f in found), found
    assert any("imports private ['_private_helper']" in f for f in found), found


def test_importing_the_state_loads_nothing_above_the_leaves() -> None:
    code = ("import sys, fnaccel.state; print('\\n'.join(m for m in sys.modules if m.startswith('fnaccel')))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                            cwd=PACKAGE.parent).stdout.split()
    above = [m for m in loaded if m != "fnaccel" and RANK[layer_of(m)] > RANK["state"]]
    assert not above, above
    assert "fnaccel.state" in loaded


@pytest.mark.parametrize("module", ["fnaccel.state", "fnaccel.preparation", "fnaccel.train",
                                    "fnaccel.checkpoint.run"])
def test_modules_have_a_layer(module: str) -> None:
    assert layer_of(module) in RANK
