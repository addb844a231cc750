"""``accelerate.commands.to_fsdp2``: rewrite a launch config file written for FSDP1 in FSDP2's keys.

hasten runs FSDP2 only and refuses ``fsdp_version: 1``; this turns such a file into one it runs, as
Accelerate's ``accelerate to-fsdp2`` does: the keys FSDP2 has no use for are dropped (with a warning),
``fsdp_sharding_strategy`` becomes ``fsdp_reshard_after_forward``, other keys are kept, and
``fsdp_version`` becomes 2. Reachable as ``python -m hasten.commands.to_fsdp2`` (``accelerate.commands.to_fsdp2``).
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from ..errors import ConfigError, ConfigFileExistsError, ConfigFileMissingError
from ..settings.fsdp import FSDP1_ONLY_KEYS, FSDP_RESHARD_AFTER_FORWARD

logger = logging.getLogger(__name__)

__all__ = ["convert_config_to_fsdp2", "to_fsdp2_command", "to_fsdp2_command_parser"]


def convert_config_to_fsdp2(config: dict) -> dict:
    """``config`` (a launch config as a dict) with its ``fsdp_config`` section in FSDP2's keys; changed in place and
    returned. A config without an FSDP section, or already at ``fsdp_version: 2``, is returned unchanged."""
    fsdp = config.get("fsdp_config") or {}
    if not fsdp:
        logger.info("The config has no fsdp_config section: nothing to convert.")
        return config
    if fsdp.get("fsdp_version", 1) == 2:
        logger.warning(
            "The config already says fsdp_version: 2; nothing converted (set it to 1 to convert FSDP1 keys)."
        )
        return config
    converted = {}
    for key, value in fsdp.items():
        if key in FSDP1_ONLY_KEYS:
            logger.warning(f"fsdp_config.{key} has no FSDP2 equivalent; dropped.")
        elif key in ("fsdp_sharding_strategy", "fsdp_reshard_after_forward"):
            converted["fsdp_reshard_after_forward"] = FSDP_RESHARD_AFTER_FORWARD.get(value, value)
        else:
            converted[key] = value
    converted["fsdp_version"] = 2
    config["fsdp_config"] = converted
    return config


def to_fsdp2_command_parser(subparsers=None) -> argparse.ArgumentParser:
    """The ``to-fsdp2`` parser (Accelerate's): a subcommand of ``subparsers``, or a parser of its own."""
    description = "Rewrite a launch config file written for FSDP1 in FSDP2's keys."
    if subparsers is not None:
        parser = subparsers.add_parser("to-fsdp2", description=description)
        parser.set_defaults(func=to_fsdp2_command)
    else:
        parser = argparse.ArgumentParser(prog="hasten to-fsdp2", description=description, allow_abbrev=False)
    parser.add_argument("--config_file", "--config-file", required=True, help="The config file to convert.")
    parser.add_argument(
        "--overwrite", action="store_true", help="Write the result over --config_file (or --output_file)."
    )
    parser.add_argument("--output_file", "--output-file", default=None, help="Where to write the result.")
    return parser


def to_fsdp2_command(args: argparse.Namespace) -> int:
    """Convert ``args.config_file`` and write it to ``args.output_file`` (or over the input with ``--overwrite``)."""
    import yaml

    source = Path(args.config_file)
    if not source.exists():
        raise ConfigFileMissingError(f"to-fsdp2: the config file {source} does not exist.")
    if args.output_file is None and not args.overwrite:
        raise ConfigError("to-fsdp2: give --output_file, or --overwrite to write the result over the config file.")
    target = Path(args.output_file) if args.output_file is not None else source
    if target.exists() and not args.overwrite:
        raise ConfigFileExistsError(
            f"to-fsdp2: {target} exists; pass --overwrite to replace it, or another --output_file."
        )
    config = yaml.safe_load(source.read_text())
    if not config:
        raise ConfigError(f"to-fsdp2: the config file {source} is empty.")
    target.write_text(yaml.safe_dump(convert_config_to_fsdp2(config), sort_keys=True, default_flow_style=False))
    return 0


if __name__ == "__main__":
    sys.exit(to_fsdp2_command(to_fsdp2_command_parser().parse_args()))
