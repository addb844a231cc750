"""The ``dynamo_config`` table: the ``torch.compile`` settings. Each row's ``field`` is the
``TorchDynamoPlugin`` field it fills."""

from __future__ import annotations

from ..enums import DynamoBackend
from . import Question, Section, Setting
from .launch import RESOURCES

DYNAMO_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
_CUSTOM = "custom"

DYNAMO = Section(
    name="dynamo_config",
    class_name="DynamoSection",
    doc="``dynamo_config``: torch.compile settings.",
    group=RESOURCES,
    rows=(
        Setting(
            "dynamo_backend",
            "choice",
            tuple(DynamoBackend.list()),
            env_help="torch.compile backend (no, eager, inductor, ...)",
            flag_help="torch.compile backend (no, eager, aot_eager, inductor, ...).",
            lower=True,
            field="backend",
            fallback="no",
            question=Question(
                "Which dynamo backend would you like to use?",
                "INDUCTOR",
                options=tuple(b for b in DynamoBackend.list() if b != "NO"),
            ),
        ),
        Setting(
            "dynamo_mode",
            "choice",
            DYNAMO_MODES,
            env_help="torch.compile mode",
            flag_help="torch.compile mode.",
            lower=True,
            field="mode",
            fallback="default",
            flag_default="default",
            question=Question("Which mode do you want to use?", "default", step=1, stage=_CUSTOM),
        ),
        Setting(
            "dynamo_use_fullgraph",
            "bool",
            env_help="torch.compile fullgraph",
            flag_help="torch.compile with fullgraph=True.",
            switch=True,
            flag_default=False,
            field="fullgraph",
            fallback=False,
            question=Question(
                "Do you want the fullgraph mode or it is ok to break model into several subgraphs?",
                step=2,
                stage=_CUSTOM,
            ),
        ),
        Setting(
            "dynamo_use_dynamic",
            "bool",
            env_help="torch.compile dynamic",
            flag_help="torch.compile with dynamic=True.",
            switch=True,
            flag_default=False,
            field="dynamic",
            question=Question("Do you want to enable dynamic shape tracing?", step=3, stage=_CUSTOM),
        ),
        Setting(
            "dynamo_use_regional_compilation",
            "bool",
            env_help="compile repeated blocks one at a time",
            flag_help="Compile repeated blocks one at a time.",
            switch=True,
            flag_default=False,
            field="use_regional_compilation",
            fallback=False,
            question=Question(
                "Do you want to compile repeated blocks one at a time (regional compilation)?", step=4, stage=_CUSTOM
            ),
        ),
    ),
)
