"""Accelerate's ``accelerate.commands.estimate`` path: ``estimate_command``, ``estimate_command_parser`` and
``gather_data`` of ``hasten estimate-memory`` (the code lives in :mod:`hasten.commands.estimate_memory`),
``add_timm_hub_prefix`` and ``main``."""

import argparse
import sys

from .estimate_memory import estimate_command, estimate_command_parser

__all__ = ["add_timm_hub_prefix", "estimate_command", "estimate_command_parser", "gather_data", "main"]


def gather_data(args: argparse.Namespace) -> list[list]:
    """The size table of ``hasten estimate-memory`` as data, one row per dtype of ``args.dtypes``:
    ``[dtype, largest layer bytes, total bytes, bytes to train with Adam (None for int8/int4)]``."""
    from .estimate_memory import _model
    from .model_size import dtype_rows

    rows = dtype_rows(_model(args), args.dtypes)
    return [[row.dtype, row.largest_group_bytes, row.total_bytes, row.training_bytes] for row in rows]


def add_timm_hub_prefix(model_name: str) -> str:
    """``model_name`` as ``timm.create_model`` takes it: a Hub repository id (``owner/name``) gets the ``hf-hub:``
    prefix; an architecture name, or a name that already names its source (``local-dir:...``), is returned as is."""
    if "/" in model_name and ":" not in model_name:
        return f"hf-hub:{model_name}"
    return model_name


def main(argv: list[str] | None = None) -> int:
    """Run ``estimate-memory`` with ``argv`` (default: this process's arguments): the ``accelerate-estimate-memory``
    console script and ``python -m accelerate.commands.estimate``."""
    from .main import run_subcommand

    return run_subcommand("estimate-memory", argv)


if __name__ == "__main__":
    sys.exit(main())
