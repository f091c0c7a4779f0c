"""fa.step across real gloo processes: DDP and accumulation against one process."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import fnaccel as fa
from tests.test_train import loss_fn, make_model

GLOBAL_BATCH = 24  # divisible by 2 and 3 ranks


def global_batches(num: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    return [
        (torch.randn(GLOBAL_BATCH, 8, generator=g), torch.randint(0, 4, (GLOBAL_BATCH,), generator=g))
        for _ in range(num)
    ]


def my_part(
    batch: tuple[torch.Tensor, torch.Tensor], rank: int, world: int
) -> tuple[torch.Tensor, torch.Tensor]:
    size = GLOBAL_BATCH // world
    return tuple(t[rank * size : (rank + 1) * size] for t in batch)  # type: ignore[return-value]


def single_process_reference(num: int, accumulate: int = 1) -> list[torch.Tensor]:
    """One process on the gathered global batches (accumulated ones concatenated)."""
    model = make_model(dropout=0.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    batches = global_batches(num)
    for i in range(0, num, accumulate):
        group = batches[i : i + accumulate]
        x = torch.cat([b[0] for b in group])
        y = torch.cat([b[1] for b in group])
        loss_fn(model, (x, y)).backward()
        opt.step()
        opt.zero_grad()
    return [p.detach() for p in model.parameters()]


def _count_allreduce(counter, bucket):  # type: ignore[no-untyped-def]
    # unannotated: DDP checks a hook's annotations, which are strings in this module
    counter[0] += 1
    tensor = bucket.buffer().div_(dist.get_world_size())
    return dist.all_reduce(tensor, async_op=True).get_future().then(lambda fut: fut.value()[0])


def train_ddp(state: fa.RunState, num: int, accumulate: int) -> dict[str, Any]:
    rank, world = state.dist.rank, state.dist.num_processes
    model = make_model(dropout=0.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    parts = [fa.ddp()] + ([fa.accumulate(accumulate)] if accumulate > 1 else [])
    state = fa.prepare(state, model, opt, loss_fn=loss_fn, pipeline=fa.compose(*parts))
    counter = [0]
    assert isinstance(state.model, torch.nn.parallel.DistributedDataParallel)
    state.model.register_comm_hook(counter, _count_allreduce)
    reductions_per_micro_step = []
    for batch in global_batches(num):
        before = counter[0]
        state, _ = fa.step(state, my_part(batch, rank, world))
        reductions_per_micro_step.append(counter[0] - before)
    return {
        "params": [p.detach() for p in model.parameters()],
        "reductions": reductions_per_micro_step,
        "step": state.step,
        "wrapped": type(state.model).__name__,
    }


def test_ddp_equals_one_process_on_the_global_batches(world: Any) -> None:
    expected = single_process_reference(6)
    for result in world.run(train_ddp, 6, 1):
        assert result["wrapped"] == "DistributedDataParallel" and result["step"] == 6
        for p, q in zip(result["params"], expected, strict=False):
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-6)
        assert all(n > 0 for n in result["reductions"])


def test_accumulate_under_ddp_equals_the_big_batch_without_early_reductions(world2: Any) -> None:
    expected = single_process_reference(8, accumulate=4)
    for result in world2.run(train_ddp, 8, 4):
        for p, q in zip(result["params"], expected, strict=False):
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-6)
        reductions = result["reductions"]
        assert reductions[0] == reductions[1] == reductions[2] == 0
        assert reductions[4] == reductions[5] == reductions[6] == 0
        assert reductions[3] > 0 and reductions[7] > 0
        assert result["step"] == 2


def _after_shutdown(state: fa.RunState) -> dict[str, Any]:
    rank, world = state.dist.rank, state.dist.num_processes
    run = fa.init(seed=0, cpu=True)  # a run of its own, with a group of its own: shut down below
    model = make_model(dropout=0.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    run = fa.prepare(run, model, opt, loss_fn=loss_fn)
    first, second = global_batches(2)
    run, _ = fa.step(run, my_part(first, rank, world))
    wrapper = run.model
    fa.shutdown(run)
    held = sorted(name for name in ("reducer", "logger") if name in vars(wrapper))
    opt.zero_grad()  # the user's model goes on alone, on the whole batch
    loss_fn(model, second).backward()
    opt.step()
    return {"held": held, "params": [p.detach() for p in model.parameters()]}


def test_shutdown_lets_the_ddp_reducer_go_and_the_model_goes_on_alone(world2: Any) -> None:
    """The reducer holds the group from C++; as its last holder it would join gloo's
    threads holding the GIL, and a thread still releasing a collective's tensors waits
    for the GIL forever (a rare hang at the end of a cycle, docs/state.md). After
    fa.shutdown it is gone, and the module trains on as a hand-written loop does."""
    model = make_model(dropout=0.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for batch in global_batches(2):
        loss_fn(model, batch).backward()
        opt.step()
        opt.zero_grad()
    for result in world2.run(_after_shutdown):
        assert result["held"] == []
        for p, q in zip(result["params"], model.parameters(), strict=False):
            torch.testing.assert_close(p, q.detach(), rtol=1e-6, atol=1e-6)


def _no_ddp(state: fa.RunState) -> str:
    model = nn.Linear(2, 2)
    try:
        fa.prepare(state, model, torch.optim.SGD(model.parameters(), lr=0.1), pipeline=fa.compose())
    except ValueError as exc:
        return str(exc)
    return "accepted"


def test_a_multi_process_pipeline_without_ddp_is_refused(world2: Any) -> None:
    assert all("has no fa.ddp() or fa.fsdp()" in message for message in world2.run(_no_ddp))


def _default_pipeline(state: fa.RunState) -> str:
    model = nn.Linear(2, 2)
    state = fa.prepare(state, model, torch.optim.SGD(model.parameters(), lr=0.1))
    return repr(state.pipeline)


def test_the_default_pipeline_adds_ddp_in_a_larger_world(world2: Any) -> None:
    assert world2.run(_default_pipeline) == ["compose(ddp())"] * 2


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.linear(x)) + x


def make_blocks() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(Block(), Block(), nn.Linear(8, 4))


def _full(p: torch.Tensor) -> torch.Tensor:
    full = getattr(p, "full_tensor", None)
    return (full() if full else p).detach().clone()


def train_parallel(state: fa.RunState, kind: str, num: int, clip: bool) -> dict[str, Any]:
    rank, world = state.dist.rank, state.dist.num_processes
    model = make_blocks()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    parallel = fa.ddp() if kind == "ddp" else fa.fsdp(transformer_cls_names_to_wrap=["Block"])
    parts = [parallel, fa.accumulate(2)] + ([fa.clip_grad_norm(0.5)] if clip else [])
    state = fa.prepare(state, model, opt, loss_fn=loss_fn, pipeline=fa.compose(*parts))
    norms = []
    for batch in global_batches(num):
        state, metrics = fa.step(state, my_part(batch, rank, world))
        if "grad_norm" in metrics:
            norms.append(metrics["grad_norm"].item())
    sharded = [type(m).__name__ for m in model.modules()]
    return {"params": [_full(p) for p in model.parameters()], "norms": norms, "classes": sharded}


def test_fsdp_ends_at_the_same_parameters_as_ddp(world2: Any) -> None:
    ddp_results = world2.run(train_parallel, "ddp", 6, True)
    fsdp_results = world2.run(train_parallel, "fsdp", 6, True)
    assert "FSDPBlock" in fsdp_results[0]["classes"]  # each Block was sharded on its own
    for ours, theirs in zip(fsdp_results, ddp_results, strict=False):
        for p, q in zip(ours["params"], theirs["params"], strict=False):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ours["norms"], theirs["norms"], rtol=1e-5, atol=1e-5)


def train_items(state: fa.RunState) -> tuple[list[torch.Tensor], list[tuple[float, float, float]]]:
    from tests.test_train import _token_batches, token_loss_sum

    mine = _token_batches(4, seed=20 + state.dist.rank)  # each rank: its own token counts
    model = make_model(dropout=0.0)
    state = fa.prepare(
        state,
        model,
        torch.optim.SGD(model.parameters(), lr=0.5),
        loss_fn=token_loss_sum,
        pipeline=fa.compose(fa.ddp(), fa.accumulate(2, normalize="items")),
    )
    reported = []
    for batch in mine:
        state, metrics = fa.step(state, batch)
        if "lr" in metrics:  # an update: the window's metrics, this rank's
            reported.append(tuple(metrics[key].item() for key in ("loss", "loss_sum", "num_items")))
    return [p.detach() for p in model.parameters()], reported


def test_items_normalisation_under_ddp_is_the_global_mean_over_tokens(world2: Any) -> None:
    from tests.test_train import _token_batches, token_loss_sum

    per_rank = [_token_batches(4, seed=20 + r) for r in range(2)]
    ref = make_model(dropout=0.0)
    opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    for i in (0, 2):
        group = [b for rank_batches in per_rank for b in rank_batches[i : i + 2]]
        sums, counts = zip(*(token_loss_sum(ref, b) for b in group), strict=False)
        (sum(sums) / sum(c["num_items"] for c in counts)).backward()
        opt.step()
        opt.zero_grad()
    for rank, (params, reported) in enumerate(world2.run(train_items)):
        for p, q in zip(params, ref.parameters(), strict=False):
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-6)
        windows = [per_rank[rank][i : i + 2] for i in (0, 2)]  # this rank's items, not all ranks'
        num_items = [float(sum(mask.sum() for _, _, mask in window)) for window in windows]
        assert [items for _, _, items in reported] == num_items
        assert all(loss == pytest.approx(loss_sum / items, rel=1e-6) for loss, loss_sum, items in reported)


def train_fsdp_variant(state: fa.RunState, variant: str) -> dict[str, Any]:
    rank, world = state.dist.rank, state.dist.num_processes
    model = make_blocks()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if variant == "sync_meta":  # rank 1 built its model on meta: every rank must refuse, none hang
        if rank == 1:
            model = model.to("meta")
        try:
            fa.prepare(state, model, pipeline=fa.compose(fa.fsdp(sync_module_states=True)))
        except ValueError as exc:
            return {"error": str(exc)}
        return {"error": None}
    if variant == "late_optimizer":  # built on the parameters fsdp() then replaced
        state = fa.prepare(state, model, pipeline=fa.compose(fa.fsdp()))
        errors = []
        for attempt in (
            lambda: fa.prepare(state, optimizer=opt),
            lambda: fa.utils.save(state, model.state_dict(), "/nonexistent/x.safetensors"),
        ):
            try:
                attempt()
            except ValueError as exc:
                errors.append(str(exc))
        return {"error": errors[0], "errors": errors}
    if variant == "offload":
        try:
            fa.prepare(state, model, opt, pipeline=fa.compose(fa.fsdp(cpu_offload=True)))
        except ValueError as exc:
            return {"error": str(exc)}
        return {"error": None}
    parts: list[fa.Transform]
    if variant == "min_size":
        parts = [fa.fsdp(min_num_params=50)]
    elif variant == "sync":  # only rank 0 holds the real weights; the others hold noise
        if rank != 0:
            with torch.no_grad():
                for p in model.parameters():
                    p.normal_()
        parts = [fa.fsdp(transformer_cls_names_to_wrap=["Block"], sync_module_states=True)]
    else:
        parts = [fa.autocast(fa.bf16), fa.fsdp(transformer_cls_names_to_wrap=["Block"])]
    state = fa.prepare(state, model, opt, loss_fn=loss_fn, pipeline=fa.compose(*parts))
    losses = []
    for batch in global_batches(4):
        state, metrics = fa.step(state, my_part(batch, rank, world))
        losses.append(metrics["loss"].item())
    return {
        "params": [_full(p) for p in model.parameters()],
        "losses": losses,
        "patched_forward": "forward" in model.__dict__,
        "param_dtype": str(model[0].linear.weight.dtype),
    }


def test_fsdp_by_size_with_bf16_policy_and_offload_refused_on_cpu(world2: Any) -> None:
    def reference() -> list[torch.Tensor]:
        model = make_blocks()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for batch in global_batches(4):
            loss_fn(model, batch).backward()
            opt.step()
            opt.zero_grad()
        return [p.detach() for p in model.parameters()]

    expected = reference()
    for result in world2.run(train_fsdp_variant, "offload"):  # needs CUDA: a clear error here
        assert "run computes on the CPU already" in result["error"]
    for result in world2.run(train_fsdp_variant, "late_optimizer"):
        assert "fa.fsdp replaced the model's parameters" in result["errors"][0]
        assert "sharded over the ranks" in result["errors"][1]  # fnaccel.utils.save, on every rank
    rank0, rank1 = world2.run(train_fsdp_variant, "sync_meta")
    assert "another rank's model has a tensor on the meta device" in rank0["error"]
    assert "'0.linear.weight' is on the meta device" in rank1["error"]
    for variant in ("min_size", "sync"):
        for result in world2.run(train_fsdp_variant, variant):
            for p, q in zip(result["params"], expected, strict=False):
                torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-5)
    for result in world2.run(train_fsdp_variant, "bf16"):
        assert not result["patched_forward"]  # the precision went into MixedPrecisionPolicy
        assert result["param_dtype"] == "torch.float32"  # sharded master weights stay fp32
        assert all(math.isfinite(loss) for loss in result["losses"])
        for p, q in zip(result["params"], expected, strict=False):
            torch.testing.assert_close(p, q, rtol=0.05, atol=0.02)  # bf16 compute


def _default_pipeline_from_handler(state: fa.RunState) -> str:
    from types import MappingProxyType

    handler = fa.DistributedDataParallelKwargs(find_unused_parameters=True, bucket_cap_mb=10)
    state = state.replace(kwargs_handlers=MappingProxyType({"DistributedDataParallelKwargs": handler}))
    model = nn.Linear(2, 2)
    state = fa.prepare(state, model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert state.model.find_unused_parameters  # type: ignore[union-attr]
    return repr(state.pipeline)


def test_the_default_ddp_takes_the_kwargs_handler(world2: Any) -> None:
    assert (
        world2.run(_default_pipeline_from_handler)
        == ["compose(ddp(bucket_cap_mb=10, find_unused_parameters=True))"] * 2
    )
