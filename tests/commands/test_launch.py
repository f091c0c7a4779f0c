"""`fnaccel launch`: real torchrun launches of tests/commands/_launched.py, the flags, the errors."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from fnaccel.commands.launch import launch_environment, resolve, torchrun_arguments
from fnaccel.commands.main import CommandError, build_parser, main
from tests._launches import start_two_machines

SCRIPT = Path(__file__).with_name("_launched.py")


def launch(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fnaccel", "launch", "-q", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )


def report(out: Path) -> list[dict[str, Any]]:
    return json.loads((out / "report.json").read_text())


def weights(out: Path) -> dict[str, torch.Tensor]:
    return load_file(out / "final" / "model.safetensors")


def assert_same_weights(a: Path, b: Path) -> None:
    left, right = weights(a), weights(b)
    assert left.keys() == right.keys()
    for name in left:
        assert torch.equal(left[name], right[name]), name


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """2 gloo processes from a config file's values, one of them overridden by a flag."""
    root = tmp_path_factory.mktemp("uninterrupted")
    config = root / "config.yaml"
    config.write_text("use_cpu: true\nnum_processes: 2\nmixed_precision: fp16\ndistributed_type: MULTI_CPU\n")
    out = root / "out"
    out.mkdir()
    result = launch("--config_file", str(config), "--mixed_precision", "no", str(SCRIPT), str(out))
    assert result.returncode == 0, result.stderr
    return out


@pytest.mark.multiprocess
def test_config_file_values_reach_the_script_and_flags_win(uninterrupted: Path) -> None:
    ranks = report(uninterrupted)
    assert [r["rank"] for r in ranks] == [0, 1]
    for seen in ranks:
        assert seen["num_processes"] == 2 and seen["backend"] == "gloo" and seen["device"] == "cpu"
        assert seen["mixed_precision"] == "no"  # the flag beat the file's fp16
        assert seen["pipeline"] == "compose(ddp())" and seen["steps"] == 16


