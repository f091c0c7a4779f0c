"""``fnaccel estimate-memory``: local models only, numbers checked by hand."""

from __future__ import annotations

import json
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from fnaccel.commands.main import main

ROOT = Path(__file__).resolve().parents[2]

# embed 16x4 float32 = 256 B; layers.0.fc 8x4 float16 = 64 B (128 B in float32); layers.1.fc 8x4
# float32 = 128 B; step: 3 int64 = 24 B, which no dtype changes. In float32: 256 + 128 + 128 + 24 = 536.
TENSORS = {
    "embed.weight": torch.zeros(16, 4),
    "layers.0.fc.weight": torch.zeros(8, 4, dtype=torch.float16),
    "layers.1.fc.weight": torch.zeros(8, 4),
    "step": torch.zeros(3, dtype=torch.int64),
}

FACTORY = """
from torch import nn

def make_model():
    model = nn.Sequential(nn.Linear(64, 64), nn.Sequential(nn.Linear(64, 32), nn.Linear(32, 64)))
    return model

def make_blocks():
    model = make_model()
    model._no_split_modules = ["Sequential"]
    return model

def not_a_model():
    return 3
"""


def estimate(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    status = main(["estimate-memory", *args])
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def table_rows(out: str) -> dict[str, list[str]]:
    rows = [
        [cell.strip() for cell in line.strip("│").split("│")]
        for line in out.splitlines()
        if line.startswith("│") and line.count("│") == 5
    ]
    return {row[0]: row[1:] for row in rows}


def test_a_safetensors_file_by_hand(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    save_file(TENSORS, tmp_path / "model.safetensors")
    status, out, _ = estimate(capsys, str(tmp_path / "model.safetensors"))
    assert status == 0
    assert "Memory Usage for loading `" in out
    assert table_rows(out)["dtype"] == [
        "Largest Layer or Residual Group",
        "Total Size",
        "Training using Adam (Peak vRAM)",
    ]
    # The largest layer is the embedding (256 B float32) against each numbered block (128 B).
    # Adam: 4 x the float32 size (2144 B = 2.09 KB); float16 mixed precision: 2 x (1072 B = 1.05 KB).
    assert table_rows(out)["float32"] == ["256 bytes", "536 bytes", "2.09 KB"]
    assert table_rows(out)["float16"] == ["128 bytes", "280 bytes", "1.05 KB"]
    assert table_rows(out)["int8"] == ["64 bytes", "152 bytes", "N/A"]
    assert table_rows(out)["int4"] == ["32 bytes", "88 bytes", "N/A"]


def test_sharded_safetensors_through_the_index_or_the_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    names = list(TENSORS)
    save_file({n: TENSORS[n] for n in names[:2]}, tmp_path / "model-00001-of-00002.safetensors")
    save_file({n: TENSORS[n] for n in names[2:]}, tmp_path / "model-00002-of-00002.safetensors")
    weight_map = {n: f"model-0000{1 + (i >= 2)}-of-00002.safetensors" for i, n in enumerate(names)}
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    for target in (index, tmp_path):
        status, out, _ = estimate(capsys, str(target), "--dtypes", "float32")
        assert status == 0 and table_rows(out)["float32"] == ["256 bytes", "536 bytes", "2.09 KB"]
        assert "float16" not in table_rows(out)
    index.unlink()
    status, out, _ = estimate(capsys, str(tmp_path), "--dtypes", "int4")  # every shard, no index
    assert status == 0 and table_rows(out)["int4"] == ["32 bytes", "88 bytes", "N/A"]


def test_a_factory_is_built_on_the_meta_device(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "my_factories.py").write_text(FACTORY)
    monkeypatch.syspath_prepend(str(tmp_path))
    # Linear(64, 64): 4160 floats = 16640 B; Linear(64, 32): 2080 floats; Linear(32, 64): 2112 floats.
    # Total 8352 floats = 33408 B = 32.62 KB; the largest layer is the first (16.25 KB).
    status, out, _ = estimate(capsys, "my_factories:make_model", "--dtypes", "float32", "float16")
    assert status == 0
    assert table_rows(out)["float32"] == ["16.25 KB", "32.62 KB", "130.50 KB"]
    assert table_rows(out)["float16"] == ["8.12 KB", "16.31 KB", "65.25 KB"]
    # Kept whole (its class is in _no_split_modules), the inner Sequential is larger: 4192 floats.
    status, out, _ = estimate(capsys, "my_factories:make_blocks", "--dtypes", "float32")
    assert table_rows(out)["float32"][0] == "16.38 KB"


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("my_factories:missing", "has no function 'missing'"),
        ("my_factories:not_a_model", "returned a int, not an nn.Module"),
        ("no_such_package.models:make", "cannot import 'no_such_package.models'"),
    ],
)
def test_bad_factories(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    name: str,
    message: str,
) -> None:
    (tmp_path / "my_factories.py").write_text(FACTORY)
    monkeypatch.syspath_prepend(str(tmp_path))
    status, out, err = estimate(capsys, name)
    assert status == 2 and out == "" and message in err and err.count("\n") == 1


