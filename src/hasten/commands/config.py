"""``hasten config``: write the launch config file.

* ``hasten config`` asks the questions of Accelerate's setup walkthrough, one by one (arrow or number
  keys pick a choice, Enter takes the default shown in brackets), and writes ``default_config.yaml``
  (or ``--config_file``). Machine types whose hardware is absent are listed as unavailable.
* ``hasten config default`` asks nothing: it looks at the hardware and writes a sensible file.
* ``hasten config update`` rewrites an older hasten file, or an Accelerate-written one, in the current format.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from pathlib import Path
from typing import Any, Callable

from .. import environment
from ..config import (
    RDZV_BACKENDS,
    Hardware,
    config_from_dict,
    detect_hardware,
    load_config_file,
    read_config_file,
    save_config_file,
    write_basic_config,
)
from ..errors import ConfigError
from ..settings import Section, Setting
from ..settings.deepspeed import DEEPSPEED
from ..settings.dynamo import DYNAMO
from ..settings.fp8 import FP8
from ..settings.fsdp import FSDP

# Accelerate's ``accelerate.commands.config`` names, which transformers' ``env`` command reads: the path of the
# default launch config file (in hasten's config folder) and a loader returning the config object.
default_config_file = str(environment.default_config_file())


def load_config_from_file(config_file):
    """The launch config read from ``config_file`` (default: :data:`default_config_file`), validated.

    Returns a ``ClusterConfig`` (or ``SageMakerConfig``); ``.to_dict()`` gives it as plain data.
    Raises :class:`~hasten.errors.ConfigError` naming the file when it is missing or invalid.
    """
    return load_config_file(config_file)

_MULTI = ("MULTI_CPU", "MULTI_GPU", "MULTI_XPU")
_YES = ("yes", "y", "true", "1")
_NO = ("no", "n", "false", "0")


def add_parser(subparsers, help_text: str) -> argparse.ArgumentParser:
    """Register ``hasten config`` and its ``default`` and ``update`` subcommands."""
    parser = subparsers.add_parser(
        "config", help=help_text, description="Write the launch config file, by asking questions."
    )
    parser.add_argument("--config_file", "--config-file", default=None, help="Where to write (default: the default config file).")
    parser.set_defaults(func=config_command)
    sub = parser.add_subparsers(dest="config_command", metavar="<subcommand>")
    default = sub.add_parser("default", help="Write a config for this machine without asking anything.")
    default.add_argument("--config_file", "--config-file", default=None, help="Where to write (default: the default config file).")
    default.add_argument("--mixed_precision", "--mixed-precision", default="no", choices=["no", "fp16", "bf16", "fp8"])
    default.set_defaults(func=default_command)
    update = sub.add_parser("update", help="Rewrite an older or Accelerate-written config file in the current format.")
    update.add_argument("--config_file", "--config-file", default=None, help="File to update (default: the default config file).")
    update.set_defaults(func=update_command)
    return parser


def default_command(args: argparse.Namespace) -> int:
    """``hasten config default``."""
    path = write_basic_config(mixed_precision=args.mixed_precision, save_location=args.config_file)
    if path:
        print(f"hasten configuration saved at {path}")
    return 0


def update_command(args: argparse.Namespace) -> int:
    """``hasten config update``: read with migration, write back (or import Accelerate's default file)."""
    source = Path(args.config_file).expanduser() if args.config_file else environment.default_config_file()
    target = source
    if args.config_file is None and not source.is_file() and environment.setting_source("HOME") is None:
        accelerate_file = environment.config_home().parent / "accelerate" / "default_config.yaml"
        if accelerate_file.is_file():
            source = accelerate_file
    loaded = read_config_file(source)
    save_config_file(loaded.config, target)
    changes = "; ".join(loaded.notes) if loaded.notes else "no key needed a change"
    verb = "updated" if source == target else f"imported from {source} into"
    print(f"hasten configuration {verb} {target} ({changes})")
    return 0


def config_command(args: argparse.Namespace) -> int:
    """``hasten config``: the interactive dialogue."""
    if not sys.stdin.isatty():
        raise ConfigError("`hasten config` asks questions and needs an interactive terminal; use `hasten config default` in scripts.")
    path = Path(args.config_file).expanduser() if args.config_file else environment.default_config_file()
    answers = ask_questions(_Asker(), detect_hardware())
    config, _, _ = config_from_dict(answers, "from your answers")
    save_config_file(config, path)
    print(f"hasten configuration saved at {path}")
    return 0


_WANTED = {int: "Please enter a whole number, such as 2.", float: "Please enter a number, such as 1.0."}


class _Asker:
    """Thin layer over questionary: choices, free text with a bracketed default, and yes/no questions."""

    def __init__(self):
        import questionary

        self._q = questionary

    def select(self, message: str, options: list[tuple[str, Any, str | None]], default: Any = None) -> Any:
        """Pick one of ``options`` = [(title, value, reason it is unavailable or None)]."""
        keys = "123456789abcdefghilmnopqrstuvwxyz"
        choices = [
            self._q.Choice(title, value=value, disabled=reason, shortcut_key=keys[i] if i < len(keys) else False)
            for i, (title, value, reason) in enumerate(options)
        ]
        start = next((c for c in choices if c.value == default and not c.disabled), None)
        return self._q.select(
            message,
            choices=choices,
            default=start,
            use_shortcuts=True,
            use_jk_keys=False,
            instruction="(arrow or number keys, Enter to select)",
        ).unsafe_ask()

    def text(self, message: str, default: Any = None, convert: Callable[[str], Any] = str, check: Callable[[Any], str | None] | None = None) -> Any:
        """Free text; an empty answer takes ``default`` (shown in brackets when not None)."""
        shown = f" [{default}]" if default is not None else ""

        def validate(answer: str) -> bool | str:
            if not answer.strip():
                return True if default is not None else "Please enter a value."
            try:
                value = convert(answer.strip())
            except ValueError:
                return _WANTED.get(convert, "Please enter a valid value.")
            problem = check(value) if check else None
            return problem or True

        answer = self._q.text(f"{message}{shown}:", validate=validate).unsafe_ask().strip()
        return convert(answer) if answer else default

    def yes_no(self, message: str, default: bool = False, check: Callable[[bool], str | None] | None = None) -> bool:
        """A yes/no question; the default is the capitalised answer."""
        shown = " [YES/no]" if default else " [yes/NO]"

        def convert(answer: str) -> bool:
            if answer.lower() in _YES:
                return True
            if answer.lower() in _NO:
                return False
            raise ValueError(answer)

        def validate(answer: str) -> bool | str:
            try:
                value = convert(answer.strip()) if answer.strip() else default
            except ValueError:
                return "Please enter yes or no."
            return (check(value) if check else None) or True

        answer = self._q.text(f"{message}{shown}:", validate=validate).unsafe_ask().strip()
        return convert(answer) if answer else default


def ask_questions(ask: _Asker, hardware: Hardware) -> dict:
    """Ask the setup questions in the walkthrough's order; returns the config as a mapping."""
    ask.select("In which compute environment are you running?", [("This machine", "LOCAL_MACHINE", None), ("AWS (Amazon SageMaker)", "AMAZON_SAGEMAKER", "not supported by hasten")])
    answers: dict[str, Any] = {"compute_environment": "LOCAL_MACHINE", "same_network": True}
    answers["distributed_type"] = _ask_machine_type(ask, hardware)
    _ask_machines(ask, answers)
    _ask_cpu(ask, answers, hardware)
    _ask_dynamo(ask, answers)
    _ask_deepspeed(ask, answers)
    _ask_fsdp(ask, answers)
    _ask_processes(ask, answers, hardware)
    _ask_precision(ask, answers, hardware)
    return answers


def _ask_machine_type(ask: _Asker, hardware: Hardware) -> str:
    absent = "not available: no {} found on this machine"
    options = [
        ("No distributed training", "NO", None),
        ("multi-CPU", "MULTI_CPU", None),
        ("multi-XPU", "MULTI_XPU", None if hardware.kind == "xpu" else absent.format("XPU")),
        ("multi-GPU", "MULTI_GPU", None if hardware.kind == "cuda" else absent.format("GPU")),
        ("multi-NPU", "MULTI_NPU", "not supported by hasten"),
        ("TPU", "XLA", "not supported by hasten"),
    ]
    default = {"cuda": "MULTI_GPU", "xpu": "MULTI_XPU"}.get(hardware.kind) if hardware.gpus > 1 else "NO"
    return ask.select("Which type of machine are you using?", options, default)


def _ask_machines(ask: _Asker, answers: dict) -> None:
    if answers["distributed_type"] not in _MULTI:
        return
    machines = ask.text(
        "How many different machines will you use (use more than 1 for multi-node training)?", 1, int, _at_least(1)
    )
    answers["num_machines"] = machines
    if machines > 1:
        answers["machine_rank"] = ask.text(
            "What is the rank of this machine?", 0, int, lambda r: None if 0 <= r < machines else f"Enter a number from 0 to {machines - 1}."
        )
        answers["main_process_ip"] = ask.text("What is the IP address of the machine that will host the main process?")
        answers["main_process_port"] = ask.text("What is the port you will use to communicate with the main process?", 29500, int, _port)
        answers["same_network"] = ask.yes_no(
            "Are all the machines on the same local network? Answer `no` if nodes are on the cloud and/or on different network hosts",
            True,
        )
        if not answers["same_network"]:
            answers["rdzv_backend"] = ask.select(
                "What rendezvous backend will you use?", [(name, name, None) for name in RDZV_BACKENDS], "static"
            )
    answers["debug"] = ask.yes_no(
        "Should distributed operations be checked while running for errors? This can avoid timeout issues but will be slower."
    )


def _ask_cpu(ask: _Asker, answers: dict, hardware: Hardware) -> None:
    kind = answers["distributed_type"]
    if kind == "NO":
        answers["use_cpu"] = hardware.kind == "cpu" or ask.yes_no(
            "Do you want to run your training on CPU only (even if a GPU is available)?"
        )
    elif kind == "MULTI_CPU":
        answers["use_cpu"] = True
        if answers.get("num_machines", 1) > 1 and ask.yes_no("Do you want hasten to launch mpirun?"):
            hostfile = ask.text("Please enter the path to the hostfile to use with mpirun", "~/hostfile")
            answers["mpirun_config"] = {"mpirun_hostfile": os.path.expanduser(hostfile)}


def _ask_dynamo(ask: _Asker, answers: dict) -> None:
    if not ask.yes_no("Do you wish to optimize your script with torch dynamo?"):
        return
    dynamo = _ask_table(ask, DYNAMO)
    if ask.yes_no("Do you want to customize the defaults sent to torch.compile?"):
        dynamo |= _ask_table(ask, DYNAMO, "custom")
    answers["dynamo_config"] = dynamo


def _deepspeed_installed(wanted: bool) -> str | None:
    if wanted and importlib.util.find_spec("deepspeed") is None:
        return "DeepSpeed is not installed: pip install 'hasten[deepspeed]', or answer no."
    return None


def _ask_deepspeed(ask: _Asker, answers: dict) -> None:
    if answers["distributed_type"] not in ("NO", *_MULTI):
        return
    if not ask.yes_no("Do you want to use DeepSpeed?", check=_deepspeed_installed):
        return
    answers["distributed_type"] = "DEEPSPEED"
    if ask.yes_no("Do you want to specify a json file to a DeepSpeed config?"):
        ds = _ask_table(ask, DEEPSPEED, "file")
    else:
        ds = _ask_table(ask, DEEPSPEED, "zero")
        if ask.yes_no("Do you want to use gradient clipping?"):
            ds |= _ask_table(ask, DEEPSPEED, "clipping")
        ds |= _ask_table(ask, DEEPSPEED, "zero3", ds)
    ds |= _ask_table(ask, DEEPSPEED, "init")
    answers["deepspeed_config"] = ds


def _ask_fsdp(ask: _Asker, answers: dict) -> None:
    if answers["distributed_type"] not in ("MULTI_GPU", "MULTI_XPU"):
        return
    if not ask.yes_no("Do you want to use FullyShardedDataParallel?"):
        return
    answers["distributed_type"] = "FSDP"
    fsdp = _ask_table(ask, FSDP)
    answers["fsdp_config"] = fsdp


def _ask_table(ask: _Asker, table: Section, stage: str = "main", known: dict | None = None) -> dict:
    """Ask the questions of one stage of a settings table in their order; returns key -> answer.

    A question is skipped unless its ``when`` key (among its stage's answers and ``known``) has one of
    the allowed answers; a fixed one writes its default, and an empty free-text answer leaves its key out.
    """
    values: dict[str, Any] = {}
    seen = dict(known or {})
    rows = sorted((row for row in table.rows if row.question and row.question.stage == stage), key=lambda row: row.question.step)
    for row in rows:
        question = row.question
        if question.when and seen.get(question.when[0]) not in question.when[1]:
            continue
        answer = question.default if question.fixed else _ask_setting(ask, row)
        if answer != "":
            values[row.key] = seen[row.key] = answer
    return values


def _ask_setting(ask: _Asker, row: Setting) -> Any:
    """Ask one setting: yes/no for a boolean default, a pick among its choices, a number, or free text."""
    question = row.question
    if isinstance(question.default, bool):
        return ask.yes_no(question.text, question.default)
    if row.kind == "int":
        return ask.text(question.text, question.default, int, _at_least(1))
    if row.kind in ("float", "float_or_auto"):
        return ask.text(question.text, question.default, float)
    if row.choices:
        options = [(str(c).lower() if row.lower else str(c), c, None) for c in question.options or row.choices]
        return ask.select(question.text, options, question.default)
    return ask.text(question.text, question.default, check=_existing_file if question.must_exist else None)


def _existing_file(path: str) -> str | None:
    return None if Path(path).expanduser().is_file() else "No such file."


def _ask_processes(ask: _Asker, answers: dict, hardware: Hardware) -> None:
    kind = answers["distributed_type"]
    on_gpu = not answers.get("use_cpu") and kind != "MULTI_CPU" and hardware.gpus > 0
    if kind in (*_MULTI, "DEEPSPEED", "FSDP"):
        word = "XPU(s)" if on_gpu and hardware.kind == "xpu" else "GPU(s)" if on_gpu else "processes"
        machines = answers.get("num_machines", 1)

        def check(total: int) -> str | None:
            if total < machines or total % machines:
                return f"Enter a multiple of the number of machines ({machines}): the total over all of them."
            if on_gpu and total // machines > hardware.gpus:
                return f"This machine has {hardware.gpus} {word}; enter at most {hardware.gpus * machines}."
            if kind == "MULTI_GPU" and machines == 1 and total == 1:
                return "One GPU on one machine is not distributed: enter 2 or more, or choose 'No distributed training'."
            return None

        where = f", in total over the {machines} machines" if machines > 1 else ""
        answers["num_processes"] = ask.text(f"How many {word} should be used for distributed training{where}?", machines, int, check)
    else:
        answers["num_processes"] = 1
    if on_gpu and kind in ("NO", "MULTI_GPU", "MULTI_XPU", "FSDP"):
        answers["gpu_ids"] = ask.text(
            f"What {'XPU(s)' if hardware.kind == 'xpu' else 'GPU(s)'} (by id) should be used for training on this machine as a comma-separated list?",
            "all",
        )
    if on_gpu and hardware.kind == "cuda" and kind in ("NO", "MULTI_GPU"):
        answers["enable_cpu_affinity"] = ask.yes_no(
            "Would you like to enable numa efficiency? (Currently only supported on NVIDIA hardware)."
        )


def _ask_precision(ask: _Asker, answers: dict, hardware: Hardware) -> None:
    fp8 = None if hardware.kind == "cuda" and not answers.get("use_cpu") else "not available: needs a GPU with FP8 support"
    options = [("no", "no", None), ("fp16", "fp16", None), ("bf16", "bf16", None), ("fp8", "fp8", fp8)]
    answers["mixed_precision"] = ask.select("Do you wish to use FP16 or BF16 (mixed precision)?", options, "no")
    if answers["mixed_precision"] == "fp8":
        answers["fp8_config"] = _ask_table(ask, FP8)


def _at_least(minimum: int) -> Callable[[int], str | None]:
    return lambda value: None if value >= minimum else f"Enter a number of at least {minimum}."


def _port(value: int) -> str | None:
    return None if 0 < value < 65536 else "Enter a port number between 1 and 65535."


def main(argv: list[str] | None = None) -> int:
    """Run ``config`` with ``argv`` (default: this process's arguments): the ``accelerate-config`` console script, ``python -m hasten.commands.config``
    and ``python -m accelerate.commands.config``."""
    from .main import run_subcommand

    return run_subcommand("config", argv)


if __name__ == "__main__":
    sys.exit(main())
