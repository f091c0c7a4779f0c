"""The examples run and do what they say: the main job (examples/train_classifier.py) learns, every
other example runs at its --tiny size, and none uses a name docs/api.md does not list."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"


@pytest.mark.multiprocess
def test_the_classifier_example_trains_on_two_processes_and_writes_its_weights(
    two_process_launch: tuple[dict[str, str], Path],
) -> None:
    """The README's main job: `fnaccel launch --cpu --num_processes 2 examples/train_classifier.py`
    (the first run of the two-process launch below: fresh processes, the same flags)."""
    out, tmp_path = two_process_launch
    output = tmp_path / "weights.safetensors"
    printed = out[f"train_classifier.py --epochs 10 --output {output}"]
    accuracy = float(re.findall(r"test accuracy ([0-9.]+)", printed)[-1])
    assert accuracy > 0.8, printed  # chance is 0.33
    weights = load_file(output)
    assert set(weights) == {"0.weight", "0.bias", "3.weight", "3.bias", "6.weight", "6.bias"}
    logged = [
        json.loads(line) for line in (tmp_path / "classifier" / "metrics.jsonl").read_text().splitlines()
    ]
    assert [entry["values"]["epoch"] for entry in logged] == list(
        range(1, 11)
    )  # the main process only: once each
    assert round(logged[-1]["values"]["test_accuracy"], 3) == accuracy


def _documented_names() -> dict[str, set[str]]:
    """What an example may use: each docs/api.md section's names, and of `fnaccel.utils` (which
    api.md lists as a module of Accelerate's utilities) the names its docs pages document."""
    import fnaccel.utils

    api = (ROOT / "docs" / "api.md").read_text()
    names = {
        module: set(re.findall(r"^- `(\w+)`", body, re.M))
        for module, body in re.findall(r"^## `(fnaccel[\w.]*)`\n(.*?)(?=^## |\Z)", api, re.M | re.S)
    }
    documented = {
        word for page in (ROOT / "docs").glob("*.md") for word in re.findall(r"`(\w+)", page.read_text())
    }
    names["fnaccel.utils"] = set(fnaccel.utils.__all__) & documented
    return names


def _undocumented_uses(source: str, names: dict[str, set[str]]) -> list[str]:
    """Every `fa.X`, `fa.ops.X`, `from fnaccel... import X` of `source` that `names` lacks."""
    import ast

    tree, aliases, bad = ast.parse(source), {}, []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for imported in (a for a in node.names if a.name.split(".")[0] == "fnaccel"):
                if imported.name not in names:  # `import fnaccel.data.sharding`
                    bad.append(f"line {node.lineno}: import {imported.name}")
                aliases[imported.asname or "fnaccel"] = (imported.asname and imported.name) or "fnaccel"
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "fnaccel":
            for imported in node.names:
                if f"{node.module}.{imported.name}" in names:  # a module (`from fnaccel import ops`)
                    aliases[imported.asname or imported.name] = f"{node.module}.{imported.name}"
                elif imported.name not in names.get(node.module or "", ()):
                    bad.append(f"line {node.lineno}: from {node.module} import {imported.name}")
    for node in ast.walk(tree):
        chain: list[str] = []
        while isinstance(node, ast.Attribute):
            chain.insert(0, node.attr)
            node = node.value
        if not (isinstance(node, ast.Name) and node.id in aliases and chain):
            continue
        module = aliases[node.id]
        for attribute in chain:
            if f"{module}.{attribute}" in names:
                module = f"{module}.{attribute}"
                continue
            if attribute not in names.get(module, ()):
                bad.append(f"line {node.lineno}: {module}.{attribute}")
            break
    return sorted(set(bad))  # `fa.x.y` is walked as `fa.x.y`, then as `fa.x`