def test_a_hub_name_says_only_local_models_work_offline(capsys: pytest.CaptureFixture[str]) -> None:
    status, _, err = estimate(capsys, "meta-llama/Llama-2-7b-hf")
    assert status == 2
    assert err.startswith(
        "fnaccel estimate-memory: error: 'meta-llama/Llama-2-7b-hf' is neither a local path"
    )
    assert "local models only" in err and "network" in err


def test_a_config_needs_transformers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    monkeypatch.setitem(sys.modules, "transformers", None)  # import fails, installed or not
    for target in (tmp_path / "config.json", tmp_path):
        status, _, err = estimate(capsys, str(target))
        assert status == 2 and "needs transformers (pip install transformers)" in err


def test_a_config_is_built_with_transformers_auto_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[tuple[str, object]] = []

    class AutoConfig:
        @staticmethod
        def from_pretrained(path: str, trust_remote_code: bool = False) -> dict[str, int]:
            calls.append((path, trust_remote_code))
            return {"width": 10}

    class AutoModel:
        @staticmethod
        def from_config(config: dict[str, int], trust_remote_code: bool = False) -> nn.Module:
            return nn.Linear(config["width"], config["width"])  # 110 floats = 440 B, weight 400

    fake = types.ModuleType("transformers")
    fake.AutoConfig, fake.AutoModel = AutoConfig, AutoModel  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "transformers", fake)
    (tmp_path / "config.json").write_text("{}")
    save_file(TENSORS, tmp_path / "model.safetensors")
    status, out, _ = estimate(
        capsys, str(tmp_path), "--library_name", "transformers", "--trust_remote_code", "--dtypes", "float32"
    )
    assert status == 0 and table_rows(out)["float32"] == ["400 bytes", "440 bytes", "1.72 KB"]
    assert calls == [(str(tmp_path), True)]
    status, out, _ = estimate(capsys, str(tmp_path), "--dtypes", "float32")  # the safetensors win otherwise
    assert table_rows(out)["float32"][1] == "536 bytes"


def test_timm_needs_timm(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "timm", None)
    status, _, err = estimate(capsys, "resnet50", "--library_name", "timm")
    assert status == 2 and "needs timm" in err


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"", "not a readable safetensors file"),
        (b"\xff" * 8 + b"{}", "not a readable safetensors file"),
        ((20).to_bytes(8, "little") + b'{"a": {"dtype": "F32"', "not a readable safetensors file"),
        (
            (63).to_bytes(8, "little")
            + b'{"a": {"dtype": "F4", "shape": [2, 2], "data_offsets": [0, 2]}}'
            + b"\0\0",
            "dtypes ['F4'], which torch has",
        ),
    ],
)
def test_broken_files_are_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: bytes, message: str
) -> None:
    file = tmp_path / "broken.safetensors"
    file.write_bytes(content)
    status, _, err = estimate(capsys, str(file))
    assert status == 2 and message in err and str(file) in err


def test_other_local_mistakes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    status, _, err = estimate(capsys, str(tmp_path))
    assert status == 2 and "no *.safetensors file and no config.json" in err
    (tmp_path / "weights.bin").write_bytes(b"x")
    status, _, err = estimate(capsys, str(tmp_path / "weights.bin"))
    assert status == 2 and "not a .safetensors file" in err
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": "gone.safetensors"}})
    )
    status, _, err = estimate(capsys, str(tmp_path / "model.safetensors.index.json"))
    assert status == 2 and "gone.safetensors, which is missing" in err


@pytest.mark.slow
def test_through_python_dash_m(tmp_path: Path) -> None:
    save_file(TENSORS, tmp_path / "model.safetensors")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "fnaccel",
            "estimate-memory",
            str(tmp_path / "model.safetensors"),
            "--dtypes",
            "float16",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert table_rows(result.stdout) == {
        "dtype": ["Largest Layer or Residual Group", "Total Size", "Training using Adam (Peak vRAM)"],
        "float16": ["128 bytes", "280 bytes", "1.05 KB"],
    }
