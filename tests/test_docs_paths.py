"""Every module, file and fnaccel name the documentation points to exists, and the map of the
package (fnaccel/README.md, "Layers") places every module where tests/test_layering.py does.

Read: fnaccel/README.md, README.md, docs/*.md, CHANGELOG.md's ``Unreleased`` section (older
sections are history and keep the names of their day) and the source of fnaccel/ (its
docstrings and comments). Each ``fnaccel/...py`` path, ``tests/...``, ``docs/...md``,
``benchmarks/...`` or ``examples/...`` path, and each dotted ``fnaccel.x.y`` name is resolved
from the files, without importing anything: a dotted name's longest prefix that is a module,
then its next part defined at that module's top level (a module's imports do not count; a
package's do, and so do the names in a facade's ``_PUBLIC`` or a module's ``__all__``).
In fnaccel/README.md, a backticked ``name.py``, ``folder/`` or ``module.name`` is relative to
fnaccel/.
"""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

import pytest

from tests.test_layering import layer_of, module_name

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "fnaccel"

# a path from the repository's root: fnaccel/x/y.py, tests/x.py, docs/x.md, a folder ending in /
_ROOTED = re.compile(r"(?<![\w./-])((?:fnaccel|tests|docs|benchmarks|examples)/[\w./-]*[\w/])")
# a dotted name: fnaccel.runtime.init (not a file name, fnaccel.yaml, nor a sentence's end)
_DOTTED = re.compile(r"(?<![\w./-])(fnaccel(?:\.[A-Za-z_]\w*)+)")
_NOT_NAMES = {"fnaccel.yaml", "fnaccel.log", "fnaccel.json", "fnaccel.toml", "fnaccel.pyi"}
# in fnaccel/README.md: `transforms/kinds.py`, `checkpoint/storage/`
_RELATIVE = re.compile(r"`([\w/]+(?:\.py|/))`")
# names gone from the code this round (issue 34), which CHANGELOG.md's Unreleased section names
# to say what a user changes, and nothing else may
_RENAMED = frozenset(
    {
        "fnaccel.protocols.CheckpointLayout",
        "fnaccel.checkpoint.run",
        "fnaccel.checkpoint.merge",
        "fnaccel.checkpoint.weights",
        "fnaccel.checkpoint.files.read_tensors",
        "fnaccel.modeling.checkpoint_files",
        "fnaccel.transforms.base",
        "fnaccel.transforms.precision",
        "fnaccel.transforms.collectives",
        "fnaccel.kwargs.base",
    }
)
# the capabilities folded into the kinds of Transform, and the check hook's old signature
_GONE = (
    "RUNS_FORWARD_BACKWARD",
    "SAME_BATCH_ACROSS_RANKS",
    "OWNS_OPTIMIZER_STEP",
    "Capability.TENSOR_PARALLEL",
    "check_pipeline(pipeline, ctx)",
)


def _texts() -> dict[str, str]:
    """The documentation read here, by its path from the root."""
    texts = {p: (ROOT / p).read_text() for p in ("README.md", "fnaccel/README.md")}
    texts |= {f"docs/{p.name}": p.read_text() for p in sorted((ROOT / "docs").glob("*.md"))}
    changelog = (ROOT / "CHANGELOG.md").read_text()
    unreleased = changelog.split("## Unreleased", 1)[1]
    texts["CHANGELOG.md (Unreleased)"] = re.split(r"^## ", unreleased, maxsplit=1, flags=re.M)[0]
    texts |= {str(p.relative_to(ROOT)): p.read_text() for p in sorted(PACKAGE.rglob("*.py"))}
    return texts


def _loggers() -> frozenset[str]:
    """The logger names fnaccel logs under (``fnaccel.environment``): names, not modules."""
    source = "\n".join(p.read_text() for p in PACKAGE.rglob("*.py"))
    return frozenset(re.findall(r"getLogger\(\"(fnaccel[\w.]*)\"\)", source))


def _module_path(module: str) -> Path | None:
    path = ROOT / module.replace(".", "/")
    for candidate in (path.with_suffix(".py"), path / "__init__.py"):
        if candidate.exists():
            return candidate
    return None


@functools.cache
def _defined(path: Path) -> frozenset[str]:
    """The names ``path`` defines at its top level, a package's imports, and the names of a
    facade's ``_PUBLIC`` table or a module's ``__all__`` (which re-export)."""
    tree = ast.parse(path.read_text())
    names: set[str] = set()
    node: ast.stmt
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
            names |= {
                e.id for t in targets if isinstance(t, ast.Tuple) for e in t.elts if isinstance(e, ast.Name)
            }
        elif isinstance(node, ast.Import | ast.ImportFrom) and path.name == "__init__.py":
            # a package re-exports what it imports; a module's imports are not its names
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    public = [
        n.value
        for n in tree.body
        if isinstance(n, ast.Assign) and ast.unparse(n.targets[0]) in ("_PUBLIC", "__all__")
    ]
    for value in public:  # _PUBLIC: its keys are the names, its values module paths
        names |= {
            c.value for c in ast.walk(value) if isinstance(c, ast.Constant) and isinstance(c.value, str)
        }
    return frozenset(names)


def _dotted_exists(name: str) -> bool:
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        path = _module_path(".".join(parts[:end]))
        if path is None:
            continue
        rest = parts[end:]
        return not rest or rest[0] in _defined(path)
    return False


