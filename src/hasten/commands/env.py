"""``hasten env``: the versions, hardware and launch config in force, as one block to paste into a bug report."""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import platform
import sys
from pathlib import Path

from .. import environment

OPTIONAL_PACKAGES = ("numpy", "safetensors", "deepspeed", "transformers", "tensorboard", "wandb", "mlflow", "questionary", "accelerate")


def add_parser(subparsers, help_text: str) -> argparse.ArgumentParser:
    """Register ``hasten env``."""
    parser = subparsers.add_parser(
        "env", help=help_text, description="Print the versions, hardware and launch config in force, to paste into a bug report."
    )
    parser.add_argument("--config_file", "--config-file", default=None, help="Config file to show (default: the default config file).")
    parser.set_defaults(func=env_command)
    return parser


def env_command(args: argparse.Namespace) -> int:
    """Print the report."""
    print(environment_report(args.config_file))
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


def _torch_lines() -> list[str]:
    import torch
    import torch.distributed as dist

    backends = [name for name in ("gloo", "nccl", "mpi", "xccl") if getattr(dist, f"is_{name}_available", lambda: False)()]
    lines = [
        f"- PyTorch version: {torch.__version__} (CUDA build: {torch.version.cuda or 'no'})",
        f"- torch.distributed backends: {', '.join(backends) or 'none'}",
    ]
    kind = environment.accelerator_type()
    if kind == "cuda":
        for index in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(index)
            lines.append(f"- GPU {index}: {props.name}, {props.total_memory / 2**30:.1f} GiB, capability {props.major}.{props.minor}")
    elif kind == "xpu":
        lines += [f"- XPU {i}: {torch.xpu.get_device_name(i)}" for i in range(torch.xpu.device_count())]
    else:
        lines.append(f"- Accelerator: {'Apple MPS' if kind == 'mps' else 'none (CPU only)'}")
    return lines


def _config_lines(config_file: str | None) -> list[str]:
    from ..config import config_to_dict, read_config_file

    path = Path(config_file).expanduser() if config_file else environment.default_config_file()
    if not path.is_file():
        return [f"- Launch config: none at {path}"]
    try:
        loaded = read_config_file(path)
    except Exception as exc:  # the report must still print when the file is broken
        return [f"- Launch config: {path} (invalid: {exc})"]
    lines = [f"- Launch config: {path}"]
    lines += [f"\t- {key}: {value}" for key, value in sorted(config_to_dict(loaded.config).items())]
    return lines


def environment_report(config_file: str | None = None) -> str:
    """The report printed by ``hasten env``."""
    import psutil

    settings = sorted(f"{key}={value}" for key, value in os.environ.items() if key.startswith(("HASTEN_", "ACCELERATE_")))
    lines = [
        "Copy-and-paste the text below in your GitHub issue.",
        "",
        f"- hasten version: {_version('hasten')}",
        f"- Platform: {platform.platform()}",
        f"- Python version: {sys.version.split()[0]} ({sys.executable})",
        *_torch_lines(),
        f"- Optional packages: {', '.join(f'{p} {_version(p)}' for p in OPTIONAL_PACKAGES)}",
        f"- CPU: {_cpu_model()}, {psutil.cpu_count(logical=False)} cores, {psutil.cpu_count()} threads",
        f"- RAM: {psutil.virtual_memory().total / 2**30:.1f} GiB",
        f"- HASTEN_*/ACCELERATE_* variables: {', '.join(settings) or 'none'}",
        *_config_lines(config_file),
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run ``env`` with ``argv`` (default: this process's arguments): ``python -m hasten.commands.env``
    and ``python -m accelerate.commands.env``."""
    from .main import run_subcommand

    return run_subcommand("env", argv)


if __name__ == "__main__":
    sys.exit(main())
