"""``hasten estimate-memory``: memory needed to train or load a model, without downloading or allocating it.

Prints the size of the weights and of Adam training per dtype, and DeepSpeed ZeRO's table of memory
per CPU and per GPU for each offload choice (ZeRO-3 by default; ``--zero_stage 2`` for ZeRO-2). The engines' tables
come from their registrations (``Engine.memory_table``), so this command names no engine.
"""

from __future__ import annotations

import argparse
import sys

HELP = "Estimate the memory a model needs (per dtype, and per CPU/GPU under DeepSpeed ZeRO)."


def _count(text: str) -> int:
    """Parse a parameter count such as ``2783e6`` or ``65000000``."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number (e.g. 2783e6)") from None
    if value <= 0 or value != int(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive whole number of parameters")
    return int(value)


def add_parser(subparsers, help_text: str = HELP) -> argparse.ArgumentParser:
    """Register ``hasten estimate-memory``."""
    parser = subparsers.add_parser(
        "estimate-memory", help=help_text, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    _add_arguments(parser)
    parser.set_defaults(func=estimate_command)
    return parser


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model_name",
        nargs="?",
        help="A known model (e.g. bigscience/T0_3B), a local Transformers config.json or its folder, or "
        "'module:factory' (a function building the model; it is built on the meta device). Optional with --num_params.",
    )
    parser.add_argument(
        "--num_params",
        "--num-params",
        type=_count,
        help="Total number of parameters (e.g. 2783e6), instead of a model.",
    )
    parser.add_argument(
        "--largest_layer",
        "--largest-layer",
        type=_count,
        help="Parameters of the largest layer (default: from the model, else 0).",
    )
    parser.add_argument("--num_gpus", "--num-gpus", type=int, default=1, help="GPUs per node (default 1).")
    parser.add_argument("--num_nodes", "--num-nodes", type=int, default=1, help="Number of nodes (default 1).")
    parser.add_argument(
        "--zero_stage", "--zero-stage", type=int, choices=(2, 3), default=3, help="ZeRO stage of the table (default 3)."
    )
    parser.add_argument(
        "--dtypes",
        nargs="+",
        default=["float32", "float16", "int8", "int4"],
        choices=["float32", "float16", "bfloat16", "int8", "int4"],
        help="Dtypes of the size table.",
    )
    parser.add_argument(
        "--library_name",
        "--library-name",
        choices=["transformers"],
        default="transformers",
        help="Library of a config.json model (transformers).",
    )
    parser.add_argument(
        "--trust_remote_code",
        "--trust-remote-code",
        action="store_true",
        help="Allow a config.json whose model class lives in its own code.",
    )


def estimate_command(args: argparse.Namespace) -> int:
    """Print both tables for the model described by ``args``."""
    print(report(args))
    return 0


def _model(args: argparse.Namespace):
    from ..errors import ConfigError
    from .model_size import ModelSize, model_size

    if args.model_name is None and args.num_params is None:
        raise ConfigError("Name a model (a known model, a config.json, or module:factory) or give --num_params.")
    if args.model_name is not None and args.num_params is not None:
        raise ConfigError(f"Give either a model ({args.model_name!r}) or --num_params ({args.num_params}), not both.")
    if args.num_params is not None:
        return ModelSize("the model", args.num_params, args.largest_layer or 0)
    size = model_size(args.model_name, trust_remote_code=args.trust_remote_code)
    if args.largest_layer is not None:
        size = ModelSize(size.name, size.total_params, args.largest_layer, size.largest_group_params)
    return size


def report(args: argparse.Namespace) -> str:
    """The text ``hasten estimate-memory`` prints."""
    from ..environment import ENGINES
    from ..settings.sizes import format_bytes
    from .model_size import dtype_rows

    size = _model(args)
    lines = [
        f"Memory for {size.name}: {size.total_params // 10**6}M total parameters, "
        f"{size.largest_layer_params // 10**6}M largest layer parameters.",
        "",
    ]
    rows = [("dtype", "Largest layer or block", "Total size", "Training with Adam")]
    rows += [
        (r.dtype, format_bytes(r.largest_group_bytes), format_bytes(r.total_bytes), format_bytes(r.training_bytes))
        for r in dtype_rows(size, args.dtypes)
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    for index, row in enumerate(rows):
        lines.append("| " + " | ".join(cell.ljust(width) for cell, width in zip(row, widths)) + " |")
        if index == 0:
            lines.append("|" + "|".join("-" * (width + 2) for width in widths) + "|")
    for engine in ENGINES:
        if engine.memory_table is not None:
            lines += ["", *engine.memory_table(args, size.total_params, size.largest_layer_params)]
    return "\n".join(lines)


def estimate_command_parser(subparsers=None) -> argparse.ArgumentParser:
    """The ``estimate-memory`` parser (Accelerate's name): a subcommand of ``subparsers``, or a parser of its own."""
    if subparsers is not None:
        return add_parser(subparsers)
    parser = argparse.ArgumentParser(prog="hasten estimate-memory", description=__doc__, allow_abbrev=False)
    _add_arguments(parser)
    return parser


def build_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse ``hasten estimate-memory`` arguments (without the command name)."""
    return estimate_command_parser().parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run ``hasten estimate-memory`` on its own (``python -m hasten.commands.estimate_memory``)."""
    from ..errors import HastenError

    args = build_args(argv)
    try:
        return estimate_command(args)
    except HastenError as error:
        print(f"hasten estimate-memory: error: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
