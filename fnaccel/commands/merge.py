"""``fnaccel merge-weights``: Accelerate's flags, parsed and answered; the merge itself is
`fnaccel.checkpoint.consolidate` (imported when the command runs: it loads torch.distributed.checkpoint).
Accelerate's ``--unsafe_serialization`` (write a pickled ``.bin``) is refused.
"""

from __future__ import annotations

import argparse

from fnaccel.commands.main import CommandError, Subcommands

__all__ = ["register", "run"]


def register(subparsers: Subcommands) -> None:
    """Add ``merge-weights`` to the ``fnaccel`` parser (``accelerate merge-weights``' flags)."""
    parser = subparsers.add_parser(
        "merge-weights",
        help="Merge a sharded (FSDP / torch.distributed.checkpoint) checkpoint into safetensors weights.",
        description=(
            "Consolidate the model weights of a sharded checkpoint, an fnaccel checkpoint saved under "
            "fsdp() or a torch.distributed.checkpoint directory, into model.safetensors (shards and "
            "an index past 10GB) in output_path."
        ),
    )
    parser.add_argument(
        "checkpoint_directory",
        help=(
            "The checkpoint directory: an fnaccel checkpoint (with fnaccel.json) or a "
            "torch.distributed.checkpoint directory (with .metadata)."
        ),
    )
    parser.add_argument("output_path", help="The directory to write the merged weights into.")
    parser.add_argument(
        "--unsafe_serialization",
        action="store_true",
        help="Accelerate's flag to write a pickled .bin instead of safetensors; fnaccel refuses it.",
    )
    parser.add_argument(
        "--remove_checkpoint_dir",
        action="store_true",
        help="Delete the checkpoint directory once the merged weights are written.",
    )
    parser.set_defaults(handler=run, command_name="merge-weights")


def run(args: argparse.Namespace) -> int:
    """Merge ``args.checkpoint_directory`` into ``args.output_path``; report what was written."""
    if args.unsafe_serialization:
        raise CommandError(
            "--unsafe_serialization writes a pickled .bin, which fnaccel never does (loading one "
            "runs arbitrary code); drop the flag to write safetensors"
        )
    from fnaccel.checkpoint.consolidate import merge_weights

    try:
        merged = merge_weights(args.checkpoint_directory, args.output_path, args.remove_checkpoint_dir)
    except ValueError as exc:
        raise CommandError(str(exc)) from None
    except OSError as exc:  # the output (or a removal) could not be written: reads raise CheckpointError
        where = exc.filename if exc.filename is not None else args.output_path
        raise CommandError(f"{where}: {exc.strerror or exc} (output_path {args.output_path})") from None
    print(
        f"Merged {merged.num_tensors} tensors from the {merged.source_kind} {args.checkpoint_directory} "
        f"into {merged.path}"
    )
    if args.remove_checkpoint_dir:
        print(f"Removed {args.checkpoint_directory}")
    return 0
