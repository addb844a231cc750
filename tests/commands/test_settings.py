"""The settings tables (hasten.settings), judged by their effect: each row's launch flag, variable and config file key
changes what a process (its plugin, its state) or the launcher gets, through `hasten launch`'s own resolution
(flags, file and variables merged by resolve_settings, carried by launch_environment, read in the process); plus the
plugins' own reads of the variables, the dialogue of each table, and the tables' independence from torch."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Callable

import pytest
from helpers import free_port, requires

from hasten import config as cfg
from hasten import environment, state
from hasten.commands import launch as launch_cmd
from hasten.commands import runners
from hasten.commands.main import build_parser
from hasten.config import Hardware
from hasten.errors import ConfigError
from hasten.plugins.dynamo import TorchDynamoPlugin
from hasten.plugins.training import GradientAccumulationPlugin
from hasten.runtime.parallelism import ParallelismConfig
from hasten.settings.deepspeed import DEEPSPEED
from hasten.settings.dialogue import ask_table
from hasten.settings.dynamo import DYNAMO
from hasten.settings.fp8 import FP8
from hasten.settings.fsdp import FSDP
from hasten.settings.launch import LAUNCH
from hasten.settings.parallelism import PARALLELISM
from hasten.strategies.base import EngineSettings
from hasten.strategies.deepspeed.plugin import DeepSpeedPlugin
from hasten.strategies.fsdp.plugin import FullyShardedDataParallelPlugin
from hasten.strategies.plan import plan_strategy

CPU = Hardware("cpu", 0)
TABLES = (LAUNCH, *cfg.SECTIONS)
KEYED = [(table, row) for table in TABLES for row in table.rows if row.key]
SECTION_KEYS = [(table, row) for table, row in KEYED if table.name]


def _fp8_recipes():
    """The fp8 rows fill two recipes: ``backend`` FP8RecipeKwargs', the torchao settings AORecipeKwargs' (needs
    torchao: the cases that build it require it, see :data:`PLUGIN_NEEDS`)."""
    from hasten.utils import AORecipeKwargs, FP8RecipeKwargs

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        backend = FP8RecipeKwargs().backend
    recipe = AORecipeKwargs()
    return SimpleNamespace(
        backend=backend,
        pad_inner_dim=recipe.pad_inner_dim,
        enable_fsdp_float8_all_gather=recipe.enable_fsdp_float8_all_gather,
    )


PLUGINS = {
    DYNAMO.name: TorchDynamoPlugin,
    DEEPSPEED.name: DeepSpeedPlugin,
    FSDP.name: FullyShardedDataParallelPlugin,
    PARALLELISM.name: ParallelismConfig,
    FP8.name: _fp8_recipes,
}

PLUGIN_NEEDS = {DEEPSPEED.name: "deepspeed", FP8.name: "torchao"}  # the package a table's plugin imports when built


def _building(builds: str | None, *values, id: str):
    """One case of ``values``; it requires the package that the plugin of the table named ``builds`` imports."""
    need = PLUGIN_NEEDS.get(builds)
    return pytest.param(*values, id=id, marks=[requires(need)] if need else [])


# plugin field -> (variable's text, the field's value after the plugin read it); every row with a field needs one.
ENV_SAMPLES = {
    "backend": ("inductor", "INDUCTOR"),
    "mode": ("max-autotune", "max-autotune"),
    "fullgraph": ("true", True),
    "dynamic": ("false", False),
    "use_regional_compilation": ("yes", True),
    "fsdp_version": ("2", 2),
    "cpu_offload": ("true", True),
    "min_num_params": ("1234", 1234),
    "sharding_strategy": ("shard_grad_op", "SHARD_GRAD_OP"),
    "reshard_after_forward": ("false", False),
    "auto_wrap_policy": ("SIZE_BASED_WRAP", "SIZE_BASED_WRAP"),
    "transformer_cls_names_to_wrap": ("Block, Layer", ["Block", "Layer"]),
    "backward_prefetch": ("BACKWARD_PRE", "BACKWARD_PRE"),
    "state_dict_type": ("FULL_STATE_DICT", "FULL_STATE_DICT"),
    "forward_prefetch": ("1", True),
    "use_orig_params": ("true", True),
    "cpu_ram_efficient_loading": ("true", True),
    "sync_module_states": ("true", True),
    "activation_checkpointing": ("true", True),
    "activation_checkpointing_offload": ("false", False),
    "ignored_modules": ("head.*", "head.*"),
    "dp_replicate_size": ("2", 2),
    "dp_shard_size": ("3", 3),
    "tp_size": ("4", 4),
    "cp_size": ("1", 1),
    "sp_size": ("1", 1),
    "zero_stage": ("3", 3),
    "offload_optimizer_device": ("cpu", "cpu"),
    "offload_param_device": ("cpu", "cpu"),
    "offload_optimizer_nvme_path": ("/nvme/a", "/nvme/a"),
    "offload_param_nvme_path": ("/nvme/b", "/nvme/b"),
    "gradient_accumulation_steps": ("4", 4),
    "gradient_clipping": ("0.5", 0.5),
    "zero3_init_flag": ("false", False),
    "zero3_save_16bit_model": ("true", True),
    "transformer_moe_cls_names": ("MoEBlock", "MoEBlock"),
}
# (table, field) -> sample, where two tables fill a field of the same name
TABLE_SAMPLES = {
    (FP8.name, "backend"): ("ao", "AO"),
    (FP8.name, "pad_inner_dim"): ("false", False),
    (FP8.name, "enable_fsdp_float8_all_gather"): ("0", False),
}
# plugin field -> other variables its sample needs to be valid
COMPANIONS = {"offload_param_device": {"DEEPSPEED_ZERO_STAGE": "3"}}


# ------------------------------------------------------------------------------ every row, by its effect


@dataclass(frozen=True)
class Effect:
    """What a setting changes: ``read(plan)`` is what the process (after taking the launch's variables) or the launcher
    gets; with the setting given as ``text`` it gets ``expected``, and something else without it. ``needs``: other
    settings (config path -> value) the sample needs, given in the config file; ``hardware``: the machine seen;
    ``builds``: the table whose plugin ``read`` builds (its case requires what the plugin imports)."""

    text: str
    read: Callable[[Any], Any]
    expected: Any
    needs: dict = field(default_factory=dict)
    hardware: Hardware = CPU
    builds: str | None = None


def _sequence_option(axis: str, option: str) -> Callable[[Any], Any]:
    """What the process's ``ParallelismConfig`` with ``<axis>_size=2`` holds as ``option`` (on itself or its
    handler)."""

    def read(plan):
        config = ParallelismConfig(**{f"{axis}_size": 2})
        handler = getattr(config, f"{axis}_handler")
        return getattr(config, option) if hasattr(config, option) else getattr(handler, option)

    return read


def _outcome(build: Callable[[], Any], name: str) -> Any:
    """``build().name``, or the name of the error building it raises."""
    try:
        return getattr(build(), name)
    except Exception as exc:
        return type(exc).__name__


def _plugin_effect(table, row) -> Effect:
    text, expected = TABLE_SAMPLES.get((table.name, row.field)) or ENV_SAMPLES[row.field]
    needs = {"distributed_type": table.only_with} if table.only_with else {}
    overrides = {  # samples equal to the field's fallback change nothing: these pick another value
        "fsdp_version": ("1", "ConfigError"),
        "cp_size": ("2", 2),
        "sp_size": ("2", 2),
        "backend": ("te", "NotSupportedError") if table is FP8 else (text, expected),
        "zero3_init_flag": ("true", True),
        "dynamic": ("true", True),
    }
    text, expected = overrides.get(row.field, (text, expected))
    if row.field in ("offload_param_device", "zero3_init_flag"):
        needs["deepspeed_config.zero_stage"] = 3
    return Effect(text, lambda plan: _outcome(PLUGINS[table.name], row.field), expected, needs, builds=table.name)


def _engine(plan) -> str:
    """The engine a process of this launch trains with."""
    return plan_strategy(EngineSettings("no", GradientAccumulationPlugin(num_steps=1)), 1).engine.name


def _mpirun(plan) -> list[str] | None:
    """The start of the mpirun command when the launch runs one."""
    if not plan.settings.config.mpirun_config.mpirun_hostfile:
        return None
    return runners.mpirun_command(plan, "openmpi")[0][:3]


def _rendezvous(part: int) -> Callable:
    return lambda plan: runners._rendezvous(plan)[part]


LOCAL, GPUS = "127.0.0.1", Hardware("cuda", 2)
TWO_MACHINES = {"num_machines": 2, "num_processes": 2, "main_process_ip": LOCAL}
PORT = free_port()
LAUNCH_EFFECTS = {
    "distributed_type": Effect("FSDP", _engine, "fsdp"),
    "debug": Effect("true", lambda plan: environment.launch_setting("debug"), True),
    "use_cpu": Effect("true", lambda plan: environment.launch_setting("use_cpu"), True),
    "mixed_precision": Effect("bf16", lambda plan: state.resolve_mixed_precision(None), "bf16"),
    "num_processes": Effect("3", lambda plan: plan.nproc_per_node, 3),
    "num_machines": Effect("2", lambda plan: plan.nproc_per_node, 1, {"num_processes": 2, "main_process_ip": LOCAL}),
    "enable_cpu_affinity": Effect("true", lambda plan: environment.launch_setting("enable_cpu_affinity"), True),
    "gpu_ids": Effect("1", lambda plan: plan.env.get("CUDA_VISIBLE_DEVICES"), "1", {"num_processes": 1}, GPUS),
    "machine_rank": Effect("1", lambda plan: runners._rendezvous(plan)[2].get("rank"), 1, TWO_MACHINES),
    "main_process_ip": Effect("127.0.0.2", _rendezvous(1), f"127.0.0.2:{PORT}", {"main_process_port": PORT}),
    "main_process_port": Effect(str(PORT), _rendezvous(1), f"127.0.0.1:{PORT}"),
    "rdzv_backend": Effect("c10d", _rendezvous(0), "c10d", {**TWO_MACHINES, "machine_rank": 1}),
    "mpirun_config.mpirun_hostfile": Effect(
        "HOSTFILE", _mpirun, ["mpirun", "--hostfile", "HOSTFILE"], {**TWO_MACHINES, "use_cpu": True}
    ),
    **{
        f"parallelism_config.parallelism_config_{key}": Effect(text, _sequence_option(axis, option), expected, needs)
        for key, axis, option, text, expected, needs in (
            ("cp_comm_strategy", "cp", "cp_comm_strategy", "alltoall", "alltoall", {}),
            ("sp_backend", "sp", "sp_backend", "accelerate", "accelerate", {}),
            ("sp_seq_length", "sp", "sp_seq_length", "64", 64, {}),
            ("sp_attn_implementation", "sp", "sp_attn_implementation", "flash_attention_2", "flash_attention_2", {}),
            (
                "sp_seq_length_is_variable",
                "sp",
                "sp_seq_length_is_variable",
                "false",
                False,
                {"parallelism_config.parallelism_config_sp_seq_length": 64},
            ),
        )
    },
    "deepspeed_config.deepspeed_config_file": Effect(
        "DSFILE",
        lambda plan: _outcome(DeepSpeedPlugin, "config_name"),
        "DSFILE",
        {"distributed_type": "DEEPSPEED"},
        builds=DEEPSPEED.name,
    ),
    "deepspeed_config.deepspeed_multinode_launcher": Effect(
        "pdsh",
        lambda plan: any("deepspeed_multinode_launcher" in line for line in plan.warnings),
        True,
        {**TWO_MACHINES, "machine_rank": 1, "distributed_type": "DEEPSPEED"},
    ),
}
# Settings hasten accepts (so that Accelerate's files and flags keep working) but does not act on, and why.
NO_EFFECT = {
    "compute_environment": "LOCAL_MACHINE is the only environment hasten launches on (a SageMaker file is refused)",
    "same_network": "torch's rendezvous needs no answer about the network",
    "main_training_function": "used by Accelerate's TPU launcher only",
    "downcast_bf16": "used by Accelerate's TPU launcher only",
    **dict.fromkeys(
        ("tpu_name", "tpu_zone", "tpu_use_cluster", "tpu_use_sudo", "command_file", "commands", "tpu_vm", "tpu_env"),
        "TPU settings: hasten does not run on TPUs",
    ),
    **dict.fromkeys(
        (f"deepspeed_config.deepspeed_{key}" for key in ("hostfile", "exclusion_filter", "inclusion_filter")),
        "DeepSpeed's own multi-machine launcher, which hasten does not use",
    ),
    "parallelism_config.parallelism_config_cp_backend": "its one value, torch, is the default",
    **dict.fromkeys(
        (
            f"fp8_config.{key}"
            for key in (
                "use_autocast_during_eval",
                "margin",
                "interval",
                "fp8_format",
                "amax_history_length",
                "amax_compute_algorithm",
                "override_linear_precision",
                "optimization_level",
            )
        ),
        "a Transformer Engine / MS-AMP recipe setting; hasten trains fp8 through torchao only",
    ),
}


def _effect(table, row) -> Effect | None:
    path = table.path(row)
    if path in LAUNCH_EFFECTS:
        return LAUNCH_EFFECTS[path]
    return _plugin_effect(table, row) if row.field else None


SOURCES = [
    _building(getattr(_effect(table, row), "builds", None), table, row, source, id=f"{table.path(row)}-{source}")
    for table, row in KEYED
    for source, given in (("flag", row.flag_name), ("variable", row.env_name), ("file", True))
    if given
]


@pytest.fixture
def launch(tmp_path, monkeypatch):
    """``launch(settings, hardware, row=None, source=None, text=None)``: run `hasten launch`'s preparation with
    ``settings`` in a config file and ``row`` given by ``source``, then put the variables it exports into this
    process's environment, as a started process sees them; returns the plan."""
    script = tmp_path / "train.py"
    script.write_text("")
    plans = []

    def run(settings: dict, hardware: Hardware, row=None, table=None, source=None, text=None):
        data: dict = {}
        for path, value in settings.items():
            section, _, key = path.rpartition(".")
            (data.setdefault(section, {}) if section else data)[key] = value
        argv = []
        if source == "file":
            section = data.setdefault(table.name, {}) if table.name else data
            section[row.key] = text
        elif source == "flag":
            argv = [f"--{row.flag_name}"] + ([] if row.switch else [text])
        elif source == "variable":
            monkeypatch.setenv(f"HASTEN_{row.env_name}", text)
        config_file = tmp_path / f"launch{len(plans)}.yaml"
        config_file.write_text(json.dumps(data))
        args = build_parser(["launch"]).parse_args(["launch", "--config_file", str(config_file), *argv, str(script)])
        plan = launch_cmd.prepare_launch(args, hardware=hardware)
        plans.append(plan)
        for name, value in plan.env.items():
            monkeypatch.setenv(name, value)
        return plan

    yield run
    for plan in plans:
        if plan.owns_hang_dir:
            plan.hang_dir.rmdir()


