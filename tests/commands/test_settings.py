"""The settings tables (hasten.settings): every row reaches the config file schema, the launch flags, the
documented environment variables, the `hasten config` dialogue and the plugin field it fills."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from types import SimpleNamespace

import pytest

from hasten import config as cfg
from hasten import environment
from hasten.commands import config as config_cmd
from hasten.commands.launch_args import FLAGS, flag_settings
from hasten.commands.main import build_parser
from hasten.config import Hardware
from hasten.errors import ConfigError
from hasten.plugins.dynamo import TorchDynamoPlugin
from hasten.runtime.parallelism import ParallelismConfig
from hasten.settings.deepspeed import DEEPSPEED
from hasten.settings.dynamo import DYNAMO
from hasten.settings.fp8 import FP8
from hasten.settings.fsdp import FSDP
from hasten.settings.parallelism import PARALLELISM
from hasten.strategies.deepspeed.plugin import DeepSpeedPlugin
from hasten.strategies.fsdp.plugin import FullyShardedDataParallelPlugin

TABLES = (DYNAMO, DEEPSPEED, FSDP, FP8, PARALLELISM)
ROWS = [(table, row) for table in TABLES for row in table.rows]
KEYED = [(table, row) for table, row in ROWS if row.key]
FLAGGED = [(table, row) for table, row in KEYED if row.flag_name]
DOCUMENTED = [(table, row) for table, row in ROWS if row.env_name]
EXPORTED = [(table, row) for table, row in KEYED if row.env_name]


def _fp8_recipes():
    """The fp8 rows fill two recipes: ``backend`` FP8RecipeKwargs', the torchao settings AORecipeKwargs' (needs torchao)."""
    pytest.importorskip("torchao", reason="AORecipeKwargs needs torchao (pip install 'hasten[fp8]')")
    from hasten.utils import AORecipeKwargs, FP8RecipeKwargs

    with pytest.warns(FutureWarning):
        backend = FP8RecipeKwargs().backend
    recipe = AORecipeKwargs()
    return SimpleNamespace(backend=backend, pad_inner_dim=recipe.pad_inner_dim, enable_fsdp_float8_all_gather=recipe.enable_fsdp_float8_all_gather)


PLUGINS = {
    DYNAMO.name: TorchDynamoPlugin, DEEPSPEED.name: DeepSpeedPlugin, FSDP.name: FullyShardedDataParallelPlugin,
    PARALLELISM.name: ParallelismConfig, FP8.name: _fp8_recipes,
}

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
TABLE_SAMPLES = {(FP8.name, "backend"): ("ao", "AO"), (FP8.name, "pad_inner_dim"): ("false", False), (FP8.name, "enable_fsdp_float8_all_gather"): ("0", False)}
# plugin field -> other variables its sample needs to be valid
COMPANIONS = {"offload_param_device": {"DEEPSPEED_ZERO_STAGE": "3"}}
# config key -> (text given as flag or in the environment, value in the config file)
CONFIG_SAMPLES = {
    "bool": ("true", True),
    "int": ("7", 7),
    "str": ("A,B", "A,B"),
    "bool_or_strategy": ("false", False),
    "float_or_auto": ("auto", "auto"),
    "bool3": ("false,false,true", (False, False, True)),
}


def _ids(pairs):
    return [f"{table.name}.{row.key or row.env_name}" for table, row in pairs]


def _config_sample(row):
    if row.kind == "choice":
        choice = row.choices[-1]
        return str(choice).lower(), choice
    return CONFIG_SAMPLES[row.kind]


@pytest.mark.parametrize(("table", "row"), KEYED, ids=_ids(KEYED))
def test_every_keyed_row_is_a_config_key_with_its_checks(table, row):
    meta = cfg.leaf_fields()[f"{table.name}.{row.key}"]
    assert (meta["kind"], meta["choices"]) == (row.kind, row.choices)


@pytest.mark.parametrize(("table", "row"), KEYED, ids=_ids(KEYED))
def test_a_config_file_key_round_trips(table, row, tmp_path):
    text, value = _config_sample(row)
    path = tmp_path / "c.yaml"
    path.write_text(f"{table.name}:\n  {row.key}: {text}\n")
    loaded = cfg.read_config_file(path)
    assert cfg.get_path(loaded.config, f"{table.name}.{row.key}") == value
    assert f"{table.name}.{row.key}" in loaded.present
    cfg.save_config_file(loaded.config, tmp_path / "again.yaml")
    assert cfg.get_path(cfg.load_config_file(tmp_path / "again.yaml"), f"{table.name}.{row.key}") == value


@pytest.mark.parametrize(("table", "row"), FLAGGED, ids=_ids(FLAGGED))
def test_the_flag_parses_into_the_setting(table, row):
    flag = next(f for f in FLAGS if f.name == row.flag_name)
    assert (flag.path, flag.help, flag.switch) == (f"{table.name}.{row.key}", row.flag_help, row.switch)
    text, value = _config_sample(row)
    argv = [f"--{row.flag_name.replace('_', '-')}"] + ([] if row.switch else [text])
    args = build_parser(["launch"]).parse_args(["launch", *argv, "train.py"])
    resolved = cfg.resolve_settings(flags=flag_settings(args), loaded=None, env={}, hardware=lambda: Hardware("cpu", 0))
    assert cfg.get_path(resolved.config, flag.path) == (True if row.switch else value)
    assert str(resolved.sources[flag.path]) == f"flag --{row.flag_name}"


@pytest.mark.parametrize(("table", "row"), DOCUMENTED, ids=_ids(DOCUMENTED))
def test_every_row_is_a_documented_variable(table, row):
    assert environment.SETTINGS[row.env_name] == row.env_help and row.env_help


@pytest.mark.parametrize(("table", "row"), EXPORTED, ids=_ids(EXPORTED))
def test_the_variable_is_a_launch_setting_and_is_exported(table, row, monkeypatch):
    text, value = _config_sample(row)
    monkeypatch.setenv(f"HASTEN_{row.env_name}", text)
    env = cfg.environment_settings()
    assert env[f"{table.name}.{row.key}"] == (text, f"HASTEN_{row.env_name}")
    resolved = cfg.resolve_settings(flags={}, loaded=None, env=env, hardware=lambda: Hardware("cpu", 0))
    exported = cfg.launch_environment(resolved)
    if row.kind == "bool3":
        return
    if table.only_with is None or row.always_export:
        assert f"HASTEN_{row.env_name}" in exported
    else:
        assert f"HASTEN_{row.env_name}" not in exported
        resolved.config.distributed_type = table.only_with
        assert f"HASTEN_{row.env_name}" in cfg.launch_environment(resolved)


FIELDED = [(table, row) for table, row in ROWS if row.field]


@pytest.mark.parametrize(("table", "row"), FIELDED, ids=_ids(FIELDED))
@pytest.mark.parametrize("prefix", ["HASTEN_", "ACCELERATE_"])
def test_the_plugin_reads_the_variable(table, row, prefix, monkeypatch):
    if table.name == "deepspeed_config" and importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed is not installed (pip install 'hasten[deepspeed]'): DeepSpeedPlugin cannot be built")
    text, expected = TABLE_SAMPLES.get((table.name, row.field)) or ENV_SAMPLES[row.field]
    monkeypatch.setenv(f"{prefix}{row.env_name}", text)
    for name, value in COMPANIONS.get(row.field, {}).items():
        monkeypatch.setenv(f"{prefix}{name}", value)
    plugin = PLUGINS[table.name]()
    assert getattr(plugin, row.field) == expected


def test_an_argument_wins_over_the_variable_and_fallbacks_apply(monkeypatch):
    monkeypatch.setenv("HASTEN_FSDP_ACTIVATION_CHECKPOINTING", "true")
    assert FullyShardedDataParallelPlugin(activation_checkpointing=False).activation_checkpointing is False
    monkeypatch.delenv("HASTEN_FSDP_ACTIVATION_CHECKPOINTING")
    monkeypatch.setenv("FSDP_ACTIVATION_CHECKPOINTING", "yes")  # Accelerate's bare name
    assert FullyShardedDataParallelPlugin().activation_checkpointing is True
    monkeypatch.delenv("FSDP_ACTIVATION_CHECKPOINTING")
    plugin = FullyShardedDataParallelPlugin()
    assert (plugin.activation_checkpointing, plugin.state_dict_type, plugin.fsdp_version, plugin.use_orig_params) == (False, "SHARDED_STATE_DICT", 2, None)
    assert TorchDynamoPlugin().dynamic is None
    assert (ParallelismConfig().tp_size, ParallelismConfig().dp_shard_size, ParallelismConfig.from_launch_settings()) == (1, None, None)


def test_a_bad_variable_names_itself(monkeypatch):
    monkeypatch.setenv("ACCELERATE_FSDP_ACTIVATION_CHECKPOINTING", "maybe")
    with pytest.raises(ConfigError, match="ACCELERATE_FSDP_ACTIVATION_CHECKPOINTING='maybe' is not a boolean"):
        FullyShardedDataParallelPlugin()
    monkeypatch.setenv("ACCELERATE_FSDP_ACTIVATION_CHECKPOINTING", "no")
    monkeypatch.setenv("HASTEN_FSDP_MIN_NUM_PARAMS", "lots")
    with pytest.raises(ConfigError, match="HASTEN_FSDP_MIN_NUM_PARAMS='lots' is not an integer"):
        FullyShardedDataParallelPlugin()


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


ASKED = [table for table in TABLES if any(row.question for row in table.rows)]


@pytest.mark.parametrize("table", ASKED, ids=[t.name for t in ASKED])
def test_the_dialogue_asks_the_table_and_writes_valid_keys(table):
    asker = _Scripted()
    answers: dict = {}
    for stage in dict.fromkeys(row.question.stage for row in table.rows if row.question):
        answers |= config_cmd._ask_table(asker, table, stage, answers)
    asked = [row.question.text for row in table.rows if row.question and not row.question.fixed and row.question.text in asker.asked]
    assert asked and set(answers) <= {row.key for row in table.rows}
    config, present, _ = cfg.config_from_dict({table.name: answers})
    assert {f"{table.name}.{key}" for key in answers} == set(present)


def test_the_tables_do_not_import_torch():
    code = "import sys\nimport hasten.settings.fsdp, hasten.settings.dynamo\nprint('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"