def _stale(texts: dict[str, str]) -> list[str]:
    """``where: what`` for each reference that names nothing."""
    found: list[str] = []
    loggers = _loggers()
    for where, text in texts.items():
        history = _RENAMED if where.startswith("CHANGELOG") else frozenset()
        for match in _ROOTED.finditer(text):
            ref = match.group(1).split("::")[0].rstrip(".")
            if text[match.end() : match.end() + 1] == "{":
                continue  # a store key built in code (f"fnaccel/launch/{what}"), not a path
            if (
                "*" in ref
                or "<" in ref
                or not ref.endswith((".py", ".md", "/", ".yaml", ".sh", ".json", ".txt"))
            ):
                continue
            if not (ROOT / ref).exists():
                found.append(f"{where}: {ref}")
        for match in _DOTTED.finditer(text):
            name = match.group(1)
            if name not in _NOT_NAMES | loggers | history and not _dotted_exists(name):
                found.append(f"{where}: {name}")
        if where == "fnaccel/README.md":
            found += [f"{where}: `{ref}`" for ref in _relative_stale(text)]
            found += [f"{where}: `{name}`" for name in _relative_names_stale(text)]
        if not where.endswith(".py") and not history:
            found += [f"{where}: {gone}" for gone in _GONE if gone in text]
    return found


def _relative_stale(text: str) -> list[str]:
    """The backticked paths of fnaccel/README.md that name nothing: relative to fnaccel/, or in
    a row of its table of folders, to the row's folder or a folder of it the row names."""
    stale = []
    for line in text.splitlines():
        refs = _RELATIVE.findall(line)
        bases = [PACKAGE, ROOT]
        if line.startswith("| `") and refs:
            bases.append(PACKAGE / refs[0])
            bases += [PACKAGE / refs[0] / r for r in refs[1:] if r.endswith("/")]
        stale += [r for r in refs if not any((base / r).exists() for base in bases)]
    return stale


def _relative_names_stale(text: str) -> list[str]:
    """The backticked dotted names of fnaccel/README.md relative to fnaccel (``rng.swap_in``,
    ``runtime._group_store``) that name nothing."""
    stale = []
    for name in re.findall(r"`([a-z_]\w*(?:\.[A-Za-z_]\w*)+)`", text):
        if name.endswith((".py", ".pyi", ".md", ".json", ".yaml")) or name.startswith("state."):
            continue  # a file, or a field of the run's state (`state.rng`), not the module
        if _module_path(f"fnaccel.{name.split('.')[0]}") and not _dotted_exists(f"fnaccel.{name}"):
            stale.append(name)
    return stale


def test_every_path_and_module_the_docs_name_exists() -> None:
    assert _stale(_texts()) == []


@pytest.mark.parametrize(
    "planted",
    [
        "See `fnaccel/transforms/base.py`.",
        "The layouts live in fnaccel.checkpoint.storage.nowhere.",
        "It calls fnaccel.transforms.kinds.NoSuchKind.",
        "Its hook is `check_pipeline(pipeline, ctx)`.",
        "Tested by tests/test_missing.py::test_it.",
        "Import it from fnaccel.transforms.base.",
        "Its settings record is fnaccel.transforms.kinds.Precision.",  # imported there, defined in declared
    ],
)
def test_a_planted_stale_reference_is_found(planted: str) -> None:
    texts = _texts()
    texts["docs/state.md"] += f"\n{planted}\n"
    assert len(_stale(texts)) == 1


def test_a_planted_stale_relative_path_and_name_in_the_map_are_found() -> None:
    texts = _texts()
    texts["fnaccel/README.md"] += (
        "\nThe hooks are in `transforms/base.py`, read by `config.with_launch_env`.\n"
    )
    assert _stale(texts) == [
        "fnaccel/README.md: `transforms/base.py`",
        "fnaccel/README.md: `config.with_launch_env`",
    ]


def _map_layers(text: str) -> dict[str, str]:
    """The Layers block of fnaccel/README.md: each entry (``dist.py``, ``checkpoint/storage/``) to
    its layer, named as tests/test_layering.py names them."""
    block = text.split("**Layers: imports point down.**", 1)[1].split("```", 2)[1]
    placed: dict[str, str] = {}
    layer = ""
    for line in block.splitlines():
        if not line.strip():
            continue
        entries = line
        if not line[0].isspace():  # a layer's first line names it; an indented one continues it
            name = "the loop" if line.startswith("the loop") else line.split()[0]
            layer, entries = name.removeprefix("the "), line[len(name) :]
        for entry in re.findall(r"[\w/]+(?:\.py|/)", entries):
            placed[entry] = layer
    return placed


def _placement(placed: dict[str, str], module: Path) -> str | None:
    """The layer the map gives ``module``: its own entry, else its closest folder's."""
    relative = module.relative_to(PACKAGE).as_posix()
    if relative in placed:
        return placed[relative]
    folders = [f for f in placed if f.endswith("/") and relative.startswith(f)]
    return placed[max(folders, key=len)] if folders else None


def _misplaced(text: str) -> list[str]:
    placed = _map_layers(text)
    wrong = [
        f"`{entry}` is placed but is not in fnaccel/" for entry in placed if not (PACKAGE / entry).exists()
    ]
    for module in sorted(PACKAGE.rglob("*.py")):
        layer = _placement(placed, module)
        expected = layer_of(module_name(module))
        if layer != expected:
            wrong.append(
                f"{module.relative_to(PACKAGE)}: the map says {layer}, tests/test_layering.py {expected}"
            )
    return wrong


def test_the_map_places_every_module_in_its_layer() -> None:
    assert _misplaced((PACKAGE / "README.md").read_text()) == []


def test_a_module_missing_from_the_map_is_found() -> None:
    text = (PACKAGE / "README.md").read_text().replace("calls.py, ", "", 1)
    assert _misplaced(text) == ["calls.py: the map says None, tests/test_layering.py leaves"]
