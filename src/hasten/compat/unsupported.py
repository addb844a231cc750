"""Public names of Accelerate that hasten does not support: they exist so imports work, and say so clearly when used."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import NotSupportedError
from ..runtime.parallelism import ParallelismConfig

__all__ = ["ParallelismConfig", "is_rich_available", "prepare_pippy"]


def _refuse_parallelism(name: str) -> NotSupportedError:
    return NotSupportedError(
        f"{name}: context and sequence parallelism are not supported by hasten. Use ParallelismConfig(dp_shard_size=..., "
        "tp_size=...) (FSDP2 and tensor parallelism) or DeepSpeed ZeRO to fit a large model; see docs/parallelism.md."
    )


def prepare_pippy(model, split_points="auto", no_split_module_classes=None, example_args=(), example_kwargs=None, num_chunks=None, gather_output=False):
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
class TorchContextParallelConfig:
    """Accelerate's TorchContextParallelConfig (context/sequence parallelism); not supported by hasten (creating one raises NotSupportedError)."""

    cp_comm_strategy: Any = None

    def __post_init__(self):
        raise _refuse_parallelism("TorchContextParallelConfig")


@dataclass
class TorchTensorParallelPlugin:
    """Accelerate's older TorchTensorParallelPlugin; creating one raises NotSupportedError pointing to ``ParallelismConfig(tp_size=...)``."""

    tp_size: Any = 1
    torch_device_mesh: Any = None

    def __post_init__(self):
        raise NotSupportedError(
            "TorchTensorParallelPlugin is Accelerate's older tensor-parallel switch; hasten reads the layout from "
            f"ParallelismConfig: Accelerator(parallelism_config=ParallelismConfig(tp_size={self.tp_size!r})) or "
            "`hasten launch --parallelism_config_tp_size N`."
        )


@dataclass
class DeepSpeedSequenceParallelConfig:
    """Accelerate's DeepSpeedSequenceParallelConfig (context/sequence parallelism); not supported by hasten (creating one raises NotSupportedError)."""

    sp_seq_length: Any = None
    sp_seq_length_is_variable: Any = None
    sp_attn_implementation: Any = None

    def __post_init__(self):
        raise _refuse_parallelism("DeepSpeedSequenceParallelConfig")


def install_xla(upgrade=False):
    """Installing torch_xla (TPU support): not supported by hasten; raises NotSupportedError."""
    raise NotSupportedError("install_xla: TPUs (torch_xla) are not supported by hasten; it runs on CPUs and CUDA/XPU GPUs.")