def _sample(effect: Effect, tmp_path) -> tuple[str, Any]:
    """The effect's text and expected value, with the files it names made."""
    if effect.text == "HOSTFILE":
        (tmp_path / "hosts").write_text("node1\nnode2\n")
        return str(tmp_path / "hosts"), ["mpirun", "--hostfile", str(tmp_path / "hosts")]
    if effect.text == "DSFILE":
        (tmp_path / "ds.json").write_text(json.dumps({"zero_optimization": {"stage": 1}}))
        return str(tmp_path / "ds.json"), f"the DeepSpeed config {str(tmp_path / 'ds.json')!r}"
    return effect.text, effect.expected


@pytest.mark.parametrize(("table", "row", "source"), SOURCES)
def test_each_flag_variable_and_file_key_changes_what_a_process_gets(table, row, source, launch, monkeypatch, tmp_path):
    effect = _effect(table, row)
    path = table.path(row)
    if effect is None:
        assert path in NO_EFFECT, f"{path} has no effect in this test and is not listed in NO_EFFECT"
        samples = {"bool": "true", "bool3": "false,false,true", "int": "7", "list": ["a"]}
        text = str(row.choices[0]) if row.choices else samples.get(row.kind, "x")
        plan = launch({}, CPU, row, table, source, text)
        assert cfg.get_path(plan.settings.config, path) is not None and plan.settings.sources[path].kind != "default"
        return
    text, expected = _sample(effect, tmp_path)
    needs = effect.needs
    if source == "flag" and row.switch:  # a switch says true; where true is the default, it overrides a file's false
        text, expected = None, True
        needs = {**needs, path: False} if row.fallback is True else needs
    with monkeypatch.context() as before:
        for name, value in COMPANIONS.get(row.field, {}).items():
            before.setenv(f"HASTEN_{name}", value)
        without = effect.read(launch(needs, effect.hardware))
    for name, value in COMPANIONS.get(row.field, {}).items():
        monkeypatch.setenv(f"HASTEN_{name}", value)
    got = effect.read(launch(needs, effect.hardware, row, table, source, text))
    assert got == expected
    assert without != expected, f"{path}: the sample {text!r} is what the process gets anyway"


