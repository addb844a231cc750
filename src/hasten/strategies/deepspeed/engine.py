"""The registration of the DeepSpeed engine (ZeRO), and what it adds to ``hasten launch`` and ``hasten config``.

Imports nothing but the settings tables (see :mod:`hasten.settings.engines`); the failure advice imports the
(torch-free) memory table when a worker failed.
"""

from __future__ import annotations

from ...settings import prefixed
from ...settings.deepspeed import DEEPSPEED
from ...settings.dialogue import ask_table
from ...settings.engines import Argument, CheckpointReading, Dialogue, Engine, Requirement, WeightsMerge
from ...settings.launch import MIXED_PRECISION
from ...settings.parallelism import PARALLELISM, asks_for_no_engine

# The variable (without prefix) that lists the DeepSpeed settings a launch gave.
_FIELDS_VARIABLE = "CONFIG_DS_FIELDS"


def _ask(ask, answers: dict) -> dict:
    """The DeepSpeed questions of ``hasten config``: a JSON file, or the ZeRO settings one by one."""
    if ask.yes_no("Do you want to specify a json file to a DeepSpeed config?"):
        settings = ask_table(ask, DEEPSPEED, "file")
    else:
        settings = ask_table(ask, DEEPSPEED, "zero")
        if ask.yes_no("Do you want to use gradient clipping?"):
            settings |= ask_table(ask, DEEPSPEED, "clipping")
        settings |= ask_table(ask, DEEPSPEED, "zero3", settings)
    settings |= ask_table(ask, DEEPSPEED, "init")
    return {DEEPSPEED.name: settings}


def _launch_variables(settings) -> dict[str, str]:
    """``HASTEN_CONFIG_DS_FIELDS``: the DeepSpeed settings the launch gave (and mixed_precision, unless by default)."""
    section = settings.config.deepspeed_config
    fields = [row.key for row in DEEPSPEED.rows if row.key and getattr(section, row.key) is not None]
    if settings.source(MIXED_PRECISION).kind != "default":
        fields.append(MIXED_PRECISION.key)
    return {prefixed(_FIELDS_VARIABLE): ",".join(fields)}


def _launch_warnings(settings) -> list[str]:
    """A multi-machine launcher hasten does not use; the CPU ops the job compiles before it trains."""
    from .op_builds import build_note

    config = settings.config
    launcher = config.deepspeed_config.deepspeed_multinode_launcher
    if config.num_machines > 1 and launcher not in (None, "standard"):
        source = settings.sources["deepspeed_config.deepspeed_multinode_launcher"]
        return [
            f"deepspeed_multinode_launcher={launcher!r} (from {source}) is not used: hasten launch starts the "
            "processes of this machine only, so run the same command on every machine with its --machine_rank "
            "(DeepSpeed's 'standard' launcher).",
            *build_note(settings),
        ]
    return build_note(settings)


def _explain_failure(env: dict, exitcode: int) -> str | None:
    """The advice for a worker the operating system killed (usually out of CPU memory), with the offload in force."""
    from .memory_estimate import explain_deepspeed_failure

    offload = [env.get(DEEPSPEED.by_field(f"offload_{part}_device").variable) for part in ("optimizer", "param")]
    return explain_deepspeed_failure(exitcode, *offload)


def _holds(folder) -> bool:
    """Whether ``folder`` holds a ZeRO checkpoint (possibly under ``deepspeed/<tag>/``)."""
    from .checkpoint import find_deepspeed_checkpoint

    return find_deepspeed_checkpoint(folder) is not None


def _merge(folder, output, safe_serialization: bool, max_shard_size: str) -> list:
    """The fp32 weights of a ZeRO checkpoint, as DeepSpeed's ``zero_to_fp32.py`` rebuilds them, written to
    ``output``."""
    from .checkpoint import merge_deepspeed_weights

    return merge_deepspeed_weights(folder, output, safe_serialization=safe_serialization, max_shard_size=max_shard_size)


def _memory_table(args, total_params: int, largest_layer_params: int) -> list[str]:
    """ZeRO's memory per CPU and per GPU for each offload choice (``--zero_stage``, ``--num_gpus``, ``--num_nodes``)."""
    from .memory_estimate import zero2_rows, zero3_rows

    lines = [
        f"DeepSpeed ZeRO-{args.zero_stage}: memory for parameters, gradients and optimizer states (fp16/bf16 mixed "
        "precision with Adam)",
        f"on {args.num_nodes} node(s) with {args.num_gpus} GPU(s) per node; activations and CUDA kernels need more.",
    ]
    if args.zero_stage == 3:
        rows = zero3_rows(total_params, largest_layer_params, args.num_gpus, args.num_nodes)
    else:
        rows = zero2_rows(total_params, args.num_gpus, args.num_nodes)
    return [*lines, "  per CPU |   per GPU | Options", *(row.format() for row in rows)]


def _holds_state(reader, index: int) -> bool:
    """Whether model ``index`` of an open checkpoint is kept as a DeepSpeed engine's files."""
    from .other_engines import holds_engine_state

    return holds_engine_state(reader, index)


def _read_state(reader, index: int, module):
    """Model ``index``'s ZeRO state by parameter name, for a resume under another engine."""
    from .other_engines import read_engine_state

    return read_engine_state(reader, index, module)


ENGINE = Engine(
    name="deepspeed",
    strategy="hasten.strategies.deepspeed.strategy:DeepSpeedStrategy",
    distributed_types=("DEEPSPEED",),
    arguments=(
        Argument("deepspeed_plugin", "hasten.strategies.deepspeed.plugin:DeepSpeedPlugin", DEEPSPEED),
        Argument(
            "parallelism_config",
            "hasten.runtime.parallelism:ParallelismConfig",
            PARALLELISM,
            from_launch=True,
            layout=asks_for_no_engine,
        ),
    ),
    sections=(DEEPSPEED,),
    switch="USE_DEEPSPEED",
    switch_help="use the DeepSpeed strategy",
    flag_help="Use DeepSpeed.",
    requirement=Requirement("deepspeed", "DeepSpeed", "deepspeed"),
    dialogue=Dialogue(
        "Do you want to use DeepSpeed?", ("NO", "MULTI_CPU", "MULTI_GPU", "MULTI_XPU"), _ask, gpu_ids=False
    ),
    settles_precision=True,
    variables={_FIELDS_VARIABLE: "comma-separated DeepSpeed fields that came from the launch config"},
    launch_variables=_launch_variables,
    launch_warnings=_launch_warnings,
    explain_failure=_explain_failure,
    merge_weights=WeightsMerge(
        "DeepSpeed ZeRO",
        "a DeepSpeed ZeRO checkpoint (*_model_states.pt and *_optim_states.pt files, possibly under deepspeed/<tag>/)",
        _holds,
        _merge,
    ),
    checkpoint_reading=CheckpointReading(
        _holds_state,
        _read_state,
        "the DeepSpeed engine's own state (its step and sample counters, loss scaler and config) does not",
    ),
    memory_table=_memory_table,
)
