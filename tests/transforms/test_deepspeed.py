"""fa.deepspeed: the real DeepSpeed engine (CPU accelerator, gloo) against fa.ddp(), resume, bad configs."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

import fnaccel as fa
from fnaccel._errors import ConfigError
from fnaccel.transforms.plugins.deepspeed import DeepSpeedPlugin, EngineSettings, resolve_ds_config
from tests.transforms import _deepspeed_fns as fns

pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (pip install 'fnaccel[deepspeed]')")

# bf16 (DeepSpeed keeps bf16 weights and fp32 masters, and reduces bf16 gradients) against ddp with fp32
# weights under bf16 autocast, after one epoch (3 AdamW updates at lr 0.05, weights of about 0.3): the
# largest weight difference measured was 1.6e-2 (AdamW's normalised update turns a rounding difference in
# a small gradient into up to a learning rate's worth of weight)
BF16_ATOL = 5e-2


@pytest.fixture(scope="module")
def ddp_reference(worlds: Any) -> dict[str, Any]:
    return worlds.get(2).run(fns.train, "ddp", None, 2, 0.5)[0]


@pytest.mark.parametrize("stage, explicit", [(1, False), (2, True), (3, False)])
def test_zero_stages_match_ddp_with_accumulation_and_clipping(
    worlds: Any, ddp_reference: dict[str, Any], stage: int, explicit: bool
) -> None:
    # explicit: fa.with_rng, fa.backward and fa.apply_gradients instead of fa.step
    ours = worlds.get(2).run(fns.train, "deepspeed", None, 2, 0.5, explicit=explicit, zero_stage=stage)
    assert ours[0]["step"] == ddp_reference["step"] == 3 and ours[0]["lr"] == ddp_reference["lr"]
    assert ours[0]["losses"] == pytest.approx(ddp_reference["losses"], abs=1e-6)
    assert ours[0]["norms"] == pytest.approx(
        ddp_reference["norms"], abs=1e-6
    )  # clipping engaged: norms > 0.5
    assert min(ddp_reference["norms"]) > 0.5
    for name, tensor in ddp_reference["weights"].items():
        torch.testing.assert_close(ours[0]["weights"][name], tensor, rtol=0, atol=1e-6)
        torch.testing.assert_close(ours[1]["weights"][name], tensor, rtol=0, atol=1e-6)


def test_bf16_stays_within_tolerance_of_ddp(worlds: Any) -> None:
    world = worlds.get(2)
    ours = world.run(fns.train, "deepspeed", "bf16", 2, 0.5, zero_stage=2)[0]
    theirs = world.run(fns.train, "ddp", "bf16", 2, 0.5)[0]
    for name, tensor in theirs["weights"].items():
        torch.testing.assert_close(ours["weights"][name], tensor, rtol=0, atol=BF16_ATOL)
    assert ours["losses"] == pytest.approx(theirs["losses"], abs=2e-2)


def test_an_update_deepspeed_skips_in_bf16_is_reported_and_holds_the_scheduler(worlds: Any) -> None:
    # DeepSpeed 0.19.8's bf16 check_grad_overflow is on: ZeRO-2 skips the update whose gradients are inf
    out = worlds.get(2).run(fns.bf16_overflow)[0]
    assert out["skipped"] == [False, True, False]
    assert not out["moved"]
    first, held, last = out["scheduler_epochs"]
    assert held == first < last, out["scheduler_epochs"]  # the skipped update did not step it


def _pickles(directory: Path) -> list[str]:
    """Files holding a pickle: protocol 2+ opens with 0x80, a zip (torch.save) with PK."""
    return [
        p.name
        for p in directory.rglob("*")
        if p.is_file() and p.read_bytes()[:2] in (b"\x80\x02", b"\x80\x03", b"\x80\x04", b"\x80\x05", b"PK")
    ]


@pytest.mark.parametrize("stage, precision", [(2, "bf16"), (3, None)])
def test_mid_epoch_save_and_load_continue_bit_identical_without_pickle(
    tmp_path: Path, worlds: Any, stage: int, precision: str | None
) -> None:
    path = tmp_path / "ckpt"
    out = worlds.get(2).run(fns.resume, str(path), 4, precision, zero_stage=stage)[0]  # 4 of 6 batches
    assert out["resumed"] == out["losses"]
    for name, tensor in out["expected"].items():
        assert torch.equal(out["got"][name], tensor), name
    files = sorted(p.name for p in path.iterdir())
    assert {"rank0.zero.safetensors", "rank1.zero.safetensors", "model.safetensors"} <= set(files)
    assert _pickles(path) == [] and _pickles(tmp_path / "ckpt-model") == []
    consolidated = load_file(tmp_path / "ckpt-model" / "model.safetensors")  # fa.save_model: full weights
    assert consolidated["first.weight"].shape == (16, 8)


def test_a_save_inside_an_accumulation_is_refused(tmp_path: Path, worlds: Any) -> None:
    with pytest.raises(fa.CheckpointError, match="falls inside an accumulation of 2.*save after the update"):
        worlds.get(2).run(fns.resume, str(tmp_path / "ckpt"), 5, None, zero_stage=1)


def test_auto_values_are_filled_from_the_run_and_conflicts_name_the_fix() -> None:
    run = EngineSettings(
        micro_steps=2, max_grad_norm=1.0, precision="bf16", micro_batch_size=4, num_processes=2, hidden_size=8
    )
    config = resolve_ds_config(
        {
            "train_batch_size": "auto",
            "gradient_accumulation_steps": "auto",
            "gradient_clipping": "auto",
            "bf16": {"enabled": "auto"},
            "zero_optimization": {
                "stage": 3,
                "reduce_bucket_size": "auto",
                "stage3_param_persistence_threshold": "auto",
            },
        },
        run,
    )
    assert config["train_batch_size"] == 16 and config["gradient_accumulation_steps"] == 2
    assert config["gradient_clipping"] == 1.0 and config["bf16"] == {"enabled": True}
    assert config["zero_optimization"]["reduce_bucket_size"] == 64
    assert config["zero_optimization"]["stage3_param_persistence_threshold"] == 80
    assert config["managed_gradient_accumulation"] is False
    bad = {
        "gradient_accumulation_steps is 4 but the pipeline's fa.accumulate says 2; set gradient_accumulation_steps "
        'to "auto"': {"gradient_accumulation_steps": 4},
        "gradient_clipping is 2.0 but the pipeline's fa.clip_grad_norm": {"gradient_clipping": 2.0},
        "bf16.enabled is False but the pipeline asks for fa.autocast": {"bf16": {"enabled": False}},
        "has a 'optimizer' section; fnaccel trains with the optimizer passed to fa.prepare": {
            "optimizer": {"type": "Adam"}
        },
        "zero_optimization.stage must be 0, 1, 2 or 3, got 4": {"zero_optimization": {"stage": 4}},
        "train_batch_size is 10 but batch 4 x accumulation 2 x 2 processes is 16": {"train_batch_size": 10},
        'zero_optimization.stage3_max_live_parameters is "auto" and nothing in the run fills it': {
            "zero_optimization": {"stage3_max_live_parameters": "auto"}
        },
    }
    for message, raw in bad.items():
        with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
            resolve_ds_config(raw, run)


REMOVED_IN_0_19 = (
    "amp",
    "compression_training",
    "curriculum_learning",
    "eigenvalue",
    "elasticity",
    "graph_harvesting",
    "nebula",
    "progressive_layer_drop",
    "quantize_training",
    "sparse_attention",
    "sparse_gradients",
)
REMOVED_ZERO_KEYS = ("mics_hierarchical_params_gather", "mics_shard_size", "zeropp_loco_param")


@pytest.mark.parametrize("key", [*REMOVED_IN_0_19, *(f"zero_optimization.{k}" for k in REMOVED_ZERO_KEYS)])
def test_a_section_deepspeed_removed_is_refused_by_name_before_the_engine(key: str) -> None:
    """DeepSpeed 0.19.6-0.19.8 (issue #8489) refuse these at initialize; fnaccel names each
    and what replaces it (or that nothing does) while resolving the config."""
    raw: dict[str, Any] = (
        {"zero_optimization": {"stage": 3, key.split(".")[1]: 2}} if "." in key else {key: {}}
    )
    with pytest.raises(
        ConfigError, match=rf"'{key}' names a feature DeepSpeed 0.19.6 removed.*Remove the key"
    ):
        resolve_ds_config(raw, EngineSettings(micro_batch_size=1))


def test_the_removed_sections_are_those_the_installed_deepspeed_refuses() -> None:
    """Kept in step with DeepSpeed: its own tables, read from the installed package when there is one."""
    config = pytest.importorskip("deepspeed.runtime.config")
    assert sorted(config._REMOVED_TOP_LEVEL_CONFIG_KEYS) == sorted(REMOVED_IN_0_19)
    assert sorted(config._REMOVED_ZERO_CONFIG_KEYS) == sorted(REMOVED_ZERO_KEYS)


def test_plugin_and_launch_sections_are_checked_where_written(tmp_path: Path) -> None:
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"zero_optimization": {"stage": 1}, "gradient_accumulation_steps": 2}))
    transform = fa.deepspeed(hf_ds_config=str(config))
    assert transform.micro_steps == 2  # the file's accumulation drives fa.step
    with pytest.raises(ConfigError, match="zero_stage is given beside hf_ds_config"):
        fa.deepspeed(hf_ds_config=str(config), zero_stage=2)
    (tmp_path / "bad.json").write_text("[1]")
    with pytest.raises(ConfigError, match="holds a JSON object"):
        fa.deepspeed(hf_ds_config=str(tmp_path / "bad.json"))
    plugin = DeepSpeedPlugin.from_config(
        {
            "zero_stage": "3",
            "offload_param_device": "cpu",
            "zero3_init_flag": "true",
            "gradient_accumulation_steps": "1",
        }
    )
    assert (
        plugin.zero_stage == 3
        and plugin.zero3_init_flag is True
        and plugin.gradient_accumulation_steps is None
    )
    with pytest.raises(ConfigError, match="offload_param_device only applies to zero_stage 3"):
        fa.deepspeed(zero_stage=2, offload_param_device="cpu")
    with pytest.raises(ValueError, match="cannot be combined"):
        fa.compose(fa.deepspeed(), fa.ddp())


def test_pipelines_deepspeed_cannot_run_are_refused_before_the_engine_starts(worlds: Any) -> None:
    world = worlds.get(2)
    with pytest.raises(ValueError, match="normalize='items'.*use normalize='mean'"):
        world.run(fns.prepare_only, "items")
    with pytest.raises(
        ValueError, match="CPU accelerator has no fp16 training; use fa.autocast\\(fa.bf16\\)"
    ):
        world.run(fns.prepare_only, "fp16")
    with pytest.raises(ValueError, match="pass both in the same fa.prepare call"):
        world.run(fns.prepare_only, "no optimizer")
    with pytest.raises(
        ConfigError, match="gradient_accumulation_steps is 4 but the pipeline's fa.accumulate"
    ):
        world.run(fns.prepare_only, "accumulation")


def test_two_models_each_with_its_own_engine_train_as_each_would_alone(worlds: Any) -> None:
    world = worlds.get(2)
    interleaved = world.run(fns.two_engines, True)[0]  # ZeRO-1 and ZeRO-3 engines, stepped in turn
    alone = world.run(fns.two_engines, False)[0]
    assert len(interleaved[0]) == len(interleaved[1]) == 6
    assert interleaved[0] == pytest.approx(alone[0], abs=1e-6) and interleaved[1] == pytest.approx(
        alone[1], abs=1e-6
    )


def _launched_under(state: fa.RunState, env: dict[str, str], out: str) -> None:
    """tests/commands/_launched.py's run in this world's processes, under a launch's variables
    (its own `fa.init` beside the world's run); the variables and the process's generator after."""
    from tests.commands import _launched

    before = {name: os.environ.get(name) for name in env}
    generator = torch.random.get_rng_state()
    os.environ.update(env)
    try:
        _launched.main(Path(out), kill=False)
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        torch.random.set_rng_state(generator)


@pytest.mark.multiprocess
def test_an_accelerate_deepspeed_yaml_launches_trains_and_resumes_in_fresh_processes(
    tmp_path: Path, worlds: Any
) -> None:
    """The yaml launched for real trains and saves at step 6; the world's processes (fresh to that
    checkpoint), under the variables the same launch gives its workers, resume from it and end with
    the launched run's weights. (The world instead of a second launch: DeepSpeed is imported there.)"""
    from fnaccel.commands.launch import launch_environment, resolve
    from fnaccel.commands.main import build_parser

    config = tmp_path / "ds.yaml"
    config.write_text(
        "compute_environment: LOCAL_MACHINE\ndistributed_type: DEEPSPEED\nuse_cpu: true\nnum_processes: 2\n"
        "mixed_precision: 'no'\ndeepspeed_config:\n  zero_stage: 2\n  offload_optimizer_device: cpu\n"
        "  offload_param_device: none\n  gradient_accumulation_steps: 2\n  gradient_clipping: 1.0\n"
        "  zero3_init_flag: false\n"
    )
    script = Path(__file__).parents[1] / "commands" / "_launched.py"
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    straight.mkdir()
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "fnaccel",
            "launch",
            "-q",
            "--config_file",
            str(config),
            str(script),
            str(straight),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    resumed.mkdir()
    shutil.copytree(straight / "ckpt", resumed / "ckpt")  # the launched run's checkpoint at step 6
    args = build_parser().parse_args(["launch", "--config_file", str(config), str(script)])
    env = {k: v for k, v in launch_environment(args, resolve(args)).items() if k.startswith("FNACCEL_")}
    worlds.get(2).run(_launched_under, env, str(resumed))
    runs = [json.loads((out / "report.json").read_text()) for out in (straight, resumed)]
    assert [run[0]["pipeline"] for run in runs] == [
        "compose(deepspeed(gradient_accumulation_steps=2, gradient_clipping=1.0, "
        "zero_stage=2, offload_optimizer_device='cpu', zero3_init_flag=False))"
    ] * 2
    assert (
        runs[0][0]["steps"] == runs[1][0]["steps"] == 8
        and not runs[0][0]["resumed"]
        and runs[1][0]["resumed"]
    )
    first, second = (load_file(out / "final" / "model.safetensors") for out in (straight, resumed))
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)