def test_the_settings_without_effect_are_rows():
    assert set(NO_EFFECT) <= {table.path(row) for table, row in KEYED if _effect(table, row) is None}


# ------------------------------------------------------------------------------ the plugins' own reads


FIELDED = [_building(t.name, t, r, id=f"{t.name}.{r.key or r.env_name}") for t in TABLES for r in t.rows if r.field]


@pytest.mark.parametrize(("table", "row"), FIELDED)
@pytest.mark.parametrize("prefix", ["HASTEN_", "ACCELERATE_"])
def test_the_plugin_reads_the_variable(table, row, prefix, monkeypatch):
    text, expected = TABLE_SAMPLES.get((table.name, row.field)) or ENV_SAMPLES[row.field]
    monkeypatch.setenv(f"{prefix}{row.env_name}", text)
    for name, value in COMPANIONS.get(row.field, {}).items():
        monkeypatch.setenv(f"{prefix}{name}", value)
    plugin = PLUGINS[table.name]()
    assert getattr(plugin, row.field) == expected


@pytest.mark.parametrize(("table", "row"), SECTION_KEYS, ids=[table.path(row) for table, row in SECTION_KEYS])
def test_a_config_file_key_round_trips(table, row, tmp_path):
    text, value = (
        (str(row.choices[-1]).lower(), row.choices[-1])
        if row.kind == "choice"
        else {
            "bool": ("true", True),
            "int": ("7", 7),
            "str": ("A,B", "A,B"),
            "bool_or_strategy": ("false", False),
            "float_or_auto": ("auto", "auto"),
            "bool3": ("false,false,true", (False, False, True)),
        }[row.kind]
    )
    path = tmp_path / "c.yaml"
    path.write_text(f"{table.name}:\n  {row.key}: {text}\n")
    loaded = cfg.read_config_file(path)
    assert cfg.get_path(loaded.config, table.path(row)) == value
    cfg.save_config_file(loaded.config, tmp_path / "again.yaml")
    assert cfg.get_path(cfg.load_config_file(tmp_path / "again.yaml"), table.path(row)) == value


