"""Sequence parallelism (ParallelismConfig(sp_size=k)): which engine a layout chooses and which backend it runs, the
checks made before training, the batch split; then real processes (slow): hasten's Ulysses under DDP and FSDP2
against one process without sequence parallelism (tests/scripts/sp_training.py), DeepSpeed's Ulysses against the
reference copy of Accelerate 1.15 on the same script and against a run without it (tests/scripts/sp_deepspeed.py),
and the memory per process at a long sequence (tests/scripts/sp_memory.py)."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import torch
from differential import side_env
from helpers import ROOT, SCRIPTS, clean_env, free_port, requires, torchrun

from hasten import DeepSpeedPlugin, ParallelismConfig
from hasten.data_loader.sequence_sharding import SequenceShardingError, split_batch
from hasten.environment import patch_environment
from hasten.errors import ConfigError, NotSupportedError
from hasten.plugins.training import GradientAccumulationPlugin
from hasten.runtime.parallelism_handlers import DeepSpeedSequenceParallelConfig, RecurrentLayersError
from hasten.runtime.sequence_parallel import check_model, settle_layout
from hasten.strategies.base import EngineSettings
from hasten.strategies.ddp.strategy import _replicate_only
from hasten.strategies.plan import plan_strategy


def _engine(arguments: dict, processes: int = 2) -> str:
    """The engine planned for ``arguments``, checking that it got the layout given."""
    plan = plan_strategy(EngineSettings("no", GradientAccumulationPlugin(), arguments), processes)
    assert plan.arguments().get("parallelism_config") is arguments["parallelism_config"]
    return plan.engine.name


def test_the_layout_goes_to_the_engine_asked_for_or_chooses_one():
    splits = ParallelismConfig(sp_size=2)
    assert _engine({"parallelism_config": splits}) == "ddp", "a layout that only splits sequences runs under DDP"
    assert _engine({"parallelism_config": ParallelismConfig(sp_size=2, dp_shard_size=2)}) == "fsdp"
    assert _engine({"parallelism_config": ParallelismConfig(tp_size=2)}) == "fsdp"
    with_deepspeed = {"parallelism_config": splits, "deepspeed_plugin": DeepSpeedPlugin(zero_stage=2)}
    assert _engine(with_deepspeed) == "deepspeed"
    # Accelerate's config file for sequence parallelism: distributed_type DEEPSPEED with a parallelism_config section
    # (this asked for two engines, FSDP by the section and DeepSpeed by the switch, and raised)
    with patch_environment(HASTEN_USE_DEEPSPEED="true", HASTEN_PARALLELISM_CONFIG_SP_SIZE="2"):
        plan = plan_strategy(EngineSettings("no", GradientAccumulationPlugin(), {}), 2)
        assert plan.engine.name == "deepspeed" and plan.arguments()["parallelism_config"].sp_size == 2
    with patch_environment(HASTEN_PARALLELISM_CONFIG_SP_SIZE="2"):
        assert plan_strategy(EngineSettings("no", GradientAccumulationPlugin(), {}), 2).engine.name == "ddp"


def test_the_engine_settles_the_backend():
    config = ParallelismConfig(sp_size=2)
    assert config.sp_backend == "deepspeed", "Accelerate's default, until an engine settles it"
    assert config.resolve_sp_backend("deepspeed") is None and config.sp_backend == "deepspeed"
    config = ParallelismConfig(sp_size=2)
    assert config.resolve_sp_backend("fsdp") is None and config.sp_backend == "accelerate"
    explicit = ParallelismConfig(sp_size=2, sp_backend="deepspeed")
    assert "needs the DeepSpeed engine" in explicit.resolve_sp_backend("ddp") and explicit.sp_backend == "accelerate"
    ours = ParallelismConfig(sp_size=2, sp_backend="accelerate")
    assert ours.resolve_sp_backend("deepspeed") is None and ours.sp_backend == "accelerate"
    with patch_environment(PARALLELISM_CONFIG_SP_BACKEND="accelerate"):
        assert ParallelismConfig(sp_size=2).sp_backend == "accelerate"
    with pytest.raises(ConfigError, match="sp_backend is 'deepspeed' .* or 'accelerate'"):
        ParallelismConfig(sp_size=2, sp_backend="ring")
    assert ParallelismConfig(sp_size=2, dp_shard_size=2).dp_shard_cp_dim_names == ["dp_shard", "sp"]


@requires("transformers")
def test_what_cannot_be_split_is_refused_before_training():
    import transformers

    def llama(heads=4, kv=2, attention="sdpa", **extra):
        config = transformers.LlamaConfig(
            vocab_size=16,
            hidden_size=8 * heads,
            intermediate_size=16,
            num_hidden_layers=1,
            num_attention_heads=heads,
            num_key_value_heads=kv,
            attn_implementation=attention,
            **extra,
        )
        return transformers.LlamaForCausalLM(config)

    assert check_model(llama(), 2, None) == "sdpa"
    assert check_model(llama(heads=4, kv=1), 2, None) == "sdpa", "fewer key/value heads than ranks: copies"
    assert check_model(llama(attention="eager"), 2, "sdpa") == "sdpa", "the handler's attention wins"
    with pytest.raises(ConfigError, match="sp_size=2 does not divide the 3 attention heads"):
        check_model(llama(heads=3, kv=3), 2, None)
    with pytest.raises(ConfigError, match="sp_size=4 and the 6 key/value heads"):
        check_model(llama(heads=12, kv=6), 4, None)
    with pytest.raises(ConfigError, match="cannot run 'eager' attention"):
        check_model(llama(attention="eager"), 2, None)
    with pytest.raises(ConfigError, match="no transformers config"):
        check_model(torch.nn.Linear(2, 2), 2, None)
    recurrent = llama()
    recurrent.config.layer_types = ["linear_attention"]
    with pytest.raises(RecurrentLayersError, match="recurrent state"):
        check_model(recurrent, 2, None)
    fixed = ParallelismConfig(sp_size=2, sp_handler=DeepSpeedSequenceParallelConfig(sp_seq_length=15))
    with pytest.raises(ConfigError, match="sp_seq_length=15.* not divisible by sp_size=2"):
        settle_layout(fixed, "ddp", "cpu")
    with pytest.raises(NotSupportedError, match="CUDA only"):
        settle_layout(ParallelismConfig(cp_size=2), "fsdp", "cpu")
    with pytest.raises(NotSupportedError, match="sequence parallelism with tensor parallelism"):
        settle_layout(ParallelismConfig(sp_size=2, tp_size=2), "fsdp", "cpu")
    from hasten.strategies.deepspeed.ulysses import check_deepspeed_layout

    with pytest.raises(NotSupportedError, match=r"tp_size=2\) under DeepSpeed"):
        check_deepspeed_layout(ParallelismConfig(tp_size=2, dp_shard_size=2))


def test_ddp_replicates_and_refuses_sharded_layouts():
    config = ParallelismConfig(sp_size=2)
    _replicate_only(config, 4)
    assert (config.dp_replicate_size, config.dp_shard_size) == (2, 1)
    with pytest.raises(NotSupportedError, match=r"dp_shard_size=2\) under DDP"):
        _replicate_only(ParallelismConfig(sp_size=2, dp_shard_size=2), 4)
    with pytest.raises(ConfigError, match="lays out 6 processes, but 4 run"):
        _replicate_only(ParallelismConfig(sp_size=2, dp_replicate_size=3), 4)


def test_a_batch_is_split_as_deepspeeds_adapter_gives_it():
    ids = torch.arange(16).reshape(2, 8)
    labels = ids.clone()
    labels[:, :3] = -100
    batch = {"input_ids": ids, "labels": labels, "attention_mask": torch.ones(2, 8), "weight": torch.ones(2)}
    parts = [split_batch(batch, rank, 2) for rank in range(2)]
    assert set(parts[0]) == {"input_ids", "shift_labels", "position_ids", "attention_mask", "weight"}
    assert torch.equal(torch.cat([p["input_ids"] for p in parts], 1), ids)
    assert torch.equal(torch.cat([p["position_ids"] for p in parts], 1), torch.arange(8).expand(2, 8))
    shifted = torch.cat([p["shift_labels"] for p in parts], 1)
    assert torch.equal(shifted[:, :-1], labels[:, 1:]) and (shifted[:, -1] == -100).all()
    assert torch.equal(parts[1]["weight"], torch.ones(2)), "tensors without the sequence dimension pass whole"
    whole = split_batch(batch, 1, 2, split=False)
    assert whole["input_ids"].shape == (2, 8) and "shift_labels" in whole
    with pytest.raises(SequenceShardingError, match="length 8 is not divisible by sp_size=3.*pad_to_multiple_of=3"):
        split_batch(batch, 0, 3)
    with pytest.raises(ValueError, match="mappings with an input_ids tensor"):
        split_batch((ids, labels), 0, 2)


def test_position_ids_made_for_a_part_are_refused(monkeypatch):
    """A batch the loader did not split reaches the attention with position ids 0..n-1 on every rank: an error, not
    attention over copies of the sequence."""
    from hasten.runtime import ulysses

    def gather(parts, tensor, group=None):
        for part in parts:
            part.copy_(tensor)

    monkeypatch.setattr(ulysses.dist, "all_gather", gather)
    cache = ulysses._PositionCache()
    with pytest.raises(ConfigError, match="position_ids 0..7 on every one of the 2"):
        cache.update(torch.arange(8)[None], None, 2)
    cache.update(torch.arange(8, 16)[None], None, 2)  # [8..15, 8..15]: not a fresh start on every rank
    assert cache.packed is False
    mask = ulysses._document_causal_mask(torch.tensor([[0, 1, 2, 0, 1]]))
    assert mask[0, 0, 4].tolist() == [False, False, False, True, True], "causal within the second document only"


# ------------------------------------------------------------------------------------------ real processes


def _passed(out: str, nproc: int) -> dict[str, str]:
    assert all(f"rank {rank}: sp checks passed" in out for rank in range(nproc)), out
    return dict(re.findall(r"RESULT \w+ (\w+): (.*?) \|", out))


@pytest.mark.slow
@requires("transformers")
@pytest.mark.parametrize(
    "nproc", [2, pytest.param(4, marks=requires("all cases"))], ids=["sp2", "sp2xdp2"]
)  # 4 processes on the 2-core machine: make test-all
def test_ddp_and_fsdp_split_sequences_like_one_process(nproc, tmp_path):
    """Losses, first-step gradients and final parameters of one process without sequence parallelism; evaluation
    logits; a resumed run's losses (2 processes)."""
    for engine in ("ddp", "fsdp"):
        out = torchrun(SCRIPTS / "sp_training.py", engine, str(tmp_path / engine), nproc=nproc, timeout=600).stdout
        results = _passed(out, nproc)
        diffs = json.loads(results["training"])
        assert max(diffs.values()) < 2e-5, diffs
        assert float(results["evaluation"]) < 2e-5
        assert nproc == 4 or float(results["resume"]) < 2e-5


