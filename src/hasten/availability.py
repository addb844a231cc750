"""Whether optional packages and hardware features are present (Accelerate's ``is_*_available`` helpers).

Each check looks for the package without importing it, except where the answer needs torch.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import operator

from packaging.version import Version

_OPERATORS = {"<": operator.lt, "<=": operator.le, "==": operator.eq, "!=": operator.ne, ">=": operator.ge, ">": operator.gt}


def _installed(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def compare_versions(library_or_version, operation: str, requirement_version: str) -> bool:
    """Compare an installed library's version (or a version string) with ``requirement_version``.

    Example: ``compare_versions("torch", ">=", "2.6")``.
    """
    if operation not in _OPERATORS:
        raise ValueError(f"compare_versions: operation must be one of {sorted(_OPERATORS)}, got {operation!r}.")
    version = library_or_version
    if isinstance(library_or_version, str) and not library_or_version[:1].isdigit():
        version = importlib.metadata.version(library_or_version)
    return _OPERATORS[operation](Version(str(version)), Version(requirement_version))


def is_torch_version(operation: str, version: str) -> bool:
    """Compare the installed torch version, e.g. ``is_torch_version(">=", "2.6")``."""
    import torch

    return compare_versions(torch.__version__.split("+")[0], operation, version)


def is_cuda_available() -> bool:
    """A CUDA device is visible."""
    import torch

    return torch.cuda.is_available()


def is_mps_available() -> bool:
    """Apple's MPS backend is available."""
    import torch

    return hasattr(torch.backends, "mps") and torch.backends.mps.is_available()


def is_xpu_available() -> bool:
    """An Intel XPU device is visible."""
    import torch

    return hasattr(torch, "xpu") and torch.xpu.is_available()


def is_bf16_available(ignore_tpu: bool = False) -> bool:
    """bf16 computation is supported (CUDA with bf16 support, or the CPU)."""
    import torch

    return torch.cuda.is_bf16_supported() if torch.cuda.is_available() else True


def is_fp16_available() -> bool:
    """fp16 mixed precision is supported (always on CUDA; on CPU with torch's CPU autocast)."""
    return True


def is_fp8_available() -> bool:
    """fp8 training can run here: a GPU of compute capability 8.9+ and torchao."""
    import torch

    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9) and _installed("torchao")


@functools.cache
def _package_check(name: str):
    def check() -> bool:
        return _installed(name)

    check.__name__ = f"is_{name}_available"
    check.__doc__ = f"The ``{name}`` package is installed."
    return check


_NEVER = {"is_npu_available", "is_mlu_available", "is_sdaa_available", "is_musa_available", "is_hpu_available", "is_torch_xla_available"}


def _never(*args, **kwargs) -> bool:
    """Always False: hasten does not support this accelerator (NPU, MLU, SDAA, MUSA, HPU, XLA)."""
    return False


def __getattr__(attribute: str):
    packages = {
        "is_deepspeed_available": "deepspeed",
        "is_tensorboard_available": "tensorboard",
        "is_wandb_available": "wandb",
        "is_mlflow_available": "mlflow",
        "is_transformers_available": "transformers",
        "is_datasets_available": "datasets",
        "is_peft_available": "peft",
        "is_timm_available": "timm",
        "is_torchao_available": "torchao",
        "is_comet_ml_available": "comet_ml",
        "is_aim_available": "aim",
        "is_clearml_available": "clearml",
        "is_dvclive_available": "dvclive",
        "is_swanlab_available": "swanlab",
        "is_trackio_available": "trackio",
        "is_bnb_available": "bitsandbytes",
        "is_torchvision_available": "torchvision",
        "is_pandas_available": "pandas",
        "is_tqdm_available": "tqdm",
        "is_rich_available": "rich",
        "is_safetensors_available": "safetensors",
    }
    if attribute in packages:
        return _package_check(packages[attribute])
    if attribute in _NEVER:
        return _never
    raise AttributeError(f"module 'hasten.availability' has no attribute {attribute!r}")
