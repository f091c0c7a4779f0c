"""Pipeline parallel: `pp(...)` splits an `nn.Sequential` into stages and runs a
`torch.distributed.pipelining` schedule inside `fa.step`.

At `fa.prepare` the model's children are cut into ``num_stages`` consecutive
runs (by count, or where ``split_points`` name the children that begin a
stage); the pipeline's ranks hold stages round-robin (rank ``r`` holds stages
``r``, ``r + P``, ...: one stage per rank for GPipe and 1F1B, several for
interleaved 1F1B). The prepared model is a `PipelinedModel` holding only this
rank's children, under their original names, so its parameter names,
``state_dict`` keys and checkpoint keys are the unsplit model's. The optimizer
passed to `fa.prepare` (built over the whole model, as in one process) is cut
down to this rank's parameters there.

A step's batch is ``(inputs, target)``: the first stage gets ``inputs`` (a
tensor, or a tuple of them as positional arguments), the last stage computes
``loss_fn(output, target)`` per micro-batch; ``inputs`` and ``target`` are
split into ``num_microbatches`` equal micro-batches along dim 0. Gradients
are the mean over micro-batches (and over `accumulate`'s batches), as for the
unsplit model on the whole batch with a mean loss. The step's ``loss`` is the
mean of the micro-batch losses, broadcast from the last stage to every rank
(a collective, no host sync).

The pipeline group is chosen in one place, `stage_group`: today it is the
whole world (no data-parallel dimension beside it). In a world of one there
is no group for torch's schedules; `InOrder` runs the micro-batches one after
the other instead, which is what every schedule computes.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any, NoReturn, Protocol

import torch
import torch.distributed as dist
from torch import nn

from fnaccel.checkpoint.storage.sharded import ShardedLayout
from fnaccel.checks import is_int
from fnaccel.dist import DistContext, data_parallel, mesh_dim
from fnaccel.transforms.contract import PipelineView, PrepareRequest
from fnaccel.transforms.declared import Accumulation, Capability
from fnaccel.transforms.kinds import ParallelismTransform, options
from fnaccel.transforms.mixed_precision import AutocastForward
from fnaccel.transforms.parallel import check_optimizer_holds_model, unwrap_compiled
from fnaccel.transforms.phases import Phase

__all__ = ["InOrder", "PipelinedModel", "SCHEDULES", "pp", "reduce_norm", "split_stages", "stage_group"]

SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B")


def stage_group(ctx: DistContext) -> tuple[dist.ProcessGroup | None, list[int]]:
    """``(process group, its global ranks in stage order)`` that the pipeline runs over:
    the mesh's ``"pp"`` dimension (``fa.ParallelismConfig(pp_size=...)``), or the
    whole world when the run's mesh has none."""
    mesh = mesh_dim(ctx, "pp")
    if mesh is not None:
        return mesh.get_group(), [int(r) for r in mesh.mesh.flatten().tolist()]
    return ctx.process_group, list(range(ctx.num_processes))


def _splits(ctx: DistContext) -> bool:
    """Whether `pp` splits the model over processes in this run (in a world of one its
    stages run in order in one process, and the model is stored whole)."""
    return stage_group(ctx)[0] is not None


