"""`fa.evaluate` over a `TensorDataset` against a hand-written evaluation loop.

The baseline is what a user writes: ``with torch.no_grad(): [model(x) for x, y in
loader]`` over ``DataLoader(TensorDataset(...), batch_size=256)`` (torch reads
it one sample at a time and stacks). fnaccel's `fa.evaluate` returns the same
outputs (checked bit for bit) and reads the dataset in one indexing per tensor.
Best of ``--rounds`` each, alternating, one CPU thread.

    python benchmarks/evaluate.py [--rows 100000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.utils.data import DataLoader, TensorDataset

import fnaccel as fa


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Linear(32, 4)
    state = fa.prepare(fa.init(seed=0, cpu=True), model)
    data = TensorDataset(torch.randn(args.rows, 32), torch.randint(0, 4, (args.rows,)))
    loader = DataLoader(data, batch_size=256)

    def hand() -> torch.Tensor:
        with torch.no_grad():
            return torch.cat([model(x) for x, _ in loader])

    def fnaccel() -> torch.Tensor:
        return fa.evaluate(state, loader, lambda m, batch: m(batch[0]))

    times: dict[str, list[float]] = {"hand": [], "fnaccel": []}
    for _ in range(args.rounds):
        for name, run in (("hand", hand), ("fnaccel", fnaccel)):
            start = time.perf_counter()
            out = run()
            times[name].append(time.perf_counter() - start)
            if name == "hand":
                expected = out
            elif not torch.equal(out, expected):
                raise SystemExit("fa.evaluate's outputs differ from the hand loop's")
    base, ours = min(times["hand"]), min(times["fnaccel"])
    print(
        f"torch {torch.__version__}, {args.rows} rows x 32, batch 256, best of {args.rounds}, one CPU thread"
    )
    print(
        f"evaluate: hand loop {base * 1e3:.0f} ms, fa.evaluate {ours * 1e3:.0f} ms, ratio {ours / base:.3f}"
    )


if __name__ == "__main__":
    main()
