"""What ``hasten launch`` decided, handed to the runners: the plan of one launch, and the ``--rdzv_conf`` parser.

Kept apart from the command itself so that the runners and the preemption helpers read the plan
without importing the command that builds it and starts them.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path

from ..config import LoadedConfig, ResolvedSettings, Source
from ..errors import ConfigError
from .config_location import ConfigLocation


@dataclass(kw_only=True)
class LaunchPlan:
    """Everything needed to start the job: merged settings, the command of one process, its environment."""

    args: argparse.Namespace
    settings: ResolvedSettings
    loaded: LoadedConfig | None
    config_location: ConfigLocation | None = None
    nproc_per_node: int
    command: list[str]
    env: dict[str, str]
    launch_sources: dict[str, Source] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    hang_dir: Path | None = None
    owns_hang_dir: bool = False


def parse_rdzv_conf(text: str | None) -> dict[str, str]:
    """Parse ``--rdzv_conf key1=value1,key2=value2``."""
    conf: dict[str, str] = {}
    for item in (text or "").split(","):
        if not item.strip():
            continue
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--rdzv_conf item {item!r} must look like key=value (items separated by commas).")
        conf[key.strip()] = value.strip()
    return conf