def split_stages(model: nn.Module, num_stages: int | None, split_points: Sequence[str]) -> list[list[str]]:
    """The names of ``model``'s children in each stage, in order.

    Args:
        model: an `nn.Sequential`.
        num_stages: cut into this many stages of consecutive children, the
            first ``len(model) % num_stages`` one child longer.
        split_points: or: the names of the children that begin the second,
            third, ... stage (torchtitan's ``pipeline_parallel_split_points``).

    Raises:
        TypeError: ``model`` is not an `nn.Sequential`.
        ValueError: more stages than children, or split points that are not
            children's names in increasing order after the first.

    >>> body = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 1))
    >>> split_stages(body, 2, ())
    [['0', '1', '2'], ['3', '4']]
    >>> split_stages(body, None, ("2",))
    [['0', '1'], ['2', '3', '4']]
    """
    if not isinstance(model, nn.Sequential):
        raise TypeError(
            f"fa.pp splits an nn.Sequential into stages, got a {type(model).__name__}; build the "
            "model as nn.Sequential(embedding, *blocks, head) (each child takes the previous "
            "child's output), or split it by hand and train each stage without fa.pp"
        )
    names = list(model._modules)  # named_children() would skip a module that appears twice
    if split_points:
        unknown = [p for p in split_points if p not in names]
        if unknown:
            raise ValueError(
                f"fa.pp: split point {unknown[0]!r} is not a child of the model; its children are {names}"
            )
        starts = [names.index(p) for p in split_points]
        if starts[0] == 0 or any(b <= a for a, b in itertools.pairwise(starts)):
            raise ValueError(
                f"fa.pp: split_points {tuple(split_points)} must name children after the first, in "
                f"increasing order (each begins a new stage); the children are {names}"
            )
        bounds = [0, *starts, len(names)]
    else:
        assert num_stages is not None
        if num_stages > len(names):
            raise ValueError(
                f"fa.pp: {num_stages} stages cannot be made from a model of {len(names)} children "
                f"({names}); use at most {len(names)} stages, or fewer processes per pipeline"
            )
        size, extra = divmod(len(names), num_stages)
        bounds = [0]
        for i in range(num_stages):
            bounds.append(bounds[-1] + size + int(i < extra))
    return [names[a:b] for a, b in itertools.pairwise(bounds)]


class PipelinedModel(nn.Module):
    """This rank's stages of a model split by `pp`: the children it holds under their
    original names, and the schedule that runs them. Called through `fa.step` only."""

    def __init__(
        self,
        children: OrderedDict[str, nn.Module],
        *,
        group: dist.ProcessGroup | None,
        last_rank: int,
        is_first: bool,
        is_last: bool,
        device: torch.device,
        num_microbatches: int,
        loss_fn: Callable[..., torch.Tensor],
    ) -> None:
        super().__init__()
        for name, child in children.items():
            self.add_module(name, child)
        self.schedule: _Schedule | None = None  # set by `_build_schedule`, which needs `scaled_loss`
        self.group, self.last_rank, self.device = group, last_rank, device
        self.is_first, self.is_last = is_first, is_last
        self.num_microbatches, self.loss_fn = num_microbatches, loss_fn
        self.loss_factor = 1.0
        self.losses: list[torch.Tensor] = []

    def forward(self, *args: object, **kwargs: object) -> NoReturn:
        raise TypeError(
            "a model split by fa.pp holds only this rank's stages and runs through its schedule: "
            "train it with fa.step(state, (inputs, target)); to evaluate, load fa.save_model's "
            "weights into the unsplit model"
        )

    def scaled_loss(self, output: object, target: object) -> torch.Tensor:
        """The schedule's loss function: the user's, kept for the metrics, scaled for backward."""
        loss: torch.Tensor = self.loss_fn(output, target)
        self.losses.append(loss.detach())
        return loss * self.loss_factor

    def run(self, batch: object, divisor: int) -> torch.Tensor:
        """One schedule step on ``batch`` (gradients added to ``.grad``); the mean
        micro-batch loss on every rank."""
        if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
            raise TypeError(
                f"fa.step under fa.pp takes a batch (inputs, target), got a {type(batch).__name__}; "
                "the first stage gets inputs, the last computes loss_fn(output, target)"
            )
        inputs, target = batch
        args = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
        for what, value in (("inputs", args[0] if args else None), ("target", target)):
            if (
                not isinstance(value, torch.Tensor)
                or value.ndim == 0
                or value.shape[0] % self.num_microbatches
            ):
                size = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
                raise ValueError(
                    f"fa.pp: the batch's {what} ({size}) must be a tensor whose dim 0 divides into "
                    f"num_microbatches={self.num_microbatches} equal micro-batches; use a batch size "
                    f"that is a multiple of {self.num_microbatches} (drop_last=True in the DataLoader)"
                )
        self.loss_factor = 1.0 / (self.num_microbatches * divisor)
        self.losses = []
        assert self.schedule is not None, "_build_schedule set it"
        self.schedule.step(*args if self.is_first else (), target=target if self.is_last else None)
        if self.is_last:  # the first step's shape inference calls the loss function first
            loss = torch.stack(self.losses[-self.num_microbatches :]).mean().float()
        else:
            loss = torch.empty((), dtype=torch.float32, device=self.device)
        self.losses = []
        if self.group is not None:
            dist.broadcast(loss, src=self.last_rank, group=self.group)
        return loss


