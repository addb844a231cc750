"""The fp8 recipes passed in ``Accelerator(mixed_precision="fp8", kwargs_handlers=[...])``.

hasten trains in fp8 through torchao's float8 training (``AORecipeKwargs``; :mod:`hasten.runtime.float8` does the
conversion). ``FP8RecipeKwargs`` is Accelerate's older, deprecated recipe: hasten accepts it when it names the
``"AO"`` backend and refuses Transformer Engine and MS-AMP, which it does not support.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Callable

from .. import environment
from ..errors import ConfigError, MissingDependencyError, require
from ..settings.fp8 import FP8, FP8_BACKENDS, unsupported_backend
from .kwargs import KwargsHandler

TORCHAO_MINIMUM = "0.14.0"
"""The oldest torchao hasten's fp8 path is written for (``Float8LinearConfig.emulate``, module filters, FSDP2 hooks)."""

_TE_FIELDS = (
    "use_autocast_during_eval",
    "margin",
    "interval",
    "fp8_format",
    "amax_history_len",
    "amax_compute_algo",
    "override_linear_precision",
    "use_mxfp8_block_scaling",
)


def require_torchao(feature: str) -> None:
    """Raise :class:`~hasten.errors.MissingDependencyError` unless torchao, at least :data:`TORCHAO_MINIMUM`, is
    installed."""
    require("torchao", feature, "fp8")
    from importlib.metadata import version

    from packaging.version import Version

    found = version("torchao")
    if Version(found) < Version(TORCHAO_MINIMUM):
        raise MissingDependencyError(
            f"{feature} needs torchao >= {TORCHAO_MINIMUM}; torchao {found} is installed. "
            "Upgrade it: pip install 'hasten[fp8]'"
        )


@dataclass
class AORecipeKwargs(KwargsHandler):
    """torchao float8 training settings for ``mixed_precision="fp8"``.

    Args:
        config: a ``torchao.float8.Float8LinearConfig``. None builds one from the two fields below; pass your own
            for other recipes (e.g. ``Float8LinearConfig(emulate=True)`` runs the float8 casts in high precision on
            any device, for tests, or ``Float8LinearConfig.from_recipe_name("rowwise")``).
        module_filter_func: ``(module, fqn) -> bool``, which linear layers become float8 ones. None: every
            ``nn.Linear`` except the model's first and last ones and those whose sizes are not multiples of 16
            (as Accelerate).
        pad_inner_dim: pad matmul dimensions to multiples of 16 (used when ``config`` is None; default:
            ``HASTEN_FP8_PAD_INNER_DIM`` / ``fp8_config.pad_inner_dim``, else True).
        enable_fsdp_float8_all_gather: under FSDP, all-gather the float8 layers' weights in float8, half the bytes
            of bf16 (used when ``config`` is None; default: ``HASTEN_FP8_ENABLE_FSDP_FLOAT8_ALL_GATHER`` /
            ``fp8_config.enable_fsdp_float8_all_gather``, else True). It applies only to models FSDP shards.

    Raises:
        MissingDependencyError: torchao is not installed (an ``ImportError``, as in Accelerate).
    """

    config: Any = None
    module_filter_func: Callable | None = None
    pad_inner_dim: bool | None = None
    enable_fsdp_float8_all_gather: bool | None = None

    def __post_init__(self):
        require_torchao("AORecipeKwargs (fp8 training through torchao)")
        if self.config is None:
            from torchao.float8 import Float8LinearConfig

            environment.fill_unset(self, FP8.rows, fields=("pad_inner_dim", "enable_fsdp_float8_all_gather"))
            self.config = Float8LinearConfig(
                pad_inner_dim=self.pad_inner_dim, enable_fsdp_float8_all_gather=self.enable_fsdp_float8_all_gather
            )


@dataclass
class FP8RecipeKwargs(KwargsHandler):
    """Accelerate's deprecated fp8 recipe (it warns with ``FutureWarning``, as Accelerate does), with Accelerate
    1.15's fields.

    hasten trains fp8 through torchao only: ``backend`` (default ``HASTEN_FP8_BACKEND`` / ``fp8_config.backend``,
    else ``"AO"``; Accelerate defaults to Transformer Engine) must be ``"AO"``, and the Transformer Engine / MS-AMP
    fields must stay unset. Equivalent to ``AORecipeKwargs()``; use that instead.

    Raises:
        NotSupportedError: ``backend`` is ``"TE"`` or ``"MSAMP"``.
        ConfigError: an unknown backend, or a Transformer Engine / MS-AMP field given with ``"AO"``.
    """

    opt_level: str | None = None
    use_autocast_during_eval: bool | None = None
    margin: int | None = None
    interval: int | None = None
    fp8_format: str | None = None
    amax_history_len: int | None = None
    amax_compute_algo: str | None = None
    override_linear_precision: tuple | None = None
    use_mxfp8_block_scaling: bool | None = None
    backend: str | None = None

    def __post_init__(self):
        warnings.warn(
            "FP8RecipeKwargs is deprecated (Accelerate removes it in 2.0); pass AORecipeKwargs() for fp8 training.",
            FutureWarning,
            stacklevel=3,
        )
        row = FP8.by_field("backend")
        where = "FP8RecipeKwargs(backend=...)" if self.backend is not None else f"{row.variable} ({FP8.path(row)})"
        environment.fill_unset(self, FP8.rows, fields=("backend",))
        self.backend = str(self.backend).upper()
        if self.backend not in FP8_BACKENDS:
            raise ConfigError(
                f"{where}: backend {self.backend!r} is not one of {list(FP8_BACKENDS)}; hasten supports 'AO' (torchao)."
            )
        if self.backend != "AO":
            raise unsupported_backend(self.backend, where)
        given = [name for name in ("opt_level", *_TE_FIELDS) if getattr(self, name) is not None]
        if given:
            raise ConfigError(
                f"FP8RecipeKwargs({given[0]}=...) is a Transformer Engine / MS-AMP setting, but the backend is 'AO' "
                "(torchao), which scales float8 tensors dynamically and has no such setting. Remove it, or pass "
                "AORecipeKwargs(config=...)."
            )
