"""Whether optional packages and hardware features are present (Accelerate's ``is_*_available`` helpers).

Each check looks for the package without importing it, except where the answer needs torch.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import operator

from packaging.version import Version

_OPERATORS = {
    "<": operator.lt,
    "<=": operator.le,
    "==": operator.eq,
    "!=": operator.ne,
    ">=": operator.ge,
    ">": operator.gt,
}


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


def _version_at_least(package: str, minimum: str | None) -> bool:
    if not _installed(package):
        return False
    if minimum is None:
        return True
    try:
        distribution = {"bitsandbytes": "bitsandbytes", "numpy": "numpy"}.get(package, package)
        return Version(importlib.metadata.version(distribution)) >= Version(minimum)
    except importlib.metadata.PackageNotFoundError:
        return False


def is_cuda_available() -> bool:
    """A CUDA device is visible."""
    import torch

    return torch.cuda.is_available()


def is_mps_available(min_version: str = "1.12") -> bool:
    """Apple's MPS backend is available and torch is at least ``min_version``."""
    import torch

    return is_torch_version(">=", min_version) and hasattr(torch.backends, "mps") and torch.backends.mps.is_available()


def is_xpu_available(check_device: bool = False) -> bool:
    """An Intel XPU device is visible (``check_device`` is accepted for Accelerate's signature: visibility is
    always checked)."""
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


def is_torch_distributed_available() -> bool:
    """torch was built with ``torch.distributed``."""
    import torch.distributed

    return torch.distributed.is_available()


def is_weights_only_available() -> bool:
    """``torch.load(weights_only=True)`` is available (always, with the torch hasten requires)."""
    return is_torch_version(">=", "2.4.0")


def is_pippy_available() -> bool:
    """torch's pipelining package is present (hasten does not use it for inference; see ``prepare_pippy``)."""
    return _installed("torch.distributed.pipelining")


def is_rocm_available() -> bool:
    """torch is a ROCm (AMD GPU) build."""
    import torch

    return getattr(torch.version, "hip", None) is not None


def is_xccl_available() -> bool:
    """torch's XCCL backend (Intel GPUs) is available."""
    import torch.distributed

    return bool(getattr(torch.distributed, "is_xccl_available", lambda: False)())


def is_bnb_available(min_version: str | None = None) -> bool:
    """bitsandbytes is installed (at least ``min_version`` when given)."""
    return _version_at_least("bitsandbytes", min_version)


def is_4bit_bnb_available() -> bool:
    """bitsandbytes with 4-bit layers (0.39.0 or later) is installed."""
    return _version_at_least("bitsandbytes", "0.39.0")


def is_8bit_bnb_available() -> bool:
    """bitsandbytes with 8-bit layers (0.37.2 or later) is installed."""
    return _version_at_least("bitsandbytes", "0.37.2")


def is_numpy_available(min_version: str = "1.25.0") -> bool:
    """numpy, at least ``min_version``, is installed."""
    return _version_at_least("numpy", min_version)


def is_torchdata_stateful_dataloader_available() -> bool:
    """torchdata with ``StatefulDataLoader`` (0.8.0 or later) is installed."""
    return _version_at_least("torchdata", "0.8.0")


def is_npu_available(check_device: bool = False) -> bool:
    """Always False: hasten does not support Ascend NPUs."""
    return False


def is_mlu_available(check_device: bool = False) -> bool:
    """Always False: hasten does not support Cambricon MLUs."""
    return False


def is_sdaa_available(check_device: bool = False) -> bool:
    """Always False: hasten does not support SDAA devices."""
    return False


def is_musa_available(check_device: bool = False) -> bool:
    """Always False: hasten does not support Moore Threads MUSA GPUs."""
    return False


def is_neuron_available(check_device: bool = False) -> bool:
    """Always False: hasten does not support AWS Neuron devices."""
    return False


def is_hpu_available(init_hccl: bool = False) -> bool:
    """Always False: hasten does not support Habana Gaudi HPUs."""
    return False


def is_habana_gaudi1() -> bool:
    """Always False: hasten does not support Habana Gaudi HPUs."""
    return False


def is_torch_xla_available(check_is_tpu: bool = False, check_is_gpu: bool = False) -> bool:
    """Always False: hasten does not run on torch_xla (TPUs)."""
    return False


def is_transformer_engine_mxfp8_available() -> bool:
    """Always False: hasten does not drive Transformer Engine."""
    return False


def _requiring(package: str, feature: str):
    def decorator(func):
        @functools.wraps(func)
        def wrapper(*args, **kwargs):
            from ..errors import require

            require(package, feature)
            return func(*args, **kwargs)

        return wrapper

    return decorator


def deepspeed_required(func):
    """Decorator: calling ``func`` without DeepSpeed installed raises a clear MissingDependencyError."""
    return _requiring("deepspeed", func.__name__)(func)


def torchao_required(func):
    """Decorator: calling ``func`` without torchao installed raises a clear MissingDependencyError."""
    return _requiring("torchao", func.__name__)(func)


# Accelerate's switch for torch_xla; hasten never uses torch_xla.
USE_TORCH_XLA = False


@functools.cache
def _package_check(name: str):
    def check() -> bool:
        return _installed(name)

    check.__name__ = f"is_{name.replace('.', '_')}_available"
    check.__doc__ = f"The ``{name}`` package is installed."
    return check


_PACKAGES = {
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
    "is_torchvision_available": "torchvision",
    "is_pandas_available": "pandas",
    "is_tqdm_available": "tqdm",
    "is_safetensors_available": "safetensors",
    "is_schedulefree_available": "schedulefree",
    "is_amdsmi_available": "amdsmi",
    "is_boto3_available": "boto3",
    "is_import_timer_available": "import_timer",
    "is_lomo_available": "lomo_optim",
    "is_matplotlib_available": "matplotlib",
    "is_megatron_lm_available": "megatron",
    "is_msamp_available": "msamp",
    "is_pynvml_available": "pynvml",
    "is_pytest_available": "pytest",
    "is_sagemaker_available": "sagemaker",
    "is_torchdata_available": "torchdata",
    "is_transformer_engine_available": "transformer_engine",
    "is_triton_available": "triton",
    "is_bitsandbytes_multi_backend_available": "bitsandbytes",
}


@functools.cache
def _torch_version() -> Version:
    import torch

    return Version(torch.__version__)


def __getattr__(attribute: str):
    if attribute in _PACKAGES:
        return _package_check(_PACKAGES[attribute])
    if attribute == "torch_version":
        return _torch_version()
    raise AttributeError(f"module 'hasten.runtime.availability' has no attribute {attribute!r}")
