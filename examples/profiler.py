"""Profile training steps with torch.profiler.

    python examples/profiler.py                 # prints the top operators, writes Chrome traces
    fnaccel launch --cpu --num_processes 2 examples/profiler.py
    # open runs/profiler/profile_0.json in chrome://tracing or https://ui.perfetto.dev

`fa.profile(...)` (the fields of `ProfileKwargs`) is a transform: the profiler starts at
`fa.prepare` and advances at every batch, so `schedule_option` counts batches: skip the first
`wait` (start-up costs), warm up, then record `active` batches. When the recording is ready the
trace is written to `output_trace_dir/profile_<rank>.json` and `on_trace_ready` is called with
the profiler, here to print the operators that took the most time. The profiler stops at
`fa.shutdown`.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import fnaccel as fa


def make_dataset(num_samples: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(num_samples, 64, generator=generator)
    return TensorDataset(x, (x[:, :32].sum(dim=1) > 0).long())


def loss_fn(model: nn.Module, batch: list[torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", default="runs/profiler")
    parser.add_argument("--tiny", action="store_true", help="a few steps, for tests")
    args = parser.parse_args()

    state = fa.init(seed=0)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = DataLoader(make_dataset(256 if args.tiny else 2048), batch_size=32, shuffle=True)

    def print_top_operators(profiler: torch.profiler.profile) -> None:
        if state.dist.is_main_process:  # every process records its own trace; one table is enough
            print(profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=8))

    profile = fa.profile(
        activities=["cpu"],
        schedule_option={"wait": 1, "warmup": 1, "active": 2},
        record_shapes=True,
        on_trace_ready=print_top_operators,
        output_trace_dir=args.output,
    )
    state = fa.prepare(
        state,
        model,
        optimizer,
        loader,
        loss_fn=loss_fn,
        pipeline=fa.compose(fa.default_pipeline(state), profile),
    )
    for batch in fa.batches(state, epochs=1):
        state, _metrics = fa.step(state, batch)
    fa.shutdown(state)  # stops the training profiler


if __name__ == "__main__":
    main()
