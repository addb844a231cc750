"""The constants of Accelerate's API (``accelerate.utils.constants``): file names, option lists, version floors.

Libraries read these (transformers validates ``fsdp`` options against ``FSDP_SHARDING_STRATEGY`` and
``FSDP_AUTO_WRAP_POLICY``), so the values are Accelerate's. Where hasten keeps its own list of the same choices
(the config file schema), the list here is built from it, so the two cannot disagree.
"""

from __future__ import annotations

import operator

from ..big_modeling.hooks import SUPPORTED_PYTORCH_LAYERS_FOR_UPCASTING  # noqa: F401 (Accelerate's name)
from ..config import DEEPSPEED_MULTINODE_LAUNCHERS as _LAUNCHERS
from ..config import (
    FSDP_AUTO_WRAP_POLICIES,
    FSDP_SHARDING_STRATEGIES,
    FSDP_STATE_DICT_TYPES,
)
from ..config import (
    FSDP_BACKWARD_PREFETCH as _PREFETCH,
)
from ..runtime.weights.files import (  # noqa: F401 (Accelerate's names, defined where hasten uses them)
    MODEL_NAME,
    SAFE_MODEL_NAME,
    SAFE_WEIGHTS_INDEX_NAME,
    SAFE_WEIGHTS_NAME,
    SAFE_WEIGHTS_PATTERN_NAME,
    WEIGHTS_INDEX_NAME,
    WEIGHTS_NAME,
    WEIGHTS_PATTERN_NAME,
)

# checkpoint file names (Accelerate's; hasten's own checkpoints are described by their manifest)
OPTIMIZER_NAME = "optimizer"
SCHEDULER_NAME = "scheduler"
SAMPLER_NAME = "sampler"
SCALER_NAME = "scaler.pt"
RNG_STATE_NAME = "random_states"
FSDP_MODEL_NAME = "pytorch_model_fsdp"
PROFILE_PATTERN_NAME = "profile_{suffix}.json"

# option lists
FSDP_SHARDING_STRATEGY = list(FSDP_SHARDING_STRATEGIES)
FSDP_AUTO_WRAP_POLICY = list(FSDP_AUTO_WRAP_POLICIES)
FSDP_BACKWARD_PREFETCH = list(_PREFETCH)
FSDP_STATE_DICT_TYPE = list(FSDP_STATE_DICT_TYPES)
FSDP2_STATE_DICT_TYPE = ["SHARDED_STATE_DICT", "FULL_STATE_DICT"]
DEEPSPEED_MULTINODE_LAUNCHERS = list(_LAUNCHERS)
TORCH_DYNAMO_MODES = ["default", "reduce-overhead", "max-autotune"]
STR_OPERATION_TO_FUNC = {
    ">": operator.gt,
    ">=": operator.ge,
    "==": operator.eq,
    "!=": operator.ne,
    "<=": operator.le,
    "<": operator.lt,
}
TORCH_LAUNCH_PARAMS = [
    "nnodes", "nproc_per_node", "rdzv_backend", "rdzv_endpoint", "rdzv_id", "rdzv_conf", "standalone", "max_restarts",
    "monitor_interval", "start_method", "role", "module", "m", "no_python", "run_path", "log_dir", "r", "redirects",
    "t", "tee", "node_rank", "master_addr", "master_port",
]  # fmt: skip
CUDA_DISTRIBUTED_TYPES = ["DEEPSPEED", "MULTI_GPU", "FSDP", "MEGATRON_LM", "TP"]
TORCH_DISTRIBUTED_OPERATION_TYPES = CUDA_DISTRIBUTED_TYPES + [
    "MULTI_NPU", "MULTI_MLU", "MULTI_SDAA", "MULTI_MUSA", "MULTI_XPU", "MULTI_CPU", "MULTI_HPU", "MULTI_NEURON",
]  # fmt: skip

# version floors of features (Accelerate's names; hasten itself requires torch >= 2.6)
FSDP_PYTORCH_VERSION = "2.1.0.a0+32f93b1"
FSDP2_PYTORCH_VERSION = "2.6.0"
DTENSOR_PYTORCH_VERSION = "2.5.0"
ELASTIC_LOG_LINE_PREFIX_TEMPLATE_PYTORCH_VERSION = "2.2.0"
MITA_PROFILING_AVAILABLE_PYTORCH_VERSION = "2.1.0"
XPU_PROFILING_AVAILABLE_PYTORCH_VERSION = "2.4.0"
BETA_TP_AVAILABLE_PYTORCH_VERSION = "2.3.0"
BETA_TP_AVAILABLE_TRANSFORMERS_VERSION = "4.52.0"
BETA_CP_AVAILABLE_PYTORCH_VERSION = "2.6.0"
BETA_SP_AVAILABLE_DEEPSPEED_VERSION = "0.18.2"

# Amazon SageMaker (hasten does not launch on SageMaker; the values are kept for code that reads them)
SAGEMAKER_PYTORCH_VERSION = "1.10.2"
SAGEMAKER_PYTHON_VERSION = "py38"
SAGEMAKER_TRANSFORMERS_VERSION = "4.17.0"
SAGEMAKER_PARALLEL_EC2_INSTANCES = ["ml.p3.16xlarge", "ml.p3dn.24xlarge", "ml.p4dn.24xlarge"]
