"""The public surface is frozen here: adding or dropping a name is a deliberate, reviewed change."""

import subprocess
import sys

import hasten
import hasten.utils

TOP_LEVEL = {
    "Accelerator",
    "AutocastKwargs",
    "DDPCommunicationHookType",
    "DataLoaderConfiguration",
    "DeepSpeedPlugin",
    "DistributedDataParallelKwargs",
    "DistributedType",
    "FullyShardedDataParallelPlugin",
    "GradScalerKwargs",
    "InitProcessGroupKwargs",
    "ParallelismConfig",
    "PartialState",
    "ProfileKwargs",
    "TorchDynamoPlugin",
    "cpu_offload",
    "cpu_offload_with_hook",
    "debug_launcher",
    "disk_offload",
    "dispatch_model",
    "find_executable_batch_size",
    "infer_auto_device_map",
    "init_empty_weights",
    "init_on_device",
    "install_as_accelerate",
    "is_rich_available",
    "load_checkpoint_and_dispatch",
    "load_checkpoint_in_model",
    "notebook_launcher",
    "prepare_pippy",
    "skip_first_batches",
    "synchronize_rng_states",
}


def test_top_level_names_are_frozen_and_resolve():
    assert set(hasten.__all__) - {"__version__"} == TOP_LEVEL
    for name in TOP_LEVEL:
        assert getattr(hasten, name).__doc__, f"hasten.{name} has no docstring"


def test_utils_names_resolve_and_are_documented():
    for name in dir(hasten.utils):
        value = getattr(hasten.utils, name)
        is_type_alias = getattr(value, "__module__", None) == "typing"  # Accelerate's Literal aliases (FP8Format, ...)
        if callable(value) and not isinstance(value, type(hasten)) and not is_type_alias:
            assert value.__doc__, f"hasten.utils.{name} has no docstring"


def test_import_hasten_imports_no_optional_package():
    code = (
        "import sys, hasten, hasten.utils\n"
        "for name in hasten.__all__: getattr(hasten, name)\n"
        "for name in dir(hasten.utils): getattr(hasten.utils, name)\n"
        "print(sorted(m for m in ('deepspeed', 'tensorboard', 'transformers', 'wandb', 'mlflow', 'questionary') if m "
        "in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_unsupported_names_say_so():
    import pytest

    from hasten.errors import NotSupportedError

    with pytest.raises(NotSupportedError, match="context_parallel .* runs on CUDA only"):
        hasten.Accelerator(cpu=True, parallelism_config=hasten.ParallelismConfig(cp_size=2))
    assert hasten.ParallelismConfig(dp_shard_size=2, tp_size=2).tp_size == 2
    with pytest.raises(NotSupportedError, match="load_checkpoint_and_dispatch"):
        hasten.prepare_pippy(None)
