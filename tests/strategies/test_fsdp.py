"""FSDP2: the strategy contract (tests/strategies/contract.py), the plugin's settings (arguments, environment, FSDP1
translation and refusals), merging sharded checkpoints, and two real processes trained against DDP and resumed from
checkpoints (tests/scripts/fsdp_*.py)."""

import functools
import json
import pickle
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import SCRIPTS, hasten_launch, torchrun
from safetensors.torch import load_file
from strategies.contract import Answers, StrategyContract

from hasten import Accelerator
from hasten.enums import DistributedType
from hasten.errors import CheckpointError, ConfigError
from hasten.strategies.fsdp.merging import merge_fsdp_weights, read_sharded_model
from hasten.strategies.fsdp.plugin import FullyShardedDataParallelPlugin as Plugin
from hasten.strategies.fsdp.wrapping import ignored_parameters, wrap_targets

sys.path.insert(0, str(SCRIPTS))
from fsdp_model import Block, make_model  # noqa: E402

# ----------------------------------------------------------------------------------- the strategy contract


class TestFSDPContract(StrategyContract):
    """tests/strategies/contract.py on one process (FSDP2 over a private one-process group)."""

    ANSWERS = Answers(
        distributed_type=DistributedType.FSDP,
        replicates_model=False,
        joins_uneven_inputs=False,
        handles_optimizer_step=False,
        saves_full_state_dicts=False,
        save_needs_every_process=True,
    )

    def build(self, tmp_path, **kwargs) -> Accelerator:
        return Accelerator(cpu=True, strategy="fsdp", **kwargs)


# ----------------------------------------------------------------------------------- plugin settings


def test_defaults_are_fsdp2_full_shard_with_sharded_checkpoints():
    plugin = Plugin()
    assert (plugin.fsdp_version, plugin.sharding_strategy, plugin.reshard_after_forward) == (2, "FULL_SHARD", True)
    assert (plugin.auto_wrap_policy, plugin.state_dict_type, plugin.cpu_offload, plugin.sync_module_states) == (
        "NO_WRAP",
        "SHARDED_STATE_DICT",
        False,
        False,
    )


def test_settings_come_from_the_environment(monkeypatch):
    monkeypatch.setenv("HASTEN_FSDP_SHARDING_STRATEGY", "2")
    monkeypatch.setenv("FSDP_OFFLOAD_PARAMS", "true")
    monkeypatch.setenv("ACCELERATE_FSDP_TRANSFORMER_CLS_TO_WRAP", "Block, Other")
    monkeypatch.setenv("HASTEN_FSDP_STATE_DICT_TYPE", "FULL_STATE_DICT")
    monkeypatch.setenv("HASTEN_FSDP_CPU_RAM_EFFICIENT_LOADING", "1")
    monkeypatch.setenv("HASTEN_FSDP_USE_ORIG_PARAMS", "true")
    plugin = Plugin()
    assert (plugin.sharding_strategy, plugin.reshard_after_forward, plugin.cpu_offload) == (
        "SHARD_GRAD_OP",
        False,
        True,
    )
    assert (plugin.auto_wrap_policy, plugin.transformer_cls_names_to_wrap) == (
        "TRANSFORMER_BASED_WRAP",
        ["Block", "Other"],
    )
    assert (plugin.state_dict_type, plugin.cpu_ram_efficient_loading, plugin.sync_module_states) == (
        "FULL_STATE_DICT",
        True,
        True,
    )