class _Schedule(Protocol):
    """What a step asks of a pipeline schedule (torch's, or `InOrder`)."""

    def step(self, *args: torch.Tensor, target: torch.Tensor | None) -> object: ...


class InOrder:
    """What every schedule computes, in a world of one: each micro-batch's forward
    and backward in turn, through all the stages (torch's schedules need a group)."""

    def __init__(self, body: nn.Module, num_microbatches: int, loss_fn: Callable[..., torch.Tensor]) -> None:
        self.body, self.num_microbatches, self.loss_fn = body, num_microbatches, loss_fn

    def step(self, *args: torch.Tensor, target: torch.Tensor | None) -> None:
        assert target is not None, "one process holds the last stage"
        chunks = [torch.tensor_split(a, self.num_microbatches) for a in args]
        for i, part in enumerate(torch.tensor_split(target, self.num_microbatches)):
            self.loss_fn(self.body(*(c[i] for c in chunks)), part).backward()


def reduce_norm(model: nn.Module, norm: torch.Tensor, norm_type: float) -> torch.Tensor:
    """``norm`` (of this rank's gradients) made the norm over every pipeline stage's
    gradients for a model split by `pp` (one all-reduce); ``norm`` itself otherwise."""
    inner = unwrap_compiled(model)
    if not isinstance(inner, PipelinedModel) or inner.group is None:
        return norm
    total = norm.detach().clone()
    if norm_type == float("inf"):
        dist.all_reduce(total, op=dist.ReduceOp.MAX, group=inner.group)
        return total
    total = total.pow(norm_type)
    dist.all_reduce(total, op=dist.ReduceOp.SUM, group=inner.group)
    return total.pow(1.0 / norm_type)


