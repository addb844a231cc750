"""Internals of Accelerate's DeepSpeed and FSDP2 wiring and device-map planner that hasten does its own way.

Accelerate exports these from ``accelerate.utils.deepspeed`` and ``accelerate.utils.fsdp_utils``; code outside
Accelerate rarely calls them. They exist with Accelerate's signatures so that imports work; calling one raises
:class:`~hasten.errors.NotSupportedError` naming what does the job in hasten (``Accelerator.prepare`` wraps models,
optimizers and schedulers for the engine in use).
"""

from __future__ import annotations

from ..errors import NotSupportedError

_PREPARE = (
    "an internal of Accelerate's DeepSpeed/FSDP2 integration; hasten does this inside Accelerator.prepare. Prepare the "
    "model, optimizer and scheduler with accelerator.prepare(...) instead of calling it."
)
_DEVICE_MAP = (
    "an internal of Accelerate's device-map planner; call infer_auto_device_map(model, max_memory=...) instead."
)


def _refuse(name: str, what: str = _PREPARE) -> NotSupportedError:
    return NotSupportedError(f"{name} is {what}")


class DeepSpeedEngineWrapper:
    """Accelerate internal; use Accelerator.prepare (raises NotSupportedError)."""

    def __init__(self, engine):
        raise _refuse("DeepSpeedEngineWrapper")


class DeepSpeedOptimizerWrapper:
    """Accelerate internal; use Accelerator.prepare (raises NotSupportedError)."""

    def __init__(self, optimizer):
        raise _refuse("DeepSpeedOptimizerWrapper")


def ensure_weights_retied(param_init_fn, model, device):
    """Accelerate internal; use Accelerator.prepare (raises NotSupportedError)."""
    raise _refuse("ensure_weights_retied")


def fsdp2_apply_ac(accelerator, model):
    """Accelerate internal; use Accelerator.prepare (raises NotSupportedError)."""
    raise _refuse("fsdp2_apply_ac")


def fsdp2_load_full_state_dict(accelerator, model, full_sd, cpu_offload=False):
    """Accelerate internal; use Accelerator.prepare (raises NotSupportedError)."""
    raise _refuse("fsdp2_load_full_state_dict")


def fsdp2_prepare_auto_wrap_policy(fsdp2_plugin, model):
    """Accelerate internal; use Accelerator.prepare (raises NotSupportedError)."""
    raise _refuse("fsdp2_prepare_auto_wrap_policy")


def fsdp2_prepare_model(accelerator, model):
    """Accelerate internal; use Accelerator.prepare (raises NotSupportedError)."""
    raise _refuse("fsdp2_prepare_model")


def fsdp2_switch_optimizer_parameters(optimizer, mapping):
    """Accelerate internal; use Accelerator.prepare (raises NotSupportedError)."""
    raise _refuse("fsdp2_switch_optimizer_parameters")


def fallback_allocate(modules, module_sizes, size_limit, no_split_module_classes=None, tied_parameters=None):
    """Accelerate internal; hasten's device-map planner lives in hasten.big_modeling.device_map (raises
    NotSupportedError)."""
    raise _refuse("fallback_allocate", _DEVICE_MAP)


def get_module_size_with_ties(tied_params, module_size, module_sizes, modules_to_treat):
    """Accelerate internal; hasten's device-map planner lives in hasten.big_modeling.device_map (raises
    NotSupportedError)."""
    raise _refuse("get_module_size_with_ties", _DEVICE_MAP)
