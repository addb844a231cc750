"""The DeepSpeed strategy: 2-process training against DDP, ZeRO-3 checkpoints and merging, fault messages.

The tests that train need DeepSpeed (``requires("deepspeed")``); the others run the strategy's own logic against a
stand-in engine and a stand-in ``deepspeed`` module (the ``deepspeed`` fixture), DeepSpeed installed or not. The
first DeepSpeed run on a machine compiles two C++ extensions (the CPU communication op and DeepSpeedCPUAdam, several
minutes); make setup builds them into .venv/torch_extensions, and the launches below get a longer time limit until
they are.
"""

import logging
import sys
from pathlib import Path

import pytest
import torch
from helpers import FIXTURES_ROOT, SCRIPTS, hasten_launch, requires, torchrun
from safetensors.torch import load_file
from strategies.contract import Answers, StrategyContract

from hasten import Accelerator
from hasten.commands import merge_weights
from hasten.enums import DistributedType
from hasten.errors import CheckpointError, NotSupportedError
from hasten.strategies.deepspeed.checkpoint import safe_torch_load
from hasten.strategies.deepspeed.memory_estimate import explain_deepspeed_failure
from hasten.strategies.deepspeed.plugin import DeepSpeedPlugin

pytestmark = pytest.mark.usefixtures("deepspeed")  # the stand-in, unless a test requires the real one

FIXTURES = FIXTURES_ROOT


def _launch_timeout() -> float:
    """Generous until DeepSpeed's extensions are compiled and cached on this machine."""
    from torch.utils.cpp_extension import _get_build_directory

    built = all(
        any(Path(_get_build_directory(name, verbose=False)).glob("*.so")) for name in ("deepspeed_shm_comm", "cpu_adam")
    )
    return 240 if built else 900


# ------------------------------------------------------------------------------- the strategy contract


@pytest.mark.slow
@requires("deepspeed")
class TestDeepSpeedContract(StrategyContract):
    """tests/strategies/contract.py on one process, with a real DeepSpeed engine (ZeRO 2, the plugin's default)."""

    ANSWERS = Answers(
        distributed_type=DistributedType.DEEPSPEED,
        replicates_model=False,
        joins_uneven_inputs=False,
        handles_optimizer_step=True,
        saves_full_state_dicts=False,
        save_needs_every_process=True,
    )

    # The engine accumulates, synchronises and clips inside its own step (test_accumulation_follows_sync_gradients...,
    # test_clipping_is_the_engines below): no_sync and clip_grad_norm_ are not the facade's to check here.
    test_no_sync_and_sync_in_backward_accumulate_local_gradients = None
    test_clip_grad_norm_returns_the_norm_before_clipping = None

    @pytest.fixture(autouse=True)
    def _fresh_deepspeed_comm(self, monkeypatch):
        """DeepSpeed keeps its communication backend and a copy of the world group in module globals, made once per
        process; the process group they wrap ends with each test, so each test starts without them."""
        from deepspeed.comm import comm
        from deepspeed.utils import groups

        monkeypatch.setattr(comm, "cdb", None)
        monkeypatch.setattr(groups, "_WORLD_GROUP", None)

    def build(self, tmp_path, **kwargs) -> Accelerator:
        return Accelerator(cpu=True, strategy="deepspeed", **kwargs)


# ------------------------------------------------------------------------------- 1 process

ONE_PROCESS_SCRIPT = """
import torch
from hasten import Accelerator

accelerator = Accelerator()
model = torch.nn.Linear(4, 2)
data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 4)), batch_size=2)
model, optimizer, data = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), data)
for (x,) in data:
    accelerator.backward(model(x).sum())
    optimizer.step()
    optimizer.zero_grad()
print("trained", accelerator.distributed_type.value, accelerator.num_processes)
"""


@pytest.mark.slow
@requires("deepspeed")
def test_one_process_without_a_launcher_trains(tmp_path):
    """DeepSpeed asserts LOCAL_RANK is set; `python train.py` and a 1-process `hasten launch` set none."""
    import subprocess

    from helpers import clean_env

    script = tmp_path / "train.py"
    script.write_text(ONE_PROCESS_SCRIPT)
    plain = subprocess.run(
        [sys.executable, str(script)],
        env=clean_env(HASTEN_USE_DEEPSPEED="1"),
        capture_output=True,
        text=True,
        timeout=_launch_timeout(),
    )
    assert plain.returncode == 0 and "trained DEEPSPEED 1" in plain.stdout, plain.stderr[-3000:]
    launched = hasten_launch(script, launch_args=("--num_processes", "1", "--use_deepspeed"), timeout=_launch_timeout())
    assert "trained DEEPSPEED 1" in launched.stdout