@pytest.mark.multiprocess
def test_mixed_precision_fp8_from_the_launch_trains(tmp_path: Path) -> None:
    pytest.importorskip("torchao", reason="torchao is not installed (pip install 'fnaccel[fp8]')")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "fnaccel",
            "test",
            "--cpu",
            "--num_processes",
            "1",
            "--mixed_precision",
            "fp8",
            "--fp8_format",
            "HYBRID",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    line = next(line for line in result.stdout.splitlines() if "mixed precision ...." in line)
    assert "ok (compose(autocast(dtype='fp8', recipe=FP8RecipeKwargs(fp8_format='HYBRID')))" in line
    assert "float8 and bf16" in line


def test_zero3_init_builds_partitioned_and_trains_like_a_whole_model(worlds: Any) -> None:
    world = worlds.get(2)
    ours = world.run(fns.zero3_init)[0]
    assert all(n == 0 for n in ours["local"].values())  # nothing whole on a rank before prepare
    whole = world.run(fns.train, "deepspeed", None, 1, None, zero_stage=3)[0]
    for name, tensor in whole["weights"].items():
        torch.testing.assert_close(ours["weights"][name], tensor, rtol=0, atol=1e-6)


def test_the_literal_port_with_its_scheduler_built_first_trains_as_under_ddp(worlds: Any) -> None:
    # Accelerate's DeepSpeed example: a weight-decay split with one group empty, which DeepSpeed drops from
    # the optimizer in place, and the scheduler built before fa.prepare. Before: the first update raised
    # "zip() argument 2 is longer than argument 1" inside torch's scheduler, on both ranks
    world = worlds.get(2)
    ours = world.run(fns.literal_port, "deepspeed")[0]
    theirs = world.run(fns.literal_port, "ddp")[0]
    assert ours["groups"] == 1 and theirs["groups"] == 2  # DeepSpeed dropped the empty group; ddp() kept it
    assert ours["step"] == theirs["step"] == 6 and ours["rates"] == theirs["rates"]
    assert ours["losses"] == pytest.approx(theirs["losses"], abs=1e-6)
    for name, tensor in theirs["weights"].items():
        torch.testing.assert_close(ours["weights"][name], tensor, rtol=0, atol=1e-6)


def test_the_docs_example_runs_as_written(worlds: Any, tmp_path: Path) -> None:
    page = (Path(__file__).parents[2] / "docs" / "deepspeed.md").read_text()
    code = next(
        block
        for block in re.findall(r"```python\n(.*?)```", page, re.S)
        if "fa.deepspeed(zero_stage=3)" in block
    )
    out = worlds.get(2).run(fns.doc_example, code, str(tmp_path))[0]
    assert out["step"] > 0 and out["groups"] == 1  # trained, its scheduler realigned to the group kept
    assert (tmp_path / "ckpt" / "model.safetensors").is_file() and (
        tmp_path / "model" / "model.safetensors"
    ).is_file()
