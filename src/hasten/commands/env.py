"""``hasten env``: the versions, hardware and launch config in force, as one block to paste into a bug report."""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import platform
import sys
from pathlib import Path
from shutil import which

from .. import environment
from ..settings import ACCELERATE_PREFIX, PREFIX
from ..settings.command import command_name

OPTIONAL_PACKAGES = (
    "numpy",
    "safetensors",
    "deepspeed",
    "transformers",
    "tensorboard",
    "wandb",
    "mlflow",
    "questionary",
    "accelerate",
)


_DESCRIPTION = "Print the versions, hardware and launch config in force, to paste into a bug report."


def add_parser(subparsers, help_text: str) -> argparse.ArgumentParser:
    """Register ``hasten env``."""
    parser = subparsers.add_parser("env", help=help_text, description=_DESCRIPTION)
    _add_arguments(parser)
    parser.set_defaults(func=_run)
    return parser


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config_file", "--config-file", default=None, help="Config file to show (default: the default config file)."
    )


def env_command_parser(subparsers=None) -> argparse.ArgumentParser:
    """The ``env`` parser (Accelerate's name): a subcommand of ``subparsers``, or a parser of its own."""
    if subparsers is not None:
        return add_parser(subparsers, _DESCRIPTION)
    parser = argparse.ArgumentParser(prog=f"{command_name()} env", description=_DESCRIPTION, allow_abbrev=False)
    _add_arguments(parser)
    return parser


def env_command(args: argparse.Namespace) -> dict[str, str]:
    """Print the report; return its entries (name -> value, without the launch config), as Accelerate's does."""
    info = environment_info()
    print(_report(info, args.config_file))
    return info


def _run(args: argparse.Namespace) -> int:
    env_command(args)
    return 0


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _cpu_model() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text(errors="replace").splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def _torch_info() -> dict[str, str]:
    import torch
    import torch.distributed as dist

    backends = [
        name for name in ("gloo", "nccl", "mpi", "xccl") if getattr(dist, f"is_{name}_available", lambda: False)()
    ]
    info = {
        "PyTorch version": f"{torch.__version__} (CUDA build: {torch.version.cuda or 'no'})",
        "torch.distributed backends": ", ".join(backends) or "none",
    }
    kind = environment.accelerator_type()
    if kind == "cuda":
        for index in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(index)
            info[f"GPU {index}"] = (
                f"{props.name}, {props.total_memory / 2**30:.1f} GiB, capability {props.major}.{props.minor}"
            )
    elif kind == "xpu":
        info.update({f"XPU {i}": torch.xpu.get_device_name(i) for i in range(torch.xpu.device_count())})
    else:
        info["Accelerator"] = "Apple MPS" if kind == "mps" else "none (CPU only)"
    return info


def _config_lines(config_file: str | None) -> list[str]:
    from ..config import config_to_dict, read_config_file
    from .config_location import file_to_read, speaks_accelerate

    location = file_to_read(config_file, speaks_accelerate())
    path = location.path
    if path is None or not path.is_file():
        return [f"- Launch config: {location.describe() if path is None else f'none at {path} ({location.source})'}"]
    try:
        loaded = read_config_file(path)
    except Exception as exc:  # the report must still print when the file is broken
        return [f"- Launch config: {path} (invalid: {exc})"]
    lines = [f"- Launch config: {location.describe()}"]
    lines += [f"\t- {key}: {value}" for key, value in sorted(config_to_dict(loaded.config).items())]
    return lines


_PREFIXES = (PREFIX, ACCELERATE_PREFIX)


def environment_info() -> dict[str, str]:
    """The entries of the report (name -> value): versions, hardware, the ``accelerate`` command found on ``PATH``
    (hasten's alias or HuggingFace's) and the ``HASTEN_*``/``ACCELERATE_*`` variables set."""
    import psutil

    settings = sorted(f"{key}={value}" for key, value in os.environ.items() if key.startswith(_PREFIXES))
    return {
        "hasten version": _version("hasten"),
        "Platform": platform.platform(),
        "Python version": f"{sys.version.split()[0]} ({sys.executable})",
        "`accelerate` bash location": which("accelerate") or "Not found",
        **_torch_info(),
        "Optional packages": ", ".join(f"{p} {_version(p)}" for p in OPTIONAL_PACKAGES),
        "CPU": f"{_cpu_model()}, {psutil.cpu_count(logical=False)} cores, {psutil.cpu_count()} threads",
        "RAM": f"{psutil.virtual_memory().total / 2**30:.1f} GiB",
        "/".join(f"{prefix}*" for prefix in _PREFIXES) + " variables": ", ".join(settings) or "none",
    }


def _report(info: dict[str, str], config_file: str | None) -> str:
    lines = ["Copy-and-paste the text below in your GitHub issue.", ""]
    lines += [f"- {name}: {value}" for name, value in info.items()]
    return "\n".join(lines + _config_lines(config_file))


def environment_report(config_file: str | None = None) -> str:
    """The report printed by ``hasten env``."""
    return _report(environment_info(), config_file)


def main(argv: list[str] | None = None) -> int:
    """Run ``env`` with ``argv`` (default: this process's arguments): ``python -m hasten.commands.env``
    and ``python -m accelerate.commands.env``."""
    from .main import run_subcommand

    return run_subcommand("env", argv)


if __name__ == "__main__":
    sys.exit(main())
