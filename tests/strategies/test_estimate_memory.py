"""``hasten estimate-memory``: the guide's ZeRO-3 table, DeepSpeed's own estimators, model sources."""

import json
import re
import sys
import types

import pytest
import torch
from helpers import requires

from hasten.commands import estimate_memory
from hasten.commands.model_size import ModelSize, count_parameters, dtype_rows, model_size
from hasten.errors import ConfigError, MissingDependencyError
from hasten.settings.sizes import format_bytes
from hasten.strategies.deepspeed.memory_estimate import zero2_rows, zero3_rows

# The Transformers DeepSpeed guide, bigscience/T0_3B on 1 node with 1 GPU.
GUIDE_ROWS = [
    (70.00, 0.25, "offload_param=cpu , offload_optimizer=cpu , zero_init=1"),
    (70.00, 0.25, "offload_param=cpu , offload_optimizer=cpu , zero_init=0"),
    (62.23, 5.43, "offload_param=none, offload_optimizer=cpu , zero_init=1"),
    (62.23, 5.43, "offload_param=none, offload_optimizer=cpu , zero_init=0"),
    (0.37, 46.91, "offload_param=none, offload_optimizer=none, zero_init=1"),
    (15.56, 46.91, "offload_param=none, offload_optimizer=none, zero_init=0"),
]
_ROW = re.compile(r"^\s*([\d.]+)GB \|\s*([\d.]+)GB \| (.*)$")


def _rows(text):
    return [(float(m[1]), float(m[2]), m[3]) for m in map(_ROW.match, text.splitlines()) if m]


def test_num_params_reproduces_the_guides_table(capsys):
    assert estimate_memory.main(["--num_params", "2783e6", "--largest_layer", "65e6", "--num_gpus", "1"]) == 0
    rows = _rows(capsys.readouterr().out)
    assert [r[2] for r in rows] == [r[2] for r in GUIDE_ROWS]
    for (cpu, gpu, _), (want_cpu, want_gpu, options) in zip(rows, GUIDE_ROWS):
        assert abs(cpu - want_cpu) <= 0.1 and abs(gpu - want_gpu) <= 0.1, options


def test_known_model_prints_the_guides_numbers_exactly():
    args = estimate_memory.build_args(["bigscience/T0_3B"])
    text = estimate_memory.report(args)
    assert text.startswith("Memory for bigscience/T0_3B: 2783M total parameters, 65M largest layer parameters.")
    assert [r for r in _rows(text)] == GUIDE_ROWS


@pytest.mark.parametrize("gpus, nodes", [(1, 1), (4, 1), (8, 2), (3, 5)])
@requires("deepspeed")
def test_tables_match_deepspeeds_estimators(gpus, nodes):
    from deepspeed.runtime.zero import stage3
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    total, largest = 1_234_567_891, 45_678_901
    rows = zero3_rows(total, largest, gpus, nodes)
    for row in rows:
        cpu, gpu, _ = stage3.estimate_zero3_model_states_mem_needs(
            total,
            largest,
            num_gpus_per_node=gpus,
            num_nodes=nodes,
            cpu_offload=row.offload_optimizer == "cpu",
            cpu_offload_params=row.offload_param == "cpu",
            zero_init=bool(row.zero_init),
        )
        assert (row.cpu_bytes, row.gpu_bytes) == (cpu, gpu), row
    for row in zero2_rows(total, gpus, nodes):
        cpu, gpu = estimate_zero2_model_states_mem_needs(
            total, num_gpus_per_node=gpus, num_nodes=nodes, cpu_offload=row.offload_optimizer == "cpu"
        )
        assert (row.cpu_bytes, row.gpu_bytes) == (cpu, gpu), row


def test_dtype_table_follows_accelerate():
    rows = dtype_rows(ModelSize("bert-base-cased", 108_310_272, 22_268_928), ["float32", "float16", "int8", "int4"])
    text = [
        (r.dtype, format_bytes(r.largest_group_bytes), format_bytes(r.total_bytes), format_bytes(r.training_bytes))
        for r in rows
    ]
    assert text == [
        ("float32", "84.95 MB", "413.17 MB", "1.61 GB"),
        ("float16", "42.47 MB", "206.59 MB", "826.34 MB"),
        ("int8", "21.24 MB", "103.29 MB", "N/A"),
        ("int4", "10.62 MB", "51.65 MB", "N/A"),
    ]
    with pytest.raises(ConfigError, match=r"Unknown dtype 'float8'.*Did you mean 'float32'\?"):
        dtype_rows(ModelSize("m", 10, 1), ["float8"])


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(8, 32)
        self.down = torch.nn.Linear(32, 8)


