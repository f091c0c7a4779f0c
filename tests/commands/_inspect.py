"""``fnaccel checkpoint inspect`` in a fresh interpreter, reporting which heavy packages it imported."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

# Runs the command as the console script does, then prints its exit code, its output and which
# of the heavy packages the process imported: inspect must answer from the manifest, the JSON
# files and the safetensors headers alone, so a new process needs no torch (seconds to import).
_INSPECT_THEN_MODULES = """
import contextlib, io, json, sys
from fnaccel.commands.main import main
with contextlib.redirect_stdout(io.StringIO()) as out:
    code = main(sys.argv[1:])
heavy = ("torch", "numpy", "safetensors")
print(json.dumps({"code": code, "out": out.getvalue(), "modules": sorted(m for m in sys.modules if m in heavy)}))
"""


def inspect_in_a_new_process(directory: Path, *flags: str) -> dict[str, Any]:
    """``fnaccel checkpoint inspect [flags] directory`` in a new interpreter: ``{"code", "out", "modules"}``."""
    done = subprocess.run(
        [sys.executable, "-c", _INSPECT_THEN_MODULES, "checkpoint", "inspect", *flags, str(directory)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return json.loads(done.stdout)