# ------------------------------------------------------------------------------- 2 processes


@pytest.mark.slow
@requires("deepspeed")
def test_zero_stages_train_like_ddp_with_offload_and_auto_config(tmp_path):
    out = torchrun(
        SCRIPTS / "deepspeed_training.py",
        str(tmp_path),
        str(FIXTURES / "deepspeed_zero3_auto.json"),
        timeout=_launch_timeout(),
    ).stdout
    assert "rank 0: deepspeed training checks passed" in out and "rank 1: deepspeed training checks passed" in out


@pytest.mark.slow
@requires("deepspeed")
def test_engine_scheduler_is_a_deepspeed_scheduler_wrapper_stepped_once_per_step():
    out = torchrun(SCRIPTS / "deepspeed_scheduler.py", timeout=_launch_timeout()).stdout
    assert "rank 0: deepspeed scheduler checks passed" in out and "rank 1: deepspeed scheduler checks passed" in out, (
        out
    )


@pytest.mark.slow
@requires("deepspeed")
def test_zero3_resume_merge_and_errors(tmp_path):
    flags = (
        "--num_processes",
        "2",
        "--use_deepspeed",
        "--zero_stage",
        "3",
        "--zero3_init_flag",
        "true",
        "--zero3_save_16bit_model",
        "true",
    )
    out = hasten_launch(
        SCRIPTS / "deepspeed_checkpoint.py", str(tmp_path), launch_args=flags, timeout=_launch_timeout()
    ).stdout
    assert "rank 0: deepspeed checkpoint checks passed" in out and "rank 1: deepspeed checkpoint checks passed" in out
    # The command line merges the same checkpoint into the same weights.
    assert merge_weights.main([str(tmp_path / "ckpt"), str(tmp_path / "cli"), "--unsafe_serialization"]) == 0
    from hasten.big_modeling.serialization import load

    by_cli = load(tmp_path / "cli" / "pytorch_model.bin")
    by_script = load_file(tmp_path / "merged" / "model.safetensors")
    assert by_cli.keys() == by_script.keys() and all(torch.equal(by_cli[k], by_script[k]) for k in by_cli)


# ------------------------------------------------------------------------------ fault messages


def test_a_process_killed_by_the_os_points_at_cpu_memory_and_offload():
    message = explain_deepspeed_failure(-9, offload_optimizer_device="cpu")
    assert "killed by the operating system (SIGKILL, exit code -9)" in message
    assert "more CPU memory than the machine has" in message and "(this run: offload_optimizer=cpu)" in message
    assert "hasten estimate-memory" in message and "offload to NVMe" in message
    assert explain_deepspeed_failure(137) is not None
    assert explain_deepspeed_failure(1) is None and explain_deepspeed_failure(0) is None


class _FakeOptimizer:
    loss_scale = 1024.0


class _FakeEngine:
    """The engine calls the strategy makes during training; ``overflow`` makes the next steps skip."""

    def __init__(self, accumulation=1, clipping=0.0):
        self.accumulation = accumulation
        self.clipping = clipping
        self.skipped_steps = 0
        self.steps = 0
        self.boundaries = []
        self.overflow = False
        self.optimizer = _FakeOptimizer()

    def managed_gradient_accumulation(self):
        return True

    def set_gradient_accumulation_boundary(self, value):
        self.boundaries.append(value)

    def backward(self, loss):
        loss.backward()

    def step(self):
        self.steps += 1
        self.skipped_steps += int(self.overflow)

    def gradient_accumulation_steps(self):
        return self.accumulation

    def gradient_clipping(self):
        return self.clipping

    def get_global_grad_norm(self):
        return 2.5


def _strategy(engine):
    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin())
    accelerator._strategy.engine = engine
    return accelerator, accelerator._strategy


def _loss(value=1.0):
    weight = torch.ones((), requires_grad=True)
    return weight * value


