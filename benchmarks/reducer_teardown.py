"""Why `fa.shutdown` lets go of DDP's reducer: torch alone, no fnaccel.

Each of ``--cycles`` cycles, on 2 gloo processes: a new group, a DDP model over it
with one backward, an all-reduce of a Python tensor on the group, the group
destroyed, and the model dropped. Variant ``reducer``: the model's ``Reducer`` is
the group's last holder, so its destructor joins gloo's threads holding the GIL
while a thread releasing the all-reduce's tensor waits for the GIL (a hang, ended
by faulthandler after ``--hang-after`` seconds). ``keep``: the same with the tensor
still held by Python (it hangs too: torch takes the GIL whenever a C++ reference to
a tensor Python has seen goes away). ``released``: the reducer and the logger that
holds it are dropped first, while a Python reference still holds the group, as
`fa.shutdown` does; the group's last holder is then a Python reference, which lets
the GIL go while joining::

    python benchmarks/reducer_teardown.py --runs 5 --cycles 40
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import socket
import subprocess
import sys

VARIANTS = ("reducer", "keep", "released")


def worker(rank: int, variant: str, cycles: int, hang_after: float) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn

    dist.init_process_group("gloo", rank=rank, world_size=2)
    for _ in range(cycles):
        faulthandler.dump_traceback_later(hang_after, exit=True)
        group = dist.new_group(backend="gloo")
        torch.manual_seed(0)
        model = nn.parallel.DistributedDataParallel(nn.Linear(4, 1), process_group=group)
        model(torch.randn(2, 4)).sum().backward()
        tensor = torch.ones(1)
        dist.all_reduce(tensor, group=group)  # a Python tensor through a gloo thread
        if variant != "keep":
            del tensor
        dist.destroy_process_group(group)
        if variant == "released":
            for name in ("logger", "reducer"):
                model.__dict__.pop(name)
        del group
        del model  # reducer/keep: ~Reducer -> ~ProcessGroupGloo joins with the GIL held
        faulthandler.cancel_dump_traceback_later()
    print("done", flush=True)


def run(variant: str, cycles: int, hang_after: float) -> bool:
    """One 2-process run; True when both ranks finished every cycle."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--rank",
                str(rank),
                "--variant",
                variant,
                "--cycles",
                str(cycles),
                "--hang-after",
                str(hang_after),
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        for rank in range(2)
    ]
    outputs = []
    for proc in procs:
        try:
            outputs.append(proc.communicate(timeout=hang_after * 2 + 60)[0])
        except subprocess.TimeoutExpired:
            proc.kill()
            outputs.append(proc.communicate()[0])
    return all("done" in out for out in outputs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--cycles", type=int, default=40)
    parser.add_argument("--hang-after", type=float, default=30.0)
    parser.add_argument("--variant", choices=VARIANTS, help="(worker) which teardown")
    parser.add_argument("--rank", type=int, help="(worker) this process's rank")
    args = parser.parse_args()
    if args.rank is not None:
        worker(args.rank, args.variant, args.cycles, args.hang_after)
        return
    for variant in VARIANTS:
        done = sum(run(variant, args.cycles, args.hang_after) for _ in range(args.runs))
        print(
            f"{variant}: {done} of {args.runs} runs finished {args.cycles} cycles ({args.runs - done} hung)",
            flush=True,
        )


if __name__ == "__main__":
    main()
