"""The enumerations of Accelerate's public API (``hasten.utils`` re-exports them), built as Accelerate 1.15 builds
each one, so that ``str``, ``repr``, ``format``, equality with strings and JSON behave the same:

- ``DistributedType``, ``SageMakerDistributedType``, ``ComputeEnvironment``, ``FP8BackendType``: ``str`` enums whose
  ``str()`` is ``"DistributedType.MULTI_CPU"``; they compare equal to their values (``== "MULTI_CPU"``);
- ``PrecisionType``, ``DynamoBackend``: ``str`` enums whose ``str()`` is the value;
- ``RNGType``, ``LoggerType``, ``DDPCommunicationHookType``: plain enums whose ``str()`` is the value and which do
  not compare equal to strings (compare ``.value``); ``CustomDtype``: a plain ``enum.Enum``.

Those built on :class:`BaseEnum` have :meth:`~BaseEnum.list` (the values) and accept a value with ``in``.
"""

from __future__ import annotations

import enum
from typing import Literal

# Accelerate's type aliases of FP8 and profiler options
Backend = Literal["MSAMP", "TE"]
OptLevel = Literal["O1", "O2"]
FP8Format = Literal["HYBRID", "E4M3", "E5M2"]
AmaxComputeAlgorithm = Literal["max", "most_recent"]
ProfilerActivity = Literal["cpu", "xpu", "mtia", "cuda", "hpu"]


def member_values(enum_type: type[enum.Enum]) -> list:
    """The values of ``enum_type``'s members, in definition order: what ``list()`` gives on the enums built on
    :class:`BaseEnum`, for those Accelerate builds without it (``DistributedType``, ``ComputeEnvironment``, ...)."""
    return [member.value for member in enum_type]


class EnumWithContains(enum.EnumMeta):
    """Enum metaclass whose ``in`` accepts values as well as members: ``"bf16" in PrecisionType``."""

    def __contains__(cls, item) -> bool:
        try:
            cls(item)
        except ValueError:
            return False
        return True


class BaseEnum(enum.Enum, metaclass=EnumWithContains):
    """An enum whose ``str()`` is its value, with :meth:`list` of all values (Accelerate's ``BaseEnum``)."""

    def __str__(self) -> str:
        return self.value

    @classmethod
    def list(cls) -> list[str]:
        """All values, in definition order."""
        return list(map(str, cls))


class DistributedType(str, enum.Enum):
    """How the job is distributed. hasten runs NO, MULTI_CPU, MULTI_GPU, MULTI_XPU, DEEPSPEED and FSDP;
    the other members exist so that configs written for Accelerate parse, and are refused with a clear error."""

    NO = "NO"
    MULTI_CPU = "MULTI_CPU"
    MULTI_GPU = "MULTI_GPU"
    MULTI_NPU = "MULTI_NPU"
    MULTI_MLU = "MULTI_MLU"
    MULTI_SDAA = "MULTI_SDAA"
    MULTI_MUSA = "MULTI_MUSA"
    MULTI_XPU = "MULTI_XPU"
    DEEPSPEED = "DEEPSPEED"
    FSDP = "FSDP"
    XLA = "XLA"
    MEGATRON_LM = "MEGATRON_LM"
    MULTI_HPU = "MULTI_HPU"
    MULTI_NEURON = "MULTI_NEURON"


SUPPORTED_DISTRIBUTED_TYPES = frozenset(
    {
        DistributedType.NO,
        DistributedType.MULTI_CPU,
        DistributedType.MULTI_GPU,
        DistributedType.MULTI_XPU,
        DistributedType.DEEPSPEED,
        DistributedType.FSDP,
    }
)


class PrecisionType(str, BaseEnum):
    """Mixed precision modes."""

    NO = "no"
    FP8 = "fp8"
    FP16 = "fp16"
    BF16 = "bf16"


class RNGType(BaseEnum):
    """Random number generators that can be synchronised across processes at each epoch."""

    TORCH = "torch"
    CUDA = "cuda"
    MLU = "mlu"
    SDAA = "sdaa"
    MUSA = "musa"
    NPU = "npu"
    XLA = "xla"
    XPU = "xpu"
    HPU = "hpu"
    NEURON = "neuron"
    GENERATOR = "generator"


class LoggerType(BaseEnum):
    """Experiment trackers known by name (``log_with=``); ``jsonl`` is hasten's dependency-free tracker."""

    ALL = "all"
    AIM = "aim"
    TENSORBOARD = "tensorboard"
    WANDB = "wandb"
    TRACKIO = "trackio"
    COMETML = "comet_ml"
    MLFLOW = "mlflow"
    CLEARML = "clearml"
    DVCLIVE = "dvclive"
    SWANLAB = "swanlab"
    JSONL = "jsonl"


class DynamoBackend(str, BaseEnum):
    """``torch.compile`` backends accepted by ``dynamo_backend``."""

    NO = "NO"
    EAGER = "EAGER"
    AOT_EAGER = "AOT_EAGER"
    INDUCTOR = "INDUCTOR"
    AOT_TS_NVFUSER = "AOT_TS_NVFUSER"
    NVPRIMS_NVFUSER = "NVPRIMS_NVFUSER"
    CUDAGRAPHS = "CUDAGRAPHS"
    OFI = "OFI"
    FX2TRT = "FX2TRT"
    ONNXRT = "ONNXRT"
    TENSORRT = "TENSORRT"
    AOT_TORCHXLA_TRACE_ONCE = "AOT_TORCHXLA_TRACE_ONCE"
    TORCHXLA_TRACE_ONCE = "TORCHXLA_TRACE_ONCE"
    TVM = "TVM"
    HPU_BACKEND = "HPU_BACKEND"
    NEURON = "NEURON"


class ComputeEnvironment(str, enum.Enum):
    """Where the job runs (config files' ``compute_environment``)."""

    LOCAL_MACHINE = "LOCAL_MACHINE"
    AMAZON_SAGEMAKER = "AMAZON_SAGEMAKER"


class SageMakerDistributedType(str, enum.Enum):
    """SageMaker modes; accepted in config files, not supported by hasten."""

    NO = "NO"
    DATA_PARALLEL = "DATA_PARALLEL"
    MODEL_PARALLEL = "MODEL_PARALLEL"


class DDPCommunicationHookType(BaseEnum):
    """DDP gradient communication hooks."""

    NO = "no"
    FP16 = "fp16"
    BF16 = "bf16"
    POWER_SGD = "power_sgd"
    BATCHED_POWER_SGD = "batched_power_sgd"


class CustomDtype(enum.Enum):
    """Data types torch lacks, used by big-model size estimates."""

    FP8 = "fp8"
    INT4 = "int4"
    INT2 = "int2"


class FP8BackendType(str, enum.Enum):
    """FP8 implementations."""

    NO = "NO"
    TE = "TE"
    MSAMP = "MSAMP"
    AO = "AO"
