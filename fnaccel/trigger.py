"""`set_trigger` / `check_trigger`: one rank asks the run to stop, every rank sees it.

Accelerate keeps the request in a hidden flag on the `Accelerator`; here it is
a value in the run's state (`RunState.trigger`). `set_trigger` returns a state
holding the request; `check_trigger`, which every rank calls at the same point
of its loop, agrees on it with one all-reduce of a single number, so every rank
gets the same answer at the same step and can leave the loop together. A rank
that stops alone would leave the others waiting in their next collective.
"""

from __future__ import annotations

import torch

from fnaccel.state import RunState

__all__ = ["check_trigger", "set_trigger"]


def set_trigger(state: RunState) -> RunState:
    """Returns ``state`` holding this rank's request to stop; consumes nothing.

    Call it on any rank (often only one knows: a NaN loss, a time limit); the
    request reaches the others at their next `check_trigger`.

    >>> import fnaccel as fa
    >>> from fnaccel.trigger import check_trigger, set_trigger
    >>> state = set_trigger(fa.init(cpu=True))
    >>> state.trigger
    True
    >>> state, stop = check_trigger(state)
    >>> stop, state.trigger
    (True, False)
    """
    return state.replace(trigger=True)


def check_trigger(state: RunState) -> tuple[RunState, bool]:
    """Whether any rank set the trigger since the last check; consumes nothing.

    Collective: every rank calls it at the same point (one all-reduce of a
    single integer, and a read of it on the host). The returned state has the
    request cleared, so a later check is False until a rank sets it again.

    Args:
        state: the run's state, holding this rank's request or not.

    Returns:
        ``(state, stop)``: the state with ``trigger`` cleared, and True on
        every rank when at least one rank had set it.

    >>> import fnaccel as fa
    >>> from fnaccel.trigger import check_trigger
    >>> check_trigger(fa.init(cpu=True))[1]
    False
    """
    ctx = state.dist
    stop = state.trigger
    if ctx.num_processes > 1:
        flag = torch.tensor([int(stop)], dtype=torch.int32, device=ctx.device)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, group=ctx.process_group)
        stop = bool(flag.item())
    return (state.replace(trigger=False) if state.trigger else state), stop
