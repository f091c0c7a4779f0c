"""The canonical order of a pipeline: `Phase`, the one table every factory takes its place from.

`compose` refuses transforms written out of this order and prints the call
with them sorted; it merges a nested pipeline's transforms in by it. Hooks run
in pipeline order, so the table also orders `fa.prepare`'s ``prepare_model``
wrappers (the earlier one wraps first: it ends up innermost) and each of
`fa.step`'s hook lists.
"""

from __future__ import annotations

from enum import IntEnum

__all__ = ["Phase"]


class Phase(IntEnum):
    """Where a transform or a collective sits in a pipeline, earliest first.

    The values leave gaps so that a transform written outside fnaccel can take
    a place between two of them (``phase=Phase.DATA_PARALLEL + 2``); the
    comment on each member says what it must come after or before.
    """

    # Collectives (called on a tree)
    PAD = 10  # pad_across_processes: padded shapes first, so the one communicating step moves equal shapes
    COMMUNICATE = 20  # gather, reduce, broadcast, ...: the one step that moves the data (two conflict)

    # Training transforms
    AUTOCAST = 110  # autocast: wraps forward first, so every later wrapper (stages, ddp) runs under it
    SEQUENCE_PARALLEL = 115  # sp: sums its group's gradients before the scaler unscales and checks them
    GRAD_SCALER = 120  # grad_scaler: scales the loss and unscales the gradients before any hook reads them
    PIPELINE_PARALLEL = 125  # pp: splits the model into stages, each keeping autocast's forward
    TENSOR_PARALLEL = 126  # tp: parallelizes the plain layers before checkpointing and fsdp wrap them
    CHECKPOINT_ACTIVATIONS = 128  # checkpoint_activations: wraps blocks (tp's included) before ddp/fsdp
    DATA_PARALLEL = 130  # ddp, fsdp, deepspeed: wrap or shard the model built so far
    LOCAL_SGD = 135  # local_sgd: replaces the gradient all-reduce of the ddp() wrapper it follows
    ACCUMULATE = 140  # accumulate: normalises summed gradients by the items before clipping reads them
    CLIP = 150  # clip_grad_norm, clip_grad_value: on unscaled, normalised gradients
    SKIP_NONFINITE = 155  # skip_nonfinite: reads clipping's grad_norm, decides after every other update hook
    COMPILE = 160  # compile: compiles the model as every earlier wrapper left it
    PROFILE = 170  # profile: its after_step ends the step last, so the trace covers the others' (local_sgd's)