def _build_schedule(
    ctx: DistContext,
    model: nn.Module,
    schedule: str,
    num_microbatches: int,
    num_stages: int | None,
    split_points: tuple[str, ...],
    loss_fn: Callable[..., torch.Tensor],
) -> PipelinedModel:
    group, ranks = stage_group(ctx)
    size = len(ranks)
    per_rank = 2 if schedule == "Interleaved1F1B" else 1
    wanted = num_stages if num_stages is not None or split_points else size * per_rank
    names = split_stages(model, wanted, split_points)
    multi = schedule == "Interleaved1F1B"
    if (multi and (len(names) % size or len(names) < 2 * size)) or (not multi and len(names) != size):
        need = f"a multiple of {size}, at least {2 * size}" if multi else f"exactly {size}"
        raise ValueError(
            f"fa.pp: schedule {schedule!r} over {size} processes needs {need} stages, got {len(names)} "
            f"({names}); change num_stages/split_points"
            + ("" if multi else ", or use schedule='Interleaved1F1B'")
        )
    if schedule == "1F1B" and num_microbatches < size:
        raise ValueError(
            f"fa.pp: schedule '1F1B' over {size} stages needs num_microbatches >= {size}, "
            f"got {num_microbatches}"
        )
    rounds = max(1, num_microbatches // size)
    if multi and num_microbatches % rounds:
        raise ValueError(
            f"fa.pp: schedule 'Interleaved1F1B' over {size} processes runs micro-batches in "
            f"rounds of {size}; use a num_microbatches below {size} or a multiple of it, "
            f"got {num_microbatches}"
        )
    children: dict[str, nn.Module] = dict(model._modules)  # type: ignore[arg-type]
    owners: dict[int, int] = {}
    for index, stage_names in enumerate(names):
        for name in stage_names:
            for p in children[name].parameters():
                if owners.setdefault(id(p), index) != index:
                    raise ValueError(
                        f"fa.pp: a parameter of child {name!r} is shared with stage {owners[id(p)]} "
                        "(tied weights across stages); keep tied modules in one stage (split_points)"
                    )
    cast = model.__dict__.get("forward")
    mine = list(range(ranks.index(ctx.rank), len(names), size))
    bodies = []
    held: OrderedDict[str, nn.Module] = OrderedDict()
    for index in mine:
        body = nn.Sequential(OrderedDict((name, children[name]) for name in names[index]))
        if isinstance(cast, AutocastForward):  # autocast wrapped the whole model: wrap each stage
            wrapped = AutocastForward(body.forward, cast.device_type, cast.dtype, cast.cache_enabled)
            body.forward = wrapped  # type: ignore[method-assign]
        held.update((name, children[name]) for name in names[index])
        bodies.append(body)
    pipelined = PipelinedModel(
        held,
        group=group,
        last_rank=ranks[(len(names) - 1) % size],
        is_first=mine[0] == 0,
        is_last=mine[-1] == len(names) - 1,
        device=ctx.device,
        num_microbatches=num_microbatches,
        loss_fn=loss_fn,
    )
    if group is None:
        pipelined.schedule = InOrder(nn.Sequential(*bodies), num_microbatches, pipelined.scaled_loss)
        return pipelined
    from torch.distributed import pipelining

    stages = [
        pipelining.PipelineStage(body, index, len(names), ctx.device, group=group)
        for body, index in zip(bodies, mine, strict=False)
    ]
    kind = {
        "GPipe": pipelining.ScheduleGPipe,
        "1F1B": pipelining.Schedule1F1B,
        "Interleaved1F1B": pipelining.ScheduleInterleaved1F1B,
    }[schedule]
    pipelined.schedule = kind(
        stages if multi else stages[0],
        n_microbatches=num_microbatches,
        loss_fn=pipelined.scaled_loss,
        scale_grads=False,
    )
    return pipelined


def pp(
    *,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    num_microbatches: int,
    schedule: str = "1F1B",
    num_stages: int | None = None,
    split_points: Sequence[str] = (),
) -> ParallelismTransform:
    """Pipeline parallel: split an `nn.Sequential` into stages over the processes and
    run a `torch.distributed.pipelining` schedule in `fa.step`.

    Args:
        loss_fn: ``loss_fn(output, target) -> loss`` on one micro-batch, at the
            last stage (a mean over the micro-batch's items, e.g.
            ``torch.nn.functional.cross_entropy``); `fa.prepare` takes no
            ``loss_fn`` beside it.
        num_microbatches: micro-batches per batch; it must divide the batch.
        schedule: ``"GPipe"``, ``"1F1B"`` or ``"Interleaved1F1B"``.
        num_stages: cut the model's children into this many stages; default
            one per process (two per process for ``"Interleaved1F1B"``).
        split_points: or: the names of the children that begin each stage
            after the first.

    Raises:
        ValueError: an unknown schedule, a non-positive micro-batch count, or
            both ``num_stages`` and ``split_points``. (A model that cannot be
            split so is refused at `fa.prepare`.)

    In a world of one the micro-batches run in order in the one process (what
    every schedule computes), so the same script runs on one process or many.

    >>> import fnaccel as fa, torch
    >>> pp = fa.pp(loss_fn=torch.nn.functional.mse_loss, num_microbatches=2, schedule="GPipe")
    >>> pp
    pp(schedule='GPipe', num_microbatches=2)
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    >>> state = fa.prepare(fa.init(seed=0, cpu=True), model, torch.optim.SGD(model.parameters(), lr=0.1),
    ...                    pipeline=fa.compose(pp))
    >>> state, metrics = fa.step(state, (torch.ones(4, 4), torch.zeros(4, 1)))
    >>> state.step, metrics["loss"].shape
    (1, torch.Size([]))
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"fa.pp: schedule must be one of {SCHEDULES}, got {schedule!r}")
    if not is_int(num_microbatches) or num_microbatches < 1:
        raise ValueError(f"fa.pp: num_microbatches must be a positive int, got {num_microbatches!r}")
    if num_stages is not None and split_points:
        raise ValueError("fa.pp: give num_stages or split_points, not both")
    if num_stages is not None and (not is_int(num_stages) or num_stages < 1):
        raise ValueError(f"fa.pp: num_stages must be a positive int, got {num_stages!r}")
    if isinstance(split_points, str):
        raise TypeError(f"fa.pp: split_points is a sequence of child names, got the string {split_points!r}")
    points = tuple(split_points)
    if not callable(loss_fn):
        raise TypeError(f"fa.pp: loss_fn must be callable (output, target) -> loss, got {loss_fn!r}")

    def prepare_model(ctx: DistContext, model: nn.Module, state: object) -> nn.Module:
        return _build_schedule(ctx, model, schedule, num_microbatches, num_stages, points, loss_fn)

    def forward_backward(
        model: nn.Module, batch: object, divisor: int | None, state: object
    ) -> tuple[torch.Tensor, None]:
        assert divisor is not None, "check refused accumulate(normalize='items')"
        inner = unwrap_compiled(model)
        assert isinstance(inner, PipelinedModel), "fa.pp's prepare_model built it"
        return inner.run(batch, divisor), None

    def check(request: PrepareRequest) -> PipelineView:
        """fa.pp's whole contract at fa.prepare: no replicas beside the stages, its own loss
        function only, mean losses, one batch for every stage, an optimizer over its stages."""
        ctx, pipeline = request.ctx, request.pipeline
        num_replicas = data_parallel(ctx)[1]
        if num_replicas > 1 and mesh_dim(ctx, "pp") is not None:
            raise ValueError(
                f"fa.prepare: fa.pp next to {num_replicas} data-parallel replicas is not built (each stage's "
                "gradients would need averaging over its replicas); use pp_size equal to the number of "
                "processes (dp_replicate_size=dp_shard_size=1)"
            )
        if request.loss_fn_given:  # the schedule computes the loss at the last stage
            raise ValueError(
                "fa.prepare: under fa.pp the loss is computed at the last stage by "
                "fa.pp(loss_fn=lambda output, target: ...); drop fa.prepare's loss_fn"
            )
        accumulation = pipeline.settings(Accumulation)
        if accumulation is not None and accumulation.sums_items:
            raise ValueError(
                "fa.pp: accumulate(normalize='items') is not supported under fa.pp (the "
                "schedule averages micro-batch losses); use accumulate(k) with a mean loss"
            )
        if request.loader_shards is not None and request.loader_shards > 1:
            raise ValueError(
                "fa.prepare: every stage of fa.pp must read the same batches, but the loader would be "
                "sharded over the processes; give fa.init(parallelism=fa.ParallelismConfig(pp_size=N)) "
                "(the data is then split over the data-parallel ranks only) or pass "
                "kwargs_handlers=[DataLoaderConfiguration(shard=False)] to fa.init"
            )
        return check_optimizer_holds_model(request)

    opts = (
        options(schedule=schedule, num_microbatches=num_microbatches)
        + (options(num_stages=num_stages) if num_stages is not None else ())
        + (options(split_points=points) if points else ())
    )
    return ParallelismTransform(
        name="pp",
        options=opts,
        phase=Phase.PIPELINE_PARALLEL,
        conflicts=frozenset({"ddp", "fsdp", "grad_scaler", "local_sgd", "compile"}),
        conflict_fix=(
            "fa.pp spans every process (each holds other layers), so there is no data-parallel "
            "dimension for ddp/fsdp/local_sgd to average over, and its schedule runs the stages "
            "itself (no compile of the whole model, no fp16 loss scaling); drop the other transform"
        ),
        capabilities=frozenset({Capability.SPLITS_MODEL}),
        layout=ShardedLayout(splits=_splits, pipelined=True),
        mesh_dims=frozenset({"pp"}),
        check=check,
        prepare_model=prepare_model,
        forward_backward=forward_backward,
    )
