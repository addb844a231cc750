"""Scenarios for the differential test of ``launch_command_parser`` (test_launch_parser_parity.py): each runs with
``import accelerate`` answered by the reference copy of Accelerate 1.15 or by hasten (tests/differential.py)."""

from __future__ import annotations


def _parser():
    from accelerate.commands.launch import launch_command_parser

    return launch_command_parser()


def _kind(value) -> str:
    """The value as text with its type, so that ``True``, ``1`` and ``"true"`` stay apart."""
    return f"{type(value).__name__}:{value!r}"


def describe_options(case: dict) -> dict:
    """Every option of the launch parser: its spellings, whether it takes a value, its choices and the name of
    its type (so the test can write a value each side accepts), and its value when left off."""
    parser = _parser()
    left_off = parser.parse_args(["train.py"])
    return {
        action.dest: {
            "spellings": sorted(action.option_strings),
            "switch": action.nargs == 0,
            "choices": [str(choice) for choice in action.choices or ()],
            "type": getattr(action.type, "__name__", "None"),
            "left_off": _kind(getattr(left_off, action.dest)),
        }
        for action in parser._actions
        if action.option_strings and action.dest != "help"
    }


def parse_one(case: dict) -> str:
    """The value of ``case["dest"]`` after parsing ``case["argv"]``."""
    return _kind(getattr(_parser().parse_args(case["argv"]), case["dest"]))
