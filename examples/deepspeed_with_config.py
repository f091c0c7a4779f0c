"""DeepSpeed ZeRO from an Accelerate config file, with no DeepSpeed code in the script.

    fnaccel launch --config_file examples/deepspeed_config.yaml examples/deepspeed_with_config.py
    python examples/deepspeed_with_config.py     # starts 2 CPU processes itself, same config

The config file (`deepspeed_config.yaml`, beside this script) is an Accelerate config:
`distributed_type: DEEPSPEED` and a `deepspeed_config` section. The script passes no pipeline
to `fa.prepare`, so the run gets the one the launch asked for, `fa.default_pipeline(state)`:
here `fa.deepspeed(zero_stage=2, ...)` with the file's accumulation and clipping. The model and
optimizer are yours (a config with its own `optimizer` or `scheduler` section is refused: pass
them to `fa.prepare`), and `fa.save` keeps fnaccel's pickle-free format, one ZeRO partition
per process. DeepSpeed needs at least 2 processes: run plainly, the script starts them.
Install with `pip install 'fnaccel[deepspeed]'`; it runs on CPUs too.
"""

from __future__ import annotations

import argparse
import os

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import fnaccel as fa

CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "deepspeed_config.yaml")


def loss_fn(model: nn.Module, batch: list[torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


def train(args: argparse.Namespace, config: str | None) -> None:
    state = fa.init(seed=0, config=config)  # None: the file `fnaccel launch --config_file` named
    if fa.default_pipeline(state).get("deepspeed") is None:
        raise SystemExit(f"this launch asks for no DeepSpeed: launch with --config_file {CONFIG}")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 128), nn.ReLU(), nn.Linear(128, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(128 if args.tiny else 4096, 16, generator=generator)
    loader = DataLoader(TensorDataset(x, x[:, :4].argmax(dim=1)), batch_size=8, shuffle=True)
    state = fa.prepare(state, model, optimizer, loader, loss_fn=loss_fn)  # the config's pipeline
    fa.print_on_main(state, f"pipeline from the config: {state.pipeline}")

    for batch in fa.batches(state, epochs=args.epochs):
        state, metrics = fa.step(state, batch)
        if "grad_norm" in metrics and state.step % 8 == 0:  # an update (every 2 batches here)
            fa.print_on_main(
                state,
                f"update {state.step}: loss {metrics['loss'].item():.4f}, "
                f"grad norm {metrics['grad_norm'].item():.3f}",
            )
    fa.save(state, os.path.join(args.output, "checkpoint"))  # rank<r>.zero.safetensors per process
    fa.save_model(state, os.path.join(args.output, "model"))  # the consolidated weights
    fa.print_on_main(state, f"checkpoint and weights written under {args.output}")
    fa.shutdown(state)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--output", default="runs/deepspeed_with_config")
    parser.add_argument("--tiny", action="store_true", help="a few steps, for tests")
    args = parser.parse_args()

    probe = fa.init()
    launched = probe.dist.num_processes > 1
    fa.shutdown(probe)
    if launched:
        train(args, config=None)
    else:  # run plainly: start the processes here, each reading the config beside this script
        fa.debug_launcher(train, args=(args, CONFIG), num_processes=2)


if __name__ == "__main__":
    main()
