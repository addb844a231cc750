"""Internals of Accelerate's DeepSpeed and FSDP2 wiring and device-map planner that hasten does its own way.

Accelerate exports these from ``accelerate.utils.deepspeed`` and ``accelerate.utils.fsdp_utils``; code outside
Accelerate rarely calls them. They exist with Accelerate's signatures so that imports work; calling one (except
``get_module_size_with_ties``, a pure size computation that hasten gives as Accelerate does) raises
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
    """The size of a module together with the modules that hold the parameters tied to it, as Accelerate's
    device-map planner computes it: ``(size, names of those modules, the modules)``.

    Args:
        tied_params: names of the parameters tied to the module (the module's own name excluded).
        module_size: the module's size alone.
        module_sizes: size of every module and tensor by name (``compute_module_sizes``).
        modules_to_treat: ``(name, module)`` pairs still to place; each tied parameter must sit under one of them.

    Each tied parameter brings its module's size less the parameter's own, which is counted once already.
    """
    names, modules = [], []
    for param in tied_params:
        holder = next(((name, module) for name, module in modules_to_treat if param.startswith(name + ".")), None)
        if holder is None:
            raise ValueError(
                f"get_module_size_with_ties: the tied parameter {param!r} is under none of the modules to treat "
                f"({[name for name, _ in modules_to_treat][:10]}); pass the modules not placed yet."
            )
        names.append(holder[0])
        modules.append(holder[1])
    size = module_size + sum(module_sizes[name] - module_sizes[param] for param, name in zip(tied_params, names))
    return size, names, modules
