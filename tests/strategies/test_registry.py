"""The engine registry (hasten.settings.engines): an engine registered from the tests alone (tests/fixtures/toy_engine,
found through HASTEN_ENGINES, no edit under src/) is chosen by ``Accelerator(strategy=...)``, by a config file, by a
launch flag and by its variable, as a built-in engine is; its flag, section, variables and question appear where the
built-ins' do. And the registry's own checks."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from helpers import FIXTURES_ROOT, ROOT, SCRIPTS, clean_env, hasten_launch

from hasten.errors import ConfigError
from hasten.settings.engines import BUILT_IN, load_engines

REPORT = SCRIPTS / "toy_engine_report.py"
TOY = {"strategy": "ToyStrategy", "distributed_type": "TOY"}


def _toy_env(**extra: str) -> dict[str, str]:
    """A process environment in which the toy engine is registered (and found by the processes hasten launch starts)."""
    path = os.pathsep.join([str(ROOT / "src"), str(FIXTURES_ROOT), os.environ.get("PYTHONPATH", "")])
    return clean_env(PYTHONPATH=path, HASTEN_ENGINES="toy_engine.engine", **extra)


def _report(result: subprocess.CompletedProcess) -> dict:
    line = next(line for line in result.stdout.splitlines() if line.startswith("REPORT "))
    return json.loads(line.removeprefix("REPORT "))


def _python(*args: str, env: dict) -> subprocess.CompletedProcess:
    result = subprocess.run([sys.executable, *args], env=env, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-4000:]
    return result


def test_the_toy_engine_joins_the_launch_flags_config_file_variables_and_dialogue(tmp_path):
    code = """
import json
from hasten import config, environment
from hasten.commands.config import ask_questions
from hasten.config import Hardware

class Yes:
    asked = []
    def yes_no(self, text, default=False, check=None):
        self.asked.append(text)
        return text == "Do you want to use the toy engine?"
    def select(self, text, options, default=None):
        return "MULTI_CPU" if text.startswith("Which type") else default if default is not None else options[0][1]
    def text(self, text, default=None, convert=str, check=None):
        self.asked.append(text)
        return default

