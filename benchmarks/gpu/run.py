"""Issue 29's device figures in one run: the step against the hand-written loop
(tokens per second and MFU), a bit-exact resume in fresh processes, and what an
asynchronous save blocks. ``benchmarks/gpu/run.sh`` runs it beside the suite's
CUDA part; ``--tiny --device cpu`` runs every row that can run on a CPU in
seconds (the others are recorded as skipped, with the reason), which is how
``tests/test_gpu_run_script.py`` keeps it working.

Sections (``--sections``, default all), run in this order, except that the
compiled step rows run last (their compiles take most of the time, so a run
cut short still has the rest):

``step``        GPT-2 small's shape (``benchmarks/gpu_step.py``'s model, batches
                and alternating timer: 124M parameters, batch 8 of 1024 tokens),
                fused AdamW (lr 3e-4) on both sides. Rows: ``eager`` (bf16
                autocast), ``compiled`` (``fa.compile()`` against
                ``torch.compile`` of the hand model), ``fp8`` (``fa.autocast(fa.fp8)``
                + ``fa.compile()`` against torchao's ``convert_to_float8_training``
                of the same layers + ``torch.compile``; CUDA of compute
                capability 8.9 or more), ``fsdp`` (``fa.fsdp()``) and
                ``deepspeed_zero2`` (``fa.deepspeed(zero_stage=2)``), both on a
                world of one against the eager hand loop. Each row: tokens per
                second of each side (median of ``--rounds`` alternating blocks
                of ``--steps`` steps), their ratio, the MFU of each (FLOPs per
                batch from ``fa.count_flops``, peak from
                ``fa.device_peak_flops(device, fa.bf16)`` for every row, fp8
                included, so the rows compare), and the largest weight
                difference after the same steps.
``resume``      a small GPT (dropout drawn in the loss, so the device's RNG
                matters; a shuffled loader) under deterministic algorithms and
                SDPA's math kernel: a fresh process trains 2 epochs of 8
                batches, saving mid-epoch after the 5th (a save consumes
                nothing: the run goes on); another fresh process loads that
                checkpoint and trains on. The figure: whether the two final
                weights are bit-identical.
``async_save``  the step section's model with its AdamW state: a blocking
                ``fa.save`` against ``fa.save(blocking=False)`` (what the loop
                is blocked for), alternating, median of ``--save-rounds``; and
                the tokens per second of 5 steps run while the write is in
                flight, over 5 steps without one.

Every row is written to ``--json`` as soon as it is measured, so a run cut
short keeps what it measured. A row that fails records its error and the run
goes on to the next.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

import gpu_step  # noqa: E402  (the model, the batches, the loss and the alternating timer)
import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402

import fnaccel as fa  # noqa: E402

SECTIONS = ("step", "resume", "async_save")
ROWS = ("eager", "fsdp", "deepspeed_zero2", "compiled", "fp8")
COMPILED = ("compiled", "fp8")  # run last: their compiles take most of the time
GPT2_MEDIUM = gpu_step.Shape(layers=24, width=1024, heads=16, vocab=50257, seq=1024, batch=8)
RESUME_SHAPE = gpu_step.Shape(layers=2, width=128, heads=4, vocab=512, seq=128, batch=4)
RESUME_BATCHES, RESUME_EPOCHS, RESUME_SAVE_AT = 8, 2, 5


class Report:
    """The figures so far, rewritten to ``path`` after every row."""

    def __init__(self, path: Path | None, header: dict[str, Any]) -> None:
        self.path = path
        self.data: dict[str, Any] = {"header": header, "rows": []}
        self._write()

    def add(self, row: dict[str, Any]) -> None:
        self.data["rows"].append(row)
        self._write()
        print(json.dumps(row), flush=True)

    def _write(self) -> None:
        if self.path is not None:
            self.path.write_text(json.dumps(self.data, indent=1) + "\n")


def fused_adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True)


def hand_block(
    model: nn.Module, opt: torch.optim.Optimizer, batches: list[Any], device: torch.device
) -> Callable[[], None]:
    def block() -> None:
        for batch in batches:
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = gpu_step.loss_fn(model, batch)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

    return block


def fnaccel_block(state: fa.RunState, batches: list[Any]) -> tuple[Callable[[], None], list[fa.RunState]]:
    holder = [state]

    def block() -> None:
        s = holder[0]
        for batch in batches:
            s, _ = fa.step(s, batch)
        holder[0] = s

    return block, holder


def fp8_layers(model: nn.Module) -> Callable[[nn.Module, str], bool]:
    """The hand loop's own choice, written out: every Linear but the first (the
    first block's qkv) and the last (the tied head), as fa.autocast(fa.fp8) picks."""
    linears = [name for name, module in model.named_modules() if isinstance(module, nn.Linear)]
    return lambda module, fqn: isinstance(module, nn.Linear) and fqn not in (linears[0], linears[-1])


