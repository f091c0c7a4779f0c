"""Functions the mesh tests run on every rank of a World (importable by the workers),
and the one-process reference they are compared with."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import fnaccel as fa
from fnaccel.utils import get_model_tp_size

NUM_SAMPLES, DIM, LR, MAX_NORM = 32, 8, 0.2, 0.5


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(DIM, 4 * DIM)
        self.down = nn.Linear(4 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(DIM, DIM)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(DIM, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def make_model() -> Net:
    torch.manual_seed(3)
    return Net()


def data() -> TensorDataset:
    generator = torch.Generator().manual_seed(4)
    return TensorDataset(
        torch.randn(NUM_SAMPLES, DIM, generator=generator), torch.randn(NUM_SAMPLES, 1, generator=generator)
    )


def loss_fn(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


def tp_plan() -> dict[str, Any]:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {"blocks.*.up": ColwiseParallel(), "blocks.*.down": RowwiseParallel()}


def reference(global_batch: int, num_steps: int) -> tuple[dict[str, torch.Tensor], list[float], torch.Tensor]:
    """One process, plain PyTorch, on the global batch: (weights, grad norms, eval outputs)."""
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    x, y = data().tensors
    norms = []
    for step in range(num_steps):
        start = (step * global_batch) % NUM_SAMPLES
        optimizer.zero_grad()
        loss_fn(model, (x[start : start + global_batch], y[start : start + global_batch])).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        optimizer.step()
    with torch.no_grad():
        outputs = model(x)[:, 0]
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, norms, outputs


def full_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for name, value in model.state_dict().items():
        full = getattr(value, "full_tensor", None)
        out[name] = (full() if full else value).detach().clone()
    return out


def train_on_mesh(
    base: fa.RunState, layout: dict[str, int], pipeline: str, num_steps: int, batch_size: int, checkpoint: str
) -> dict[str, Any]:
    """Train on the layout's mesh; evaluate; save, perturb, load; report what rank 0 needs."""
    state = fa.init(cpu=True, seed=0, parallelism=fa.ParallelismConfig(**layout))
    try:
        layouts: dict[str, Callable[[], list[fa.Transform]]] = {
            "tp": lambda: [fa.tp(tp_plan())],
            "fsdp+tp": lambda: [
                fa.tp(tp_plan()),
                fa.checkpoint_activations(),  # torchtitan's order
                fa.fsdp(transformer_cls_names_to_wrap=["Block"]),
            ],
            "hsdp": lambda: [fa.fsdp(transformer_cls_names_to_wrap=["Block"])],
        }
        transforms = layouts[pipeline]()
        model = make_model()
        state = fa.prepare(
            state,
            model,
            torch.optim.SGD(model.parameters(), lr=LR),
            DataLoader(data(), batch_size=batch_size),
            loss_fn=loss_fn,
            pipeline=fa.compose(*transforms, fa.clip_grad_norm(MAX_NORM)),
        )
        norms, seen = [], []
        for batch in fa.batches(state, epochs=2):
            seen.append(batch[0][:, 0].tolist())
            state, metrics = fa.step(state, batch)
            norms.append(float(metrics["grad_norm"]))
            if state.step == num_steps:
                break
        outputs = fa.evaluate(state, DataLoader(data(), batch_size=3), lambda m, b: m(b[0])[:, 0])
        weights = full_weights(state.model)
        fa.save(state, checkpoint)
        with torch.no_grad():
            for p in state.model.parameters():
                p.zero_()
        state = fa.load(state, checkpoint)
        reloaded = full_weights(state.model)
        return {
            "weights": weights,
            "reloaded": reloaded,
            "norms": norms,
            "outputs": outputs,
            "batches": seen,
            "kinds": sorted({type(p).__name__ for p in state.model.parameters()}),
            "tp_size": get_model_tp_size(state.model),
        }
    finally:
        fa.shutdown(state)


def mesh_facts(base: fa.RunState, layout: dict[str, int]) -> dict[str, Any]:
    """What the accessors say on this rank, and that the groups are the mesh's."""
    from fnaccel.dist import data_parallel, data_parallel_context, mesh_dim

    state = fa.init(cpu=True, parallelism=fa.ParallelismConfig(**layout))
    try:
        dims = {
            name: None if mesh_dim(state.dist, name) is None else mesh_dim(state.dist, name).mesh.tolist()
            for name in ("pp", "dp_replicate", "dp_shard", "cp", "tp", "dp")
        }
        dp = data_parallel_context(state.dist)
        total = fa.ops.reduce(dp, torch.tensor([1.0]), "sum")
        mine = torch.tensor([float(state.dist.rank)])
        from_second = [float(fa.ops.broadcast(dp, mine, from_process=1)) for _ in range(2)]
        objects = fa.ops.broadcast_object_list(dp, [state.dist.rank], from_process=1)
        return {
            "names": state.dist.mesh.mesh_dim_names,
            "dims": dims,
            "dp": data_parallel(state.dist),
            "dp_sum": float(total),
            "from_second": from_second,
            "objects": objects,
        }
    finally:
        fa.shutdown(state)


def refusals(base: fa.RunState) -> list[str]:
    """The mesh errors that need a world larger than one."""
    messages = []
    for layout, pipeline in (
        ({"tp_size": 2}, None),
        ({"dp_replicate_size": 4}, [fa.fsdp()]),
        ({"tp_size": 2}, [fa.ddp(), fa.tp(tp_plan())]),
    ):
        state = fa.init(cpu=True, parallelism=fa.ParallelismConfig(**layout))
        try:
            model = make_model()
            fa.prepare(
                state,
                model,
                torch.optim.SGD(model.parameters(), lr=LR),
                pipeline=None if pipeline is None else fa.compose(*pipeline),
            )
        except ValueError as exc:
            messages.append(str(exc))
        finally:
            fa.shutdown(state)
    return messages
