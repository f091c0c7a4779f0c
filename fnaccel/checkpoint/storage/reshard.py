"""Loading a checkpoint on another number of processes than saved it.

What moves and how (docs/checkpoints.md, "Another number of processes"):

- the model and the optimizer: the checkpoint layouts' (`fnaccel.checkpoint.storage.choice`).
  A replicated run's (``model.safetensors``, ``optimizer.*``) load on any
  number of processes as they are, into a replicated run or, whole tensors
  sharded, an `fsdp()` one; a sharded run's (``sharded/``) go through
  `torch.distributed.checkpoint`, which reads each rank's chunks of the new
  layout, into an `fsdp()` run on any number of processes or into a
  replicated one (every rank reads whole tensors);
- the per-rank files: rank ``r`` reads ``rank<r>.*`` when the saving run had
  a rank ``r``, and rank 0's otherwise (`source_rank`). Its generators are
  rank ``r``'s own; a rank the saving run did not have gets generators
  derived from rank 0's and its rank (`derived_generators`), the same on
  every load. The data position and the transform states are the same on
  every rank of a run, so rank 0's serve a new rank;
- gradients accumulated between micro-steps are per-rank partial sums over
  that rank's samples: they cannot be split over another number of ranks, so
  such a checkpoint loads on the saving number of processes only.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import torch

from fnaccel._errors import CheckpointError
from fnaccel.dist import DistContext
from fnaccel.rng import RNGState

__all__ = ["derived_generators", "refuse_moved_gradients", "source_rank"]


def source_rank(manifest: Mapping[str, Any], ctx: DistContext) -> int:
    """Whose ``rank<r>.*`` files this process reads: its own rank's when the saving
    run had it, rank 0's otherwise.

    >>> source_rank({"num_processes": 2}, DistContext(num_processes=4, rank=3))
    0
    >>> source_rank({"num_processes": 2}, DistContext(num_processes=4, rank=1))
    1
    """
    return ctx.rank if ctx.rank < manifest["num_processes"] else 0


def derived_generators(saved: RNGState, rank: int) -> RNGState:
    """Generators for a rank the saving run did not have: every generator seeded
    from a hash of ``saved`` (rank 0's torch generator state) and ``rank``, so the new
    ranks draw different streams from each other and from rank 0, and the same ones
    on every load of the checkpoint.

    >>> a, b = derived_generators(RNGState.seeded(0), 2), derived_generators(RNGState.seeded(0), 3)
    >>> bool(torch.equal(a.torch, derived_generators(RNGState.seeded(0), 2).torch)), bool(torch.equal(a.torch, b.torch))
    (True, False)
    """
    digest = hashlib.sha256(saved.torch.numpy().tobytes() + rank.to_bytes(8, "little")).digest()
    return RNGState.seeded(int.from_bytes(digest[:8], "little") >> 1)


def refuse_moved_gradients(
    grads: Mapping[str, torch.Tensor], manifest: Mapping[str, Any], ctx: DistContext, source: str
) -> None:
    """Refuse gradients accumulated between micro-steps on another number of processes."""
    saved = manifest["num_processes"]
    if grads and saved != ctx.num_processes:
        raise CheckpointError(
            f"{source}: the checkpoint was saved between accumulation micro-steps by {saved} process(es); "
            f"each holds gradients summed over its own samples, which cannot be split over "
            f"{ctx.num_processes}. Resume it on {saved} process(es), or save after an optimizer step "
            "(when state.micro_step is a multiple of the accumulation steps) to change the number"
        )
