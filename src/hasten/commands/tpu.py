"""``accelerate.commands.tpu``: Accelerate's ``tpu-config`` parser and launcher, for imports.

hasten does not run on TPUs (torch_xla), so it configures no TPU pod: the parser reads Accelerate's options
(so scripts that build it work) and :func:`tpu_command_launcher` raises :class:`~hasten.errors.NotSupportedError`.
"""

from __future__ import annotations

import argparse

from ..errors import NotSupportedError

__all__ = ["tpu_command_launcher", "tpu_command_parser"]


def tpu_command_parser(subparsers=None) -> argparse.ArgumentParser:
    """Accelerate's ``tpu-config`` options: a subcommand of ``subparsers``, or a parser of its own."""
    description = "Run commands on every worker of a TPU pod (not supported by hasten)."
    if subparsers is not None:
        parser = subparsers.add_parser("tpu-config", description=description)
        parser.set_defaults(func=tpu_command_launcher)
    else:
        parser = argparse.ArgumentParser(prog="hasten tpu-config", description=description, allow_abbrev=False)
    for name in ("--config_file", "--tpu_name", "--tpu_zone", "--command_file", "--accelerate_version"):
        parser.add_argument(name, default=None)
    parser.add_argument("--command", action="append", nargs="+")
    for name in ("--use_alpha", "--install_accelerate", "--debug"):
        parser.add_argument(name, action="store_true")
    return parser


def tpu_command_launcher(args: argparse.Namespace):
    """Accelerate's ``accelerate tpu-config``: not supported by hasten, which does not run on TPUs."""
    raise NotSupportedError(
        "tpu-config: hasten does not run on TPUs (torch_xla), so it has no TPU pod to configure; it runs on CPUs and "
        "CUDA/XPU GPUs. Run the pod's setup commands with `gcloud compute tpus tpu-vm ssh` directly."
    )
