"""Saves again and again until killed (see test_crash.py): each save after the
first starts when a line arrives on stdin, so the test knows which save a kill
can land in, however loaded the machine (EOF ends the loop).

    python _save_loop.py PATH            # over the same checkpoint PATH
    python _save_loop.py PATH rotate     # automatic checkpoints in project PATH, total_limit=1
    python _save_loop.py PATH step       # over PATH, a step before each save (new weights), 4 layers
"""

import sys

import torch
from torch import nn

import fnaccel as fa


def main(path: str, rotate: bool, step: bool) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(512, 512) for _ in range(4 if step else 20)])  # ~4 or ~21 MB of weights
    optimizer = torch.optim.AdamW(model.parameters())
    project = fa.ProjectConfiguration(project_dir=path, automatic_checkpoint_naming=True, total_limit=1)
    state = fa.prepare(fa.init(seed=0, cpu=True, kwargs_handlers=[project] if rotate else ()), model, optimizer,
                       loss_fn=lambda m, b: m(b).pow(2).mean())
    state, _ = fa.step(state, torch.ones(2, 512))  # optimizer state exists
    target = None if rotate else path
    fa.save(state, target)
    print("first save done", flush=True)
    while sys.stdin.readline():
        if step:  # every file but the generators' then differs from the last save's
            state, _ = fa.step(state, torch.ones(2, 512))
        state = state.replace(epoch=state.epoch + 1)  # each save is recognisable by its epoch
        fa.save(state, target)
        print(f"saved {state.epoch}", flush=True)


if __name__ == "__main__":  # a script: importing it (doctest collection) must not run it
    main(sys.argv[1], sys.argv[2:] == ["rotate"], sys.argv[2:] == ["step"])
