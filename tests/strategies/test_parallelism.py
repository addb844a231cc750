"""N-D parallelism: ParallelismConfig sizes and errors, tensor-parallel plans (resolution and errors), and real
processes training FSDP x TP, TP alone and HSDP against one-process references (tests/scripts/parallelism_*.py)."""

import re

import pytest
from helpers import SCRIPTS, hasten_launch, requires, torchrun
from torch import nn

from hasten import ParallelismConfig
from hasten.environment import patch_environment
from hasten.errors import ConfigError, NotSupportedError
from hasten.strategies.tensor_parallel import resolve_plan, tp_plan


def test_sizes_fill_the_shard_dimension_and_must_multiply_to_the_world():
    assert ParallelismConfig(tp_size=2).sizes(4) == {"dp_replicate": 1, "dp_shard": 2, "cp": 1, "sp": 1, "tp": 2}
    assert ParallelismConfig(dp_replicate_size=2, dp_shard_size=2).sizes(4)["dp_replicate"] == 2
    with pytest.raises(ConfigError, match="lays out 6 processes, but 4 run"):
        ParallelismConfig(dp_shard_size=3, tp_size=2).sizes(4)
    with pytest.raises(ConfigError, match="at least 1"):
        ParallelismConfig(tp_size=0)


def test_context_and_sequence_parallel_layouts_build_and_context_parallelism_is_refused_off_cuda():
    from hasten import Accelerator
    from hasten.runtime.parallelism import DeepSpeedSequenceParallelConfig, TorchContextParallelConfig

    config = ParallelismConfig(dp_shard_size=2, cp_size=2)
    assert config.cp_handler.cp_comm_strategy == "allgather"
    assert config._get_mesh() == (("dp_shard", "cp"), (2, 2))
    assert (config.dp_shard_cp_dim_names, config.dp_cp_dim_names) == (["dp_shard", "cp"], ["dp_shard", "cp"])
    with patch_environment(PARALLELISM_CONFIG_CP_COMM_STRATEGY="alltoall"):
        assert ParallelismConfig(cp_size=2).cp_handler.cp_comm_strategy == "alltoall"
    with pytest.raises(ValueError, match="Invalid cp_comm_strategy: ring"):
        TorchContextParallelConfig(cp_comm_strategy="ring")
    with pytest.raises(ValueError, match="Invalid sp_attn_implementation: eager"):
        DeepSpeedSequenceParallelConfig(sp_attn_implementation="eager")
    sequence = ParallelismConfig(sp_size=2)
    assert sequence.sp_handler.sp_seq_length_is_variable is True and sequence.sp_backend == "deepspeed"
    with pytest.raises(ValueError, match="mutually exclusive"):
        ParallelismConfig(cp_size=2, sp_size=2)
    with pytest.raises(ValueError, match="need a shard dimension"):
        ParallelismConfig(dp_replicate_size=2, dp_shard_size=1, tp_size=2)
    with pytest.raises(NotSupportedError, match="cp_size=2.* on cpu: torch's context_parallel .* CUDA only"):
        Accelerator(cpu=True, parallelism_config=ParallelismConfig(cp_size=2))


def test_the_mesh_has_the_axes_above_one_in_accelerates_order(monkeypatch):
    """Accelerate's layout, read without processes: the shape and names given to init_device_mesh, and the
    sub-meshes flattened (the real meshes are built by the multi-process tests below)."""
    import torch.distributed.device_mesh as device_mesh

    built = {}

    class Mesh:
        def __init__(self, device_type, shape, mesh_dim_names):
            built.update(shape=shape, names=mesh_dim_names, flattened=[])

        def __getitem__(self, dims):
            return type("Sub", (), {"_flatten": lambda _, name: built["flattened"].append((tuple(dims), name))})()

    monkeypatch.setattr(device_mesh, "init_device_mesh", Mesh)
    ParallelismConfig(dp_replicate_size=2, dp_shard_size=2, tp_size=2).build_device_mesh("cpu")
    assert (built["shape"], built["names"]) == ((2, 2, 2), ("dp_replicate", "dp_shard", "tp"))
    pair = ("dp_replicate", "dp_shard")
    assert built["flattened"] == [(pair, "dp"), (("dp_shard",), "dp_shard_cp"), (pair, "dp_cp")]
    assert ParallelismConfig(dp_replicate_size=8, dp_shard_size=1)._get_mesh() == (("dp_replicate",), (8,))
    assert ParallelismConfig(dp_shard_size=1).build_device_mesh("cpu") is None, "no axis above 1: no mesh"


def test_launch_settings_fill_unset_sizes():
    assert ParallelismConfig.from_launch_settings() is None
    with patch_environment(HASTEN_PARALLELISM_CONFIG_TP_SIZE="2", HASTEN_PARALLELISM_CONFIG_DP_SHARD_SIZE="2"):
        config = ParallelismConfig.from_launch_settings()
        assert (config.dp_replicate_size, config.dp_shard_size, config.tp_size) == (1, 2, 2)
        assert ParallelismConfig(tp_size=1).tp_size == 1, "an argument wins over the launch settings"
    with patch_environment(PARALLELISM_CONFIG_TP_SIZE="2"):
        assert ParallelismConfig.from_launch_settings().tp_size == 2, "Accelerate's unprefixed variables are read too"


