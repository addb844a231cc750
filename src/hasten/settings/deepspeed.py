"""The ``deepspeed_config`` table: DeepSpeed settings (a JSON file, or the ZeRO settings one by one).

``hasten config`` asks the questions of stage ``file`` (a JSON file) or of stages ``zero``, ``clipping``
(after a yes to gradient clipping) and ``zero3``, then of stage ``init``.
"""

from __future__ import annotations

from . import Question, Section, Setting
from .values import AUTO, float_or_auto  # AUTO: DeepSpeed's "fill this from the script" value

_ZERO = "zero"
_STAGE_2_OR_3 = ("zero_stage", (2, 3))

OFFLOAD_DEVICES = ("none", "cpu", "nvme")
DEEPSPEED_MULTINODE_LAUNCHERS = ("pdsh", "standard", "openmpi", "mvapich", "mpich", "nossh", "slurm")

# Gradient accumulation applies under every engine: the accumulation plugin of every Accelerator reads this row's
# variable (hasten.plugins.training.resolve_accumulation), and hasten launch exports it whatever the distributed type.
# Accelerate keeps its key in deepspeed_config and its flag among DeepSpeed's options, so the row is this table's; its
# field fills DeepSpeedPlugin.gradient_accumulation_steps ("auto": the Accelerator's steps).
GRADIENT_ACCUMULATION_STEPS = Setting(
    "gradient_accumulation_steps",
    "int",
    env_help="default gradient accumulation steps",
    flag_help="Gradient accumulation steps.",
    field="gradient_accumulation_steps",
    fallback=AUTO,
    always_export=True,
    question=Question("How many gradient accumulation steps you're passing in your script?", 1, step=5, stage=_ZERO),
)

DEEPSPEED = Section(
    name="deepspeed_config",
    class_name="DeepSpeedSection",
    doc="``deepspeed_config``: DeepSpeed settings (a JSON file, or the ZeRO settings one by one).",
    group="DeepSpeed arguments",
    only_with="DEEPSPEED",
    rows=(
        Setting(
            "deepspeed_config_file",
            env_help="DeepSpeed JSON config file",
            flag_help="DeepSpeed JSON config file.",
            question=Question(
                "Please enter the path to the json DeepSpeed config file", None, stage="file", must_exist=True
            ),
        ),
        Setting(
            "zero_stage",
            "choice",
            (0, 1, 2, 3),
            env="DEEPSPEED_ZERO_STAGE",
            env_help="DeepSpeed ZeRO stage",
            flag_help="ZeRO stage.",
            flag_type=int,
            field="zero_stage",
            fallback=2,
            question=Question("What should be your DeepSpeed's ZeRO optimization stage?", 2, stage=_ZERO),
        ),
        Setting(
            "offload_optimizer_device",
            "choice",
            OFFLOAD_DEVICES,
            env="DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE",
            env_help="none, cpu or nvme",
            flag_help="Offload optimizer states to.",
            field="offload_optimizer_device",
            fallback="none",
            question=Question("Where to offload optimizer states?", "none", step=1, stage=_ZERO, when=_STAGE_2_OR_3),
        ),
        Setting(
            "offload_param_device",
            "choice",
            OFFLOAD_DEVICES,
            env="DEEPSPEED_OFFLOAD_PARAM_DEVICE",
            env_help="none, cpu or nvme",
            flag_help="Offload parameters to.",
            field="offload_param_device",
            fallback="none",
            question=Question("Where to offload parameters?", "none", step=2, stage=_ZERO, when=_STAGE_2_OR_3),
        ),
        Setting(
            "offload_optimizer_nvme_path",
            env="DEEPSPEED_OFFLOAD_OPTIMIZER_NVME_PATH",
            env_help="NVMe folder for optimizer offload",
            flag_help="NVMe folder for optimizer offload.",
            field="offload_optimizer_nvme_path",
            fallback="none",
            question=Question(
                "Nvme Path to offload optimizer states?",
                "/nvme",
                step=4,
                stage=_ZERO,
                when=("offload_optimizer_device", ("nvme",)),
            ),
        ),
        Setting(
            "offload_param_nvme_path",
            env="DEEPSPEED_OFFLOAD_PARAM_NVME_PATH",
            env_help="NVMe folder for parameter offload",
            flag_help="NVMe folder for parameter offload.",
            field="offload_param_nvme_path",
            fallback="none",
            question=Question(
                "Nvme Path to offload parameters?",
                "/nvme",
                step=3,
                stage=_ZERO,
                when=("offload_param_device", ("nvme",)),
            ),
        ),
        GRADIENT_ACCUMULATION_STEPS,
        Setting(
            "gradient_clipping",
            "float_or_auto",
            env_help="DeepSpeed gradient clipping",
            flag_help="Gradient clipping value.",
            flag_type=float_or_auto,
            field="gradient_clipping",
            fallback=AUTO,
            question=Question("What is the gradient clipping value?", 1.0, stage="clipping"),
        ),
        Setting(
            "zero3_init_flag",
            "bool",
            env="DEEPSPEED_ZERO3_INIT",
            env_help="build the model partitioned under ZeRO-3 (deepspeed.zero.Init)",
            flag_help="Build the model partitioned (deepspeed.zero.Init).",
            field="zero3_init_flag",
            fallback=False,
            question=Question(
                "Do you want to enable `deepspeed.zero.Init` when using ZeRO Stage-3 for constructing massive models?",
                stage="init",
            ),
        ),
        Setting(
            "zero3_save_16bit_model",
            "bool",
            env="DEEPSPEED_ZERO3_SAVE_16BIT_MODEL",
            env_help="gather 16-bit weights when saving under ZeRO-3",
            flag_help="Save 16-bit weights under ZeRO-3.",
            field="zero3_save_16bit_model",
            fallback=False,
            question=Question(
                "Do you want to save 16-bit model weights when using ZeRO Stage-3?",
                stage="zero3",
                when=("zero_stage", (3,)),
            ),
        ),
        Setting("deepspeed_hostfile", env=None, flag_help="DeepSpeed hostfile."),
        Setting("deepspeed_exclusion_filter", env=None, flag_help="DeepSpeed exclusion filter."),
        Setting("deepspeed_inclusion_filter", env=None, flag_help="DeepSpeed inclusion filter."),
        Setting(
            "deepspeed_multinode_launcher",
            "choice",
            DEEPSPEED_MULTINODE_LAUNCHERS,
            env=None,
            flag_help="DeepSpeed multi-node launcher.",
        ),
        Setting(
            "deepspeed_moe_layer_cls_names",
            env_help="comma-separated MoE layer classes",
            flag_help="Comma-separated MoE layer class names.",
            field="transformer_moe_cls_names",
        ),
    ),
)