@pytest.mark.multiprocess
def test_config_default_then_launch_uses_its_values(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a CPU config, even on a GPU box
    config = tmp_path / "default.yaml"
    assert main(["config", "default", "--config_file", str(config), "--mixed_precision", "bf16"]) == 0
    out = tmp_path / "out"
    out.mkdir()
    result = launch(
        "--config_file",
        str(config),
        "--num_processes",
        "2",
        "--use_fsdp",
        "--fsdp_sharding_strategy",
        "SHARD_GRAD_OP",
        "--enable_cpu_affinity",
        "--num_cpu_threads_per_process",
        "1",
        "--debug",
        str(SCRIPT),
        str(out),
    )
    assert result.returncode == 0, result.stderr
    ranks = report(out)
    for seen in ranks:
        assert seen["mixed_precision"] == "bf16"  # from `config default`
        assert (
            seen["device"] == "cpu" and seen["num_processes"] == 2
        )  # use_cpu from the file, 2 from the flag
        assert "fsdp(reshard_after_forward=False, sync_module_states=True)" in seen["pipeline"]
        assert seen["debug"] is True and seen["omp_threads"] == "1"
    if len(os.sched_getaffinity(0)) >= 2:  # each process pinned to its own share
        assert not set(ranks[0]["affinity"]) & set(ranks[1]["affinity"])


@pytest.mark.multiprocess
def test_an_accelerate_hybrid_shard_config_with_a_parallelism_section_trains(tmp_path: Path) -> None:
    """Accelerate's HYBRID_SHARD (refused before meshes) runs as HSDP on a 2x2 mesh."""
    config = tmp_path / "hsdp.yaml"
    config.write_text(
        textwrap.dedent("""\
        compute_environment: LOCAL_MACHINE
        distributed_type: FSDP
        use_cpu: true
        num_processes: 4
        fsdp_config:
          fsdp_sharding_strategy: HYBRID_SHARD
          fsdp_version: 2
          fsdp_state_dict_type: SHARDED_STATE_DICT
        parallelism_config:
          parallelism_config_dp_replicate_size: 2
          parallelism_config_dp_shard_size: 2
          parallelism_config_tp_size: 1
          parallelism_config_cp_size: 1
        """)
    )
    out = tmp_path / "out"
    out.mkdir()
    result = launch("--config_file", str(config), str(SCRIPT), str(out))
    assert result.returncode == 0, result.stderr
    for seen in report(out):
        assert seen["mesh"] == ["dp_replicate", "dp_shard"] and seen["num_processes"] == 4
        assert "fsdp(sync_module_states=True)" in seen["pipeline"]
        assert seen["steps"] == 8  # 64 samples, 4 data-parallel ranks of 4: 4 steps an epoch


def test_parallelism_flags_override_the_file_and_reach_the_processes(tmp_path: Path) -> None:
    args = parse(
        "--cpu",
        "--num_processes",
        "4",
        "--parallelism_config_dp_replicate_size",
        "2",
        "--parallelism_config_tp_size",
        "2",
        str(SCRIPT),
    )
    config = resolve(args)
    assert config.parallelism_config == {
        "parallelism_config_dp_replicate_size": 2,
        "parallelism_config_tp_size": 2,
    }
    env = launch_environment(args, config)
    assert env["FNACCEL_PARALLELISM_CONFIG_TP_SIZE"] == "2"
    bad = parse("--cpu", "--num_processes", "4", "--parallelism_config_tp_size", "3", str(SCRIPT))
    with pytest.raises(CommandError, match="does not divide the 4 processes"):
        resolve(bad)


@pytest.mark.multiprocess
def test_two_machines_form_one_world(tmp_path: Path, uninterrupted: Path) -> None:
    """Two machines simulated on the loopback address (one process each) resume the
    checkpoint one machine's 2 processes wrote at step 6 and end with its weights, bit
    for bit: the same world on another layout trains and resumes alike (issue 37 point 9)."""
    out = tmp_path / "out"
    out.mkdir()
    shutil.copytree(uninterrupted / "ckpt", out / "ckpt")
    machines = start_two_machines(str(SCRIPT), str(out))
    for machine in machines:
        _, stderr = machine.communicate(timeout=240)
        assert machine.returncode == 0, stderr
    ranks = report(out)
    assert [(r["rank"], r["node_rank"], r["num_nodes"], r["num_processes"], r["resumed"]) for r in ranks] == [
        (0, 0, 2, 2, True),
        (1, 1, 2, 2, True),
    ]
    assert_same_weights(out, uninterrupted)  # the same training as 2 processes on one machine


@pytest.mark.multiprocess
def test_a_killed_rank_restarts_and_resumes_from_its_checkpoint(tmp_path: Path, uninterrupted: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    result = launch(
        "--cpu",
        "--num_processes",
        "2",
        "--max_restarts",
        "1",
        "--monitor_interval",
        "0.2",
        str(SCRIPT),
        str(out),
        "--kill-after-checkpoint",
    )
    assert result.returncode == 0, result.stderr
    assert "exitcode: -9" in result.stderr  # rank 1 really died once
    ranks = report(out)
    assert all(r["restarts"] == 1 and r["resumed"] for r in ranks)
    assert_same_weights(out, uninterrupted)


@pytest.mark.multiprocess
def test_a_failing_script_gives_its_exit_status(tmp_path: Path) -> None:
    script = tmp_path / "fails.py"
    script.write_text("import sys\nsys.exit(3)\n")
    result = launch("--cpu", str(script))
    assert result.returncode == 3
    assert "rank 0 exited with code 3" in result.stderr


BAD_CONFIGS = {
    "num_processes: [2\n": "malformed YAML at line",
    "num_proceses: 2\n": "unknown key 'num_proceses'",
    "num_processes: two\n": "key 'num_processes' must be int",
    "fsdp_config: {fsdp_sharding_strategy: 9}\ndistributed_type: FSDP\n": "key 'fsdp_sharding_strategy'",
}


@pytest.mark.parametrize(("text", "message"), BAD_CONFIGS.items())
def test_bad_config_files_give_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, message: str
) -> None:
    """Refused before any process starts (the console script's own no-traceback path:
    tests/commands/test_cli_errors.py), so in this process."""
    config = tmp_path / "bad.yaml"
    config.write_text(text)
    assert main(["launch", "-q", "--config_file", str(config), str(SCRIPT), str(tmp_path)]) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert message in lines[0] and str(config) in lines[0]


def parse(*argv: str) -> Any:
    return build_parser().parse_args(["launch", *argv, "train.py", "--lr", "1"])


@pytest.mark.parametrize(
    "flag",
    [
        ["--use_megatron_lm"],
        ["--megatron_lm_tp_degree", "2"],
        ["--tpu"],
        ["--main_training_function", "main"],
        ["--aws_access_key_id", "x"],
        ["--ipex"],
        ["--use_xpu"],
    ],
)
def test_flags_of_engines_not_shipped_are_refused(
    flag: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["launch", *flag, str(SCRIPT)]) == 2
    err = capsys.readouterr().err
    assert flag[0] in err and len(err.strip().splitlines()) == 1
    if "megatron" in flag[0]:  # why, and what to use instead: the message MegatronLMPlugin.transform() gives
        from fnaccel.transforms.plugins.megatron import megatron_refusal

        assert megatron_refusal() in err and "fa.fsdp()" in err
    else:
        assert "this build" in err


def test_bad_fp8_and_deepspeed_settings_are_refused_with_the_fix(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["launch", "--mixed_precision", "fp8", "--fp8_backend", "te", str(SCRIPT)]) == 2
    assert "runs fp8 on CUDA GPUs only" in capsys.readouterr().err
    assert main(["launch", "--fp8_format", "E4M3", str(SCRIPT)]) == 2
    assert "pass --mixed_precision fp8" in capsys.readouterr().err
    assert main(["launch", "--use_deepspeed", "--zero_stage", "4", str(SCRIPT)]) == 2
    assert "zero_stage must be 0, 1, 2 or 3" in capsys.readouterr().err
    assert main(["launch", "--zero_stage", "2", str(SCRIPT)]) == 2
    assert "pass --use_deepspeed" in capsys.readouterr().err
    assert (
        main(
            [
                "launch",
                "--use_deepspeed",
                "--deepspeed_config_file",
                "ds.json",
                "--zero_stage",
                "2",
                str(SCRIPT),
            ]
        )
        == 2
    )
    assert "zero_stage is given beside deepspeed_config_file" in capsys.readouterr().err
    assert main(["launch", "--use_deepspeed", "--mixed_precision", "fp8", str(SCRIPT)]) == 2
    assert "fp8 does not run through DeepSpeed" in capsys.readouterr().err
    assert main(["launch", "--cpu", "--multi_gpu", str(SCRIPT)]) == 2
    assert "contradict" in capsys.readouterr().err
    assert main(["launch", "--cpu", str(tmp_path / "missing.py")]) == 2
    assert "no such script" in capsys.readouterr().err


def test_torchrun_arguments() -> None:
    args = parse(
        "--cpu",
        "--num_processes",
        "4",
        "--num_machines",
        "2",
        "--machine_rank",
        "1",
        "--main_process_ip",
        "10.0.0.1",
        "--main_process_port",
        "1234",
        "--max_restarts",
        "2",
        "--tee",
        "3",
        "--log_dir",
        "logs",
        "--role",
        "trainer",
        "--monitor_interval",
        "0.5",
    )
    # every worker starts through the entry that ends it with this launcher, then runs the script
    worker = ["--module", "fnaccel.commands.launch_worker", str(os.getpid())]
    assert torchrun_arguments(args, resolve(args)) == [
        "--nproc_per_node",
        "2",
        "--nnodes",
        "2",
        "--node_rank",
        "1",
        "--master_addr",
        "10.0.0.1",
        "--master_port",
        "1234",
        "--max_restarts",
        "2",
        "--monitor_interval",
        "0.5",
        "--role",
        "trainer",
        "--tee",
        "3",
        "--log_dir",
        "logs",
        *worker,
        sys.executable,
        "-u",
        "train.py",
        "--lr",
        "1",
    ]
    args = parse(
        "--num_processes",
        "4",
        "--num_machines",
        "2",
        "--rdzv_backend",
        "c10d",
        "--main_process_ip",
        "h",
        "--main_process_port",
        "9",
        "--rdzv_conf",
        "a=1",
        "-m",
    )
    assert torchrun_arguments(args, resolve(args)) == [
        "--nproc_per_node",
        "2",
        "--nnodes",
        "2",
        "--rdzv_backend",
        "c10d",
        "--rdzv_endpoint",
        "h:9",
        "--rdzv_conf",
        "a=1",
        *worker,
        sys.executable,
        "-u",
        "-m",
        "train.py",
        "--lr",
        "1",
    ]
    args = parse("--num_processes", "3", "--no_python")
    assert torchrun_arguments(args, resolve(args)) == [
        "--nproc_per_node",
        "3",
        "--standalone",
        *worker,
        "train.py",
        "--lr",
        "1",
    ]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            [
                "--num_processes",
                "3",
                "--num_machines",
                "2",
                "--main_process_ip",
                "h",
                "--main_process_port",
                "1",
            ],
            "must divide evenly",
        ),
        (["--num_processes", "2", "--num_machines", "2"], "needs --main_process_ip and --main_process_port"),
        (
            [
                "--num_processes",
                "2",
                "--num_machines",
                "2",
                "--machine_rank",
                "2",
                "--main_process_ip",
                "h",
                "--main_process_port",
                "1",
            ],
            "machine_rank 2 is outside 0..1",
        ),
    ],
)
def test_inconsistent_machine_flags(argv: list[str], message: str) -> None:
    from fnaccel.commands.main import CommandError

    args = parse(*argv)
    with pytest.raises(CommandError, match=message):
        torchrun_arguments(args, resolve(args))


