"""A data-parallel transform written outside fnaccel takes part as `fa.ddp()` does.

`allreduce_gradients` below is built from the public records only
(`fa.ParallelismTransform`, `fa.Capability`): rank 0's weights to every rank at
`fa.prepare`, then, before each update, every gradient averaged over the
ranks. It declares `Capability.AVERAGES_GRADIENTS`, which is all `fa.prepare`
asks of a pipeline on several processes (it never looks for the name
``ddp``). On 2 processes it prepares, steps, saves and resumes bit for bit
like `fa.ddp()`, with no change to fnaccel (issue 27, point 1); given a
checkpoint layout of its own (`ReplicaLayout`: torch's state_dicts in files
named after it, through the public storage half: `fa.CheckpointLayout`,
`fa.CheckpointFiles`, `fa.read_checkpoint_tensors` / `fa.read_checkpoint_json`),
it saves and resumes through that layout, bit for bit too (issue 27 point 3,
issue 34 point 1). Only public names are imported here (tests/checkpoint/storage/test_layout.py
checks it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import fnaccel as fa

NUM_SAMPLES, BATCH = 40, 4  # 5 batches per epoch on each of 2 processes


def allreduce_gradients(layout: fa.CheckpointLayout | None = None) -> fa.ParallelismTransform:
    """Data parallel in a few lines: the replicas start equal and average their gradients."""

    def prepare_model(ctx: Any, model: nn.Module, state: Any) -> nn.Module:
        if ctx.num_processes > 1:  # every replica starts from rank 0's weights, as DDP's do
            first = dist.get_global_rank(ctx.process_group, 0)
            for tensor in [*model.parameters(), *model.buffers()]:
                dist.broadcast(tensor.data, src=first, group=ctx.process_group)
        return model

    def before_update(model: nn.Module, optimizer: Any, ctx: Any) -> dict[str, Any]:
        if ctx.num_processes > 1:  # divided first, then summed: DDP's order, the same bits
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.div_(ctx.num_processes)
                    dist.all_reduce(p.grad, group=ctx.process_group)
        return {}

    return fa.ParallelismTransform(
        name="allreduce_gradients",
        capabilities=frozenset({fa.Capability.AVERAGES_GRADIENTS}),
        init=lambda ctx: ctx,  # its state: the run's context (nothing to save)
        prepare_model=prepare_model,
        before_update=before_update,
        layout=layout,
    )


class ReplicaLayout:
    """The outsider's checkpoint layout: rank 0 writes the model's and the optimizer's
    ``state_dict()`` as torch gives them (the optimizer's parameters by index), each
    rank its gradients when the save falls inside an accumulation window."""

    def holds(self, state: fa.RunState) -> bool:
        return True  # every run of this transform: its replicas are whole

    def snapshot(self, state: fa.RunState, files: fa.CheckpointFiles) -> None:
        model, optimizer = state.model, state.optimizer
        if any(p.grad is not None for p in model.parameters()):
            files.add_tensors(
                f"rank{files.rank}.safetensors",
                {f"grad/{name}": p.grad for name, p in model.named_parameters() if p.grad is not None},
            )
        if files.writer:
            files.add_tensors("replica_model.safetensors", model.state_dict())
            saved = optimizer.state_dict()
            files.add_tensors(
                "replica_optimizer.safetensors",
                {
                    f"{index}/{key}": value
                    for index, values in saved["state"].items()
                    for key, value in values.items()
                },
            )
            files.add_json("replica_optimizer.json", {"param_groups": saved["param_groups"]})

    def write(self, captured: None, ctx: fa.DistContext, directory: Path) -> dict[str, Any]:
        return {}  # every file is in the snapshot

    def read(
        self,
        state: fa.RunState,
        directory: Path,
        manifest: dict[str, Any],
        gradients: dict[str, torch.Tensor],
    ) -> dict[str, Any]:
        tensors = fa.read_checkpoint_tensors(directory, "replica_optimizer.safetensors", manifest)
        by_param: dict[int, dict[str, torch.Tensor]] = {}
        for key, value in tensors.items():
            index, name = key.split("/")
            by_param.setdefault(int(index), {})[name] = value
        groups = fa.read_checkpoint_json(directory, "replica_optimizer.json", manifest)["param_groups"]
        return {
            "model": fa.read_checkpoint_tensors(directory, "replica_model.safetensors", manifest),
            "optimizer": {"state": by_param, "param_groups": groups},
            "gradients": gradients,
        }

    def restore(self, state: fa.RunState, read: dict[str, Any]) -> None:
        state.model.load_state_dict(read["model"])
        state.optimizer.load_state_dict(read["optimizer"])
        for name, p in state.model.named_parameters():
            grad = read["gradients"].get(name)
            p.grad = None if grad is None else grad.clone()


def loss_fn(model: nn.Module, batch: list[torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


def _fresh(state: fa.RunState, pipeline: fa.Pipeline) -> tuple[fa.RunState, nn.Module]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.7)
    g = torch.Generator().manual_seed(11)
    data = TensorDataset(
        torch.randn(NUM_SAMPLES, 8, generator=g), torch.randint(0, 4, (NUM_SAMPLES,), generator=g)
    )
    loader = DataLoader(data, batch_size=BATCH, shuffle=True)
    return fa.prepare(state, model, optimizer, loader, scheduler, pipeline=pipeline, loss_fn=loss_fn), model


def _train(state: fa.RunState, stop_after: int | None = None) -> tuple[fa.RunState, list[float]]:
    losses = []
    for batch in fa.batches(state, epochs=2):
        state, metrics = fa.step(state, batch)
        losses.append(metrics["loss"].item())
        if state.micro_step == stop_after:
            break
    return state, losses


def _weights(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def outsider_against_ddp(
    state: fa.RunState, directory: str, own_directory: str, stop_after: int
) -> dict[str, Any]:
    """On each rank, under accumulate(2) (DDP's no_sync micro-steps, then its averaged one):
    fa.ddp() straight through; the outsider straight through; the outsider saved after
    ``stop_after`` batches and resumed into fresh objects, through the layout its
    capabilities choose and through its own `ReplicaLayout`."""
    extra = (fa.accumulate(2),)
    ddp, ddp_model = _fresh(state, fa.compose(fa.ddp(), *extra))
    ddp, ddp_losses = _train(ddp)
    fa.shutdown(ddp)  # each fa.init below forms a group of its own

    whole, whole_model = _fresh(fa.init(seed=0, cpu=True), fa.compose(allreduce_gradients(), *extra))
    whole, whole_losses = _train(whole)
    fa.shutdown(whole)

    first, _ = _fresh(fa.init(seed=0, cpu=True), fa.compose(allreduce_gradients(), *extra))
    first, first_losses = _train(first, stop_after=stop_after)
    fa.save(first, directory)
    fa.shutdown(first)
    second, resumed_model = _fresh(fa.init(seed=0, cpu=True), fa.compose(allreduce_gradients(), *extra))
    second = fa.load(second, directory)
    second, rest = _train(second)
    fa.shutdown(second)

    own = fa.compose(allreduce_gradients(ReplicaLayout()), *extra)
    first, own_first_losses = _train(_fresh(fa.init(seed=0, cpu=True), own)[0], stop_after=stop_after)
    fa.save(first, own_directory)
    fa.shutdown(first)
    third, own_model = _fresh(fa.init(seed=0, cpu=True), own)
    third = fa.load(third, own_directory)
    third, own_rest = _train(third)
    fa.shutdown(third)
    return {
        "losses": {
            "ddp": ddp_losses,
            "outsider": whole_losses,
            "resumed": first_losses + rest,
            "own layout": own_first_losses + own_rest,
        },
        "weights": {
            "ddp": _weights(ddp_model),
            "outsider": _weights(whole_model),
            "resumed": _weights(resumed_model),
            "own layout": _weights(own_model),
        },
        "steps": (ddp.step, whole.step, second.step, third.step),
    }


def test_an_outsider_data_parallel_transform_equals_ddp_bit_for_bit(world2: Any, tmp_path: Path) -> None:
    stop_after = 7  # mid-epoch 1, inside an accumulation window (its gradients are saved)
    results = world2.run(outsider_against_ddp, str(tmp_path / "ckpt"), str(tmp_path / "own"), stop_after)
    for rank, result in enumerate(results):
        losses, weights = result["losses"], result["weights"]
        assert losses["outsider"] == losses["ddp"] == losses["resumed"] == losses["own layout"], (
            rank,
            losses,
        )
        for kind in ("outsider", "resumed", "own layout"):
            assert all(torch.equal(p, q) for p, q in zip(weights[kind], weights["ddp"], strict=True)), (
                rank,
                kind,
            )
        assert result["steps"] == (5, 5, 5, 5)  # 10 batches on each rank, 2 per update
    # the replicas agree: the gradients were averaged, not kept per rank
    assert all(
        torch.equal(p, q)
        for p, q in zip(results[0]["weights"]["resumed"], results[1]["weights"]["resumed"], strict=False)
    )
    # the checkpoint is the replicated layout fa.ddp()'s is (chosen from the capabilities, not the name)
    assert (tmp_path / "ckpt" / "model.safetensors").is_file()
    # the outsider's own layout wrote its files instead of the plain layout's (and both ranks' gradients)
    written = {p.name for p in (tmp_path / "own").iterdir()}
    assert {
        "replica_model.safetensors",
        "replica_optimizer.safetensors",
        "replica_optimizer.json",
        "rank0.safetensors",
        "rank1.safetensors",
    } <= written, written
    assert not {"model.safetensors", "optimizer.safetensors", "optimizer.json"} & written, written
