"""A plain PyTorch DDP script and its fnaccel port train the same weights, bit for bit, and the
port resumes exactly (docs/from-pytorch.md; issue 37 point 5).

Each runs on 1 process as nanoGPT's single-device `python train.py` (no launcher: a launcher of
one process adds only its own imports), and on 2 processes launched, plain_train.py with torchrun
(`python -m torch.distributed.run`), fnaccel_train.py with `fnaccel launch`: four runs, started
together. Both use
AdamW with decay and no-decay groups (the optimizer's parameter order is not the model's),
clipping that acts at every update, gradient accumulation (`no_sync` in the plain script,
`fa.accumulate` in the port), a learning rate set by hand on the live optimizer before each
update, random windows drawn with replacement from each process's own generator, and no dropout.
In the port's launch the script runs three times, as `python fnaccel_train.py` would: through
to the end; cut after its save at iteration 4; started again, resuming from that save.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

pytestmark = pytest.mark.multiprocess

HERE = Path(__file__).resolve().parent
PLAIN, PORT = HERE / "plain_train.py", HERE / "fnaccel_train.py"
GRAD_CLIP = 0.25  # both scripts' grad_clip
STOP_AFTER = 4

# Runs the port several times in one launch, each as `python fnaccel_train.py ARGS` would (a new
# fa.init each time: nothing of a run stays in the process), with one marker per run from rank 0.
_DRIVER = """\
import json, os, runpy, sys
script, runs = sys.argv[1], json.loads(sys.argv[2])
for argv in runs:
    if os.environ.get("RANK", "0") == "0":
        print("=== " + " ".join(argv), flush=True)
    sys.argv = [script, *argv]
    runpy.run_path(script, run_name="__main__")
"""


def _environment() -> dict[str, str]:
    """This process's environment without a launcher's variables (a test may run under one)."""
    launch = (
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "GROUP_RANK",
        "GROUP_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
    )
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in launch and not k.startswith(("FNACCEL_", "TORCHELASTIC_"))
    }
    return {**env, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _runs(out: Path) -> list[list[str]]:
    return [
        ["--out", str(out / "whole")],
        ["--out", str(out / "cut"), "--stop-after", str(STOP_AFTER)],
        ["--out", str(out / "cut")],
    ]


@pytest.fixture(scope="module")
def launches(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, dict[str, str]]]:
    """The four runs, side by side; each one's output by name. Every process they started
    is killed (by process group) when the fixture ends, however it ends."""
    tmp = tmp_path_factory.mktemp("ports")
    driver = tmp / "driver.py"
    driver.write_text(_DRIVER)
    commands = {
        "plain1": [sys.executable, str(PLAIN), "--out", str(tmp / "plain1")],
        "port1": [sys.executable, str(driver), str(PORT), json.dumps(_runs(tmp / "port1"))],
        "plain2": [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
            str(PLAIN),
            "--out",
            str(tmp / "plain2"),
        ],
        "port2": [
            sys.executable,
            "-m",
            "fnaccel",
            "launch",
            "-q",
            "--cpu",
            "--num_processes",
            "2",
            "--num_cpu_threads_per_process",
            "1",
            str(driver),
            str(PORT),
            json.dumps(_runs(tmp / "port2")),
        ],
    }
    started = {}
    try:
        for name, command in commands.items():
            with open(tmp / f"{name}.log", "w") as log:  # files: a full pipe would block a launch
                started[name] = subprocess.Popen(
                    command,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env={**_environment(), "FNACCEL_USE_CPU": "true"},  # what the launch's --cpu sets
                    start_new_session=True,
                )
        outputs = {}
        for name, process in started.items():
            process.wait(timeout=600)
            outputs[name] = (tmp / f"{name}.log").read_text()
            assert process.returncode == 0, (
                f"{name} ({' '.join(commands[name])}) failed:\n{outputs[name][-8000:]}"
            )
        yield tmp, outputs
    finally:
        for process in started.values():  # the launcher's session holds its workers
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def _weights(path: Path) -> dict[str, torch.Tensor]:
    return load_file(path / "weights.safetensors")


def _differing(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict[str, float]:
    assert a.keys() == b.keys()
    return {k: (a[k] - b[k]).abs().max().item() for k in a if not torch.equal(a[k], b[k])}


def _grad_norms(output: str) -> list[str]:
    return re.findall(r"^iter \d+: .*grad norm ([\d.]+)", output, re.M)


@pytest.mark.parametrize("num_processes", [1, 2])
def test_the_port_trains_the_plain_scripts_weights_bit_for_bit(
    launches: tuple[Path, dict[str, str]], num_processes: int
) -> None:
    """Clipping acts at every update (each printed norm is above the clip), over the model's
    parameter order although the optimizer's groups order them otherwise; accumulation and the
    hand-set learning rate are on: the final weights are equal, not close."""
    tmp, outputs = launches
    plain_norms = _grad_norms(outputs[f"plain{num_processes}"])
    assert len(plain_norms) == 12 and all(float(norm) > GRAD_CLIP for norm in plain_norms)
    port_output = re.split(r"^=== .*$", outputs[f"port{num_processes}"], flags=re.M)[1]  # the whole run
    assert _grad_norms(port_output) == plain_norms
    plain = _weights(tmp / f"plain{num_processes}")
    assert _differing(_weights(tmp / f"port{num_processes}" / "whole"), plain) == {}


@pytest.mark.parametrize("num_processes", [1, 2])
def test_the_port_resumed_from_a_mid_run_save_ends_as_the_uninterrupted_run(
    launches: tuple[Path, dict[str, str]], num_processes: int
) -> None:
    """The save at iteration 4 of 12 holds the weights, AdamW's moments, the data position in
    the random windows, the hand-set learning rate's iteration (state.step) and the registered
    best_val_loss; the run started again from it ends with the uninterrupted run's weights."""
    tmp, outputs = launches
    out = tmp / f"port{num_processes}"
    assert f"resumed from {out / 'cut' / 'ckpt'} at iteration {STOP_AFTER}" in outputs[f"port{num_processes}"]
    assert _differing(_weights(out / "cut"), _weights(out / "whole")) == {}
