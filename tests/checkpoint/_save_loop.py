"""Saves again and again until killed (see test_crash.py): each save after the
first starts when a line arrives on stdin, so the test knows which save a kill
can land in, however loaded the machine (EOF ends the loop).

    python _save_loop.py PATH            # over the same checkpoint PATH
    python _save_loop.py PATH rotate     # automatic checkpoints in project PATH, total_limit=1
    python _save_loop.py PATH step       # over PATH, a step before each save (new weights), 4 layers

With ``wait`` (``PATH step wait``) the first save, too, waits for a line on stdin: a second
saver started beside the first prepares while the first does, and saves only when told.

With ``hold`` (``PATH hold fork``) a save that replaces a checkpoint deletes the replaced one's
manifest, says ``removing NAME`` and never removes the rest: a test kills the saver between
its commit and the end of that removal (which runs beside the loop: the save says ``saved``
all the same).

With ``fork`` last (``PATH fork``, ``PATH rotate fork``), every line ``run`` starts that loop
in a child forked from this process, which has imported torch and prepared the run: a
test kills the child (SIGKILL) mid-save, and each kill costs a save instead of a new
interpreter (seconds of imports; the loop is what the kill lands in, and each child is a
process of its own, its files and lock its own). The child says ``pid N`` first, then the
loop's lines; once it has ended and been reaped, this process says ``ended``. Other lines
(a ``go`` the killed child never read) are skipped.
"""

import os
import sys
import traceback
from pathlib import Path

import torch
from torch import nn

import fnaccel as fa


def say(line: str) -> None:
    """One line to the test, in one write: the held removal's thread writes beside the loop, and an
    unbuffered print (PYTHONUNBUFFERED=1) writes a line's text and its newline in two writes, between
    which the other line could land."""
    os.write(sys.stdout.fileno(), f"{line}\n".encode())


def main(path: str, rotate: bool, step: bool, fork: bool, wait: bool) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(512, 512) for _ in range(4 if step else 20)])  # ~4 or ~21 MB of weights
    optimizer = torch.optim.AdamW(model.parameters())
    project = fa.ProjectConfiguration(project_dir=path, automatic_checkpoint_naming=True, total_limit=1)
    state = fa.prepare(
        fa.init(seed=0, cpu=True, kwargs_handlers=[project] if rotate else ()),
        model,
        optimizer,
        loss_fn=lambda m, b: m(b).pow(2).mean(),
    )
    state, _ = fa.step(state, torch.ones(2, 512))  # optimizer state exists
    if not fork:
        if not wait or sys.stdin.readline():
            save_loop(state, None if rotate else path, step)
        return
    while line := sys.stdin.readline():
        if line.strip() != "run":
            continue
        child = os.fork()  # one thread here (OMP_NUM_THREADS=1, no group): safe to fork
        if child == 0:  # the loop, then out: never back into this loop, nor this process's exit handlers
            try:
                say(f"pid {os.getpid()}")
                save_loop(state, None if rotate else path, step)
            except BaseException:
                traceback.print_exc()
                os._exit(1)
            os._exit(0)
        os.waitpid(child, 0)
        say("ended")


def save_loop(state: fa.RunState, target: str | None, step: bool) -> None:
    fa.save(state, target)
    say("first save done")
    while sys.stdin.readline():
        if step:  # every file but the generators' then differs from the last save's
            state, _ = fa.step(state, torch.ones(2, 512))
        state = state.replace(epoch=state.epoch + 1)  # each save is recognisable by its epoch
        fa.save(state, target)
        say(f"saved {state.epoch}")


def hold_removals() -> None:
    """Replace the background removal of a replaced checkpoint by one that stops half-way, forever."""
    import threading

    from fnaccel.checkpoint import writer

    def held(old: Path, manifest: str) -> None:
        (old / manifest).unlink()
        say(f"removing {old.name}")
        threading.Event().wait()

    setattr(writer, "remove_replaced", held)  # the module attribute the save calls


if __name__ == "__main__":  # a script: importing it (doctest collection) must not run it
    modes = sys.argv[2:]
    if "hold" in modes:
        hold_removals()
    main(sys.argv[1], "rotate" in modes, "step" in modes, "fork" in modes, "wait" in modes)
