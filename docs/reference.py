"""mkdocs hook: the API reference, one page per public module, generated from its ``__all__``.

Each name of ``fnaccel``, ``fnaccel.ops``, ``fnaccel.testing`` and ``fnaccel.utils``
gets an entry rendered from its docstring by mkdocstrings, so no public name can be
left out of the reference; a function or class without a docstring is reported,
which the strict build (mkdocs.yml) turns into a failure. The guide's links to files
outside docs/ (examples, the package's README) become the path as text when the file
exists, and are reported when it does not. `DoctestBlocks`, a griffe extension,
shows the docstrings' ``>>>`` examples as code (Markdown would read them as quotes).
"""

from __future__ import annotations

import importlib
import inspect
import logging
import re
from pathlib import Path
from types import ModuleType
from typing import Any

from griffe import Extension, Object
from mkdocs.structure.files import File, Files
from mkdocs.structure.pages import Page

PUBLIC = ("fnaccel", "fnaccel.ops", "fnaccel.testing", "fnaccel.utils")
log = logging.getLogger("mkdocs.plugins.fnaccel_reference")
OUTSIDE_LINK = re.compile(r"\[([^\]]+)\]\((\.\./[^)#\s]+)(#[^)\s]*)?\)")


class DoctestBlocks(Extension):
    """Each run of ``>>>`` lines and their output, up to a blank line, becomes a ``pycon`` block."""

    def on_instance(self, *, obj: Object, **kwargs: Any) -> None:
        if obj.docstring is None or ">>>" not in obj.docstring.value:
            return
        out: list[str] = []
        fence = None
        for line in obj.docstring.value.splitlines():
            if fence is None and line.lstrip().startswith(">>>"):
                fence = line[: len(line) - len(line.lstrip())] + "```"
                out.append(fence + "pycon")
            elif fence is not None and not line.strip():
                out.append(fence)
                fence = None
            out.append(line)
        obj.docstring.value = "\n".join(out + ([fence] if fence else []))


def entry(module: str, attr: str, value: Any, seen: dict[int, str]) -> list[str]:
    if id(value) in seen:  # a name exported twice (by fnaccel and fnaccel.utils, or as an alias)
        return [f"## `{module}.{attr}`", "", f"The same object as {seen[id(value)]}.", ""]
    if isinstance(value, ModuleType):
        return [f"## `{module}.{attr}`", "", f"A module: [its names]({value.__name__}.md).", ""]
    if inspect.isclass(value) or inspect.isroutine(value):
        if not inspect.getdoc(value):
            log.warning("%s.%s has no docstring: write one (the reference is generated from it)", module, attr)
        # the defining module's path: mkdocstrings reads the source statically, and the facades'
        # names are loaded lazily (fnaccel/_lazy.py), which static analysis cannot follow
        path = f"{value.__module__}.{value.__qualname__}"
        seen[id(value)] = f"[`{module}.{attr}`]({module}.md#{path})"
        return [f"::: {path}",
                "    options:", "      show_root_full_path: false", ""]
    return [f"## `{module}.{attr}`", "", f"`{attr} = {value!r}`", ""]


def page(name: str, seen: dict[int, str]) -> str:
    module = importlib.import_module(name)
    lines = [f"# `{name}`", "", inspect.getdoc(module) or "", ""]
    for attr in module.__all__:
        lines += entry(name, attr, getattr(module, attr), seen)
    return "\n".join(lines)


def on_files(files: Files, config: Any) -> Files:
    seen: dict[int, str] = {}
    for name in PUBLIC:
        files.append(File.generated(config, f"reference/{name}.md", content=page(name, seen)))
    return files


def on_page_markdown(markdown: str, page: Page, config: Any, files: Files) -> str:
    here = Path(config["docs_dir"]) / page.file.src_path

    def outside(match: re.Match[str]) -> str:
        target = (here.parent / match.group(2)).resolve()
        if not target.exists():
            log.warning("%s links to %s, which does not exist", page.file.src_path, match.group(2))
        return f"{match.group(1)} (`{target.relative_to(Path(config['docs_dir']).resolve().parent)}`)" \
            if target.exists() else match.group(0)

    return OUTSIDE_LINK.sub(outside, markdown)