def test_the_environment_the_script_reads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import fnaccel as fa
    from fnaccel.preparation import default_pipeline

    config = tmp_path / "c.yaml"
    config.write_text(
        textwrap.dedent("""\
        distributed_type: FSDP
        fsdp_config: {fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP, fsdp_transformer_layer_cls_to_wrap: Block}
        dynamo_config: {dynamo_backend: EAGER}
    """)
    )
    args = parse(
        "--config_file",
        str(config),
        "--cpu",
        "--fsdp_offload_params",
        "false",
        "--dynamo_use_fullgraph",
        "--gpu_ids",
        "0,1",
        "--num_cpu_threads_per_process",
        "2",
    )
    env = launch_environment(args, resolve(args))
    assert env["FNACCEL_USE_FSDP"] == "true" and env["FNACCEL_FSDP_OFFLOAD_PARAMS"] == "false"
    assert env["FNACCEL_DISTRIBUTED_TYPE"] == "FSDP"
    assert env["FNACCEL_FSDP_TRANSFORMER_LAYER_CLS_TO_WRAP"] == "Block"
    assert env["FNACCEL_DYNAMO_BACKEND"] == "EAGER" and env["FNACCEL_DYNAMO_USE_FULLGRAPH"] == "true"
    assert env["CUDA_VISIBLE_DEVICES"] == "0,1" and env["OMP_NUM_THREADS"] == "2"
    assert env["FNACCEL_USE_CPU"] == "true" and env["FNACCEL_MIXED_PRECISION"] == "no"
    assert env["FNACCEL_CONFIG_FILE"] == str(config.resolve())
    # what fa.init makes of it (a world of one: ddp/fsdp are left out, compile is not)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    state = fa.init()
    assert state.config.distributed_type == "FSDP"
    assert state.config.fsdp_config["fsdp_offload_params"] == "false"
    assert repr(default_pipeline(state)) == "compose(compile(backend='eager', fullgraph=True))"
    # a flag switches the file's FSDP off in the script too (the file is read again there)
    args = parse("--config_file", str(config), "--multi_gpu")
    for name, value in launch_environment(args, resolve(args)).items():
        monkeypatch.setenv(name, value)
    assert fa.init(cpu=True).config.distributed_type == "MULTI_GPU"


