"""Public names of Accelerate that hasten does not support: they exist so imports work, and say so clearly when used."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import NotSupportedError
from ..runtime.parallelism import ParallelismConfig

__all__ = ["ParallelismConfig", "is_rich_available", "prepare_pippy"]


def prepare_pippy(
    model,
    split_points="auto",
    no_split_module_classes=None,
    example_args=(),
    example_kwargs=None,
    num_chunks=None,
    gather_output=False,
):
    """Pipeline-parallel inference (Accelerate's ``prepare_pippy``) is not supported by hasten."""
    raise NotSupportedError(
        "prepare_pippy (pipeline-parallel inference) is not supported by hasten. For a model larger than one device, "
        "use big-model inference: load_checkpoint_and_dispatch(model, checkpoint, device_map='auto')."
    )


def is_rich_available() -> bool:
    """Whether the ``rich`` package is installed (hasten does not install rich tracebacks)."""
    import importlib.util

    return importlib.util.find_spec("rich") is not None


@dataclass
class TorchTensorParallelPlugin:
    """Accelerate's older TorchTensorParallelPlugin; creating one raises NotSupportedError pointing to
    ``ParallelismConfig(tp_size=...)``."""

    tp_size: Any = 1
    torch_device_mesh: Any = None

    def __post_init__(self):
        raise NotSupportedError(
            "TorchTensorParallelPlugin is Accelerate's older tensor-parallel switch; hasten reads the layout from "
            f"ParallelismConfig: Accelerator(parallelism_config=ParallelismConfig(tp_size={self.tp_size!r})) or "
            "`hasten launch --parallelism_config_tp_size N`."
        )


def install_xla(upgrade=False):
    """Installing torch_xla (TPU support): not supported by hasten; raises NotSupportedError."""
    raise NotSupportedError(
        "install_xla: TPUs (torch_xla) are not supported by hasten; it runs on CPUs and CUDA/XPU GPUs."
    )
