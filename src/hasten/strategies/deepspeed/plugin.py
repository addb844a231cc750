"""``DeepSpeedPlugin`` and the DeepSpeed helpers user scripts import (``DummyOptim``, ``DummyScheduler``, ...).

A plugin holds one DeepSpeed config: the user's JSON file or dict (``hf_ds_config``), or one built
from the plugin's fields. Fields left as None take their value from the launch settings
(``HASTEN_DEEPSPEED_*`` variables written by ``hasten launch`` from its flags or config file), then
from the defaults. A field given explicitly (argument or variable) that contradicts the file is an
error naming both values. ``"auto"`` values are filled at ``prepare`` (see
:mod:`hasten.deepspeed_config`).

Importing this module does not import ``deepspeed``.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from . import config as dsc
from ... import environment
from ...errors import ConfigError, NotSupportedError, require

_BOOL_FIELDS = {"zero3_init_flag": "DEEPSPEED_ZERO3_INIT", "zero3_save_16bit_model": "DEEPSPEED_ZERO3_SAVE_16BIT_MODEL"}
_STR_FIELDS = {
    "offload_optimizer_device": "DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE",
    "offload_param_device": "DEEPSPEED_OFFLOAD_PARAM_DEVICE",
    "offload_optimizer_nvme_path": "DEEPSPEED_OFFLOAD_OPTIMIZER_NVME_PATH",
    "offload_param_nvme_path": "DEEPSPEED_OFFLOAD_PARAM_NVME_PATH",
    "transformer_moe_cls_names": "DEEPSPEED_MOE_LAYER_CLS_NAMES",
}
# plugin field -> key path in the DeepSpeed config
_CONFIG_PATHS = {
    "gradient_accumulation_steps": "gradient_accumulation_steps",
    "gradient_clipping": "gradient_clipping",
    "zero_stage": "zero_optimization.stage",
    "offload_optimizer_device": "zero_optimization.offload_optimizer.device",
    "offload_param_device": "zero_optimization.offload_param.device",
    "offload_optimizer_nvme_path": "zero_optimization.offload_optimizer.nvme_path",
    "offload_param_nvme_path": "zero_optimization.offload_param.nvme_path",
    "zero3_save_16bit_model": "zero_optimization.stage3_gather_16bit_weights_on_model_save",
}
_DEFAULTS = {
    "gradient_accumulation_steps": dsc.AUTO,
    "gradient_clipping": dsc.AUTO,
    "zero_stage": 2,
    "offload_optimizer_device": "none",
    "offload_param_device": "none",
    "offload_optimizer_nvme_path": "none",
    "offload_param_nvme_path": "none",
    "zero3_init_flag": False,
    "zero3_save_16bit_model": False,
}


class HfDeepSpeedConfig:
    """A read-only view of a DeepSpeed config that tells Transformers to build models partitioned (ZeRO-3).

    As in Transformers' own class: create it *before* ``from_pretrained`` and keep it alive; while it
    lives (and Transformers is installed), ``from_pretrained`` builds the model under
    ``deepspeed.zero.Init`` when the config is ZeRO-3.

    Args:
        config_file_or_dict: a DeepSpeed config dict or the path of its JSON file.
    """

    def __init__(self, config_file_or_dict):
        self.config, _ = dsc.load_config(config_file_or_dict)
        self.set_stage_and_offload()
        _register_with_transformers(self)

    @classmethod
    def _unregistered(cls, config: dict) -> "HfDeepSpeedConfig":
        view = cls.__new__(cls)
        view.config = config
        view.set_stage_and_offload()
        return view

    def set_stage_and_offload(self) -> None:
        """Record the ZeRO stage (``_stage``, -1 when unset) and whether anything is offloaded (``_offload``), as
        Accelerate's class does for the code that reads those attributes."""
        self._stage = self.get_value("zero_optimization.stage", -1)
        self._offload = self.is_offload()

    def find_config_node(self, ds_key_long: str):
        """``(the dict holding the last part of the dotted key, that last part)``; ``(None, last part)`` when a
        parent section is missing. Transformers fills ``"auto"`` values through it."""
        *parents, key = ds_key_long.split(".")
        node = self.config
        for part in parents:
            node = node.get(part)
            if node is None:
                return None, key
        return node, key

    def get_value(self, ds_key_long: str, default=None):
        """The value at a dotted key path (``"zero_optimization.stage"``), or ``default``."""
        return dsc.get_value(self.config, ds_key_long, default)

    def del_config_sub_tree(self, ds_key_long: str, must_exist: bool = False) -> None:
        """Remove the section at a dotted key path; a missing one is an error only with ``must_exist``."""
        node, key = self.find_config_node(ds_key_long)
        if node is None or key not in node:
            if must_exist:
                raise ConfigError(f"The DeepSpeed config has no {ds_key_long!r} section to delete.")
            return
        del node[key]

    def is_zero2(self) -> bool:
        """True for a ZeRO stage 2 config."""
        return self.get_value("zero_optimization.stage") == 2

    def is_true(self, ds_key_long: str) -> bool:
        """True when the key is set to ``True``."""
        return self.get_value(ds_key_long) is True

    def is_false(self, ds_key_long: str) -> bool:
        """True when the key is set to ``False``."""
        return self.get_value(ds_key_long) is False

    def is_zero3(self) -> bool:
        """True for a ZeRO stage 3 config."""
        return self.get_value("zero_optimization.stage") == 3

    def is_offload(self) -> bool:
        """True when parameters or optimizer states are offloaded to the CPU or NVMe."""
        return any(self.get_value(f"zero_optimization.{part}.device", "none") in ("cpu", "nvme") for part in ("offload_optimizer", "offload_param"))


