"""How a checkpoint holds the model and optimizer: one layout per kind of run, chosen once per save or load.

Every layout implements `fnaccel.protocols.CheckpointLayout` (``snapshot``,
``write``, ``read``, ``restore``); the rest of a checkpoint is the same in all::

    plain.py    a replicated run (one process, ddp(), an engine stepping the model's own
                parameters): rank 0 writes model.safetensors and optimizer.*
    sharded.py  a run whose model is split over the ranks (fsdp(), tp(), pp()): every rank
                writes its shards through torch.distributed.checkpoint
    zero.py     a DeepSpeed ZeRO engine: every rank writes its optimizer partitions, rank 0
                the consolidated weights

`layout_for` chooses from what the pipeline's transforms declare, never from
their names: a transform's own ``layout`` wins (one written outside fnaccel
brings its own this way), then their `Capability` set.
"""

from __future__ import annotations

from typing import Any

from fnaccel.checkpoint.layouts.plain import PlainLayout
from fnaccel.checkpoint.layouts.sharded import ShardedLayout, is_sharded, is_stored_sharded
from fnaccel.checkpoint.layouts.zero import ZeroLayout, zero_engine
from fnaccel.protocols import CheckpointLayout
from fnaccel.transforms.base import Capability, Pipeline, Transform

__all__ = ["PlainLayout", "ShardedLayout", "ZeroLayout", "layout_for"]

_SPLIT = frozenset({Capability.SHARDS_PARAMETERS, Capability.TENSOR_PARALLEL, Capability.SPLITS_MODEL})


def layout_for(state: Any, manifest: dict[str, Any] | None = None) -> CheckpointLayout:
    """The checkpoint layout of ``state``'s run, from what its pipeline declares.

    A transform's own ``layout`` wins. Otherwise a pipeline that shards or
    splits the model (`Capability.SHARDS_PARAMETERS`, ``TENSOR_PARALLEL``,
    ``SPLITS_MODEL``) is sharded once the model holds shards (in a world of
    one it stays whole), an engine that steps the optimizer itself
    (``OWNS_OPTIMIZER_STEP``) is ZeRO when it steps master partitions (ZeRO-0
    in fp32 steps the model's own parameters), and any other run is plain. A
    load passes the checkpoint's ``manifest``: a sharded checkpoint goes into
    a replicated model through the sharded layout (DCP reads whole tensors).

    >>> import fnaccel as fa, torch
    >>> model = torch.nn.Linear(1, 1)
    >>> type(layout_for(fa.prepare(fa.init(cpu=True), model, pipeline=fa.compose(fa.accumulate(2))))).__name__
    'PlainLayout'
    """
    pipeline = Pipeline() if state.pipeline is None else state.pipeline
    own = next(
        (t.layout for t in pipeline.transforms if isinstance(t, Transform) and t.layout is not None), None
    )
    if own is not None:
        return own
    declared = pipeline.capabilities
    if declared & _SPLIT and is_sharded(state.model):
        return ShardedLayout()
    if Capability.OWNS_OPTIMIZER_STEP in declared and zero_engine(state.model) is not None:
        return ZeroLayout()
    if manifest is not None and is_stored_sharded(manifest) and state.model is not None:
        return ShardedLayout()
    return PlainLayout()