def _deepspeed_side(side: str, nproc: int, tmp_path, *args: str, dp_shard: int = 0) -> dict:
    """tests/scripts/sp_deepspeed.py on one side (``import accelerate``: the reference copy or hasten), without
    ``ACCELERATE_USE_CPU`` (which turns Accelerate's DeepSpeed off)."""
    out = tmp_path / f"{side}-{nproc}-{'-'.join(args)}"
    env = side_env(side)
    env["SP_TEST_DP_SHARD"] = str(dp_shard)
    launch = ["--nproc_per_node", str(nproc), "--master_addr", "127.0.0.1", "--master_port", str(free_port())]
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", *launch, str(SCRIPTS / "sp_deepspeed.py"), str(out), *args],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, f"{side}: {proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return json.loads((out / "result.json").read_text())


def _check_against_the_run_without(result: dict, resume: bool = False) -> None:
    for stage, found in result.items():
        assert found["grad_diff"] < 1e-6, (stage, found)
        if found["factor"] == 1:
            assert found["loss_diff"] < 2e-5 and found["param_rel"] < 2e-4, (stage, found)
    if resume:
        assert [result[stage]["resume_diff"] for stage in ("zero2", "zero3") if stage in result] == [0.0] * len(
            {"zero2", "zero3"} & set(result)
        ), result


@pytest.mark.slow
@requires("deepspeed")
@requires("reference")
@pytest.mark.parametrize(
    ("nproc", "stages", "dp_shard"),
    [(2, "1,2,3", 0), pytest.param(4, "2,3", 2, marks=requires("all cases"))],
    ids=["sp2", "sp2xdp2"],
)  # 4 processes on the 2-core machine: make test-all
def test_deepspeed_ulysses_trains_as_accelerate_does(nproc, stages, dp_shard, tmp_path):
    """The same script on Accelerate 1.15 and on hasten, ZeRO-1 to 3: the same losses, gradients and parameters, bit
    for bit; against a run without sequence parallelism the gradients are sp times larger under ZeRO-1/2 with
    Accelerate's documented loss and equal under ZeRO-3 (DeepSpeed's own scaling, the same on both sides). On 4
    processes Accelerate needs dp_shard_size=2 (without it DeepSpeed refuses its train_batch_size)."""
    args = (stages, "same", "deepspeed", "recipe")
    theirs = _deepspeed_side("accelerate", nproc, tmp_path, *args, dp_shard=dp_shard)
    ours = _deepspeed_side("hasten", nproc, tmp_path, *args, dp_shard=dp_shard)
    for stage in theirs:
        for key in ("losses", "grad_sample", "param_sample", "grad_ratio"):
            assert ours[stage][key] == theirs[stage][key], (stage, key, ours[stage][key], theirs[stage][key])
        assert "sp=2" in ours[stage]["mesh"] and theirs[stage]["mesh"] == "None"
    _check_against_the_run_without(ours, resume=nproc == 2)


@pytest.mark.slow
@requires("deepspeed", "all cases")  # 4 processes, then 2 (make test-all)
def test_deepspeed_sequence_parallelism_equals_a_run_without_it(tmp_path):
    """hasten only: every rank reading its own samples on 4 processes without data-parallel sizes (DeepSpeed's
    Ulysses, the loss divided by sp under ZeRO-1), and hasten's Ulysses under DeepSpeed on 2 processes (ZeRO-1 to 3,
    Accelerate's loss as documented): equal to one process without sequence parallelism."""
    _check_against_the_run_without(_deepspeed_side("hasten", 4, tmp_path, "1", "distinct", "deepspeed", "divided"))
    ours = _deepspeed_side("hasten", 2, tmp_path, "1,2,3", "distinct", "accelerate", "recipe")
    assert all(found["factor"] == 1 for found in ours.values())
    _check_against_the_run_without(ours, resume=True)


@pytest.mark.slow
@requires("transformers")
def test_activations_per_process_halve_with_two_sequence_parallel_ranks():
    """The bytes autograd keeps for the backward, per process, at 4096 tokens: half with sp 2 (the table of
    docs/parallelism.md comes from the same script at longer sequences)."""
    alone = subprocess.run(
        [sys.executable, str(SCRIPTS / "sp_memory.py"), "4096"],
        env=clean_env(),
        cwd=ROOT,
        capture_output=True,
        text=True,
    ).stdout
    split = torchrun(SCRIPTS / "sp_memory.py", "4096", nproc=2).stdout
    values = [dict(re.findall(r"(\w+)=([\d.]+)", line)) for line in (alone, split) if "MEMORY" in line]
    assert len(values) == 2, (alone, split)
    ratio = float(values[1]["saved_mb"]) / float(values[0]["saved_mb"])
    assert 0.45 < ratio < 0.55, values