def test_fp16_overflow_skips_are_counted_and_reported(caplog):
    engine = _FakeEngine()
    accelerator, strategy = _strategy(engine)
    strategy._monitor.every = 3
    with caplog.at_level(logging.WARNING, logger="hasten.deepspeed"):
        strategy.backward(_loss())
        assert not strategy.step_was_skipped
        engine.overflow = True
        for _ in range(6):
            strategy.backward(_loss())
    assert strategy.step_was_skipped and engine.steps == 7 and engine.boundaries == [True] * 7
    reports = [r.getMessage() for r in caplog.records if "fp16 overflow" in r.getMessage()]
    assert len(reports) == 3, reports
    assert "(1 of 2 steps skipped so far; the loss scale is now 1024)" in reports[0]
    assert "(6 of 7 steps skipped so far" in reports[-1] and "raise fp16.initial_scale_power" in reports[-1]


def test_nan_loss_under_fp16_gets_the_bf16_advice():
    engine = _FakeEngine()
    engine.overflow = True
    _, strategy = _strategy(engine)
    with pytest.warns(
        UserWarning, match=r"The loss is NaN/inf under fp16. This usually happens with a model pretrained in bf16"
    ):
        strategy.backward(_loss(float("nan")))


def test_accumulation_follows_sync_gradients_and_warns_without_accumulate():
    engine = _FakeEngine(accumulation=2)
    accelerator, strategy = _strategy(engine)
    accelerator.gradient_accumulation_steps = 2
    model = torch.nn.Linear(1, 1)
    for _ in range(4):
        with accelerator.accumulate(model):
            strategy.backward(_loss())
    assert engine.boundaries == [False, True, False, True] and engine.steps == 2
    with pytest.warns(UserWarning, match=r"every backward is a synchronisation step.*accelerator.accumulate\(model\)"):
        for _ in range(3):
            strategy.backward(_loss())


def test_clipping_is_the_engines():
    _, strategy = _strategy(_FakeEngine(clipping=1.0))
    assert strategy.clip_grad_norm_([], 1.0).item() == 2.5
    with pytest.warns(
        UserWarning,
        match=(
            r"clip_grad_norm_\(max_norm=0.5\) under DeepSpeed: the engine clips with gradient_clipping from the "
            r"DeepSpeed config, which is 1.0"
        ),
    ):
        strategy.clip_grad_norm_([], 0.5)
    with pytest.raises(NotSupportedError, match="DeepSpeed clips gradients by norm only"):
        strategy.clip_grad_value_([], 1.0)
    assert strategy.scaler is None and strategy.handles_optimizer_step


def test_one_model_per_engine():
    _, strategy = _strategy(_FakeEngine())
    model = torch.nn.Linear(2, 2)
    with pytest.raises(NotSupportedError, match="trains one model with one optimizer"):
        strategy.prepare([model], [], [], [True], [])
    with pytest.raises(NotSupportedError, match=r"prepare_model\(model, evaluation_mode=True\)"):
        strategy.setup_model(model)


# ------------------------------------------------------------------------------ safe loading


class Smuggled:
    """A class a checkpoint must not be able to make hasten build."""


def test_checkpoint_files_load_without_running_code(tmp_path):
    path = tmp_path / "evil.pt"
    torch.save({"payload": Smuggled()}, path)
    with pytest.raises(CheckpointError, match=r"evil.pt holds a Python object hasten does not load"):
        safe_torch_load(path, path)


def test_merge_weights_detects_the_format(tmp_path, monkeypatch, capsys):
    assert merge_weights.main([str(tmp_path), str(tmp_path / "out")]) == 1
    assert "holds neither a DeepSpeed ZeRO checkpoint" in capsys.readouterr().err
    shards = tmp_path / "pytorch_model_fsdp_0"
    shards.mkdir()
    (shards / ".metadata").write_bytes(b"")
    calls = []
    from hasten.strategies.fsdp import merging as fsdp_merging

    monkeypatch.setattr(
        fsdp_merging,
        "merge_fsdp_weights",
        lambda *args, **kwargs: calls.append((args, kwargs)) or [Path("out/model.safetensors")],
    )
    assert merge_weights.main([str(tmp_path), str(tmp_path / "out")]) == 0
    assert calls == [((tmp_path, tmp_path / "out"), {"safe_serialization": True})]
    assert merge_weights.main([str(tmp_path), str(tmp_path / "inside"), "--remove_checkpoint_dir"]) == 1
    assert "would delete the output" in capsys.readouterr().err


def test_importing_the_deepspeed_modules_does_not_import_deepspeed():
    import subprocess

    code = (
        "import sys, hasten.commands.merge_weights, hasten.commands.estimate_memory, "
        "hasten.strategies.deepspeed.plugin, hasten.strategies.deepspeed.strategy; assert 'deepspeed' not in "
        "sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
