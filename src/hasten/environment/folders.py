"""Folders processes find their files in: the default launch config file (hasten's, and Accelerate's as Accelerate
finds it) and the torch extensions folder that JIT-compiled ops build in."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from ..settings import prefixed


def config_home() -> Path:
    """Folder of the default launch config file.

    ``$HASTEN_HOME``, then ``$HF_HOME/hasten``, then ``$XDG_CACHE_HOME/huggingface/hasten``, then
    ``~/.cache/huggingface/hasten``.
    """
    explicit = os.environ.get(prefixed("HOME"))  # hasten's own: Accelerate has no such variable
    if explicit:
        return Path(explicit).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hasten"
    cache = os.environ.get("XDG_CACHE_HOME")
    base = Path(cache).expanduser() if cache else Path.home() / ".cache"
    return base / "huggingface" / "hasten"


def default_config_file() -> Path:
    """Path of ``default_config.yaml`` in :func:`config_home`."""
    return config_home() / "default_config.yaml"


def torch_extensions_dir() -> Path:
    """The folder where torch builds and finds JIT-compiled extensions (DeepSpeed's ops) in processes started from this
    one: ``$TORCH_EXTENSIONS_DIR`` (the venv ``make`` builds sets it to its own ``torch_extensions`` folder), else
    torch's default, ``~/.cache/torch_extensions/py<version>_<cpu or cuXYZ>`` (imports torch)."""
    explicit = os.environ.get("TORCH_EXTENSIONS_DIR")
    if explicit:
        return Path(explicit).expanduser()
    import torch
    from torch.utils.cpp_extension import get_default_build_root

    build = "cpu" if torch.version.cuda is None else f"cu{torch.version.cuda.replace('.', '')}"
    python = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
    return Path(get_default_build_root()) / f"{python}_{build}"


def accelerate_config_home() -> Path:
    """Folder of Accelerate's default launch config file, found as Accelerate 1.15 finds it: ``$HF_HOME/accelerate``,
    else ``$XDG_CACHE_HOME/huggingface/accelerate``, else ``~/.cache/huggingface/accelerate``."""
    hf_home = os.environ.get("HF_HOME")
    if not hf_home:
        cache = os.environ.get("XDG_CACHE_HOME")
        hf_home = os.path.join(cache or "~/.cache", "huggingface")
    return Path(hf_home).expanduser() / "accelerate"