def _help(*argv: str) -> str:
    parser = build_parser()
    for name in argv:
        sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
        parser = sub.choices[name]  # type: ignore[attr-defined]
    return parser.format_help()


# accelerate launch's flags, from the reference page (docs/cli.md maps each)
ACCELERATE_LAUNCH_FLAGS = [
    "--config_file",
    "-m",
    "--module",
    "--no_python",
    "--debug",
    "-q",
    "--quiet",
    "--cpu",
    "--multi_gpu",
    "--tpu",
    "--ipex",
    "--mixed_precision",
    "--num_processes",
    "--num_machines",
    "--num_cpu_threads_per_process",
    "--enable_cpu_affinity",
    "--use_deepspeed",
    "--use_fsdp",
    "--use_megatron_lm",
    "--use_xpu",
    "--gpu_ids",
    "--same_network",
    "--machine_rank",
    "--main_process_ip",
    "--main_process_port",
    "-t",
    "--tee",
    "--log_dir",
    "--role",
    "--rdzv_backend",
    "--rdzv_conf",
    "--max_restarts",
    "--monitor_interval",
    "--tpu_cluster",
    "--tpu_use_sudo",
    "--vm",
    "--env",
    "--main_training_function",
    "--downcast_bf16",
    "--deepspeed_config_file",
    "--zero_stage",
    "--offload_optimizer_device",
    "--offload_param_device",
    "--offload_optimizer_nvme_path",
    "--gradient_accumulation_steps",
    "--gradient_clipping",
    "--zero3_init_flag",
    "--zero3_save_16bit_model",
    "--deepspeed_hostfile",
    "--deepspeed_exclusion_filter",
    "--deepspeed_inclusion_filter",
    "--deepspeed_multinode_launcher",
    "--deepspeed_moe_layer_cls_names",
    "--fsdp_offload_params",
    "--fsdp_min_num_params",
    "--fsdp_sharding_strategy",
    "--fsdp_auto_wrap_policy",
    "--fsdp_transformer_layer_cls_to_wrap",
    "--fsdp_backward_prefetch_policy",
    "--fsdp_state_dict_type",
    "--fsdp_forward_prefetch",
    "--fsdp_use_orig_params",
    "--fsdp_cpu_ram_efficient_loading",
    "--fsdp_sync_module_states",
    "--fsdp_activation_checkpointing",
    "--megatron_lm_tp_degree",
    "--megatron_lm_pp_degree",
    "--megatron_lm_num_micro_batches",
    "--megatron_lm_sequence_parallelism",
    "--megatron_lm_recompute_activations",
    "--megatron_lm_use_distributed_optimizer",
    "--megatron_lm_gradient_clipping",
    "--fp8_backend",
    "--fp8_use_autocast_during_eval",
    "--fp8_margin",
    "--fp8_interval",
    "--fp8_format",
    "--fp8_amax_history_len",
    "--fp8_amax_compute_algo",
    "--fp8_override_linear_precision",
    "--fp8_opt_level",
    "--aws_access_key_id",
    "--aws_secret_access_key",
    "--dynamo_backend",
    "--dynamo_mode",
    "--dynamo_use_fullgraph",
    "--dynamo_use_dynamic",
]


