"""``hasten config``: write the launch config file.

* ``hasten config`` asks the questions of Accelerate's setup walkthrough, one by one (arrow or number
  keys pick a choice, Enter takes the default shown in brackets), and writes ``default_config.yaml``
  (or ``--config_file``). Machine types whose hardware is absent are listed as unavailable.
* ``hasten config default`` asks nothing: it looks at the hardware and writes a sensible file.
* ``hasten config update`` rewrites an older hasten file, or an Accelerate-written one, in the current format.

Under Accelerate's name (``accelerate config``) the file is Accelerate's default file, which ``accelerate launch``
reads (:mod:`hasten.commands.config_location`).

A package, as Accelerate's ``accelerate.commands.config`` is: ``config_args`` and ``default`` hold the names
Accelerate's modules of those names give (the config classes and loader, ``write_basic_config``).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Callable

from ... import environment
from ...config import (
    Hardware,
    config_from_dict,
    detect_hardware,
    load_config_file,
    read_config_file,
    save_config_file,
    write_basic_config,
)
from ...errors import ConfigError
from ...settings import Setting
from ...settings.command import command_name
from ...settings.dialogue import ask_setting, ask_table
from ...settings.dynamo import DYNAMO
from ...settings.engines import Engine
from ...settings.fp8 import FP8
from ...settings.launch import (
    COMPUTE_ENVIRONMENT,
    DEBUG,
    DISTRIBUTED_TYPE,
    ENABLE_CPU_AFFINITY,
    GPU_IDS,
    MACHINE_RANK,
    MAIN_PROCESS_IP,
    MAIN_PROCESS_PORT,
    MIXED_PRECISION,
    MPIRUN,
    NUM_MACHINES,
    NUM_PROCESSES,
    RDZV_BACKEND,
    SAME_NETWORK,
    USE_CPU,
)
from ..config_location import accelerate_default_file, file_to_write, named_file, speaks_accelerate

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
    parser.add_argument(
        "--config_file", "--config-file", default=None, help="Where to write (default: the default config file)."
    )
    parser.set_defaults(func=config_command)
    sub = parser.add_subparsers(dest="config_command", metavar="<subcommand>")
    default = sub.add_parser("default", help="Write a config for this machine without asking anything.")
    default.add_argument(
        "--config_file", "--config-file", default=None, help="Where to write (default: the default config file)."
    )
    default.add_argument("--mixed_precision", "--mixed-precision", default="no", choices=["no", "fp16", "bf16", "fp8"])
    default.set_defaults(func=default_command)
    update = sub.add_parser("update", help="Rewrite an older or Accelerate-written config file in the current format.")
    update.add_argument(
        "--config_file", "--config-file", default=None, help="File to update (default: the default config file)."
    )
    update.set_defaults(func=update_command)
    return parser


def default_command(args: argparse.Namespace) -> int:
    """``hasten config default``."""
    target = file_to_write(args.config_file, speaks_accelerate())
    path = write_basic_config(mixed_precision=args.mixed_precision, save_location=target)
    if path:
        print(f"{command_name()} configuration saved at {path}")
    return 0


def update_command(args: argparse.Namespace) -> int:
    """``hasten config update``: read with migration, write back (``hasten config update`` imports Accelerate's
    default file when hasten has none)."""
    accelerate = speaks_accelerate()
    source = target = file_to_write(args.config_file, accelerate)
    if not accelerate and named_file(args.config_file) is None and not source.is_file():
        if accelerate_default_file().is_file():
            source = accelerate_default_file()
    loaded = read_config_file(source)
    save_config_file(loaded.config, target)
    changes = "; ".join(loaded.notes) if loaded.notes else "no key needed a change"
    verb = "updated" if source == target else f"imported from {source} into"
    print(f"{command_name()} configuration {verb} {target} ({changes})")
    return 0


def config_command(args: argparse.Namespace) -> int:
    """``hasten config``: the interactive dialogue."""
    name = command_name()
    if not sys.stdin.isatty():
        raise ConfigError(
            f"`{name} config` asks questions and needs an interactive terminal; use `{name} config default` in scripts."
        )
    path = file_to_write(args.config_file, speaks_accelerate())
    answers = ask_questions(_Asker(), detect_hardware())
    config, _, _ = config_from_dict(answers, "from your answers")
    save_config_file(config, path)
    print(f"{name} configuration saved at {path}")
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

    def text(
        self,
        message: str,
        default: Any = None,
        convert: Callable[[str], Any] = str,
        check: Callable[[Any], str | None] | None = None,
    ) -> Any:
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
    """Ask the setup questions in the walkthrough's order; returns the config as a mapping.

    The questions, their defaults and kinds are the rows' (the launch table's, the sections', the engines'); the
    order and the conditions, which depend on the machine and the answers so far, are here.
    """
    places = [
        ("This machine", "LOCAL_MACHINE", None),
        ("AWS (Amazon SageMaker)", "AMAZON_SAGEMAKER", "not supported by hasten"),
    ]
    ask.select(COMPUTE_ENVIRONMENT.question.text, places)
    answers: dict[str, Any] = {COMPUTE_ENVIRONMENT.key: COMPUTE_ENVIRONMENT.default, SAME_NETWORK.key: True}
    answers[DISTRIBUTED_TYPE.key] = _ask_machine_type(ask, hardware)
    _ask_machines(ask, answers)
    _ask_cpu(ask, answers, hardware)
    _ask_dynamo(ask, answers)
    for engine in environment.ENGINES:
        _ask_engine(ask, answers, engine)
    _ask_processes(ask, answers, hardware)
    _ask_precision(ask, answers, hardware)
    return answers


def _answer(ask: _Asker, answers: dict, row: Setting, **options) -> Any:
    """Ask the launch table's ``row`` (see :func:`~hasten.settings.dialogue.ask_setting`) and note the answer under
    its key; returns it."""
    answers[row.key] = ask_setting(ask, row, **options)
    return answers[row.key]


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
    return ask.select(DISTRIBUTED_TYPE.question.text, options, default)


def _ask_machines(ask: _Asker, answers: dict) -> None:
    if answers[DISTRIBUTED_TYPE.key] not in _MULTI:
        return
    machines = _answer(ask, answers, NUM_MACHINES)
    if machines > 1:
        last = machines - 1
        _answer(
            ask,
            answers,
            MACHINE_RANK,
            check=lambda rank: None if 0 <= rank <= last else f"Enter a number from 0 to {last}.",
        )
        _answer(ask, answers, MAIN_PROCESS_IP)
        _answer(ask, answers, MAIN_PROCESS_PORT, check=_port)
        if not _answer(ask, answers, SAME_NETWORK):
            _answer(ask, answers, RDZV_BACKEND)
    _answer(ask, answers, DEBUG)


def _ask_cpu(ask: _Asker, answers: dict, hardware: Hardware) -> None:
    kind = answers[DISTRIBUTED_TYPE.key]
    if kind == "NO":
        answers[USE_CPU.key] = hardware.kind == "cpu" or ask_setting(ask, USE_CPU)
    elif kind == "MULTI_CPU":
        answers[USE_CPU.key] = True
        if answers.get(NUM_MACHINES.key, 1) > 1 and ask.yes_no("Do you want hasten to launch mpirun?"):
            hostfile = ask_setting(ask, MPIRUN.by_key("mpirun_hostfile"))
            answers[MPIRUN.name] = {"mpirun_hostfile": os.path.expanduser(hostfile)}


def _ask_dynamo(ask: _Asker, answers: dict) -> None:
    if not ask.yes_no("Do you wish to optimize your script with torch dynamo?"):
        return
    dynamo = ask_table(ask, DYNAMO)
    if ask.yes_no("Do you want to customize the defaults sent to torch.compile?"):
        dynamo |= ask_table(ask, DYNAMO, "custom")
    answers[DYNAMO.name] = dynamo


def _ask_engine(ask: _Asker, answers: dict, engine: Engine) -> None:
    """Offer ``engine`` when the machine type answered allows it; after a yes, it runs and its questions are asked."""
    dialogue = engine.dialogue
    if dialogue is None or answers[DISTRIBUTED_TYPE.key] not in dialogue.offered_for:
        return
    requirement = engine.requirement

    def installed(wanted: bool) -> str | None:
        if wanted and requirement is not None and not requirement.installed:
            return f"{requirement.what} is not installed: {requirement.hint}, or answer no."
        return None

    if not ask.yes_no(dialogue.question, check=installed if requirement is not None else None):
        return
    answers[DISTRIBUTED_TYPE.key] = engine.distributed_type
    answers |= dialogue.ask(ask, answers)


def _ask_processes(ask: _Asker, answers: dict, hardware: Hardware) -> None:
    kind = answers[DISTRIBUTED_TYPE.key]
    on_gpu = not answers.get(USE_CPU.key) and kind != "MULTI_CPU" and hardware.gpus > 0
    gpu_word = "XPU(s)" if hardware.kind == "xpu" else "GPU(s)"
    if kind != "NO":
        machines = answers.get(NUM_MACHINES.key, 1)

        def check(total: int) -> str | None:
            if total < machines or total % machines:
                return f"Enter a multiple of the number of machines ({machines}): the total over all of them."
            if on_gpu and total // machines > hardware.gpus:
                return f"This machine has {hardware.gpus} {gpu_word}; enter at most {hardware.gpus * machines}."
            if kind == "MULTI_GPU" and machines == 1 and total == 1:
                return (
                    "One GPU on one machine is not distributed: enter 2 or more, or choose 'No distributed training'."
                )
            return None

        where = f", in total over the {machines} machines" if machines > 1 else ""
        devices = gpu_word if on_gpu else "processes"
        _answer(ask, answers, NUM_PROCESSES, check=check, default=machines, devices=devices, where=where)
    else:
        answers[NUM_PROCESSES.key] = 1
    if on_gpu and _asks_gpu_ids(kind):
        _answer(ask, answers, GPU_IDS, devices=gpu_word)
    if on_gpu and hardware.kind == "cuda" and kind in ("NO", "MULTI_GPU"):
        _answer(ask, answers, ENABLE_CPU_AFFINITY)


def _asks_gpu_ids(kind: str) -> bool:
    """Whether the machine type (or the engine chosen) asks which GPUs to use (as Accelerate's: not DeepSpeed's)."""
    engine = next((e for e in environment.ENGINES if kind in e.distributed_types), None)
    return engine is None or engine.dialogue is None or engine.dialogue.gpu_ids


def _ask_precision(ask: _Asker, answers: dict, hardware: Hardware) -> None:
    fp8 = (
        None
        if hardware.kind == "cuda" and not answers.get(USE_CPU.key)
        else "not available: needs a GPU with FP8 support"
    )
    row = MIXED_PRECISION
    options = [(choice, choice, fp8 if choice == "fp8" else None) for choice in row.choices]
    answers[row.key] = ask.select(row.question.text, options, row.question.default)
    if answers[row.key] == "fp8":
        answers[FP8.name] = ask_table(ask, FP8)


def _port(value: int) -> str | None:
    return None if 0 < value < 65536 else "Enter a port number between 1 and 65535."


def main(argv: list[str] | None = None) -> int:
    """Run ``config`` with ``argv`` (default: this process's arguments): the ``accelerate-config`` console script,
    ``python -m hasten.commands.config`` and ``python -m accelerate.commands.config``."""
    from ..main import run_subcommand

    return run_subcommand("config", argv)