def test_examples_use_only_the_names_docs_api_md_lists() -> None:
    """An example uses the public surface only: each `fa.X`, `fa.ops.X`, `fa.utils.X` and
    `from fnaccel... import X` is a name docs/api.md lists (for `fnaccel.utils`: one its docs
    document), never an implementation detail a user could not look up."""
    names = _documented_names()
    bad = {
        path.name: found
        for path in sorted(EXAMPLES.glob("*.py"))
        if (found := _undocumented_uses(path.read_text(), names))
    }
    assert not bad
    # and the check sees what it must
    assert _undocumented_uses("import fnaccel as fa\nfa.ops.gather\nfa.fsdp()\nfa.utils.save", names) == []
    assert _undocumented_uses(
        "import fnaccel as fa\nfrom fnaccel import ops as o\nfrom fnaccel.utils import nothing\n"
        "fa.no_such_name(x)\nfa.ops.gather_all\no.nope\nfa.utils.u.v\nimport fnaccel.data.sharding\n"
        "from fnaccel.data import loader",
        names,
    ) == [
        "line 3: from fnaccel.utils import nothing",
        "line 4: fnaccel.no_such_name",
        "line 5: fnaccel.ops.gather_all",
        "line 6: fnaccel.ops.nope",
        "line 7: fnaccel.utils.u",
        "line 8: import fnaccel.data.sharding",
        "line 9: from fnaccel.data import loader",
    ]


# ---------------------------------------------------------------------------------------------
# Every example of examples/ runs, at its --tiny size (the classifier at the README's), in two
# processes' worth of launches.
#
# Starting Python with torch costs seconds per process (torch, and torch._dynamo, which the
# first optimizer imports), and a 2-process `fnaccel launch` several more, so the examples are
# not started one process each: one `python` process runs the one-process examples in turn,
# each as `python examples/<x>.py` runs it (`runpy`, `__name__ == "__main__"`, its own argv),
# and one `fnaccel launch --num_processes 2` runs the distributed ones the same way on each
# rank. That several runs share a process is itself the contract (a run leaves nothing behind
# in the process: DESIGN.md, principle 1; `fa.init` after `fa.shutdown` works, any number of
# times). The markers in the output tell which example broke.


_DRIVER = """\
import json, os, runpy, sys
for script, argv in json.loads(sys.argv[1]):
    if os.environ.get("RANK", "0") == "0":  # one marker per run, from the launch's rank 0
        sys.stdout.write("=== " + " ".join([script, *argv]) + "\\n")  # one write: see below
        sys.stdout.flush()
    sys.argv = [script, *argv]
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exit:  # argparse's and the examples' own exits
        if exit.code not in (None, 0):
            raise
"""

# Examples that other tests run: loss_spike.py in tests/debug/test_loss_spike_example.py.
_TESTED_ELSEWHERE = {"loss_spike.py"}
# Run at the size its test needs (the README's main job learns), not --tiny.
_FULL_SIZE = {"train_classifier.py"}


def _run_examples(runs: list[tuple[str, list[str]]], tmp_path: Path, launch: list[str]) -> dict[str, str]:
    """Runs the examples in one process (or one launch), returns each run's output by its marker."""
    driver = tmp_path / "run_examples.py"
    driver.write_text(_DRIVER)
    runs = [
        (str(EXAMPLES / script), argv if script in _FULL_SIZE else ["--tiny", *argv]) for script, argv in runs
    ]
    result = subprocess.run(
        [sys.executable, *launch, str(driver), json.dumps(runs)],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"},  # in order
    )
    sections = re.split(r"^=== (.*)$", result.stdout, flags=re.M)
    outputs = {
        " ".join([Path(key.split()[0]).name, *(word for word in key.split()[1:] if word != "--tiny")]): text
        for key, text in zip(sections[1::2], sections[2::2], strict=False)
    }
    failed = list(outputs)[-1] if outputs else "(none started)"
    assert result.returncode == 0, f"{failed} failed:\n{result.stdout[-4000:]}\n{result.stderr[-8000:]}"
    return {key.strip(): text for key, text in outputs.items()} | {"(all)": result.stdout}