asker = Yes()
answers = ask_questions(asker, Hardware("cpu", 0))
print(json.dumps({
    "engines": [e.name for e in environment.ENGINES],
    "variables": {k: environment.SETTINGS[k] for k in ("USE_TOY", "TOY_SCALE")},
    "section": [f.name for f in __import__("dataclasses").fields(config.ClusterConfig)][-4:],
    "answers": {k: answers[k] for k in ("distributed_type", "toy_config")},
    "asked": [t for t in asker.asked if "toy" in t],
}))
"""
    found = json.loads(_python("-c", code, env=_toy_env()).stdout)
    assert found["engines"] == ["single", "ddp", "deepspeed", "fsdp", "toy"]
    assert found["variables"] == {"USE_TOY": "use the toy engine", "TOY_SCALE": "how much the toy engine scales"}
    assert found["section"] == ["toy_config", "fp8_config", "mpirun_config", "megatron_lm_config"]
    assert found["answers"] == {"distributed_type": "TOY", "toy_config": {"toy_scale": 2}}
    assert found["asked"] == ["Do you want to use the toy engine?", "How much should the toy engine scale?"]
    help_text = _python("-m", "hasten.commands.main", "launch", "-h", env=_toy_env()).stdout
    assert "  --use_toy             Use the toy engine.\n" in help_text
    assert help_text.index("--use_toy") < help_text.index("--use_megatron_lm")
    toy_section = "Toy arguments:\n  --toy_scale TOY_SCALE\n                        How much the toy engine scales."
    assert toy_section in help_text


@pytest.mark.slow
def test_the_toy_engine_is_chosen_by_argument_config_file_flag_and_variable(tmp_path):
    by_name = _report(_python(str(REPORT), "name", env=_toy_env()))
    assert by_name == {**TOY, "plugin_scale": 1, "model_scale": 1}
    by_plugin = _report(_python(str(REPORT), "plugin", env=_toy_env()))
    assert by_plugin == {**TOY, "plugin_scale": 3, "model_scale": 3}
    config_file = tmp_path / "toy.yaml"
    config_file.write_text("distributed_type: TOY\ntoy_config:\n  toy_scale: 5\n")
    by_file = _report(hasten_launch(REPORT, "launch", launch_args=("--config_file", str(config_file)), env=_toy_env()))
    assert by_file == {**TOY, "plugin_scale": 5, "model_scale": 5}
    by_flag = _report(hasten_launch(REPORT, "launch", launch_args=("--use_toy", "--toy_scale", "7"), env=_toy_env()))
    assert by_flag == {**TOY, "plugin_scale": 7, "model_scale": 7}
    by_variable = _report(_python(str(REPORT), "launch", env=_toy_env(HASTEN_USE_TOY="1", HASTEN_TOY_SCALE="9")))
    assert by_variable == {**TOY, "plugin_scale": 9, "model_scale": 9}
    plain = _report(_python(str(REPORT), "launch", env=_toy_env()))
    single = {"strategy": "SingleDeviceStrategy", "distributed_type": "NO"}
    assert plain == {**single, "plugin_scale": None, "model_scale": None}


def test_two_engines_cannot_claim_the_same_name_type_variable_or_argument(tmp_path, monkeypatch):
    (tmp_path / "twin.py").write_text(
        "from hasten.settings.engines import Engine\n"
        "ENGINE = Engine(name='twin', strategy='x:Y', distributed_types=('FSDP',))\n"
    )
    (tmp_path / "nothing.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match=r"'twin' \(from twin\) claims the distributed type 'FSDP' of engine 'fsdp'"):
        load_engines([*BUILT_IN, "twin"])
    with pytest.raises(ConfigError, match=r"'nothing' defines no ENGINE = hasten.settings.engines.Engine"):
        load_engines(["nothing"])
    with pytest.raises(ConfigError, match=r"'no_such_module' cannot be imported .*; check HASTEN_ENGINES"):
        load_engines(["no_such_module"])


def test_an_unknown_strategy_name_or_object_is_refused():
    from hasten import Accelerator

    unknown = r"strategy='fdsp' is not a registered engine; the engines are single, ddp, deepspeed, fsdp\. Did you mean"
    with pytest.raises(ConfigError, match=unknown):
        Accelerator(strategy="fdsp")
    with pytest.raises(ConfigError, match=r"strategy=object\(\.\.\.\) is neither a registered engine's name nor"):
        Accelerator(strategy=object())


def test_two_engines_asked_for_at_once_are_refused(monkeypatch):
    from hasten import Accelerator
    from hasten.utils import FullyShardedDataParallelPlugin

    monkeypatch.setenv("HASTEN_USE_DEEPSPEED", "1")
    both = r"Several engines are asked for \(fsdp by fsdp_plugin=; deepspeed by HASTEN_USE_DEEPSPEED\)"
    with pytest.raises(ConfigError, match=both):
        Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin())


def test_merge_weights_and_estimate_memory_ask_the_registrations(tmp_path):
    env = _toy_env()
    checkpoint = tmp_path / "checkpoint"
    checkpoint.mkdir()
    (checkpoint / "toy_shards.txt").write_text("two shards")
    merged = _python(
        "-m",
        "hasten.commands.merge_weights",
        str(checkpoint),
        str(tmp_path / "out"),
        "--max_shard_size",
        "1GB",
        env=env,
    )
    assert f"Merged the toy checkpoint {checkpoint} into {tmp_path / 'out' / 'toy_merged.txt'}" in merged.stdout
    assert (tmp_path / "out" / "toy_merged.txt").read_text() == "two shards safe=True max=1GB"
    empty = tmp_path / "empty"
    empty.mkdir()
    refused = subprocess.run(
        [sys.executable, "-m", "hasten.commands.merge_weights", str(empty), str(tmp_path / "out2")],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert refused.returncode == 1
    assert "a DeepSpeed ZeRO checkpoint" in refused.stderr and "nor a toy checkpoint (toy_shards.txt)" in refused.stderr
    table = _python(
        "-m", "hasten.commands.estimate_memory", "--num_params", "1000000", "--num_gpus", "2", env=env
    ).stdout
    assert "DeepSpeed ZeRO-3: memory for parameters" in table
    assert table.rstrip().endswith("Toy engine: 1000000 parameters on 2 GPU(s)")


def test_the_launch_help_reads_the_registrations_without_torch_or_any_strategy():
    code = (
        "import sys\nfrom hasten.commands.main import main\n"
        "try:\n    main(['launch', '-h'])\nexcept SystemExit:\n    pass\n"
        "names = [m for m in sys.modules if m == 'torch' or m.startswith('hasten.strategies.')]\n"
        "print(sorted(m for m in names if not m.endswith('.engine')))"
    )
    result = _python("-c", code, env=clean_env(PYTHONPATH=str(ROOT / "src")))
    packages = [f"hasten.strategies.{name}" for name in ("ddp", "deepspeed", "fsdp", "single")]
    assert result.stdout.strip().splitlines()[-1] == str(packages)


def test_ddp_joins_uneven_inputs_until_the_script_relabels_the_job_as_another_engine():
    from types import SimpleNamespace

    from hasten.enums import DistributedType
    from hasten.strategies.ddp.strategy import DDPStrategy

    strategy = DDPStrategy.__new__(DDPStrategy)
    strategy.state = SimpleNamespace(distributed_type=DistributedType.MULTI_CPU)
    assert strategy.joins_uneven_inputs is True
    strategy.state.distributed_type = DistributedType.FSDP  # what Accelerate's test_distributed_data_loop.py does
    assert strategy.joins_uneven_inputs is False


def test_every_built_in_engine_runs_the_strategy_contract():
    """Each built-in engine's test file (tests/strategies/test_<engine>.py) subclasses the shared StrategyContract."""
    import ast

    for registration in BUILT_IN:
        engine = registration.split(".")[-2]
        tree = ast.parse((ROOT / "tests" / "strategies" / f"test_{engine}.py").read_text())
        classes = [node for node in tree.body if isinstance(node, ast.ClassDef)]
        contracts = [c.name for c in classes if any(getattr(base, "id", "") == "StrategyContract" for base in c.bases)]
        assert len(contracts) == 1, f"tests/strategies/test_{engine}.py: {contracts or 'no StrategyContract subclass'}"
