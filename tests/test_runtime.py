"""fa.init and fa.shutdown: the launch environment, the config file, the process group."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import fnaccel as fa
from fnaccel.config.launch import default_config_file


def test_init_in_a_world_of_one() -> None:
    state = fa.init(seed=0, cpu=True)
    ctx = state.dist
    assert (ctx.num_processes, ctx.rank, ctx.local_rank, ctx.num_nodes) == (1, 0, 0, 1)
    assert ctx.device == torch.device("cpu") and ctx.backend is None and ctx.process_group is None
    assert ctx.distributed_type == fa.DistributedType.NO
    assert state.mixed_precision == fa.PrecisionType.NO and state.step == 0
    assert not dist.is_initialized()


def test_cpu_flag_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FNACCEL_USE_CPU", "true")
    assert fa.init().dist.device.type == "cpu"


def test_launch_variables_are_validated(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "zero")
    with pytest.raises(fa.ConfigError, match="RANK='zero' is not an integer"):
        fa.init(cpu=True)
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(fa.ConfigError, match="RANK=3 is outside the world of WORLD_SIZE=2"):
        fa.init(cpu=True)
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(fa.ConfigError, match="MASTER_ADDR is not set"):
        fa.init(cpu=True)


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


def test_config_file_precedence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # the default location (under HF_HOME, which the conftest points at a temp dir)
    _write(default_config_file(), "mixed_precision: fp16\nuse_cpu: true\n")
    assert fa.init().mixed_precision == fa.PrecisionType.FP16
    # FNACCEL_CONFIG_FILE beats the default location
    named = _write(tmp_path / "named.yaml", "mixed_precision: bf16\n")
    monkeypatch.setenv("FNACCEL_CONFIG_FILE", str(named))
    state = fa.init(cpu=True)
    assert state.mixed_precision == fa.PrecisionType.BF16 and state.config.source == str(named)
    # the launcher's variable beats the file, and the argument beats both
    monkeypatch.setenv("FNACCEL_MIXED_PRECISION", "fp16")
    assert fa.init(cpu=True).mixed_precision == fa.PrecisionType.FP16
    assert fa.init(cpu=True, mixed_precision="no").mixed_precision == fa.PrecisionType.NO


def test_an_accelerate_config_file_is_read(tmp_path: Path) -> None:
    path = _write(
        tmp_path / "default_config.yaml",
        """\
        compute_environment: LOCAL_MACHINE
        debug: false
        distributed_type: MULTI_CPU
        downcast_bf16: 'no'
        enable_cpu_affinity: false
        machine_rank: 0
        main_training_function: main
        mixed_precision: bf16
        num_machines: 1
        num_processes: 2
        rdzv_backend: static
        same_network: true
        tpu_env: []
        tpu_use_cluster: false
        tpu_use_sudo: false
        use_cpu: true
    """,
    )
    state = fa.init(config=path)
    assert state.config.num_processes == 2 and state.mixed_precision == fa.PrecisionType.BF16


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("mixed_precision: [fp16\n", r"malformed YAML at line \d"),
        ("mixed_precison: fp16\n", "unknown key 'mixed_precison'"),
        ("num_processes: two\n", "key 'num_processes' must be int, got str 'two'"),
        ("use_cpu: 1\n", "key 'use_cpu' must be bool, got int"),
        ("mixed_precision: fp12\n", "key 'mixed_precision' must be one of"),
        ("- a\n- b\n", "must hold a mapping"),
    ],
)
def test_bad_config_files_name_the_key_and_file(tmp_path: Path, text: str, message: str) -> None:
    path = _write(tmp_path / "bad.yaml", text)
    with pytest.raises(fa.ConfigError, match=message) as info:
        fa.init(config=path)
    assert str(path) in str(info.value)


def test_missing_config_file(tmp_path: Path) -> None:
    with pytest.raises(fa.ConfigError, match="cannot read the config file"):
        fa.init(config=tmp_path / "nope.yaml")


def test_kwargs_handlers_are_checked() -> None:
    handler = fa.AutocastKwargs(cache_enabled=False)
    state = fa.init(cpu=True, kwargs_handlers=[handler])
    assert state.kwargs_handlers["AutocastKwargs"] is handler
    with pytest.raises(ValueError, match="two AutocastKwargs"):
        fa.init(cpu=True, kwargs_handlers=[handler, fa.AutocastKwargs()])
    with pytest.raises(TypeError, match="got dict"):
        fa.init(cpu=True, kwargs_handlers=[{"enabled": True}])  # type: ignore[list-item]


def test_unknown_mixed_precision_argument() -> None:
    with pytest.raises(fa.ConfigError, match="unknown mixed_precision 'fp12'"):
        fa.init(cpu=True, mixed_precision="fp12")


def _describe_context(state: fa.RunState) -> dict[str, Any]:
    ctx = state.dist
    return {
        "rank": ctx.rank,
        "num_processes": ctx.num_processes,
        "local_rank": ctx.local_rank,
        "num_local_processes": ctx.num_local_processes,
        "backend": ctx.backend,
        "type": str(ctx.distributed_type),
        "main": ctx.is_main_process,
        "group": ctx.process_group is not None,
    }


def test_init_reads_torchrun_variables(world: Any) -> None:
    n = world.num_processes
    assert world.run(_describe_context) == [
        {
            "rank": r,
            "num_processes": n,
            "local_rank": r,
            "num_local_processes": n,
            "backend": "gloo",
            "type": "MULTI_CPU",
            "main": r == 0,
            "group": True,
        }
        for r in range(n)
    ]


def _second_run_gets_its_own_group(state: fa.RunState) -> tuple[float, float, float]:
    handler = fa.InitProcessGroupKwargs(backend="gloo", timeout=timedelta(seconds=42))
    second = fa.init(seed=1, cpu=True, kwargs_handlers=[handler])
    group = second.dist.process_group
    assert group is not None and group is not state.dist.process_group
    timeout = group._get_backend(torch.device("cpu")).options._timeout.total_seconds()
    one = fa.ops.reduce(second, torch.tensor(1.0), "sum").item()
    fa.shutdown(second)
    fa.shutdown(second)  # a second call is a no-op
    # the first run's group is untouched by the second's shutdown
    return timeout, one, fa.ops.reduce(state, torch.tensor(2.0), "sum").item()


def test_a_second_run_in_the_same_processes_gets_its_own_group(world2: Any) -> None:
    assert world2.run(_second_run_gets_its_own_group) == [(42.0, 2.0, 4.0)] * 2


def _init_with_file_rendezvous(rank: int, rendezvous: str, results: Any) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2")
    for name in ("MASTER_ADDR", "MASTER_PORT"):  # whatever the forkserver's environment holds
        os.environ.pop(name, None)
    handler = fa.InitProcessGroupKwargs(backend="gloo", init_method=rendezvous, timeout=timedelta(seconds=33))
    state = fa.init(cpu=True, kwargs_handlers=[handler])
    group = state.dist.process_group
    assert group is not None
    timeout = group._get_backend(torch.device("cpu")).options._timeout.total_seconds()
    total = fa.ops.reduce(state, torch.tensor(float(rank + 1)), "sum").item()
    try:
        fa.init(cpu=True, kwargs_handlers=[handler])
        second = "accepted"
    except fa.ConfigError as exc:
        second = str(exc)
    fa.shutdown(state)
    results.put((rank, timeout, total, second, dist.is_initialized()))


@pytest.mark.multiprocess
def test_init_method_and_timeout_are_honoured(forked_context: Any, tmp_path: Path) -> None:
    """No MASTER_ADDR: the handler's file:// rendezvous says where to meet."""
    results = forked_context.Queue()
    rendezvous = f"file://{tmp_path / 'rendezvous'}"
    procs = [
        forked_context.Process(target=_init_with_file_rendezvous, args=(rank, rendezvous, results))
        for rank in range(2)
    ]
    for proc in procs:
        proc.start()
    collected = sorted(results.get(timeout=90) for _ in procs)
    for proc in procs:
        proc.join(timeout=30)
    assert [p.exitcode for p in procs] == [0, 0]
    for _, timeout, total, second, still_initialized in collected:
        assert (timeout, total, still_initialized) == (33.0, 3.0, False)
        assert "init_method" in second and "cannot apply" in second