def test_an_argument_wins_over_the_variable_and_fallbacks_apply(monkeypatch):
    monkeypatch.setenv("HASTEN_FSDP_ACTIVATION_CHECKPOINTING", "true")
    assert FullyShardedDataParallelPlugin(activation_checkpointing=False).activation_checkpointing is False
    monkeypatch.delenv("HASTEN_FSDP_ACTIVATION_CHECKPOINTING")
    monkeypatch.setenv("FSDP_ACTIVATION_CHECKPOINTING", "yes")  # Accelerate's bare name
    assert FullyShardedDataParallelPlugin().activation_checkpointing is True
    monkeypatch.delenv("FSDP_ACTIVATION_CHECKPOINTING")
    plugin = FullyShardedDataParallelPlugin()
    assert (plugin.activation_checkpointing, plugin.state_dict_type, plugin.fsdp_version, plugin.use_orig_params) == (
        False,
        "SHARDED_STATE_DICT",
        2,
        None,
    )
    assert TorchDynamoPlugin().dynamic is None
    assert (
        ParallelismConfig().tp_size,
        ParallelismConfig().dp_shard_size,
        ParallelismConfig.from_launch_settings(),
    ) == (1, None, None)


def test_a_bad_variable_names_itself(monkeypatch):
    monkeypatch.setenv("ACCELERATE_FSDP_ACTIVATION_CHECKPOINTING", "maybe")
    with pytest.raises(ConfigError, match="ACCELERATE_FSDP_ACTIVATION_CHECKPOINTING='maybe' is not a boolean"):
        FullyShardedDataParallelPlugin()
    monkeypatch.setenv("ACCELERATE_FSDP_ACTIVATION_CHECKPOINTING", "no")
    monkeypatch.setenv("HASTEN_FSDP_MIN_NUM_PARAMS", "lots")
    with pytest.raises(ConfigError, match="HASTEN_FSDP_MIN_NUM_PARAMS='lots' is not an integer"):
        FullyShardedDataParallelPlugin()


