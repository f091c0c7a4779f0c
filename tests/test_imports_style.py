"""How fnaccel defers imports, read from every module's source (issue 27 point 5).

- **No class is defined inside a function.** A class made per call is a new type
  each time, cannot be named, imported or pickled, and hides from type checkers;
  defining one inside a function to defer a heavy import is what this forbids. The
  heavy import moves instead to a module that imports it at its top and is itself
  imported lazily (``fnaccel.checkpoint.storage.dcpstore`` holds everything that needs
  ``torch.distributed.checkpoint``).
- **A function makes at most one deferred import** (one ``import`` statement in
  its own body; a nested function counts its own). Two mean the function reaches
  into a heavy package's pieces: they belong in such a module.
- **A deferred import avoids a heavy import**: never of a standard-library
  module, of one its own module already imports at its top, or, in a module that
  imports torch at its top, of one that ``import torch`` loads itself (`WITH_TORCH`).
"""

from __future__ import annotations

import ast
import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch  # noqa: F401 - loads the modules of WITH_TORCH, whose submodules _imported looks up

PACKAGE = Path(__file__).resolve().parents[1] / "fnaccel"
FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef)
# loaded by `import torch` itself (torch 2.13): deferring them saves nothing in a module that uses torch
WITH_TORCH = frozenset({"torch.distributed", "torch.futures", "torch.nn", "torch.utils._pytree"})


def _imported(node: ast.Import | ast.ImportFrom) -> list[str]:
    """The modules an import statement loads: ``from torch.distributed import pipelining``
    loads the submodule ``torch.distributed.pipelining``."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    module = "." * node.level + (node.module or "")
    if (
        module in WITH_TORCH
    ):  # loaded already (the test imports torch): finding its submodules imports nothing
        package = hasattr(sys.modules.get(module), "__path__")
        submodules = [
            f"{module}.{alias.name}"
            for alias in node.names
            if package and importlib.util.find_spec(f"{module}.{alias.name}") is not None
        ]
        return submodules or [module]
    return [module]


def _own_statements(function: ast.FunctionDef | ast.AsyncFunctionDef) -> Iterator[ast.AST]:
    """Every node in ``function``'s body, not descending into nested functions, classes or lambdas."""
    stack: list[ast.AST] = list(function.body)
    while stack:
        node = stack.pop()
        yield node
        if not isinstance(node, (*FUNCTIONS, ast.ClassDef, ast.Lambda)):
            stack.extend(ast.iter_child_nodes(node))


def problems(source: str, where: str) -> list[str]:
    """What in ``source`` (a module's text) breaks the rules above, one line each."""
    tree = ast.parse(source)
    top = {
        name
        for node in tree.body
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for name in _imported(node)
    }
    with_torch = any(name == "torch" or name.startswith("torch.") for name in top)
    found = []
    for function in (n for n in ast.walk(tree) if isinstance(n, FUNCTIONS)):
        at = f"{where}:{function.lineno} {function.name}()"
        own = list(_own_statements(function))
        found += [
            f"{at} defines class {node.name} inside it: define it at module level"
            for node in own
            if isinstance(node, ast.ClassDef)
        ]
        imports = sorted(
            (node for node in own if isinstance(node, (ast.Import, ast.ImportFrom))),
            key=lambda node: node.lineno,
        )
        if len(imports) > 1:
            names = ", ".join(name for node in imports for name in _imported(node))
            found.append(
                f"{at} makes {len(imports)} deferred imports ({names}): import them at the top, "
                "or from one module that is itself imported lazily"
            )
        for name in (name for node in imports for name in _imported(node)):
            if (
                name.split(".")[0] in sys.stdlib_module_names
                or name in top
                or (name in WITH_TORCH and with_torch)
            ):
                found.append(f"{at} defers importing {name}, which costs nothing to import at the top")
    return found


def test_no_class_inside_a_function_and_one_deferred_import_of_a_heavy_module_at_most() -> None:
    found = [
        line
        for path in sorted(PACKAGE.rglob("*.py"))
        for line in problems(path.read_text(), str(path.relative_to(PACKAGE.parent)))
    ]
    assert not found, "\n".join(found)


@pytest.mark.parametrize(
    "source, expected",
    [
        ("def f():\n    class A:\n        pass\n", "f() defines class A inside it"),
        ("def f():\n    if True:\n        class A: ...\n", "f() defines class A inside it"),
        (
            "def f():\n    import deepspeed\n    from torch.distributed.checkpoint import api\n",
            "f() makes 2 deferred imports (deepspeed, torch.distributed.checkpoint",
        ),
        (
            "def f():\n    try:\n        import deepspeed\n    except ImportError:\n        import transformers\n",
            "f() makes 2 deferred imports",
        ),
        ("def f():\n    import json\n", "f() defers importing json"),
        (
            "import torch\n\ndef f():\n    import torch.distributed as dist\n",
            "f() defers importing torch.distributed",
        ),
        (
            "import torch\n\ndef f():\n    from torch.distributed import ReduceOp\n",
            "f() defers importing torch.distributed",
        ),
        ("import deepspeed\n\ndef f():\n    import deepspeed\n", "f() defers importing deepspeed"),
    ],
)
def test_a_planted_breach_is_named(source: str, expected: str) -> None:
    assert any(expected in line for line in problems(source, "m.py")), problems(source, "m.py")


@pytest.mark.parametrize(
    "allowed",
    [
        "def f():\n    import deepspeed\n\n"
        "def g():\n    from fnaccel.checkpoint.storage import dcpstore\n\n"
        "    def inner():\n        import transformers\n\n"  # a nested function counts its own
        "class A:\n    def m(self):\n        import torchao\n",
        "def h():\n    import torch.distributed\n",  # in a module without torch: torch itself is deferred
        "import torch\n\ndef i():\n    from torch.distributed import pipelining\n",  # a submodule torch does not load
    ],
)
def test_what_the_rules_allow(allowed: str) -> None:
    assert problems(allowed, "m.py") == []