def test_launch_help_lists_every_accelerate_flag() -> None:
    text = _help("launch")
    missing = [
        flag
        for flag in ACCELERATE_LAUNCH_FLAGS
        if f"{flag} " not in text and f"{flag}," not in text and f"{flag}\n" not in text
    ]
    assert not missing


def test_every_help_lists_every_flag_of_its_parser(capsys: pytest.CaptureFixture[str]) -> None:
    def walk(parser: Any, path: tuple[str, ...]) -> list[tuple[tuple[str, ...], Any]]:
        found = [(path, parser)]
        for action in parser._actions:
            if action.__class__.__name__ == "_SubParsersAction":
                for name, child in action.choices.items():
                    found += walk(child, (*path, name))
        return found

    parsers = walk(build_parser(), ())
    names = {path[0] for path, _ in parsers if path}
    assert {"config", "env", "launch", "test", "estimate-memory", "merge-weights", "tpu-config"} <= names
    for path, parser in parsers:
        text = parser.format_help()
        for action in parser._actions:
            for option in action.option_strings:
                assert option in text, (path, option)
    with pytest.raises(SystemExit) as done:  # `fnaccel --help` (the console entry: test_cli_errors.py)
        main(["--help"])
    out = capsys.readouterr().out
    assert done.value.code == 0 and [name for name in names if name not in out] == [], out
