"""ZeRO-3 model construction: the config view Transformers reads, partitioned construction, MoE leaf modules.

Nothing here imports ``deepspeed`` or ``transformers`` at module level.
"""

from __future__ import annotations

import contextlib
import importlib.util

from ...errors import ConfigError
from . import config as dsc


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
        register_with_transformers(self)

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
        return any(
            self.get_value(f"zero_optimization.{part}.device", "none") in ("cpu", "nvme")
            for part in ("offload_optimizer", "offload_param")
        )


def register_with_transformers(view: HfDeepSpeedConfig | None) -> None:
    """Point Transformers' ``is_deepspeed_zero3_enabled()`` at ``view`` (None: forget it)."""
    if importlib.util.find_spec("transformers") is None:
        return
    from transformers.integrations import deepspeed as hf_deepspeed

    if view is None:
        hf_deepspeed.unset_hf_deepspeed_config()
    else:
        hf_deepspeed.set_hf_deepspeed_config(view)


@contextlib.contextmanager
def partitioned_construction(config: dict, mixed_precision: str):
    """Modules built inside the block are partitioned at construction (``deepspeed.zero.Init`` with ``config``)."""
    import deepspeed

    with deepspeed.zero.Init(config_dict_or_path=dsc.config_for_zero_init(config, mixed_precision)):
        yield


def set_moe_leaf_modules(model, class_names: str | None) -> None:
    """Mark the classes of ``model`` named in ``class_names`` (comma-separated) as ZeRO-3 leaf modules (gathered
    whole)."""
    if not class_names:
        return
    names = {n.strip() for n in str(class_names).split(",") if n.strip()}
    classes = {type(m) for m in model.modules() if type(m).__name__ in names}
    missing = names - {c.__name__ for c in classes}
    if missing:
        raise ConfigError(
            f"transformer_moe_cls_names lists {sorted(missing)}, which are not layer classes of this model."
        )
    from deepspeed.utils import set_z3_leaf_modules

    set_z3_leaf_modules(model, sorted(classes, key=lambda c: c.__name__))