def _one_process_runs(out: Path) -> list[tuple[str, list[str]]]:
    return [
        ("checkpointing.py", ["--output", str(out / "ckpt_whole")]),
        ("checkpointing.py", ["--output", str(out / "ckpt_cut"), "--stop-after", "7"]),
        ("checkpointing.py", ["--output", str(out / "ckpt_cut")]),
        ("tracking.py", ["--output", str(out / "tracking")]),
        ("gradient_accumulation.py", []),
        ("gradient_accumulation_causal_lm.py", []),
        ("batch_size_search.py", []),
        ("early_stopping.py", ["--output", str(out / "early")]),
        ("early_stopping.py", ["--output", str(out / "early"), "--target-loss", "0.2"]),
        ("profiler.py", ["--output", str(out / "profiler")]),
        ("char_gpt.py", ["--output", str(out / "gpt"), "--save-every", "5", "--stop-after", "12"]),
        ("char_gpt.py", ["--output", str(out / "gpt"), "--save-every", "5"]),
        ("deepspeed_with_config.py", ["--output", str(out / "deepspeed")]),  # starts 2 processes itself
    ]


def _two_process_runs(out: Path) -> list[tuple[str, list[str]]]:
    return [
        # first, so that it runs in fresh processes exactly as the README's command runs it
        ("train_classifier.py", ["--epochs", "10", "--output", str(out / "weights.safetensors")]),
        ("local_sgd.py", ["--local-sgd-steps", "4"]),
        ("ddp_comm_hook.py", ["--comm-hook", "power_sgd", "--comm-wrapper", "fp16"]),
        ("multi_process_metrics.py", []),
        ("fsdp_peak_memory.py", ["--output", str(out / "fsdp")]),
        ("cross_validation.py", []),
        ("gan.py", []),
    ]


def test_every_example_is_run_by_a_test(tmp_path: Path) -> None:
    run = {script for script, _ in _one_process_runs(tmp_path) + _two_process_runs(tmp_path)}
    assert run | _TESTED_ELSEWHERE == {path.name for path in EXAMPLES.glob("*.py")}


@pytest.mark.multiprocess
def test_the_one_process_examples_run_and_do_what_they_say(tmp_path: Path) -> None:
    import importlib.util

    runs = _one_process_runs(tmp_path)
    has_deepspeed = importlib.util.find_spec("deepspeed") is not None  # in the test extra
    out = _run_examples(
        [run for run in runs if has_deepspeed or run[0] != "deepspeed_with_config.py"], tmp_path, launch=[]
    )

    def line(key: str, pattern: str) -> re.Match[str]:
        match = re.search(pattern, out[key])
        assert match, f"{key}: no {pattern!r} in:\n{out[key]}"
        return match

    # an interrupted and resumed run ends with the weights of the uninterrupted one, bit for bit
    whole = line(f"checkpointing.py --output {tmp_path / 'ckpt_whole'}", r"fingerprint (\w+)")[1]
    line(f"checkpointing.py --output {tmp_path / 'ckpt_cut'} --stop-after 7", r"stopped after step 7")
    resumed_key = f"checkpointing.py --output {tmp_path / 'ckpt_cut'}"
    line(resumed_key, r"resumed from .*: epoch 0, step 5")
    assert line(resumed_key, r"fingerprint (\w+)")[1] == whole

    logged = (tmp_path / "tracking" / "tracking" / "metrics.jsonl").read_text().splitlines()
    assert len(logged) == int(line(f"tracking.py --output {tmp_path / 'tracking'}", r"(\d+) lines logged")[1])
    line("gradient_accumulation.py", r"36 batches, 9 optimizer updates")
    per_token = float(line("gradient_accumulation_causal_lm.py", r"epoch 3: .* loss per token ([\d.]+)")[1])
    assert per_token < 3.0  # a mean per token (chance: log 17 = 2.8), not the window's sum
    line("batch_size_search.py", r"batch 32 fits \(tried \[128, 64, 32\]\); 4 accumulation steps")

    first = f"early_stopping.py --output {tmp_path / 'early'}"
    line(first, r"smoothed loss .*: stopping")
    next_epoch = line(first, r"a resume starts at epoch (\d+)")[1]
    line(f"{first} --target-loss 0.2", rf"resumed at the start of epoch {next_epoch} ")

    line(f"profiler.py --output {tmp_path / 'profiler'}", r"ProfilerStep")
    assert (tmp_path / "profiler" / "profile_0.json").stat().st_size > 0

    gpt = f"char_gpt.py --output {tmp_path / 'gpt'} --save-every 5"
    line(f"{gpt} --stop-after 12", r"stopped after step 12")
    line(gpt, r"resumed from .* at step 10 ")
    line(gpt, r"It writes:\nI\n\nFrom fairest")  # the prompt, then what it learnt

    if not has_deepspeed:
        pytest.skip(
            "deepspeed is not installed (pip install 'fnaccel[deepspeed]'): the others ran, "
            "deepspeed_with_config.py did not"
        )
    line(
        f"deepspeed_with_config.py --output {tmp_path / 'deepspeed'}",
        r"pipeline from the config: compose\(deepspeed\(gradient_accumulation_steps=2, gradient_clipping=1.0, "
        r"zero_stage=2",
    )
    assert {p.name for p in (tmp_path / "deepspeed" / "checkpoint").glob("rank*.zero.safetensors")} == {
        "rank0.zero.safetensors",
        "rank1.zero.safetensors",
    }