def why_not(row: str, device: torch.device) -> str | None:
    """Why ``row`` cannot run here, or None."""
    if row in ("compiled", "fp8") and device.type == "cpu":
        return "compiled rows are for the device (Inductor's CPU compile takes minutes here)"
    if row == "fp8":
        if device.type != "cuda" or torch.cuda.get_device_capability(device) < (8, 9):
            return "float8 matmuls need CUDA of compute capability 8.9 or more"
        if not fa.utils.is_torchao_available():
            return "torchao is not installed (carry its wheel: benchmarks/gpu/wheels.sh)"
    if row == "deepspeed_zero2" and not fa.utils.is_deepspeed_available():
        return "deepspeed is not installed (carry its wheel: benchmarks/gpu/wheels.sh)"
    return None


def step_row(
    row: str,
    shape: gpu_step.Shape,
    device: torch.device,
    args: argparse.Namespace,
    flops: int,
    peak: float | None,
) -> dict[str, Any]:
    batches = gpu_step.make_batches(shape, device, args.steps)
    hand_model = gpu_step.make_model(shape, device)
    model = gpu_step.make_model(shape, device)
    parts: list[Any] = [fa.autocast(fa.fp8 if row == "fp8" else fa.bf16)]
    run_hand: nn.Module = hand_model
    if row == "fp8":
        from torchao.float8 import convert_to_float8_training

        hand_model = convert_to_float8_training(hand_model, module_filter_fn=fp8_layers(hand_model))
    if row in ("compiled", "fp8"):
        run_hand = torch.compile(hand_model)
        parts.append(fa.compile())
    if row == "fsdp":
        parts.append(fa.fsdp())
    if row == "deepspeed_zero2":
        parts.append(fa.deepspeed(zero_stage=2))
    with world_of_one(device) if row == "deepspeed_zero2" else contextlib.nullcontext():
        hand = hand_block(run_hand, fused_adamw(hand_model), batches, device)
        state = fa.init(seed=0, cpu=device.type == "cpu")
        state = fa.prepare(
            state, model, fused_adamw(model), loss_fn=gpu_step.loss_fn, pipeline=fa.compose(*parts)
        )
        ours, holder = fnaccel_block(state, batches)
        hand_s, ours_s = gpu_step.measure(hand, ours, args.rounds, device)
        tokens = args.steps * shape.batch * shape.seq
        diff = max(
            (a.float() - b.float()).abs().max().item()
            for a, b in zip(hand_model.parameters(), model.parameters(), strict=True)
        )
        fa.shutdown(holder[0])
    result: dict[str, Any] = {
        "section": "step",
        "row": row,
        "hand_tokens_per_second": tokens / hand_s,
        "fnaccel_tokens_per_second": tokens / ours_s,
        "throughput_ratio": hand_s / ours_s,
        "flops_per_batch": flops,
        "max_weight_difference": diff,
    }
    for side, seconds in (("hand", hand_s), ("fnaccel", ours_s)):
        result[f"{side}_mfu"] = None if peak is None else args.steps * flops / seconds / peak
    return result