def _register_with_transformers(view: HfDeepSpeedConfig | None) -> None:
    """Point Transformers' ``is_deepspeed_zero3_enabled()`` at ``view`` (None: forget it)."""
    if importlib.util.find_spec("transformers") is None:
        return
    from transformers.integrations import deepspeed as hf_deepspeed

    if view is None:
        hf_deepspeed.unset_hf_deepspeed_config()
    else:
        hf_deepspeed.set_hf_deepspeed_config(view)


@dataclass
class DeepSpeedPlugin:
    """Settings of the DeepSpeed engine (ZeRO stage, offload, accumulation, clipping, config file).

    Args:
        hf_ds_config: a DeepSpeed config dict or JSON file path (default ``HASTEN_DEEPSPEED_CONFIG_FILE``).
            Its keys are checked: a misspelled key is an error with the closest valid key.
        gradient_accumulation_steps: micro-batches per optimizer step (default: the Accelerator's).
        gradient_clipping: clip gradients to this global norm. Without a config file, hasten does not
            clip unless asked, like DDP (DeepSpeed alone clips at 1.0 by default, and so does Accelerate);
            a file's ``"auto"`` becomes this value, or 1.0.
        zero_stage: 0, 1, 2 or 3 (default 2).
        is_train_batch_min: with several dataloaders, the micro batch size is the smallest batch size
            (True) or the largest (False).
        offload_optimizer_device: ``"none"``, ``"cpu"`` or ``"nvme"``.
        offload_param_device: ``"none"``, ``"cpu"`` or ``"nvme"`` (ZeRO-3 only).
        offload_optimizer_nvme_path, offload_param_nvme_path: folders on the NVMe drive.
        zero3_init_flag: build models partitioned at construction (ZeRO-3): Transformers'
            ``from_pretrained`` does so by itself; other models are built inside
            :meth:`zero3_init_context_manager`.
        zero3_save_16bit_model: gather full 16-bit weights when saving a ZeRO-3 model.
        transformer_moe_cls_names: comma-separated mixture-of-experts layer class names, kept whole (ZeRO-3 leaf modules).
        enable_msamp, msamp_opt_level: MS-AMP fp8; not supported by hasten.
    """

    hf_ds_config: Any = None
    gradient_accumulation_steps: int | str | None = None
    gradient_clipping: float | str | None = None
    zero_stage: int | None = None
    is_train_batch_min: bool = True
    offload_optimizer_device: str | None = None
    offload_param_device: str | None = None
    offload_optimizer_nvme_path: str | None = None
    offload_param_nvme_path: str | None = None
    zero3_init_flag: bool | None = None
    zero3_save_16bit_model: bool | None = None
    transformer_moe_cls_names: str | None = None
    enable_msamp: bool | None = None
    msamp_opt_level: str | None = None
    deepspeed_config: dict = field(init=False, repr=False)

    def __post_init__(self):
        require("deepspeed", "DeepSpeedPlugin (the DeepSpeed engine)", "deepspeed")
        if self.enable_msamp:
            raise NotSupportedError("DeepSpeedPlugin(enable_msamp=True): MS-AMP fp8 is not supported by hasten; train with mixed_precision='bf16'.")
        explicit = self._read_settings()
        source = self.hf_ds_config if self.hf_ds_config is not None else environment.get_str("DEEPSPEED_CONFIG_FILE")
        if isinstance(source, HfDeepSpeedConfig):
            source = source.config
        if source is None:
            self.config_name = "the DeepSpeed config built from DeepSpeedPlugin"
            config = self._build_config()
        else:
            config, self.config_name = dsc.load_config(source)
            dsc.validate_config(config, self.config_name)
            paths = tuple(_CONFIG_PATHS[name] for name in explicit if name in _CONFIG_PATHS)
            dsc.fill(config, {_CONFIG_PATHS[n]: s for n, s in explicit.items() if n in _CONFIG_PATHS}, self.config_name, must_match=paths, add_missing=paths)
            self._adopt_file_values(config, explicit)
        dsc.validate_config(config, self.config_name)
        self.deepspeed_config = config
        self.hf_ds_config = HfDeepSpeedConfig._unregistered(config)
        self.explicit_fields = explicit
        self._dschf = None
        self.selected = False
        if self.zero3_init_flag and self.zero_stage != 3:
            raise ConfigError(f"zero3_init_flag is set but the ZeRO stage is {self.zero_stage}; building models partitioned needs stage 3. Set zero_stage=3 or drop zero3_init_flag.")
        self._set_transformers_view(self.is_zero3_init_enabled())

    def _read_settings(self) -> dict[str, dsc.Setting]:
        """Fill unset fields from the launch settings, then defaults; return the explicit ones with their source."""
        explicit = {}
        for name in ("gradient_accumulation_steps", "gradient_clipping", "zero_stage", *_STR_FIELDS, *_BOOL_FIELDS):
            value = getattr(self, name)
            if value is not None:
                explicit[name] = dsc.Setting(_parse_field(name, value, f"DeepSpeedPlugin({name}={value!r})"), f"DeepSpeedPlugin({name}={value!r})")
                setattr(self, name, explicit[name].value)
                continue
            variable = _VARIABLES[name]
            if environment.setting_source(variable) is not None and environment.get_str(variable) not in ("", None):
                raw = environment.get_str(variable)
                where = f"{environment.setting_source(variable)}={raw}"
                explicit[name] = dsc.Setting(_parse_field(name, raw, where), where)
                setattr(self, name, explicit[name].value)
            elif name in _DEFAULTS:
                setattr(self, name, _DEFAULTS[name])
        for name in ("gradient_accumulation_steps", "gradient_clipping"):
            if name in explicit and explicit[name].value == dsc.AUTO:
                del explicit[name]
        return explicit

    def _build_config(self) -> dict:
        zero: dict[str, Any] = {"stage": self.zero_stage}
        for part in ("optimizer", "param"):
            device = getattr(self, f"offload_{part}_device")
            section = {"device": device}
            if device == "nvme":
                section["nvme_path"] = getattr(self, f"offload_{part}_nvme_path")
            zero[f"offload_{part}"] = section
        zero["stage3_gather_16bit_weights_on_model_save"] = self.zero3_save_16bit_model
        config = {
            "train_batch_size": dsc.AUTO,
            "train_micro_batch_size_per_gpu": dsc.AUTO,
            "gradient_accumulation_steps": self.gradient_accumulation_steps,
            "zero_optimization": zero,
            "steps_per_print": 2**31 - 1,
        }
        # DeepSpeed clips at 1.0 unless told otherwise; DDP does not clip, so neither does a plugin not asked to.
        config["gradient_clipping"] = 0.0 if self.gradient_clipping in (dsc.AUTO, None) else self.gradient_clipping
        return config

    def _adopt_file_values(self, config: dict, explicit: dict) -> None:
        """Make the plugin's fields describe the file (the file wins over defaults)."""
        for name, path in _CONFIG_PATHS.items():
            if name not in explicit:
                value = dsc.get_value(config, path)
                if value is not None:
                    setattr(self, name, value)
        stage = dsc.get_value(config, "zero_optimization.stage", 0)
        self.zero_stage = 0 if stage == dsc.AUTO else stage

    # ------------------------------------------------------------------------- Accelerate API

    def get_value(self, ds_key_long: str, default=None):
        """The config value at a dotted key path, or ``default``."""
        return dsc.get_value(self.deepspeed_config, ds_key_long, default)

    def is_auto(self, ds_key_long: str) -> bool:
        """True when the key is ``"auto"``."""
        return self.get_value(ds_key_long) == dsc.AUTO

    def fill_match(self, ds_key_long: str, mismatches: list | None = None, must_match: bool = True, **kwargs) -> None:
        """Fill the key from ``kwargs[ds_key_long]`` when it is ``"auto"``; record a mismatch when it differs.

        Mismatches are appended to ``mismatches`` as text (when a list is given); nothing is raised.
        """
        if ds_key_long not in kwargs:
            return
        value = self.get_value(ds_key_long)
        if value is None:
            return
        if value == dsc.AUTO:
            dsc.set_value(self.deepspeed_config, ds_key_long, kwargs[ds_key_long])
        elif must_match and mismatches is not None and not dsc.values_equal(value, kwargs[ds_key_long]):
            mismatches.append(f"{ds_key_long}: {value!r} in {self.config_name}, but {kwargs[ds_key_long]!r} from the script")

    def deepspeed_config_process(self, prefix: str = "", mismatches: list | None = None, config: dict | None = None, must_match: bool = True, **kwargs) -> None:
        """Fill every ``"auto"`` key named in ``kwargs`` (dotted paths); raise one error listing all mismatches."""
        top = mismatches is None
        mismatches = [] if top else mismatches
        config = self.deepspeed_config if config is None else config
        for key, value in config.items():
            if isinstance(value, dict):
                self.deepspeed_config_process(f"{prefix}{key}.", mismatches, value, must_match, **kwargs)
            else:
                self.fill_match(f"{prefix}{key}", mismatches, must_match, **kwargs)
        if top and mismatches:
            raise ConfigError("The DeepSpeed config and the training script disagree:\n" + "\n".join(f"  - {m}" for m in mismatches) + "\nMake them agree, or set the values to \"auto\".")

    def set_mixed_precision(self, mixed_precision: str) -> None:
        """Fill ``fp16``/``bf16`` from the Accelerator's mixed precision; a contradiction is an error."""
        if mixed_precision == "fp8":
            raise NotSupportedError("mixed_precision='fp8' with DeepSpeed is not supported by hasten; use 'bf16'.")
        config = self.deepspeed_config
        for kind, other in (("fp16", "bf16"), ("bf16", "fp16")):
            if mixed_precision == kind and dsc.get_value(config, f"{other}.enabled") is True:
                raise ConfigError(
                    f"mixed_precision={kind!r} but {self.config_name} enables {other} ({other}.enabled: true). "
                    f"Make them agree: set {other}.enabled to false or \"auto\", or use mixed_precision={other!r}."
                )
            if mixed_precision == kind and kind not in config:
                config[kind] = {"enabled": True, **({"auto_cast": True} if kind == "fp16" else {})}
        for kind in ("fp16", "bf16"):
            if self.is_auto(f"{kind}.enabled"):
                dsc.set_value(config, f"{kind}.enabled", mixed_precision == kind)

    @property
    def config_mixed_precision(self) -> str:
        """The precision the config trains in: ``"fp16"``, ``"bf16"`` or ``"no"``."""
        for kind in ("fp16", "bf16"):
            if self.get_value(f"{kind}.enabled") is True:
                return kind
        return "bf16" if self.get_value("bfloat16.enabled") is True else "no"

    def is_zero3_init_enabled(self) -> bool:
        """True when models are built partitioned (``zero3_init_flag`` with ZeRO stage 3)."""
        return bool(self.zero3_init_flag) and self.zero_stage == 3

    @contextlib.contextmanager
    def zero3_init_context_manager(self, enable: bool = False):
        """Context manager turning partitioned model construction on or off for its block.

        With ``enable=True`` under ZeRO-3, modules built in the block are partitioned at construction
        (``deepspeed.zero.Init``) and Transformers' ``from_pretrained`` does the same; with
        ``enable=False`` models are built whole (e.g. a frozen teacher model). Accelerate's version
        only toggles Transformers; hasten also partitions plain ``torch.nn.Module`` models.
        """
        previous = self.zero3_init_flag
        self.zero3_init_flag = enable
        self._set_transformers_view(self.is_zero3_init_enabled())
        try:
            if self.is_zero3_init_enabled():
                import deepspeed

                config = dsc.config_for_zero_init(self.deepspeed_config, self.config_mixed_precision)
                with deepspeed.zero.Init(config_dict_or_path=config):
                    yield
            else:
                yield
        finally:
            self.zero3_init_flag = previous
            self._set_transformers_view(self.is_zero3_init_enabled())

    def _set_transformers_view(self, enabled: bool) -> None:
        if enabled:
            self._dschf = HfDeepSpeedConfig._unregistered(dsc.config_for_zero_init(self.deepspeed_config, self.config_mixed_precision))
            _register_with_transformers(self._dschf)
        elif self._dschf is not None:
            self._dschf = None
            _register_with_transformers(None)

    def set_deepspeed_weakref(self) -> None:
        """Point Transformers at this plugin's config, so that ``from_pretrained`` builds the model partitioned when
        ZeRO-3 init is on (Accelerate's name; :meth:`select` does it too)."""
        self._set_transformers_view(self.is_zero3_init_enabled())

    def select(self, _from_accelerator_state: bool = False) -> None:
        """Make this plugin the active one (hasten runs one DeepSpeed plugin per Accelerator)."""
        self.selected = True
        self._set_transformers_view(self.is_zero3_init_enabled())

    def set_moe_leaf_modules(self, model) -> None:
        """Mark the ``transformer_moe_cls_names`` classes in ``model`` as ZeRO-3 leaf modules (gathered whole)."""
        if not self.transformer_moe_cls_names:
            return
        names = {n.strip() for n in str(self.transformer_moe_cls_names).split(",") if n.strip()}
        classes = {type(m) for m in model.modules() if type(m).__name__ in names}
        missing = names - {c.__name__ for c in classes}
        if missing:
            raise ConfigError(f"transformer_moe_cls_names lists {sorted(missing)}, which are not layer classes of this model.")
        from deepspeed.utils import set_z3_leaf_modules

        set_z3_leaf_modules(model, sorted(classes, key=lambda c: c.__name__))


