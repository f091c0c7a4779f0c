"""`fnaccel checkpoint inspect` / `verify` and `fa.diff` on a 50M-parameter AdamW checkpoint (~600 MB).

Builds the checkpoint of ``tests/debug/test_diff.py`` (four ``Linear(3536,
3536)``, one AdamW step), then times, ``--rounds`` times in alternation:

``summarize``   the work of ``inspect`` in process (manifest + headers, no tensor)
``inspect``     ``fnaccel checkpoint inspect`` as a new process (it imports no torch)
``import``      ``python -c "import torch"``, for comparison
``verify``      every file's size and checksum through `fa.load`'s verified readers
``sha256``      ``hashlib.sha256`` of the bytes alone (the bound on ``verify``)
``cat``         reading the same files with ``cat`` (the disk, or the page cache)
``diff``        ``fa.diff`` of the checkpoint against itself (every tensor read twice)

Run from the repository root::

    python benchmarks/checkpoint_tools.py [--rounds 3] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import fnaccel as fa
from fnaccel.checkpoint.summary import summarize, verify

WIDTH = 3536


def build(directory: Path) -> Path:
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(4)))
    loader = DataLoader(TensorDataset(torch.randn(8, WIDTH)), batch_size=2)
    state = fa.prepare(
        fa.init(seed=0, cpu=True),
        model,
        torch.optim.AdamW(model.parameters(), lr=1e-4),
        loader,
        loss_fn=lambda m, batch: m(batch[0]).pow(2).mean(),
    )
    state, _ = fa.step(state, next(iter(fa.batches(state))))
    fa.save(state, directory / "ckpt")
    fa.shutdown(state)
    return directory / "ckpt"


def timed(function: object) -> float:
    start = time.perf_counter()
    function()  # type: ignore[operator]
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(dir=args.dir, prefix="fnaccel-bench-"))
    try:
        ckpt = build(root)
        files = [str(p) for p in sorted(ckpt.iterdir())]
        size = sum(Path(f).stat().st_size for f in files)
        summarize(ckpt)
        print(f"checkpoint: {size / 2**20:.0f} MiB in {len(files)} files")
        for _ in range(args.rounds):
            figures = {
                "summarize": timed(lambda: summarize(ckpt)),
                "inspect": timed(
                    lambda: subprocess.run(
                        [sys.executable, "-m", "fnaccel", "checkpoint", "inspect", str(ckpt)],
                        check=True,
                        capture_output=True,
                    )
                ),
                "import": timed(lambda: subprocess.run([sys.executable, "-c", "import torch"], check=True)),
                "verify": timed(lambda: verify(ckpt)),
                "sha256": timed(lambda: [hashlib.sha256(Path(f).read_bytes()).hexdigest() for f in files]),
                "cat": timed(lambda: subprocess.run(["cat", *files], check=True, stdout=subprocess.DEVNULL)),
                "diff": timed(lambda: fa.diff(ckpt, ckpt)),
            }
            print(
                " | ".join(
                    f"{name} {seconds * 1000:.1f} ms" if seconds < 0.1 else f"{name} {seconds:.2f} s"
                    for name, seconds in figures.items()
                ),
                flush=True,
            )
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