class TinyLM(torch.nn.Module):
    _no_split_modules = ["Block"]

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(100, 8)
        self.blocks = torch.nn.ModuleList(Block() for _ in range(2))
        self.head = torch.nn.Linear(8, 100, bias=False)
        self.head.weight = self.embed.weight


def build_tiny_lm():
    assert torch.empty(1).device.type == "meta", "the factory runs on the meta device"
    return TinyLM()


def test_parameters_are_counted_once_with_blocks_kept_whole():
    size = count_parameters(TinyLM())
    block = (8 * 32 + 32) + (32 * 8 + 8)
    assert size.total_params == 800 + 2 * block
    assert size.largest_layer_params == 800 and size.largest_group_params == 800
    assert count_parameters(Block()).largest_group_params == 8 * 32 + 32, "without _no_split_modules, the largest leaf"


def test_module_factory_is_built_on_the_meta_device(capsys):
    assert estimate_memory.main([f"{__name__}:build_tiny_lm", "--dtypes", "float32"]) == 0
    out = capsys.readouterr().out
    assert f"Memory for {__name__}:build_tiny_lm: 0M total parameters" in out and "| float32 | 3.12 KB" in out
    with pytest.raises(ConfigError, match=r"Cannot load 'no_such_module:f'"):
        model_size("no_such_module:f")


def test_config_json_builds_the_transformers_model_on_meta(tmp_path, monkeypatch):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "tiny"}))
    fake = types.ModuleType("transformers")
    fake.AutoConfig = types.SimpleNamespace(
        from_pretrained=lambda path, trust_remote_code=False: {"path": path, "trust": trust_remote_code}
    )
    built = []

    def from_config(config, trust_remote_code=False):
        built.append((config, torch.empty(1).device.type))
        return TinyLM()

    fake.AutoModel = types.SimpleNamespace(from_config=from_config)
    monkeypatch.setitem(sys.modules, "transformers", fake)
    size = model_size(str(tmp_path), trust_remote_code=True)
    assert built == [({"path": str(tmp_path), "trust": True}, "meta")]
    assert (size.name, size.total_params, size.largest_layer_params) == (str(tmp_path), 800 + 2 * 552, 800)


def test_config_json_without_transformers_says_what_to_install(tmp_path, monkeypatch):
    (tmp_path / "config.json").write_text("{}")
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(
        MissingDependencyError, match=r"needs the transformers package.*pip install transformers, or pass --num_params"
    ):
        model_size(str(tmp_path / "config.json"))


def test_unknown_models_and_bad_arguments(capsys):
    with pytest.raises(
        ConfigError,
        match=(
            r"Unknown model 't0-3b': hasten estimate-memory does not download models. Did you mean "
            r"'bigscience/T0_3B'\?"
        ),
    ):
        model_size("t0-3b")
    assert estimate_memory.main([]) == 1
    assert "Name a model" in capsys.readouterr().err
    assert estimate_memory.main(["gpt2", "--num_params", "1e6"]) == 1
    assert "Give either a model ('gpt2') or --num_params (1000000), not both" in capsys.readouterr().err
    with pytest.raises(ConfigError, match=r"0 < largest layer <= total"):
        zero3_rows(10, 20)
    with pytest.raises(SystemExit):
        estimate_memory.main(["--num_params", "1.5"])
    assert "is not a positive whole number of parameters" in capsys.readouterr().err


def test_the_memory_table_imports_no_strategy():
    import subprocess

    code = (
        "import sys, hasten.strategies.deepspeed.memory_estimate\n"
        "loaded = [m for m in ('hasten.state', 'hasten.strategies.base', 'hasten.strategies.deepspeed.strategy', "
        "'hasten.strategies.deepspeed.plugin', 'deepspeed') if m in sys.modules]\n"
        "assert not loaded, loaded"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
