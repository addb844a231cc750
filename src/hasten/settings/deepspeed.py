"""The ``deepspeed_config`` table: DeepSpeed settings (a JSON file, or the ZeRO settings one by one).

``hasten config`` asks for these with its own DeepSpeed questions (their order depends on the answers).
"""

from __future__ import annotations

from . import Section, Setting

OFFLOAD_DEVICES = ("none", "cpu", "nvme")
DEEPSPEED_MULTINODE_LAUNCHERS = ("pdsh", "standard", "openmpi", "mvapich", "mpich", "nossh", "slurm")

DEEPSPEED = Section(
    name="deepspeed_config",
    class_name="DeepSpeedSection",
    doc="``deepspeed_config``: DeepSpeed settings (a JSON file, or the ZeRO settings one by one).",
    only_with="DEEPSPEED",
    rows=(
        Setting("deepspeed_config_file", env_help="DeepSpeed JSON config file", flag_help="DeepSpeed JSON config file."),
        Setting("zero_stage", "choice", (0, 1, 2, 3), env="DEEPSPEED_ZERO_STAGE", env_help="DeepSpeed ZeRO stage", flag_help="ZeRO stage."),
        Setting(
            "offload_optimizer_device", "choice", OFFLOAD_DEVICES, env="DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE", env_help="none, cpu or nvme",
            flag_help="Offload optimizer states to.",
        ),
        Setting(
            "offload_param_device", "choice", OFFLOAD_DEVICES, env="DEEPSPEED_OFFLOAD_PARAM_DEVICE", env_help="none, cpu or nvme",
            flag_help="Offload parameters to.",
        ),
        Setting(
            "offload_optimizer_nvme_path", env="DEEPSPEED_OFFLOAD_OPTIMIZER_NVME_PATH", env_help="NVMe folder for optimizer offload",
            flag_help="NVMe folder for optimizer offload.",
        ),
        Setting(
            "offload_param_nvme_path", env="DEEPSPEED_OFFLOAD_PARAM_NVME_PATH", env_help="NVMe folder for parameter offload",
            flag_help="NVMe folder for parameter offload.",
        ),
        Setting(
            "gradient_accumulation_steps", "int", env_help="default gradient accumulation steps", flag_help="Gradient accumulation steps.",
            always_export=True,
        ),
        Setting("gradient_clipping", "float_or_auto", env_help="DeepSpeed gradient clipping", flag_help="Gradient clipping value."),
        Setting(
            "zero3_init_flag", "bool", env="DEEPSPEED_ZERO3_INIT", env_help="build the model partitioned under ZeRO-3 (deepspeed.zero.Init)",
            flag_help="Build the model partitioned (deepspeed.zero.Init).",
        ),
        Setting(
            "zero3_save_16bit_model", "bool", env="DEEPSPEED_ZERO3_SAVE_16BIT_MODEL", env_help="gather 16-bit weights when saving under ZeRO-3",
            flag_help="Save 16-bit weights under ZeRO-3.",
        ),
        Setting("deepspeed_hostfile", env=None, flag_help="DeepSpeed hostfile."),
        Setting("deepspeed_exclusion_filter", env=None, flag_help="DeepSpeed exclusion filter."),
        Setting("deepspeed_inclusion_filter", env=None, flag_help="DeepSpeed inclusion filter."),
        Setting("deepspeed_multinode_launcher", "choice", DEEPSPEED_MULTINODE_LAUNCHERS, env=None, flag_help="DeepSpeed multi-node launcher."),
        Setting(
            "deepspeed_moe_layer_cls_names", env_help="comma-separated MoE layer classes", flag_help="Comma-separated MoE layer class names."
        ),
    ),
)