_VARIABLES = {"gradient_accumulation_steps": "GRADIENT_ACCUMULATION_STEPS", "gradient_clipping": "GRADIENT_CLIPPING", "zero_stage": "DEEPSPEED_ZERO_STAGE", **_STR_FIELDS, **_BOOL_FIELDS}


def _parse_field(name: str, value, where: str):
    """Check and convert one plugin field (from an argument or an environment variable)."""
    text = value.strip() if isinstance(value, str) else value
    try:
        if name in _BOOL_FIELDS:
            return value if isinstance(value, bool) else bool(environment.str_to_bool(text))
        if name == "zero_stage":
            stage = int(text)
            if stage not in (0, 1, 2, 3):
                raise ValueError
            return stage
        if name == "gradient_accumulation_steps":
            if text == dsc.AUTO:
                return text
            steps = int(text)
            if steps < 1:
                raise ValueError
            return steps
        if name == "gradient_clipping":
            return text if text == dsc.AUTO else float(text)
    except (ValueError, TypeError, ConfigError):
        expected = {"zero_stage": "0, 1, 2 or 3", "gradient_accumulation_steps": "a positive integer or 'auto'", "gradient_clipping": "a number or 'auto'"}
        raise ConfigError(f"{where}: expected {expected.get(name, 'true or false')}.") from None
    if name.endswith("_device") and text not in dsc.OFFLOAD_DEVICES:
        raise ConfigError(f"{where}: expected one of {list(dsc.OFFLOAD_DEVICES)}.")
    return text


