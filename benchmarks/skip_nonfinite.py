"""What `fa.skip_nonfinite()` costs per step, on benchmarks/step_overhead.py's model.

The same 32-64-10 MLP, batch 16, SGD, one CPU thread, 200 steps per block;
blocks of ``fa.step`` without and with the transform alternate, the figure is
the median over rounds of time per step. Rows: the pipeline alone, and after
``clip_grad_norm(1.0)`` (whose norm the check reuses), each against the same
pipeline without the transform; and the plain hand-written loop for scale.

Run from the repository root::

    python benchmarks/skip_nonfinite.py [--rounds 21] [--clock cpu]
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
from step_overhead import CLOCKS, _loops, _row, _time_blocks, loss_fn, make_data, make_model

import fnaccel as fa


def _stepper(pipeline: fa.Pipeline, data: list[Any]) -> Any:
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    holder = [fa.prepare(fa.init(seed=0, cpu=True), model, opt, loss_fn=loss_fn, pipeline=pipeline)]

    def run() -> None:
        s = holder[0]
        for batch in data:
            s, _ = fa.step(s, batch)
        holder[0] = s

    return run


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description="fa.skip_nonfinite's cost per step")
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    data = make_data(0)
    print(f"torch {torch.__version__}, one CPU thread, {args.rounds} rounds, {args.clock} clock")
    print(f"{'case':<10} {'without':>13} {'with':>13}  {'ratio':>6}")
    rows = [
        _row("hand/step", _time_blocks(*_loops(None, data), rounds=args.rounds, clock=args.clock), 1e6, "us")
    ]
    for label, parts in (("plain", ()), ("clip", (fa.clip_grad_norm(1.0),))):
        without = _stepper(fa.compose(*parts), data)
        with_it = _stepper(fa.compose(*parts, fa.skip_nonfinite()), data)
        rows.append(
            _row(label, _time_blocks(without, with_it, rounds=args.rounds, clock=args.clock), 1e6, "us")
        )
    return rows


if __name__ == "__main__":
    main()
