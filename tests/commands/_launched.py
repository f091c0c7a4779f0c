"""A training script that `fnaccel launch` runs in tests/commands/test_launch.py.

    _launched.py OUT [--kill-after-checkpoint]

Trains a small MLP (dropout, AdamW, a shuffling loader) for two epochs with
the default pipeline, saves a checkpoint after step 6 and resumes from it
when it exists (a restarted worker group), and writes OUT/report.json
(what every rank saw of its launch) and the final weights OUT/final/.
With --kill-after-checkpoint, rank 1 of the first attempt kills itself with
SIGKILL right after the checkpoint is written.
"""

import json
import os
import signal
import sys
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import fnaccel as fa

CHECKPOINT_STEP = 6


def loss_fn(model: nn.Module, batch: list[torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


def main(out: Path, kill: bool) -> None:
    state = fa.init(seed=0)
    generator = torch.Generator().manual_seed(1)
    x, y = torch.randn(64, 8, generator=generator), torch.randn(64, 2, generator=generator)
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = DataLoader(TensorDataset(x, y), batch_size=4, shuffle=True)
    state = fa.prepare(state, model, optimizer, loader, loss_fn=loss_fn)
    checkpoint = out / "ckpt"
    resumed = (checkpoint / "fnaccel.json").exists()
    if resumed:
        state = fa.load(state, checkpoint)
    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    saved = False
    for batch in fa.batches(state, epochs=2):
        state, _ = fa.step(state, batch)
        if state.step == CHECKPOINT_STEP and not resumed and not saved:  # right after the update
            fa.save(state, checkpoint)
            saved = True
            if kill and restarts == 0 and state.dist.rank == 1:
                os.kill(os.getpid(), signal.SIGKILL)
    ctx = state.dist
    seen = {
        "rank": ctx.rank,
        "local_rank": ctx.local_rank,
        "node_rank": ctx.node_rank,
        "num_processes": ctx.num_processes,
        "num_nodes": ctx.num_nodes,
        "backend": ctx.backend,
        "device": str(ctx.device),
        "debug": ctx.debug,
        "mixed_precision": str(state.mixed_precision),
        "pipeline": repr(state.pipeline),
        "omp_threads": os.environ.get("OMP_NUM_THREADS"),
        "affinity": sorted(os.sched_getaffinity(0)),
        "restarts": restarts,
        "resumed": resumed,
        "steps": state.step,
        "mesh": None if ctx.mesh is None else list(ctx.mesh.mesh_dim_names or ()),
    }
    everyone = fa.ops.gather_object(state, [seen])
    fa.save_model(state, out / "final")
    if ctx.rank == 0:
        (out / "report.json").write_text(json.dumps(everyone, indent=1))
    fa.shutdown(state)


if __name__ == "__main__":  # a script: importing it (doctest collection) must not run it
    main(Path(sys.argv[1]), "--kill-after-checkpoint" in sys.argv[2:])