def test_reshard_after_forward_accepts_a_flag_or_a_strategy_name(monkeypatch):
    monkeypatch.setenv("HASTEN_FSDP_RESHARD_AFTER_FORWARD", "HYBRID_SHARD")
    assert (Plugin().sharding_strategy, Plugin().reshard_after_forward) == ("HYBRID_SHARD", True)
    monkeypatch.setenv("HASTEN_FSDP_RESHARD_AFTER_FORWARD", "false")
    assert (Plugin().sharding_strategy, Plugin().reshard_after_forward) == ("SHARD_GRAD_OP", False)
    assert Plugin(reshard_after_forward=4).reshard_after_forward == 4
    assert Plugin(sharding_strategy="NO_SHARD").reshard_after_forward is False


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"fsdp_version": 1}, "hasten runs FSDP2 .* only"),
        ({"use_orig_params": False}, "use_orig_params=False is an FSDP1 setting"),
        ({"backward_prefetch": "BACKWARD_POST"}, "backward_prefetch='BACKWARD_POST' is an FSDP1 setting"),
        ({"limit_all_gathers": False}, "limit_all_gathers=False is an FSDP1 setting"),
        ({"state_dict_type": "LOCAL_STATE_DICT"}, "state_dict_type='LOCAL_STATE_DICT' is an FSDP1 setting"),
        ({"param_init_fn": lambda m: m}, "param_init_fn=.* cpu_ram_efficient_loading=True"),
        ({"activation_checkpointing_offload": True}, "activation_checkpointing_offload=True is not supported"),
        (
            {"mixed_precision_policy": {"param_dtype": "bf16", "buffer_dtype": "bf16"}},
            r"\['buffer_dtype'\].* FSDP1 setting",
        ),
        ({"mixed_precision_policy": {"param_dtyp": "bf16"}}, "unknown key 'param_dtyp'.*Did you mean 'param_dtype'"),
        ({"sharding_strategy": "FULL_SHARDS"}, "Did you mean 'FULL_SHARD'"),
        ({"sharding_strategy": "FULL_SHARD", "reshard_after_forward": False}, "means reshard_after_forward=True"),
        ({"cpu_ram_efficient_loading": True, "sync_module_states": False}, "needs sync_module_states=True"),
        ({"auto_wrap_policy": "TRANSFORMER_WRAP"}, "Did you mean 'TRANSFORMER_BASED_WRAP'"),
    ],
)
def test_settings_fsdp2_cannot_honour_are_refused_by_name(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        Plugin(**kwargs)


def test_fsdp1_settings_with_fsdp2_meaning_are_accepted():
    from torch.distributed.fsdp import CPUOffload, MixedPrecision
    from torch.distributed.fsdp.wrap import (
        lambda_auto_wrap_policy,
        size_based_auto_wrap_policy,
        transformer_auto_wrap_policy,
    )

    plugin = Plugin(
        use_orig_params=True,
        backward_prefetch="BACKWARD_PRE",
        cpu_offload=CPUOffload(offload_params=True),
        mixed_precision_policy=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
        auto_wrap_policy=functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block}),
    )
    assert plugin.cpu_offload is True and plugin.transformer_cls_names_to_wrap == ["Block"]
    assert (plugin.mixed_precision_policy.param_dtype, plugin.mixed_precision_policy.reduce_dtype) == (
        torch.bfloat16,
        torch.float32,
    )
    sized = Plugin(auto_wrap_policy=functools.partial(size_based_auto_wrap_policy, min_num_params=500))
    assert (sized.auto_wrap_policy, sized.min_num_params) == ("SIZE_BASED_WRAP", 500)
    is_block = lambda module: isinstance(module, Block)  # noqa: E731
    assert (
        Plugin(auto_wrap_policy=functools.partial(lambda_auto_wrap_policy, lambda_fn=is_block)).auto_wrap_policy
        is is_block
    )
    with pytest.raises(ConfigError, match=r"must be callable as policy\(module\) -> bool"):
        Plugin(auto_wrap_policy=lambda module, recurse, nonwrapped_numel: True)


def test_mixed_precision_gathers_in_half_and_reduces_in_fp32():
    plugin = Plugin()
    plugin.set_mixed_precision("bf16")
    assert (plugin.mixed_precision_policy.param_dtype, plugin.mixed_precision_policy.reduce_dtype) == (
        torch.bfloat16,
        torch.float32,
    )
    kept = Plugin(mixed_precision_policy={"param_dtype": "fp16", "reduce_dtype": "float16"})
    kept.set_mixed_precision("bf16")
    assert kept.mixed_precision_policy.reduce_dtype == torch.float16, "a policy given by the user is kept"
    with pytest.raises(ConfigError, match="buffer_autocast=True is an FSDP1 setting"):
        plugin.set_mixed_precision("bf16", buffer_autocast=True)


def test_wrap_targets_follow_the_policy():
    model = make_model()
    assert wrap_targets(Plugin(auto_wrap_policy="TRANSFORMER_BASED_WRAP"), model) == list(model.layers), (
        "_no_split_modules is the default"
    )
    sized = wrap_targets(Plugin(min_num_params=1000), model)
    assert model.layers[0].mlp[0] in sized and model.layers[0] in sized and model.layers[0].norm1 not in sized
    assert wrap_targets(Plugin(auto_wrap_policy=lambda m: isinstance(m, torch.nn.LayerNorm)), model) == [
        m for m in model.modules() if isinstance(m, torch.nn.LayerNorm)
    ]
    assert wrap_targets(Plugin(), model) == []
    with pytest.raises(
        ConfigError, match="names 'Blok', which is not a module class of this model. Did you mean 'Block'"
    ):
        wrap_targets(Plugin(transformer_cls_names_to_wrap=["Blok"]), model)
    with pytest.raises(ConfigError, match="ignored_modules='lm_head' matches no module name"):
        ignored_parameters(Plugin(ignored_modules="lm_head"), model)
    assert ignored_parameters(Plugin(ignored_modules=r"layers\.\d\.mlp"), model) == set(
        model.layers[0].mlp.parameters()
    ) | set(model.layers[1].mlp.parameters())