class DummyOptim(torch.optim.Optimizer):
    """Stands for the optimizer defined in the DeepSpeed config's ``optimizer`` section.

    Pass it to ``prepare`` instead of a torch optimizer; its values fill the section's ``"auto"`` params,
    and ``prepare`` returns the engine's optimizer in its place.

    Args:
        params: the model's parameters (or parameter groups).
        lr: learning rate.
        weight_decay: weight decay.
        **kwargs: other optimizer params (``betas``, ``eps``, ...).
    """

    def __init__(self, params, lr: float = 0.001, weight_decay: float = 0, **kwargs):
        super().__init__(params, {"lr": lr, "weight_decay": weight_decay, **kwargs})
        self.lr = lr
        self.weight_decay = weight_decay
        self.kwargs = kwargs

    @property
    def params(self) -> list[dict]:
        """The parameter groups, without the values the config's optimizer sets (for ``deepspeed.initialize``)."""
        return [{k: v for k, v in group.items() if k not in self.defaults or v != self.defaults[k]} for group in self.param_groups]

    def step(self, closure=None):
        """Refuses to run: the DeepSpeed engine replaces this optimizer at ``prepare``."""
        raise ConfigError("DummyOptim cannot step: pass it to accelerator.prepare() and use the optimizer prepare() returns.")