def test_state_config_is_what_the_run_uses(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The file says fp16, the launch says bf16: the state (and a checkpoint) records bf16."""
    path = _write(tmp_path / "config.yaml", "mixed_precision: fp16\n")
    monkeypatch.setenv("FNACCEL_CONFIG_FILE", str(path))
    monkeypatch.setenv("FNACCEL_MIXED_PRECISION", "bf16")
    state = fa.init()
    assert state.mixed_precision == fa.PrecisionType.BF16 and state.config.mixed_precision == "bf16"
    state = fa.init(mixed_precision="no", cpu=True)  # arguments win, and are recorded too
    assert (state.config.mixed_precision, state.config.use_cpu) == ("no", True)


def test_the_default_collective_timeout() -> None:
    from fnaccel.runtime import COLLECTIVE_TIMEOUT

    assert timedelta(minutes=10) == COLLECTIVE_TIMEOUT


def _group_timeout(state: Any) -> float:
    group = state.dist.process_group
    return group._get_backend(torch.device("cpu")).options._timeout.total_seconds()


def test_a_world_runs_under_the_default_collective_timeout(world2: Any) -> None:
    assert world2.run(_group_timeout) == [600.0, 600.0]


_SCRIPT = """\
import sys, torch, fnaccel as fa
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
out, ending = sys.argv[1], sys.argv[2]
state = fa.init(seed=0)
total = fa.ops.reduce(state, torch.tensor(float(state.dist.rank + 1)), "sum")
dcp.save({"w": torch.arange(4.0) + state.dist.rank}, checkpoint_id=out + "/dcp")
# one write per line (print's separate arguments could interleave between ranks)
print(f"rank {state.dist.rank} of {state.dist.num_processes} total {total.item()}", flush=True)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
data = TensorDataset(torch.randn(32, 8), torch.randn(32, 2))
state = fa.prepare(state, model, torch.optim.AdamW(model.parameters(), lr=1e-2),
                   DataLoader(data, batch_size=4), pipeline=fa.compose(fa.fsdp()),
                   loss_fn=lambda m, b: nn.functional.mse_loss(m(b[0]), b[1]))
for batch in fa.batches(state, epochs=1):
    state, _ = fa.step(state, batch)
fa.save(state, out + "/ckpt")
print(f"rank {state.dist.rank} saved at step {state.step}", flush=True)
if ending == "shutdown":
    fa.shutdown(state)
"""


@pytest.mark.parametrize(
    "launcher, ending",
    [(["torch.distributed.run", "--standalone"], "exit"), (["fnaccel", "launch", "-q", "--cpu"], "shutdown")],
    ids=["torchrun-exit", "fnaccel_launch-shutdown"],
)
@pytest.mark.multiprocess
def test_a_run_with_saves_ends_without_abort(tmp_path: Path, launcher: list[str], ending: str) -> None:
    """A DCP save, then an fsdp() run's fa.save, then a clean end whether or not shutdown is
    called, under real torchrun (--standalone: the agent binds a free port itself) and under
    fnaccel launch. The clean end still settles before the group goes (the loop of 60 such
    launches in the fail-fast work aborted 0 times). Each ending once: the worker's end is the
    same under either launcher (fnaccel launch's worker execs the script as torchrun would)."""
    script = tmp_path / "job.py"
    script.write_text(_SCRIPT)
    nproc = ["--nproc_per_node"] if launcher[0] == "torch.distributed.run" else ["--num_processes"]
    result = subprocess.run(
        [sys.executable, "-m", *launcher, *nproc, "2", str(script), str(tmp_path), ending],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    # nor a traceback from the exit hook (one importing a torch module there found its ops gone)
    assert "terminate called" not in output and "not every rank reached" not in output, output
    assert "Traceback" not in output, output
    assert "rank 0 of 2 total 3.0" in result.stdout and "rank 1 of 2 total 3.0" in result.stdout
    assert "rank 0 saved at step 4" in result.stdout and "rank 1 saved at step 4" in result.stdout
