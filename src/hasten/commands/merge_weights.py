"""``hasten merge-weights``: turn a sharded checkpoint into one model file that plain PyTorch loads.

Works on DeepSpeed ZeRO checkpoints (the fp32 master weights, as DeepSpeed's ``zero_to_fp32.py``
rebuilds them) and on FSDP sharded checkpoints; which one is told by the folder's content. The engines' registrations
say how (``Engine.merge_weights``), so this command names no engine. The
checkpoint may be a folder written by ``accelerator.save_state`` or the engine's own folder.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

HELP = "Merge a sharded DeepSpeed ZeRO or FSDP checkpoint into one model file."


def add_parser(subparsers, help_text: str = HELP) -> argparse.ArgumentParser:
    """Register ``hasten merge-weights``."""
    parser = subparsers.add_parser(
        "merge-weights", help=help_text, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    _add_arguments(parser)
    parser.set_defaults(func=merge_command)
    return parser


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "checkpoint_directory",
        help="The checkpoint folder (from save_state, DeepSpeed's save_checkpoint, or FSDP's sharded save).",
    )
    parser.add_argument(
        "output_path",
        help="Folder to write the merged weights into (model.safetensors, sharded with an index when large).",
    )
    parser.add_argument(
        "--safe_serialization",
        "--safe-serialization",
        dest="safe_serialization",
        action="store_true",
        default=True,
        help="Write safetensors (the default).",
    )
    parser.add_argument(
        "--unsafe_serialization",
        "--unsafe-serialization",
        dest="safe_serialization",
        action="store_false",
        help="Write pytorch_model.bin (torch.save) instead of safetensors.",
    )
    parser.add_argument(
        "--max_shard_size",
        "--max-shard-size",
        default="10GB",
        help="Largest file of the merged weights (default 10GB).",
    )
    parser.add_argument(
        "--remove_checkpoint_dir",
        "--remove-checkpoint-dir",
        action="store_true",
        help="Delete the checkpoint folder once the merged weights are written.",
    )


def detect_format(checkpoint: Path):
    """The registered engine whose sharded checkpoint ``checkpoint`` holds (its :class:`WeightsMerge`), asked in
    registry order; a ``CheckpointError`` naming what each engine expects otherwise."""
    from ..environment import ENGINES
    from ..errors import CheckpointError

    if not checkpoint.is_dir():
        raise CheckpointError(f"{checkpoint} is not a folder: pass the checkpoint folder to merge.")
    merges = [engine.merge_weights for engine in ENGINES if engine.merge_weights is not None]
    for merge in merges:
        if merge.holds(checkpoint):
            return merge
    raise CheckpointError(f"{checkpoint} holds neither {' nor '.join(merge.expects for merge in merges)}.")


def merge_command(args: argparse.Namespace) -> int:
    """Merge the checkpoint and print the files written."""
    from ..errors import ConfigError

    checkpoint = Path(args.checkpoint_directory)
    output = Path(args.output_path)
    if args.remove_checkpoint_dir and output.resolve().is_relative_to(checkpoint.resolve()):
        raise ConfigError(
            f"--remove_checkpoint_dir would delete the output {output}, which is inside {checkpoint}; write the merged "
            "weights elsewhere."
        )
    merge = detect_format(checkpoint)
    written = merge.merge(checkpoint, output, args.safe_serialization, args.max_shard_size)
    if args.remove_checkpoint_dir:
        shutil.rmtree(checkpoint)
    names = ", ".join(str(path) for path in written)
    print(f"Merged the {merge.label} checkpoint {checkpoint} into {names}")
    return 0


def merge_command_parser(subparsers=None) -> argparse.ArgumentParser:
    """The ``merge-weights`` parser (Accelerate's name): a subcommand of ``subparsers``, or a parser of its own."""
    if subparsers is not None:
        return add_parser(subparsers)
    parser = argparse.ArgumentParser(prog="hasten merge-weights", description=__doc__, allow_abbrev=False)
    _add_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run ``hasten merge-weights`` on its own (``python -m hasten.commands.merge_weights``)."""
    from ..errors import HastenError

    args = merge_command_parser().parse_args(argv)
    try:
        return merge_command(args)
    except HastenError as error:
        print(f"hasten merge-weights: error: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
