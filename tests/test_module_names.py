"""Module names say which: no two fnaccel modules share a file name, unless they do the same
job in parallel places, and those places are listed here (issue 34 point 4).

A reader who sees ``precision.py`` in a traceback or an import should not have to ask which.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from fnaccel.commands.main import _COMMANDS

PACKAGE = Path(__file__).resolve().parents[1] / "fnaccel"


def _parallel_place(path: Path, root: Path) -> str | None:
    """Why ``path`` may share its name with a module elsewhere, or None."""
    relative = path.relative_to(root)
    if relative.parent == Path("commands") and path.stem in _COMMANDS.values():
        return "the module of an `fnaccel <command>` subcommand, named after it"
    if relative.parent == Path("transforms/plugins"):
        return "an Accelerate plugin's record, named after the engine it configures"
    return None


def duplicated_names(root: Path) -> dict[str, list[Path]]:
    """The module file names used more than once under ``root`` by modules that are not
    in a listed parallel place (packages' ``__init__.py`` aside)."""
    found: defaultdict[str, list[Path]] = defaultdict(list)
    for path in sorted(root.rglob("*.py")):
        if path.name != "__init__.py":
            found[path.name].append(path)
    return {
        name: paths
        for name, paths in found.items()
        if len(paths) > 1 and sum(_parallel_place(p, root) is None for p in paths) > 1
    }


def test_no_two_modules_are_named_alike() -> None:
    duplicated = duplicated_names(PACKAGE)
    assert not duplicated, {
        name: [str(p.relative_to(PACKAGE)) for p in paths] for name, paths in duplicated.items()
    }


def test_a_planted_namesake_is_caught(tmp_path: Path) -> None:
    """The check can fail: a second ``precision.py`` outside the listed places is found, one
    under commands/ named after a subcommand is not."""
    for relative in ("precision.py", "transforms/precision.py", "commands/launch.py", "launch.py"):
        (tmp_path / relative).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / relative).write_text("")
    assert set(duplicated_names(tmp_path)) == {"precision.py"}