class DummyScheduler:
    """Stands for the scheduler defined in the DeepSpeed config's ``scheduler`` section.

    Args:
        optimizer: the ``DummyOptim`` (or optimizer) it schedules.
        total_num_steps: optimizer steps of the whole run (fills ``total_num_steps``).
        warmup_num_steps: warm-up steps (fills ``warmup_num_steps``).
        lr_scheduler_callable: ``callable(optimizer) -> scheduler`` building the scheduler instead of the config.
        **kwargs: other scheduler params.
    """

    def __init__(self, optimizer, total_num_steps: int | None = None, warmup_num_steps: int = 0, lr_scheduler_callable: Callable | None = None, **kwargs):
        self.optimizer = optimizer
        self.total_num_steps = total_num_steps
        self.warmup_num_steps = warmup_num_steps
        self.lr_scheduler_callable = lr_scheduler_callable
        self.kwargs = kwargs

    def step(self, *args, **kwargs) -> None:
        """Refuses to run: the DeepSpeed engine replaces this scheduler at ``prepare``."""
        raise ConfigError("DummyScheduler cannot step: pass it to accelerator.prepare() and use the scheduler prepare() returns.")

    def get_last_lr(self) -> list[float]:
        """The learning rates of the optimizer's groups."""
        return [group["lr"] for group in self.optimizer.param_groups]


