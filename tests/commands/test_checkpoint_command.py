"""``fnaccel checkpoint inspect|verify|diff``: bad input is one line and exit 2, never a traceback."""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import fnaccel as fa
from fnaccel.checkpoint.manifest import manifest_hash
from fnaccel.commands.main import main
from tests.commands._inspect import inspect_in_a_new_process


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    model = nn.Linear(3, 2)
    state = fa.prepare(fa.init(seed=0, cpu=True), model, torch.optim.SGD(model.parameters(), lr=0.1))
    fa.save(state, tmp_path / "ckpt")
    return tmp_path / "ckpt"


def _error(capsys: Any) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


def _rehash(directory: Path, name: str) -> None:
    """Make the manifest agree with an edited file's size (as a hostile checkpoint would)."""
    manifest = json.loads((directory / "fnaccel.json").read_text())
    manifest["files"][name]["size"] = (directory / name).stat().st_size
    manifest["manifest_sha256"] = manifest_hash(manifest)
    (directory / "fnaccel.json").write_text(json.dumps(manifest))


def test_inspect_and_verify_a_good_checkpoint(ckpt: Path, capsys: Any) -> None:
    assert main(["checkpoint", "inspect", str(ckpt)]) == 0
    assert "model        8 parameters: float32 8" in capsys.readouterr().out
    assert main(["checkpoint", "verify", str(ckpt)]) == 0
    assert "intact" in capsys.readouterr().out


@pytest.mark.parametrize("command", ["inspect", "verify"])
def test_not_a_checkpoint(tmp_path: Path, capsys: Any, command: str) -> None:
    assert main(["checkpoint", command, str(tmp_path / "nothing")]) == 2
    assert "fnaccel.json is missing" in _error(capsys)


def test_a_truncated_file_is_named(ckpt: Path, capsys: Any) -> None:
    data = (ckpt / "model.safetensors").read_bytes()
    (ckpt / "model.safetensors").write_bytes(data[:-4])
    for command in ("inspect", "verify"):
        assert main(["checkpoint", command, str(ckpt)]) == 2
        assert "model.safetensors: truncated or extended" in _error(capsys)


def test_a_hostile_header_is_refused_before_it_is_read(ckpt: Path, capsys: Any) -> None:
    path = ckpt / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(struct.pack("<Q", 2**62) + data[8:])  # a header "longer" than the file
    _rehash(ckpt, "model.safetensors")
    assert main(["checkpoint", "inspect", str(ckpt)]) == 2
    assert "header length 4611686018427387904 runs past the end of the file" in _error(capsys)


def test_a_file_replaced_by_a_symlink_is_refused(ckpt: Path, tmp_path: Path, capsys: Any) -> None:
    shutil.move(ckpt / "model.safetensors", tmp_path / "elsewhere")
    (ckpt / "model.safetensors").symlink_to(tmp_path / "elsewhere")
    assert main(["checkpoint", "inspect", str(ckpt)]) == 2
    assert "model.safetensors: a symbolic link" in _error(capsys)


def test_inspect_imports_no_torch(ckpt: Path, capsys: Any) -> None:
    # a new process prints what main() prints in this one, without importing torch (tests/debug/
    # test_two_runs_tools.py checks the same for a sharded fsdp() checkpoint)
    for flags in ((), ("--json",)):
        assert main(["checkpoint", "inspect", *flags, str(ckpt)]) == 0
        in_process = capsys.readouterr().out
        fresh = inspect_in_a_new_process(ckpt, *flags)
        assert fresh == {"code": 0, "out": in_process, "modules": []}, fresh
    (ckpt / "model.safetensors").write_bytes(b"\0" * 3)  # a bad file: the one error line, still no torch
    done = subprocess.run(
        [sys.executable, "-m", "fnaccel", "checkpoint", "inspect", str(ckpt)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert "model.safetensors: truncated or extended" in done.stderr


def test_diff_exit_codes(ckpt: Path, tmp_path: Path, capsys: Any) -> None:
    assert main(["checkpoint", "diff", str(ckpt), str(ckpt)]) == 0
    capsys.readouterr()
    assert main(["checkpoint", "diff", "--json", str(ckpt), str(ckpt)]) == 0
    assert json.loads(capsys.readouterr().out) == {"equal": True, "differences": []}
    assert main(["checkpoint", "diff", "--atol", "-1", str(ckpt), str(ckpt)]) == 2
    assert "--atol and --rtol must be >= 0" in _error(capsys)
    assert main(["checkpoint", "diff", str(ckpt), str(tmp_path)]) == 2
    assert "fnaccel.json is missing" in _error(capsys)