# ------------------------------------------------------------------------------ the dialogue, the import cost


class _Scripted:
    """Answers the dialogue: yes to every question, the last option of every choice, the default of every text
    (a file name where there is none)."""

    def __init__(self):
        self.asked: list[str] = []

    def yes_no(self, message, default=False, check=None):
        self.asked.append(message)
        return True

    def select(self, message, options, default=None):
        self.asked.append(message)
        return options[-1][1]

    def text(self, message, default=None, convert=str, check=None):
        self.asked.append(message)
        return "a.json" if default is None else default


ASKED = [table for table in cfg.SECTIONS if any(row.question and row.question.text for row in table.rows)]


@pytest.mark.parametrize("table", ASKED, ids=[t.name for t in ASKED])
def test_the_dialogue_asks_the_table_and_writes_valid_keys(table):
    asker = _Scripted()
    answers: dict = {}
    for stage in dict.fromkeys(row.question.stage for row in table.rows if row.question):
        answers |= ask_table(asker, table, stage, answers)
    asked = [
        row.question.text
        for row in table.rows
        if row.question and not row.question.fixed and row.question.text in asker.asked
    ]
    assert asked and set(answers) <= {row.key for row in table.rows}
    config, present, _ = cfg.config_from_dict({table.name: answers})
    assert {f"{table.name}.{key}" for key in answers} == set(present)


def test_the_tables_and_registrations_do_not_import_torch():
    code = "import sys\nimport hasten.settings.fsdp, hasten.environment\nprint('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"