@contextlib.contextmanager
def world_of_one(device: torch.device) -> Iterator[None]:
    """A default process group of one process, as torchrun would start it (DeepSpeed
    communicates over it and reads LOCAL_RANK); ended, and the environment put back, after."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with fa.utils.patch_environment(
        RANK="0",
        LOCAL_RANK="0",
        WORLD_SIZE="1",
        LOCAL_WORLD_SIZE="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    ):
        torch.distributed.init_process_group(
            "nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1
        )
        try:
            yield
        finally:
            torch.distributed.destroy_process_group()


def step_section(
    shapes: list[tuple[str, gpu_step.Shape]],
    rows: list[str],
    device: torch.device,
    args: argparse.Namespace,
    report: Report,
) -> None:
    peak = fa.device_peak_flops(device, fa.bf16)
    for shape_name, shape in shapes:
        count_model = gpu_step.GPT(shape)  # counted on a meta copy: no second model on the device
        flops = fa.count_flops(
            count_model, gpu_step.make_batches(shape, torch.device("cpu"), 1)[0], gpu_step.loss_fn
        )
        del count_model
        for row in rows:
            reason = why_not(row, device)
            if reason is not None:
                report.add({"section": "step", "row": row, "shape": shape_name, "skipped": reason})
                continue
            try:
                result = {"shape": shape_name, **step_row(row, shape, device, args, flops, peak)}
            except Exception as exc:  # a broken row is a finding; the next rows still run
                result = {
                    "section": "step",
                    "row": row,
                    "shape": shape_name,
                    "error": f"{type(exc).__name__}: {exc}",
                }
            report.add(result)
            if device.type == "cuda":
                torch.cuda.empty_cache()


# ---- resume: three fresh processes -------------------------------------------------------------


def resume_child(mode: str, directory: Path, device: torch.device) -> None:
    """One process of the resume section: ``full`` (saving mid-epoch on the way) or ``resumed``."""
    torch.use_deterministic_algorithms(True)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    shape = gpu_step.TINY if device.type == "cpu" else RESUME_SHAPE
    model = gpu_step.make_model(shape, device)
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, shape.vocab, (RESUME_BATCHES * shape.batch, shape.seq + 1), generator=g)
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(ids[:, :-1], ids[:, 1:]), batch_size=shape.batch, shuffle=True
    )

    def loss_fn(m: nn.Module, batch: Any) -> torch.Tensor:
        inputs, targets = batch
        logits = F.dropout(m(inputs), p=0.1, training=True)  # draws from the device's generator
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())

    state = fa.init(seed=0, cpu=device.type == "cpu")
    state = fa.prepare(
        state, model, fused_adamw(model), loader, loss_fn=loss_fn, pipeline=fa.compose(fa.autocast(fa.bf16))
    )
    checkpoint = directory / "mid_epoch"
    if mode == "resumed":
        state = fa.load(state, checkpoint)
    with sdpa_kernel(SDPBackend.MATH):  # the fused attention backward accumulates in varying order
        for batch in fa.batches(state, epochs=RESUME_EPOCHS):
            state, _ = fa.step(state, batch)
            if mode == "full" and state.micro_step == RESUME_SAVE_AT:
                fa.save(state, checkpoint)
    digest = hashlib.sha256()
    for tensor in model.state_dict().values():
        digest.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    (directory / f"{mode}.json").write_text(
        json.dumps({"micro_step": state.micro_step, "weights_sha256": digest.hexdigest()})
    )
    fa.shutdown(state)


def resume_section(device: torch.device, report: Report) -> None:
    env = {**os.environ, "CUBLAS_WORKSPACE_CONFIG": ":4096:8", "PYTHONUNBUFFERED": "1"}
    with tempfile.TemporaryDirectory() as tmp:
        out: dict[str, Any] = {}
        started = time.perf_counter()
        for mode in ("full", "resumed"):
            try:
                done = subprocess.run(
                    [sys.executable, __file__, "--resume-child", mode, "--dir", tmp, "--device", str(device)],
                    env=env,
                    timeout=300,
                    capture_output=True,
                    text=True,
                )
            except subprocess.TimeoutExpired as exc:  # subprocess.run has killed it
                report.add({"section": "resume", "error": f"the {mode!r} process ran past {exc.timeout} s"})
                return
            if done.returncode != 0:
                report.add(
                    {"section": "resume", "error": f"the {mode!r} process failed:\n{done.stderr[-3000:]}"}
                )
                return
            out[mode] = json.loads((Path(tmp) / f"{mode}.json").read_text())
    full, resumed = out["full"], out["resumed"]
    report.add(
        {
            "section": "resume",
            "saved_at_micro_step": RESUME_SAVE_AT,
            "micro_steps": [full["micro_step"], resumed["micro_step"]],
            "bit_identical": full["weights_sha256"] == resumed["weights_sha256"],
            "seconds": time.perf_counter() - started,
        }
    )


# ---- asynchronous save -------------------------------------------------------------------------


def async_save_section(
    shape: gpu_step.Shape, device: torch.device, args: argparse.Namespace, report: Report
) -> None:
    model = gpu_step.make_model(shape, device)
    state = fa.init(seed=0, cpu=device.type == "cpu")
    state = fa.prepare(
        state, model, fused_adamw(model), loss_fn=gpu_step.loss_fn, pipeline=fa.compose(fa.autocast(fa.bf16))
    )
    batches = gpu_step.make_batches(shape, device, 5)
    for batch in batches:  # AdamW's state exists, the kernels are warm
        state, _ = fa.step(state, batch)

    def steps() -> float:
        nonlocal state
        gpu_step._sync(device)
        start = time.perf_counter()
        for batch in batches:
            state, _ = fa.step(state, batch)
        gpu_step._sync(device)
        return time.perf_counter() - start

    blocking, blocked, during, idle = [], [], [], []
    with tempfile.TemporaryDirectory(dir=args.save_dir) as tmp:
        for r in range(args.save_rounds):
            for kind in ("blocking", "async") if r % 2 == 0 else ("async", "blocking"):
                gpu_step._sync(device)
                start = time.perf_counter()
                if kind == "blocking":
                    fa.save(state, Path(tmp) / "blocking")
                    blocking.append(time.perf_counter() - start)
                    idle.append(steps())
                else:
                    handle = fa.save(state, Path(tmp) / "async", blocking=False)
                    blocked.append(time.perf_counter() - start)
                    during.append(steps())
                    handle.wait()
        size = sum(f.stat().st_size for f in (Path(tmp) / "blocking").rglob("*") if f.is_file())
    fa.shutdown(state)
    report.add(
        {
            "section": "async_save",
            "checkpoint_bytes": size,
            "blocking_save_s": statistics.median(blocking),
            "async_blocked_s": statistics.median(blocked),
            "blocked_ratio": statistics.median(blocked) / statistics.median(blocking),
            "steps_during_write_over_idle": statistics.median(idle) / statistics.median(during),
        }
    )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="gpu_step's toy size: checks the script on a CPU")
    parser.add_argument(
        "--medium", action="store_true", help="also the step rows at GPT-2 medium's shape (350M)"
    )
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated, of {SECTIONS}")
    parser.add_argument("--rows", default=",".join(ROWS), help=f"step rows, comma-separated, of {ROWS}")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10, help="steps per timed block")
    parser.add_argument("--save-rounds", type=int, default=3)
    parser.add_argument("--save-dir", default=None, help="where the checkpoints go (default: the temp dir)")
    parser.add_argument("--json", type=Path, default=None, help="write the figures here")
    parser.add_argument("--resume-child", choices=("full", "resumed"), help=argparse.SUPPRESS)
    parser.add_argument("--dir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device() if torch.cuda.is_available() else 0)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device here: run on a GPU machine, or pass --tiny --device cpu")
    if args.resume_child:
        resume_child(args.resume_child, args.dir, device)
        return {}
    sections = args.sections.split(",")
    args.rows = args.rows.split(",")
    unknown = sorted(set(sections) - set(SECTIONS)) + sorted(set(args.rows) - set(ROWS))
    if unknown:
        raise SystemExit(f"unknown sections or rows {unknown}: sections are {SECTIONS}, rows {ROWS}")
    shape = gpu_step.TINY if args.tiny else gpu_step.GPT2_SMALL
    shapes = [("tiny" if args.tiny else "gpt2_small_124m", shape)]
    if args.medium and not args.tiny:
        shapes.append(("gpt2_medium_350m", GPT2_MEDIUM))
    header = {
        "device": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else platform.processor() or "cpu",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "peak_bf16_flops": fa.device_peak_flops(device, fa.bf16),
        "steps_per_block": args.steps,
        "rounds": args.rounds,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    print(json.dumps(header), flush=True)
    report = Report(args.json, header)
    # the rows that compile go last, so that a run cut short by its time limit has the rest
    if "step" in sections:
        step_section(shapes, [row for row in args.rows if row not in COMPILED], device, args, report)
    if "resume" in sections:
        resume_section(device, report)
    if "async_save" in sections:
        async_save_section(shape, device, args, report)
    if "step" in sections:
        step_section(shapes, [row for row in args.rows if row in COMPILED], device, args, report)
    return report.data


if __name__ == "__main__":
    main()
