"""ZeRO 1-3 checkpoints resumed on another number of processes (strategies/deepspeed/resharding.py).

The launches run tests/scripts/zero_resharding.py (a tiny transformer with tied weights, AdamW, fp32, every stage in
one launch): after the resume the next steps' losses, the fp32 weights and Adam's moments match a run on the target
number of processes that never stopped, within 1e-6 relative, and right after the load the masters and moments are
the saved ones bit for bit (also in bf16 mixed precision, whose files are named bf16_zero_pp_rank_*, with the module's
bf16 weights the masters). 2->1 and 1->2 run by default; 4->2 and 2->4 with --all-cases. The checks of the reader
and of the loader's refusals run without a launch, on those checkpoints.
"""

import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from differential import side_env
from helpers import ROOT, SCRIPTS, free_port, requires, torchrun

from hasten.errors import CheckpointError
from hasten.strategies.deepspeed.resharding import apply_zero_full_state, read_zero_checkpoint

pytestmark = [pytest.mark.slow, requires("deepspeed")]

SCRIPT = SCRIPTS / "zero_resharding.py"
STAGES = "1,2,3"
TIMEOUT = 600
PARTITIONED = "were partitioned again in memory"


def _launch(nproc: int, root: Path, *actions: str) -> str:
    out = torchrun(SCRIPT, str(root), STAGES, *actions, nproc=nproc, timeout=TIMEOUT)
    text = out.stdout + out.stderr
    for action in actions:
        for stage in STAGES.split(","):
            for rank in range(nproc):
                assert f"rank {rank}: {action} zero{stage} passed" in text, text[-4000:]
    return text


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Checkpoints of every stage saved on 2 and on 1 process; the 1-process launch also resumes the 2-process ones."""
    root = tmp_path_factory.mktemp("zero")
    _launch(2, root, "save", "save-bf16")
    resumed = _launch(1, root, "resume:2", "resume-bf16:2", "save", "save-bf16")
    return SimpleNamespace(root=root, two_to_one=resumed)


def test_two_processes_to_one(checkpoints):
    assert checkpoints.two_to_one.count(PARTITIONED) == 6, checkpoints.two_to_one[-4000:]
    assert "saved by 2 process(es) and is resumed on 1" in checkpoints.two_to_one


def test_one_process_to_two(checkpoints):
    text = _launch(2, checkpoints.root, "resume:1", "resume-bf16:1")
    assert text.count(PARTITIONED) == 6, text[-4000:]  # one line per resume, from the main process only


@requires("reference")
def test_a_checkpoint_of_accelerate_on_two_processes_resumes_on_one_and_two(checkpoints):
    launch = ["--nproc_per_node", "2", "--master_addr", "127.0.0.1", "--master_port", str(free_port())]
    command = [sys.executable, "-m", "torch.distributed.run", *launch, str(SCRIPT), str(checkpoints.root), STAGES]
    saved = subprocess.run(
        [*command, "save"], env=side_env("accelerate"), cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT
    )
    assert saved.returncode == 0, saved.stderr[-6000:]
    assert (checkpoints.root / "accelerate" / "zero2_w2" / "pytorch_model").is_dir()
    text = _launch(1, checkpoints.root, "accelerate:2")
    assert text.count(PARTITIONED) == 3, text[-4000:]
    # and on the number of processes that saved it, through DeepSpeed's own load (hasten found no engine folder)
    text = _launch(2, checkpoints.root, "accelerate:2")
    assert PARTITIONED not in text, text[-4000:]


@requires("all cases")
def test_four_processes_to_two_and_two_to_four(checkpoints):
    _launch(4, checkpoints.root, "resume:2", "save")
    _launch(2, checkpoints.root, "resume:4")


# ------------------------------------------------------------------------------ without a launch


def test_the_full_state_holds_every_parameter_by_name(checkpoints):
    for stage in (1, 2, 3):
        state = read_zero_checkpoint(checkpoints.root / "hasten" / f"zero{stage}_w2")
        assert (state.stage, state.world_size) == (stage, 2)
        assert "head.weight" not in state.weights and "embed.weight" in state.weights  # tied: stored once
        assert state.weights["qkv.weight"].shape == (48, 16)
        assert set(state.optimizer_state["qkv.weight"]) == {"exp_avg", "exp_avg_sq", "step"}
        assert state.optimizer_state["qkv.weight"]["exp_avg"].shape == (48, 16)
        assert float(state.optimizer_state["down.bias"]["step"]) == 3.0
        assert state.param_groups[0]["weight_decay"] == 0.01 and "qkv.weight" in state.param_groups[0]["params"]
        assert state.engine["global_steps"] == 3 and "mask" in state.buffers
        one = read_zero_checkpoint(checkpoints.root / "hasten" / f"zero{stage}_w1")
        assert one.weights.keys() == state.weights.keys()


def _copy(checkpoints, tmp_path, stage: int) -> Path:
    folder = tmp_path / f"zero{stage}"
    shutil.copytree(checkpoints.root / "hasten" / f"zero{stage}_w2", folder)
    return folder / "deepspeed" / "state"


@pytest.mark.parametrize("stage", [2, 3])
def test_a_missing_or_damaged_shard_is_refused_naming_it(checkpoints, tmp_path, stage):
    files = _copy(checkpoints, tmp_path, stage)
    damaged = files / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    damaged.write_bytes(damaged.read_bytes()[:-200])
    with pytest.raises(CheckpointError, match=rf"{damaged}.*damaged or was not written completely"):
        read_zero_checkpoint(files)
    damaged.unlink()
    with pytest.raises(CheckpointError, match=r"should hold 2 \*_optim_states.pt files .* holds 1"):
        read_zero_checkpoint(files)


def _engine(model: torch.nn.Module, groups: int = 1, stage: int = 2):
    """What apply_zero_full_state looks at before it writes anything."""
    optimizer = SimpleNamespace(optimizer=SimpleNamespace(param_groups=[{} for _ in range(groups)]))
    return SimpleNamespace(module=model, optimizer=optimizer, zero_optimization_stage=lambda: stage)


def test_a_model_that_does_not_match_is_refused_naming_the_parameter(checkpoints):
    sys.path.insert(0, str(SCRIPTS))
    try:
        from zero_resharding import TinyTransformer
    finally:
        sys.path.remove(str(SCRIPTS))
    state = read_zero_checkpoint(checkpoints.root / "hasten" / "zero2_w2")
    model = TinyTransformer()
    model.extra = torch.nn.Linear(2, 2)
    with pytest.raises(CheckpointError, match=r"has no parameter 'extra.bias', which the model has"):
        apply_zero_full_state(_engine(model), state)
    model = TinyTransformer()
    model.up = torch.nn.Linear(16, 64)
    with pytest.raises(CheckpointError, match=r"parameter 'up.weight' has shape \(32, 16\) in the checkpoint and"):
        apply_zero_full_state(_engine(model), state)
    with pytest.raises(CheckpointError, match="holds 1 parameter groups; the optimizer has 2"):
        apply_zero_full_state(_engine(TinyTransformer(), groups=2), state)


def test_the_bf16_optimizer_of_zero_stage_0_is_refused_naming_the_file(checkpoints, tmp_path):
    files = _copy(checkpoints, tmp_path, 2)
    for rank in range(2):  # what DeepSpeed's bf16 optimizer writes: no ZeRO stage, its own layout
        torch.save(
            {"optimizer_state_dict": {"partition_count": 2}},
            files / f"bf16_zero_pp_rank_{rank}_mp_rank_00_optim_states.pt",
        )
        (files / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt").unlink()
    first = files / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"
    with pytest.raises(
        CheckpointError, match=rf"{first} holds the state of DeepSpeed's bf16 optimizer of ZeRO stage 0"
    ):
        read_zero_checkpoint(files)
