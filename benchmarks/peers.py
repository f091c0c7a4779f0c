"""The data + step loop of `step_overhead.py` written for Accelerate and Lightning Fabric.

Each builder returns a function that runs one epoch of the same shuffled
``DataLoader`` over the same ``TensorDataset`` through that framework's own
API, as its documentation writes the loop (CPU, one process, fp32). The
peers come from the ``bench`` extra (``pip install -e '.[bench]'``); a
missing one is reported by name, never faked.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from step_overhead import loss_fn, make_model
from torch.utils.data import DataLoader


def accelerate_loop(loader: DataLoader) -> Callable[[], None]:
    """``accelerator.prepare`` + ``accelerator.backward`` over the loader."""
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    model, opt, prepared = accelerator.prepare(model, opt, loader)

    def epoch() -> None:
        for batch in prepared:
            loss = loss_fn(model, batch)
            accelerator.backward(loss)
            opt.step()
            opt.zero_grad(set_to_none=True)

    return epoch


def fabric_loop(loader: DataLoader) -> Callable[[], None]:
    """``fabric.setup`` + ``fabric.setup_dataloaders`` + ``fabric.backward``."""
    from lightning_fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=1)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    model, opt = fabric.setup(model, opt)
    prepared = fabric.setup_dataloaders(loader)
    # Fabric's return type also covers several loaders passed at once (a list); one in, one out.
    assert not isinstance(prepared, list)

    def epoch() -> None:
        for batch in prepared:
            loss = loss_fn(model, batch)
            fabric.backward(loss)
            opt.step()
            opt.zero_grad(set_to_none=True)

    return epoch


PEERS: dict[str, Callable[[DataLoader], Callable[[], None]]] = {
    "accelerate": accelerate_loop,
    "fabric": fabric_loop,
}


def accelerate_checkpoint(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[Any, Any]:
    """Accelerate's ``save_state(dir)`` and ``load_state(dir)`` for a prepared model + optimizer."""
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    model, optimizer = accelerator.prepare(model, optimizer)

    def save(folder: Any) -> None:
        accelerator.save_state(str(folder), safe_serialization=True)

    def load(folder: Any) -> None:
        accelerator.load_state(str(folder))

    return save, load
