"""`fa.evaluate`: a model's outputs over an evaluation set, every sample once, in order.

Evaluation is a reading of the state, not a step: it consumes nothing, draws
nothing from the run's generators (it runs under a copy of them and gives the
process its own generators back), leaves the data position alone and puts
every module's train/eval mode back as it found it. The split is
`fnaccel.data.eval_batches.eval_batches`'s, so gathering is exact for any
dataset length and world size. With `fa.PreemptionKwargs`, a signal stops an
evaluation at a batch boundary on every rank alike (docs/training.md, "Preemption").
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, TypeGuard

import torch

from fnaccel.calls import collective
from fnaccel.data.eval_batches import eval_batches
from fnaccel.dist import data_parallel_context
from fnaccel.ops.collectives import gather_object
from fnaccel.ops.metrics import gather_for_metrics
from fnaccel.rng import installed
from fnaccel.state import RunState

__all__ = ["evaluate"]

_CONTAINERS = (Mapping, list, tuple, torch.Tensor)


def _is_objects(node: object) -> TypeGuard[list[object]]:
    """A list of per-sample Python objects (strings, numbers, ...): gathered by pickling."""
    return isinstance(node, list) and not any(isinstance(x, _CONTAINERS) for x in node)


def _gather(state: RunState, node: object, num_valid: int) -> object:
    if isinstance(node, torch.Tensor):
        return gather_for_metrics(state, node, num_valid=num_valid)
    if isinstance(node, Mapping):
        return {key: _gather(state, value, num_valid) for key, value in node.items()}
    if _is_objects(node):
        return gather_object(data_parallel_context(state.dist), node[:num_valid])
    if isinstance(node, (list, tuple)):
        return type(node)(_gather(state, value, num_valid) for value in node)
    raise TypeError(
        f"fa.evaluate: fn returned a {type(node).__name__}; return per-sample outputs: tensors whose dim 0 "
        "is the sample, lists with one Python object per sample, or dicts/tuples/lists of those"
    )


def _join(parts: list[Any]) -> Any:
    """The per-batch gathered trees joined along the samples."""
    first = parts[0]
    if isinstance(first, torch.Tensor):
        if len({p.shape[1:] for p in parts}) == 1:
            return torch.cat(parts)
        return [row for p in parts for row in p.unbind(0)]  # ragged: one tensor per sample
    if isinstance(first, Mapping):
        return {key: _join([p[key] for p in parts]) for key in first}
    if _is_objects(first):
        return [item for p in parts for item in p]
    return type(first)(_join([p[i] for p in parts]) for i in range(len(first)))


@collective("fa.evaluate")
def evaluate(
    state: RunState, loader: torch.utils.data.DataLoader[object], fn: Callable[[torch.nn.Module, Any], Any]
) -> Any:
    """Reads ``state`` (not consumed): ``fn(model, batch)`` over ``loader``'s dataset,
    split across the ranks, gathered on every rank, each sample exactly once, in
    dataset order.

    ``fn`` runs under ``torch.no_grad()`` with the model in eval mode (the
    prepared model's forward carries the run's autocast, as in training) and
    under a copy of the run's generators, so the run continues as if no
    evaluation had happened, and evaluating twice gives the same outputs.

    Args:
        state: a prepared `RunState` (its ``model`` is evaluated).
        loader: a `DataLoader` with a ``batch_size`` (samples per rank per step).
        fn: ``fn(model, batch) -> outputs``: per-sample outputs, i.e. tensors
            whose dim 0 is the sample, lists of one Python object per sample,
            nested in dicts, tuples and lists.

    Returns:
        ``fn``'s structure over the whole dataset: tensors concatenated along
        dim 0 (a list of per-sample tensors where their other dims differ from
        batch to batch), object lists concatenated. Within a step, the ranks'
        tensors must agree beyond dim 0 (pad them in ``fn`` with
        `fa.ops.pad_across_processes` otherwise). With `fa.PreemptionKwargs`,
        once the ranks agree that one received a signal the evaluation stops
        at a batch boundary (after its first batch): ``state.preempted`` is
        then set and the outputs cover the dataset's first samples only; save
        and exit rather than report them.

    Raises:
        ValueError: the state has no model, or the loader cannot be split
            (see `fa.eval_batches`).
        TypeError: ``fn`` returned something that is not per-sample outputs.

    >>> import torch, fnaccel as fa
    >>> model = torch.nn.Linear(1, 1)
    >>> state = fa.prepare(fa.init(seed=0, cpu=True), model)
    >>> data = torch.utils.data.DataLoader(torch.arange(5.0).view(5, 1), batch_size=2)
    >>> out = fa.evaluate(state, data, lambda m, x: {"x": x[:, 0], "tag": [f"s{int(v)}" for v in x[:, 0]]})
    >>> out["x"].tolist(), out["tag"]
    ([0.0, 1.0, 2.0, 3.0, 4.0], ['s0', 's1', 's2', 's3', 's4'])
    """
    model = state.model
    if model is None:
        raise ValueError("fa.evaluate: the state has no model; prepare one first (fa.prepare(state, model))")
    modes = [(module, module.training) for module in model.modules()]
    parts = []
    watch = state.resources.get("preemption")  # fa.init(kwargs_handlers=[PreemptionKwargs()])
    try:
        with installed(state.rng), torch.no_grad():
            model.eval()
            for index, (batch, num_valid) in enumerate(eval_batches(state, loader)):
                if watch is not None and watch.evaluation_stops(index):
                    break  # every rank at the same batch: the run is being preempted
                parts.append(_gather(state, fn(model, batch), num_valid))
    finally:
        for module, training in modes:
            module.training = training
    if not parts:
        raise ValueError("fa.evaluate: the loader yielded no batch")
    return _join(parts)
