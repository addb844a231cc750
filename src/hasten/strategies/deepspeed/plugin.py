"""``DeepSpeedPlugin``: the settings of the DeepSpeed engine, and their validation.

A plugin holds one DeepSpeed config: the user's JSON file or dict (``hf_ds_config``), or one built
from the plugin's fields. Fields left as None take their value from the launch settings
(``HASTEN_DEEPSPEED_*`` variables written by ``hasten launch`` from its flags or config file), then
from the defaults. A field given explicitly (argument or variable) that contradicts the file is an
error naming both values. ``"auto"`` values are filled at ``prepare`` (see :func:`.config.fill`). Accelerate's
methods (``fill_match``, ``set_mixed_precision``, ...) are kept and call the config code in :mod:`.config`
and :mod:`.zero3`.

Importing this module does not import ``deepspeed``.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

from ... import environment
from ...errors import ConfigError, NotSupportedError, require
from ...settings.deepspeed import DEEPSPEED
from . import config as dsc
from . import zero3

# plugin field -> its deepspeed_config row (variable, kind, default when neither argument nor variable sets it)
_ROWS = {row.field: row for row in DEEPSPEED.rows if row.field}
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
        transformer_moe_cls_names: comma-separated mixture-of-experts layer class names, kept whole (ZeRO-3 leaf
            modules).
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
            raise NotSupportedError(
                "DeepSpeedPlugin(enable_msamp=True): MS-AMP fp8 is not supported by hasten; train with "
                "mixed_precision='bf16'."
            )
        explicit = self._read_settings()
        source = self.hf_ds_config if self.hf_ds_config is not None else environment.get_str("DEEPSPEED_CONFIG_FILE")
        # An HfDeepSpeedConfig passed in is kept, its config completed in place, as Accelerate does: Transformers'
        # Trainer passes its own (HfTrainerDeepSpeedConfig), later fills the config's "auto" values through it
        # (trainer_config_finalize) and expects prepare to see them.
        given = source if isinstance(source, zero3.HfDeepSpeedConfig) else None
        if source is None:
            self.config_name = "the DeepSpeed config built from DeepSpeedPlugin"
            config = self._build_config()
        else:
            if given is not None:
                config, self.config_name = given.config, f"the DeepSpeed config of the {type(given).__name__} given"
            else:
                config, self.config_name = dsc.load_config(source)
            dsc.validate_config(config, self.config_name)
            paths = tuple(_CONFIG_PATHS[name] for name in explicit if name in _CONFIG_PATHS)
            dsc.fill(
                config,
                {_CONFIG_PATHS[n]: s for n, s in explicit.items() if n in _CONFIG_PATHS},
                self.config_name,
                must_match=paths,
                add_missing=paths,
            )
            self._adopt_file_values(config, explicit)
        dsc.validate_config(config, self.config_name)
        self.deepspeed_config = config
        if given is not None:
            given.set_stage_and_offload()
            self.hf_ds_config = given
        else:
            self.hf_ds_config = zero3.HfDeepSpeedConfig._unregistered(config)
        self.explicit_fields = explicit
        self._dschf = None
        self.selected = False
        if self.zero3_init_flag and self.zero_stage != 3:
            raise ConfigError(
                f"zero3_init_flag is set but the ZeRO stage is {self.zero_stage}; building models partitioned needs "
                "stage 3. Set zero_stage=3 or drop zero3_init_flag."
            )
        self._set_transformers_view(self.is_zero3_init_enabled())

    def _read_settings(self) -> dict[str, dsc.Setting]:
        """Fill unset fields from the launch settings, then defaults; return the explicit ones with their source."""
        explicit = {}
        for name, row in _ROWS.items():
            value = getattr(self, name)
            if value is not None:
                explicit[name] = dsc.Setting(
                    _parse_field(name, value, f"DeepSpeedPlugin({name}={value!r})"),
                    f"DeepSpeedPlugin({name}={value!r})",
                )
                setattr(self, name, explicit[name].value)
                continue
            variable = row.env_name
            if environment.setting_source(variable) is not None and environment.get_str(variable) not in ("", None):
                raw = environment.get_str(variable)
                where = f"{environment.setting_source(variable)}={raw}"
                explicit[name] = dsc.Setting(_parse_field(name, raw, where), where)
                setattr(self, name, explicit[name].value)
            elif row.fallback is not None:
                setattr(self, name, row.fallback)
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
            "gradient_clipping": self.gradient_clipping,
        }
        # DeepSpeed clips at 1.0 unless told otherwise; DDP does not clip, so neither does a plugin not asked to.
        no_clipping = dsc.Setting(0.0, "DeepSpeedPlugin without gradient_clipping (no clipping, as DDP)", default=True)
        dsc.fill(config, {"gradient_clipping": no_clipping}, self.config_name, add_missing=("gradient_clipping",))
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
        if ds_key_long in kwargs:
            values = {ds_key_long: kwargs[ds_key_long]}
            dsc.fill_from_script(
                self.deepspeed_config, self.config_name, values, must_match, [] if mismatches is None else mismatches
            )

    def deepspeed_config_process(
        self,
        prefix: str = "",
        mismatches: list | None = None,
        config: dict | None = None,
        must_match: bool = True,
        **kwargs,
    ) -> None:
        """Fill every ``"auto"`` key named in ``kwargs`` (dotted paths); raise one error listing all mismatches."""
        paths = [f"{prefix}{path}" for path in dsc.leaf_paths(self.deepspeed_config if config is None else config)]
        values = {path: kwargs[path] for path in paths if path in kwargs}
        dsc.fill_from_script(self.deepspeed_config, self.config_name, values, must_match, mismatches)

    def set_mixed_precision(self, mixed_precision: str) -> None:
        """Fill ``fp16``/``bf16`` from the Accelerator's mixed precision; a contradiction is an error."""
        dsc.apply_mixed_precision(self.deepspeed_config, mixed_precision, self.config_name)

    @property
    def config_mixed_precision(self) -> str:
        """The precision the config trains in: ``"fp16"``, ``"bf16"`` or ``"no"``."""
        return dsc.mixed_precision_of(self.deepspeed_config)

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
            with (
                zero3.partitioned_construction(self.deepspeed_config, self.config_mixed_precision)
                if self.is_zero3_init_enabled()
                else contextlib.nullcontext()
            ):
                yield
        finally:
            self.zero3_init_flag = previous
            self._set_transformers_view(self.is_zero3_init_enabled())

    def _set_transformers_view(self, enabled: bool) -> None:
        if enabled:
            self._dschf = zero3.HfDeepSpeedConfig._unregistered(
                dsc.config_for_zero_init(self.deepspeed_config, self.config_mixed_precision)
            )
            zero3.register_with_transformers(self._dschf)
        elif self._dschf is not None:
            self._dschf = None
            zero3.register_with_transformers(None)

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
        zero3.set_moe_leaf_modules(model, self.transformer_moe_cls_names)


def _parse_field(name: str, value, where: str):
    """Check and convert one plugin field (from an argument or an environment variable)."""
    text = value.strip() if isinstance(value, str) else value
    try:
        if _ROWS[name].kind == "bool":
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
        expected = {
            "zero_stage": "0, 1, 2 or 3",
            "gradient_accumulation_steps": "a positive integer or 'auto'",
            "gradient_clipping": "a number or 'auto'",
        }
        raise ConfigError(f"{where}: expected {expected.get(name, 'true or false')}.") from None
    if name.endswith("_device") and text not in dsc.OFFLOAD_DEVICES:
        raise ConfigError(f"{where}: expected one of {list(dsc.OFFLOAD_DEVICES)}.")
    return text


def get_active_deepspeed_plugin(state) -> DeepSpeedPlugin:
    """The DeepSpeed plugin of ``state`` (an ``AcceleratorState``); an error when DeepSpeed is not in use."""
    plugin = getattr(state, "deepspeed_plugin", None)
    if plugin is None:
        raise ConfigError(
            "DeepSpeed is not in use: pass Accelerator(deepspeed_plugin=DeepSpeedPlugin(...)) or launch with "
            "--use_deepspeed."
        )
    return plugin