def test_use_fsdp_selects_fsdp_and_trains_on_one_process(monkeypatch):
    monkeypatch.setenv("HASTEN_USE_FSDP", "1")
    acc = Accelerator(cpu=True)
    assert acc.distributed_type == DistributedType.FSDP and acc.is_fsdp2
    model = make_model()
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))  # a private one-process group
    before = [p.detach().full_tensor().clone() for p in model.parameters()]
    tokens = torch.randint(0, 16, (2, 8))
    acc.backward(model(tokens).float().pow(2).mean())
    opt.step()
    assert any(not torch.equal(a, p.detach().full_tensor()) for a, p in zip(before, model.parameters()))


# ----------------------------------------------------------------------------------- merging


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_merge_fsdp_weights_writes_one_safetensors_model(tmp_path):
    model = make_model()
    shards = tmp_path / "ckpt" / "pytorch_model_fsdp_0"
    dcp.save({"model": model.state_dict()}, checkpoint_id=shards, no_dist=True)
    written = merge_fsdp_weights(tmp_path / "ckpt", tmp_path / "out", remove_checkpoint_dir=True)
    assert [p.name for p in written] == ["model.safetensors"] and not (tmp_path / "ckpt").exists()
    merged = load_file(tmp_path / "out" / "model.safetensors")
    assert merged.keys() == model.state_dict().keys() and all(
        torch.equal(merged[k], v) for k, v in model.state_dict().items()
    )


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_merge_refuses_missing_and_unsafe_checkpoints(tmp_path):
    with pytest.raises(CheckpointError, match="holds no FSDP sharded model"):
        merge_fsdp_weights(tmp_path, tmp_path / "out")
    shards = tmp_path / "pytorch_model_fsdp_0"
    dcp.save({"model": {"w": torch.ones(2)}}, checkpoint_id=shards, no_dist=True)

    class Exploit:
        def __reduce__(self):
            return (print, ("this must never run",))

    (shards / ".metadata").write_bytes(pickle.dumps(Exploit()))
    with pytest.raises(CheckpointError, match="refers to builtins.print, which is not a DCP metadata type"):
        read_sharded_model(tmp_path)


# ----------------------------------------------------------------------------------- two processes


@pytest.mark.slow
def test_fsdp_trains_like_ddp_on_two_processes():
    out = torchrun(SCRIPTS / "fsdp_training.py").stdout
    assert "rank 0: fsdp training checks passed" in out and "rank 1: fsdp training checks passed" in out
    assert "MEMORY rank 0: 15552 of 31104 parameter bytes (0.500)" in out


@pytest.mark.slow
def test_the_three_prepare_orders_train_identically():
    out = torchrun(SCRIPTS / "fsdp_prepare_orders.py").stdout
    assert all(f"rank {rank}: fsdp prepare orders give identical losses over 20 steps" in out for rank in (0, 1)), out


@pytest.mark.slow
def test_fsdp_checkpoints_resume_in_a_new_process_group(tmp_path):
    for mode, nproc in (("save", 2), ("resume", 2), ("reshard", 1)):
        out = torchrun(SCRIPTS / "fsdp_resume.py", mode, str(tmp_path), nproc=nproc).stdout
        assert f"rank 0: fsdp {mode} checks passed" in out, out


@pytest.mark.slow
def test_accelerate_fsdp_helpers_save_and_load_for_real(tmp_path):
    out = torchrun(SCRIPTS / "fsdp_accelerate_helpers.py", str(tmp_path), timeout=400).stdout
    assert (
        "rank 0: fsdp accelerate helpers checks passed" in out
        and "rank 1: fsdp accelerate helpers checks passed" in out
    ), out


_CONFIG = """\
compute_environment: LOCAL_MACHINE
distributed_type: FSDP
use_cpu: true
num_processes: 2
fsdp_config:
  fsdp_sharding_strategy: SHARD_GRAD_OP
  fsdp_backward_prefetch: BACKWARD_PRE
  fsdp_use_orig_params: true
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_transformer_layer_cls_to_wrap: Block
"""


@pytest.mark.slow
def test_config_file_and_launch_flags_reach_the_plugin(tmp_path):
    config = tmp_path / "fsdp.yaml"
    config.write_text(_CONFIG)
    out = hasten_launch(
        SCRIPTS / "fsdp_launch_settings.py",
        launch_args=("--config_file", str(config), "--fsdp_state_dict_type", "FULL_STATE_DICT"),
    ).stdout
    lines = sorted(line.split(" ", 3)[1:] for line in out.splitlines() if line.startswith("SETTINGS"))
    assert [line[:2] for line in lines] == [["0", "FSDP"], ["1", "FSDP"]], out
    settings = json.loads(lines[0][2])
    assert settings == {
        "activation_checkpointing": False,
        "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
        "cpu_offload": False,
        "reshard_after_forward": False,
        "sharding_strategy": "SHARD_GRAD_OP",
        "state_dict_type": "FULL_STATE_DICT",
        "transformer_cls_names_to_wrap": ["Block"],
        "use_orig_params": True,
    }