class MLP(nn.Module):
    _tp_plan = {"up": "colwise", "down": "rowwise"}

    def __init__(self, hidden=8):
        super().__init__()
        self.up = nn.Linear(4, hidden)
        self.down = nn.Linear(hidden, 4)


def test_plans_resolve_patterns_and_refuse_what_does_not_fit():
    assert resolve_plan(MLP(), MLP._tp_plan, 2) == {"up": "colwise", "down": "rowwise"}
    layers = nn.Module()
    layers.layers = nn.ModuleList(MLP() for _ in range(2))
    assert resolve_plan(layers, {"layers.*.up": "colwise"}, 2) == {"layers.0.up": "colwise", "layers.1.up": "colwise"}
    with pytest.raises(ConfigError, match=r"'layers\.\*\.gate' -> 'colwise' names no module of Module"):
        resolve_plan(layers, {"layers.*.gate": "colwise"}, 2)
    with pytest.raises(
        ConfigError, match=r"tp_size=3 does not divide dimension 0 \(size 8\) of up.weight.*'up' -> 'colwise'"
    ):
        resolve_plan(MLP(), MLP._tp_plan, 3)
    with pytest.raises(ConfigError, match="style 'packed_moe'"):
        resolve_plan(MLP(), {"up": "packed_moe"}, 2)


@requires("transformers")
def test_transformers_models_carry_their_plan():
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
    )
    plan = tp_plan(transformers.LlamaForCausalLM(config))
    assert plan["model.layers.*.self_attn.q_proj"] == "colwise" and plan["model.layers.*.mlp.down_proj"] == "rowwise"
    assert plan["lm_head"] == "colwise_gather_output"


def _results(out: str, layout: str, nproc: int) -> dict[str, str]:
    assert all(f"rank {rank}: parallelism {layout} checks passed" in out for rank in range(nproc)), out
    return dict(re.findall(rf"RESULT {layout} (\w+): (.*?) \|", out))


@pytest.mark.slow
def test_tensor_parallel_alone_trains_like_one_process():
    results = _results(torchrun(SCRIPTS / "parallelism_training.py", "tp", nproc=2, timeout=400).stdout, "tp", 2)
    assert results.keys() == {"orders", "mlp", "llama"}
    assert "'tp': 2" in results["llama"]


@pytest.mark.slow
def test_launch_flags_lay_out_fsdp_x_tp_which_trains_like_one_process_on_a_quarter_of_the_bytes():
    flags = (
        "--cpu",
        "--num_processes",
        "4",
        "--parallelism_config_dp_shard_size",
        "2",
        "--parallelism_config_tp_size",
        "2",
    )
    results = _results(
        hasten_launch(SCRIPTS / "parallelism_training.py", "launch", launch_args=flags, timeout=500).stdout, "launch", 4
    )
    assert "{'dp_shard': 2, 'tp': 2}" in results["llama"], "Accelerate's mesh: the axes above 1"
    ratio = float(results["llama"].rsplit("(", 1)[1].rstrip(")"))
    assert "identical losses" in results["orders"]
    assert 0.25 <= ratio < 0.26, f"only the norm weights stay whole on the tensor-parallel ranks: {results['llama']}"


@pytest.mark.slow
def test_hsdp_trains_like_one_process():
    results = _results(torchrun(SCRIPTS / "parallelism_training.py", "hsdp", nproc=4, timeout=500).stdout, "hsdp", 4)
    assert "{'dp_replicate': 2, 'dp_shard': 2}" in results["mlp"] and "identical losses" in results["orders"]


@pytest.mark.slow
def test_fsdp_x_tp_checkpoints_resume_in_a_new_process_group_and_merge(tmp_path):
    for mode in ("save", "resume"):
        out = torchrun(SCRIPTS / "parallelism_resume.py", mode, str(tmp_path), nproc=4, timeout=500).stdout
        assert all(f"rank {rank}: parallelism {mode} checks passed" in out for rank in range(4)), out
    assert (tmp_path / "checkpoint" / "pytorch_model_fsdp_0").is_dir() and (
        tmp_path / "merged" / "model.safetensors"
    ).is_file()


def test_the_config_file_section_reaches_the_processes(tmp_path):
    from hasten import config as cfg

    path = tmp_path / "nd.yaml"
    path.write_text(
        "compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_CPU\nuse_cpu: true\nnum_processes: 4\n"
        "parallelism_config:\n  parallelism_config_dp_shard_size: 2\n  parallelism_config_tp_size: 2\n"
    )
    settings = cfg.resolve_settings(
        flags={}, loaded=cfg.read_config_file(path), env={}, hardware=lambda: cfg.Hardware("cpu", 0)
    )
    env = cfg.launch_environment(settings)
    assert (env["HASTEN_PARALLELISM_CONFIG_DP_SHARD_SIZE"], env["HASTEN_PARALLELISM_CONFIG_TP_SIZE"]) == ("2", "2")
    with patch_environment(**{k: v for k, v in env.items() if k.startswith("HASTEN_PARALLELISM_CONFIG_")}):
        config = ParallelismConfig.from_launch_settings()
    assert config.sizes(4) == {"dp_replicate": 1, "dp_shard": 2, "cp": 1, "sp": 1, "tp": 2}
