"""``TorchDynamoPlugin``: the ``torch.compile`` settings of an Accelerator.

Built from its arguments, else from the ``HASTEN_DYNAMO_*`` settings (``ACCELERATE_DYNAMO_*`` accepted),
which ``hasten launch`` sets from ``--dynamo_backend`` and the config file's ``dynamo_config`` block.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .. import environment
from ..enums import DynamoBackend
from ..errors import ConfigError, did_you_mean
from ..settings.dynamo import DYNAMO, DYNAMO_MODES
from .kwargs import KwargsHandler

_DEFAULTS = {
    "backend": "no",
    "mode": "default",
    "fullgraph": False,
    "dynamic": None,
    "options": None,
    "disable": False,
    "use_regional_compilation": False,
}


@dataclass
class TorchDynamoPlugin(KwargsHandler):
    """How ``prepare`` compiles models with ``torch.compile``.

    Args:
        backend: a :class:`~hasten.utils.DynamoBackend` or its name, any case (``"inductor"``,
            ``"eager"``, ``"aot_eager"``, ...); ``"no"`` (the default) compiles nothing. Default:
            ``HASTEN_DYNAMO_BACKEND``.
        mode: ``"default"``, ``"reduce-overhead"``, ``"max-autotune"`` or
            ``"max-autotune-no-cudagraphs"``. Default: ``HASTEN_DYNAMO_MODE`` or ``"default"``.
        fullgraph: fail instead of breaking the graph. Default: ``HASTEN_DYNAMO_USE_FULLGRAPH`` or False.
        dynamic: compile for dynamic shapes (True), static shapes (False), or let torch decide on the
            first recompilation (None). Default: ``HASTEN_DYNAMO_USE_DYNAMIC`` or None.
        options: backend options (a dict passed to ``torch.compile``); cannot be combined with a ``mode``
            other than ``"default"``.
        disable: turn compilation off while keeping the other settings.
        use_regional_compilation: compile the model by region, in place, instead of as a whole: each repeated
            block (the items of an ``nn.ModuleList`` of one class) on its own, and every other part on the way to
            them (embeddings, final norm, head) whole, as Accelerate does; identical blocks share one graph, so
            compiling is much faster, at the same speed for models made of identical blocks. Default:
            ``HASTEN_DYNAMO_USE_REGIONAL_COMPILATION`` or False.
    """

    backend: DynamoBackend | str | None = None
    mode: str | None = None
    fullgraph: bool | None = None
    dynamic: bool | None = None
    options: Any = None
    disable: bool = False
    use_regional_compilation: bool | None = None

    def __post_init__(self):
        environment.fill_unset(self, DYNAMO.rows)
        self.backend = _backend(self.backend)
        if self.mode not in DYNAMO_MODES:
            raise ConfigError(
                f"TorchDynamoPlugin: mode={self.mode!r} is not a torch.compile mode; choose one of "
                f"{list(DYNAMO_MODES)}.{did_you_mean(str(self.mode), DYNAMO_MODES)}"
            )
        if self.options is not None and self.mode != "default":
            raise ConfigError(
                f"TorchDynamoPlugin: torch.compile takes either a mode or options, got mode={self.mode!r} and "
                f"options={self.options!r}. Drop one of them (mode='default' with options is fine)."
            )

    @property
    def enabled(self) -> bool:
        """True when ``prepare`` compiles models (a backend other than ``"no"`` and not disabled)."""
        return self.backend != DynamoBackend.NO and not self.disable

    def to_dict(self) -> dict[str, Any]:
        """All fields, with the backend as the lowercase name ``torch.compile`` takes."""
        data = super().to_dict()
        data["backend"] = self.backend.value.lower()
        return data

    def to_kwargs(self) -> dict[str, Any]:
        """The ``torch.compile`` arguments whose value differs from the defaults (the defaults of the class, not of the
        environment), as Accelerate's: ``use_regional_compilation`` is not one of them."""
        return {k: v for k, v in self.to_dict().items() if k != "use_regional_compilation" and _DEFAULTS[k] != v}

    def compile_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of ``torch.compile`` (``backend``, ``fullgraph``, ``dynamic``, and ``mode`` or
        ``options``)."""
        kwargs: dict[str, Any] = {
            "backend": self.backend.value.lower(),
            "fullgraph": bool(self.fullgraph),
            "dynamic": self.dynamic,
        }
        if self.options is not None:
            kwargs["options"] = self.options
        else:
            kwargs["mode"] = self.mode
        return kwargs


def _backend(value) -> DynamoBackend:
    if isinstance(value, DynamoBackend):
        return value
    text = str(value).upper()
    if text not in DynamoBackend.list():
        names = [name.lower() for name in DynamoBackend.list()]
        raise ConfigError(
            f"TorchDynamoPlugin: backend={value!r} is not a known torch.compile backend; choose one of "
            f"{names}.{did_you_mean(str(value).lower(), names)}"
        )
    return DynamoBackend(text)


def build_dynamo_plugin(dynamo_backend=None, dynamo_plugin: TorchDynamoPlugin | None = None) -> TorchDynamoPlugin:
    """The plugin for ``Accelerator(dynamo_backend=..., dynamo_plugin=...)``.

    ``dynamo_plugin`` is used as given; ``dynamo_backend`` builds one with that backend (the other
    settings from the environment); with neither, everything comes from the environment. Passing both
    is a :class:`~hasten.errors.ConfigError`.
    """
    if dynamo_plugin is not None and dynamo_backend is not None:
        raise ConfigError(
            "Accelerator: pass either dynamo_backend or dynamo_plugin, not both (set the backend in "
            "TorchDynamoPlugin(backend=...))."
        )
    if dynamo_plugin is not None:
        if not isinstance(dynamo_plugin, TorchDynamoPlugin):
            raise ConfigError(
                f"Accelerator: dynamo_plugin must be a TorchDynamoPlugin, got {type(dynamo_plugin).__name__}."
            )
        return dynamo_plugin
    return TorchDynamoPlugin(backend=dynamo_backend)