@pytest.fixture(scope="module")
def two_process_launch(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, str], Path]:
    """One `fnaccel launch --cpu --num_processes 2` of every distributed example, the classifier
    first: each run's output by its marker, and the directory they wrote in."""
    tmp_path = tmp_path_factory.mktemp("two_process_examples")
    launch = [
        "-m",
        "fnaccel",
        "launch",
        "-q",
        "--cpu",
        "--num_processes",
        "2",
        "--num_cpu_threads_per_process",
        "1",
    ]
    return _run_examples(_two_process_runs(tmp_path), tmp_path, launch=launch), tmp_path


@pytest.mark.multiprocess
def test_the_distributed_examples_run_on_two_processes(
    two_process_launch: tuple[dict[str, str], Path],
) -> None:
    out, tmp_path = two_process_launch

    def lines(key: str, pattern: str) -> list[Any]:
        found = re.findall(pattern, out[key])
        assert found, f"{key}: no {pattern!r} in:\n{out[key]}"
        return found

    spread = lines("local_sgd.py --local-sgd-steps 4", r"step (\d+): .* differ by up to ([\d.e+-]+)")
    assert len(spread) > 4 and all((float(by) == 0) == (int(step) % 4 == 0) for step, by in spread), spread
    # the replicas agree right after each average, and only then
    lines(
        "ddp_comm_hook.py --comm-hook power_sgd --comm-wrapper fp16",
        r"epoch 2 \(power_sgd hook, fp16 wrapper\)",
    )
    counts = lines("multi_process_metrics.py", r": (\d+) samples, accuracy ([\d.]+)")
    assert counts[0] == counts[1] and counts[0][0] == "103"  # both forms count every sample once
    # each rank prints its own figures straight to the launch's stdout. Unbuffered, `print` writes
    # the text and its newline in two writes, so the other rank's line can land between them (seen
    # in CI: "... holds parametersrank 1 epoch 1: ... holds parameters\n\n"): match lazily
    held = lines("(all)", r"rank (\d) epoch 1: .*? holds parameters")
    assert sorted(held) == ["0", "1"] and (tmp_path / "fsdp" / "model.safetensors").exists()
    initial = lines("cross_validation.py", r"fold \d: initial weight\[0, 0\] ([-+.\d]+)")
    with torch.random.fork_rng():  # the example's one seed: fold k's model is the (k+1)-th built after it
        torch.manual_seed(0)
        built = [
            nn.Sequential(nn.Linear(6, 64), nn.ReLU(), nn.Linear(64, 2))[0].weight[0, 0].item()
            for _ in initial
        ]
    assert initial == [f"{w:+.4f}" for w in built] and initial[0] != initial[1]
    lines("gan.py", r"epoch 1: .* modes covered")
