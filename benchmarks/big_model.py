"""Peak memory of loading a big model and running it from disk, against plain PyTorch.

A model of 16 residual blocks of four 2048x2048 ``Linear`` layers (1.07 GB
in float32) is saved as a sharded safetensors checkpoint (``fa.save_model``,
200 MB shards). Then each case runs in a fresh interpreter, which reports its
peak resident memory (``VmHWM``, file-backed pages included) and its
resident memory after the imports, before any work:

``plain torch``
    The hand-written baseline: build the model (random init), then for each
    shard ``model.load_state_dict(safetensors.torch.load_file(shard),
    strict=False)``, then one forward. Its output is the reference.
``load_checkpoint_in_model``
    The model built with ``init_empty_weights`` (on ``meta``), filled with
    ``load_checkpoint_in_model``, then one forward: peak should be about one
    model, never two.
``load_checkpoint_and_dispatch``
    The same empty model through ``load_checkpoint_and_dispatch(...,
    device_map="auto", max_memory={"cpu": "256MB", "disk": "100GB"},
    no_split_module_classes=["Block"])``: a few blocks stay on the CPU, the rest
    are offloaded to a folder and memory-mapped one layer at a time; two
    forwards (cold, warm). Peak should be well under the model's size.

Both fnaccel outputs are compared with the reference (``torch.equal``, and
``allclose``). Run from the repository root::

    python benchmarks/big_model.py [--blocks 16] [--dim 2048] [--cpu 256MB] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
from torch import nn
from torch.nn import functional as F

import fnaccel as fa
from fnaccel.modeling.dispatch import load_checkpoint_and_dispatch
from fnaccel.modeling.empty import init_empty_weights
from fnaccel.modeling.loading import load_checkpoint_in_model
from fnaccel.modeling.tensors import device_for


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc1, self.fc2, self.fc3, self.fc4 = (nn.Linear(dim, dim) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc4(F.gelu(self.fc3(F.gelu(self.fc2(F.gelu(self.fc1(x)))))))


class Net(nn.Module):
    def __init__(self, blocks: int, dim: int) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(Block(dim) for _ in range(blocks)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x)


def _status_mb(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _phase(name: str, folder: Path, args: argparse.Namespace) -> dict[str, Any]:
    """One case, in this (fresh) process; returns its figures."""
    start = _status_mb("VmRSS")
    x = safetensors.torch.load_file(folder / "input.safetensors")["x"]
    checkpoint = folder / "checkpoint"
    figures: dict[str, Any] = {}
    began = time.perf_counter()
    if name == "save":
        torch.manual_seed(0)
        model = Net(args.blocks, args.dim)
        fa.save_model(fa.prepare(fa.init(cpu=True), model), checkpoint, max_shard_size=args.shard)
        return {"bytes": sum(p.numel() * p.element_size() for p in model.parameters())}
    with torch.no_grad():
        if name == "baseline":
            model = Net(args.blocks, args.dim)
            for shard in sorted(checkpoint.glob("*.safetensors")):
                model.load_state_dict(safetensors.torch.load_file(shard), strict=False)
            figures["load_s"] = time.perf_counter() - began
            began = time.perf_counter()
            out = model(x)
            figures["forward_s"] = time.perf_counter() - began
            safetensors.torch.save_file({"out": out}, folder / "reference.safetensors")
        else:
            with init_empty_weights():
                model = Net(args.blocks, args.dim)
            if name == "load":
                load_checkpoint_in_model(model, checkpoint, strict=True)
            else:
                model = load_checkpoint_and_dispatch(
                    model,
                    checkpoint,
                    device_map="auto",
                    max_memory={"cpu": args.cpu, "disk": "100GB"},
                    no_split_module_classes=["Block"],
                    offload_folder=folder / "offload",
                    strict=True,
                )
                places = list(model.hf_device_map.values())
                figures["map"] = {place: places.count(place) for place in sorted(set(places))}
            figures["load_s"] = time.perf_counter() - began
            began = time.perf_counter()
            out = model(x)
            figures["forward_s"] = time.perf_counter() - began
            if name == "dispatch":
                began = time.perf_counter()
                out = model(x)
                figures["warm_forward_s"] = time.perf_counter() - began
                device_map = model.hf_device_map
                figures["on_meta_after"] = all(
                    p.is_meta for n, p in model.named_parameters() if device_for(n, device_map) == "disk"
                )
            reference = safetensors.torch.load_file(folder / "reference.safetensors")["out"]
            figures["equal"] = torch.equal(out, reference)
            figures["allclose"] = torch.allclose(out, reference)
    figures.update(start_mb=start, peak_mb=_status_mb("VmHWM"))
    return figures


def _run(name: str, folder: Path, argv: list[str]) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, __file__, *argv, "--phase", name, "--folder", str(folder)],
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=16)
    parser.add_argument("--dim", type=int, default=2048)
    parser.add_argument("--cpu", default="256MB", help="max_memory for the CPU in the dispatch case")
    parser.add_argument("--shard", default="200MB", help="max_shard_size of the checkpoint")
    parser.add_argument("--keep", help="work in this folder and keep it (default: a temporary one)")
    parser.add_argument("--phase", help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.phase:
        print(json.dumps(_phase(args.phase, Path(args.folder), args)))
        return
    argv = ["--blocks", str(args.blocks), "--dim", str(args.dim), "--cpu", args.cpu, "--shard", args.shard]
    with tempfile.TemporaryDirectory(prefix="fnaccel-big-model-") as scratch:
        folder = Path(args.keep or scratch)
        folder.mkdir(parents=True, exist_ok=True)
        torch.manual_seed(1)
        safetensors.torch.save_file({"x": torch.randn(4, args.dim)}, folder / "input.safetensors")
        model_mb = _run("save", folder, argv)["bytes"] / 2**20
        rows = [
            (label, _run(name, folder, argv))
            for label, name in (
                ("plain torch (baseline)", "baseline"),
                ("load_checkpoint_in_model", "load"),
                ("load_checkpoint_and_dispatch", "dispatch"),
            )
        ]
    print(
        f"model: {args.blocks} blocks x 4 Linear({args.dim}, {args.dim}), {model_mb:.0f} MiB in float32; "
        f"shards of {args.shard}; torch {torch.__version__}"
    )
    print(
        f"{'case':<30} {'peak RSS':>9} {'at start':>9} {'peak-start':>10} {'/ model':>8} "
        f"{'/ baseline':>10} {'load s':>7} {'fwd s':>6}  output"
    )
    base = rows[0][1]["peak_mb"] - rows[0][1]["start_mb"]
    for label, row in rows:
        used = row["peak_mb"] - row["start_mb"]
        check = "reference" if "equal" not in row else f"equal={row['equal']} allclose={row['allclose']}"
        print(
            f"{label:<30} {row['peak_mb']:>7.0f}MB {row['start_mb']:>7.0f}MB {used:>8.0f}MB "
            f"{used / model_mb:>8.2f} {used / base:>10.2f} {row['load_s']:>7.2f} {row['forward_s']:>6.2f}  {check}"
        )
    dispatched = rows[2][1]
    print(
        f"dispatch: device map {dispatched['map']} (blocks), warm forward {dispatched['warm_forward_s']:.2f} s, "
        f"disk weights back on meta after the forward: {dispatched['on_meta_after']}"
    )


if __name__ == "__main__":
    main()