def get_active_deepspeed_plugin(state) -> DeepSpeedPlugin:
    """The DeepSpeed plugin of ``state`` (an ``AcceleratorState``); an error when DeepSpeed is not in use."""
    plugin = getattr(state, "deepspeed_plugin", None)
    if plugin is None:
        raise ConfigError("DeepSpeed is not in use: pass Accelerator(deepspeed_plugin=DeepSpeedPlugin(...)) or launch with --use_deepspeed.")
    return plugin


def map_pytorch_optim_to_deepspeed(optimizer):
    """Replace a torch Adam/AdamW/Adagrad by DeepSpeed's CPU implementation (needed for optimizer offload).

    The new optimizer has the same parameter groups and hyperparameters; other optimizers are returned
    unchanged (DeepSpeed then needs ``"zero_force_ds_cpu_optimizer": false`` to offload them).
    """
    from deepspeed.ops.adam import DeepSpeedCPUAdam
    from deepspeed.ops.adagrad import DeepSpeedCPUAdagrad

    groups = [copy.copy(group) for group in optimizer.param_groups]
    if isinstance(optimizer, torch.optim.AdamW) or (isinstance(optimizer, torch.optim.Adam) and optimizer.defaults.get("decoupled_weight_decay")):
        return DeepSpeedCPUAdam(groups, lr=optimizer.defaults["lr"], adamw_mode=True)
    if isinstance(optimizer, torch.optim.Adam):
        return DeepSpeedCPUAdam(groups, lr=optimizer.defaults["lr"], adamw_mode=False)
    if isinstance(optimizer, torch.optim.Adagrad):
        return DeepSpeedCPUAdagrad(groups, lr=optimizer.defaults["lr"])
    return optimizer
