"""The launch helpers of ``accelerate.utils.launch``: the command and environment of the processes a launch starts.

Libraries that start training themselves (trl's CLI, notebook helpers) parse ``launch_command_parser()``'s
flags and call these. Here they run ``hasten launch``'s own resolution (flags > config file > environment >
defaults, with its checks), so the processes get exactly what ``hasten launch`` would give them.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from .. import environment
from ..enums import DistributedType
from ..errors import ConfigError, NotSupportedError
from ..settings.launch import DEBUG, MAIN_PROCESS_PORT


def _convert_nargs_to_dict(nargs: list[str]) -> dict[str, Any]:
    """A script's ``--name value`` arguments as SageMaker hyperparameters: ``{name: value}``, with whole numbers as
    ``int``, other numbers as ``float`` and ``True``/``False`` as booleans. SageMaker passes every hyperparameter
    with a value, so an option followed by another option, or last (a ``store_true`` switch), is a
    :class:`~hasten.errors.ConfigError` (a ``ValueError``, as in Accelerate)."""
    result: dict[str, Any] = {}
    for index, argument in enumerate(nargs):
        if not argument.startswith("-"):
            continue
        value = nargs[index + 1] if index + 1 < len(nargs) else None
        if value is None or value.startswith("-"):
            raise ConfigError(
                f"SageMaker hyperparameter {argument} has no value: SageMaker does not pass store_true/store_false "
                f"switches. Give it an explicit value ({argument} True) and a type in the script's parser."
            )
        result[argument.lstrip("-").replace("-", "_")] = _typed(value)
    return result


def _typed(text: str) -> Any:
    if text in ("True", "False"):
        return text == "True"
    try:
        number = float(text)
    except ValueError:
        return text
    return int(number) if number.is_integer() else number


def prepare_simple_launcher_cmd_env(args: argparse.Namespace) -> tuple[list[str], dict[str, str]]:
    """The command and environment of a one-process launch of ``args.training_script``."""
    from ..commands.launch import plan_partial_launch

    plan = plan_partial_launch(args)
    return plan.command, {**os.environ, **plan.env}


def prepare_multi_gpu_env(args: argparse.Namespace) -> dict[str, str]:
    """The environment of the processes of a multi-process launch (for ``torch.distributed.run``).

    Like Accelerate, also fills the ``torch.distributed.run`` fields of ``args`` (``nproc_per_node``, ``nnodes``,
    ``node_rank``, ``master_addr``, ``master_port``) from the resolved settings; ``main_process_port=0`` picks a
    free port.
    """
    if getattr(args, MAIN_PROCESS_PORT.flag_name, None) == 0:
        from .misc import get_free_port

        args.main_process_port = get_free_port()
    from ..commands.launch import plan_partial_launch

    plan = plan_partial_launch(args)
    config = plan.settings.config
    args.nproc_per_node = str(plan.nproc_per_node)
    args.nnodes = str(config.num_machines)
    args.node_rank = int(config.machine_rank)
    if config.main_process_ip is not None:
        args.master_addr = str(config.main_process_ip)
    if config.main_process_port is not None:
        args.master_port = str(config.main_process_port)
    return {**os.environ, **plan.env}


def prepare_deepspeed_cmd_env(args: argparse.Namespace) -> tuple[list[str], dict[str, str]]:
    """The command and environment of a DeepSpeed launch: hasten starts DeepSpeed jobs like any other
    (torch's elastic agent on each machine), with the DeepSpeed settings in the environment."""
    return prepare_simple_launcher_cmd_env(args)


def _settings_subset(args: argparse.Namespace, current_env: dict[str, str], marker: str) -> dict[str, str]:
    from ..commands.launch import plan_partial_launch

    current_env.update({key: value for key, value in plan_partial_launch(args).env.items() if marker in key})
    return current_env


def setup_fp8_env(args: argparse.Namespace, current_env: dict[str, str]) -> dict[str, str]:
    """``current_env`` with the FP8 settings of ``args`` (and the config file) added."""
    return _settings_subset(args, current_env, "FP8")


def prepare_extend_env_parallelism_config(args: argparse.Namespace, current_env: dict[str, str]) -> dict[str, str]:
    """``current_env`` with the parallelism settings of ``args`` (and the config file) added."""
    return _settings_subset(args, current_env, "PARALLELISM")


def env_var_path_add(env_var_name: str, path_to_add: str) -> str:
    """The value of the ``os.pathsep``-separated variable ``env_var_name`` with ``path_to_add`` appended."""
    paths = [path for path in os.environ.get(env_var_name, "").split(os.pathsep) if path]
    paths.append(str(path_to_add))
    return os.pathsep.join(paths)


def prepare_tpu(args: argparse.Namespace, current_env: dict[str, str], pod: bool = False):
    """TPU launches are not supported by hasten."""
    raise NotSupportedError(
        "prepare_tpu: TPU (torch_xla) launches are not supported by hasten; it runs on CPUs and CUDA/XPU GPUs."
    )


def prepare_sagemager_args_inputs(sagemaker_config, args: argparse.Namespace):
    """Amazon SageMaker launches are not supported by hasten."""
    raise NotSupportedError(
        "prepare_sagemager_args_inputs: hasten does not launch on Amazon SageMaker; run `hasten launch` on the "
        "instances."
    )


class PrepareForLaunch:
    """Wrap ``launcher`` so that, started as process ``index`` (by ``torch.multiprocessing.start_processes``), it
    finds its rank in the environment first.

    Args:
        launcher: the function to run.
        distributed_type: a multi-process type sets ``LOCAL_RANK`` to ``index`` and ``RANK`` to
            ``NPROC * NODE_RANK + index``; ``"NO"`` sets nothing.
        debug: run the function in hasten's debug mode (``HASTEN_DEBUG_MODE=1``).
    """

    def __init__(self, launcher, distributed_type="NO", debug=False):
        self.launcher = launcher
        self.distributed_type = DistributedType(distributed_type)
        self.debug = debug

    def __call__(self, index, *args):
        if self.distributed_type != DistributedType.NO:
            nproc = environment.get_int_from_env(["NPROC"], 1)
            node_rank = environment.get_int_from_env(["NODE_RANK"], 0)
            os.environ["LOCAL_RANK"] = str(index)
            os.environ["RANK"] = str(nproc * node_rank + index)
        if self.debug:
            os.environ[DEBUG.variable] = "1"
        os.environ["FORK_LAUNCHED"] = "1"
        self.launcher(*args)
