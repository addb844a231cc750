"""Asking for settings in ``hasten config``: one row's :class:`~hasten.settings.Question`, or one stage of a table's.

The asker is any object with ``yes_no(text, default, check)``, ``select(text, options, default)`` and
``text(text, default, convert, check)`` (``hasten.commands.config`` gives one over questionary; tests give scripted
ones). The engines' registrations ask their sections through :func:`ask_table`, so this module imports nothing
but the tables.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from . import Section, Setting


def ask_table(ask, table: Section, stage: str = "main", known: dict | None = None) -> dict:
    """Ask the questions of one stage of a settings table in their order; returns key -> answer.

    A question is skipped unless its ``when`` key (among its stage's answers and ``known``) has one of
    the allowed answers; a fixed one writes its default, and an empty free-text answer leaves its key out.
    """
    values: dict[str, Any] = {}
    seen = dict(known or {})
    asked = (row for row in table.rows if row.question and row.question.stage == stage)
    rows = sorted(asked, key=lambda row: row.question.step)
    for row in rows:
        question = row.question
        if question.when and seen.get(question.when[0]) not in question.when[1]:
            continue
        answer = question.default if question.fixed else ask_setting(ask, row)
        if answer != "":
            values[row.key] = seen[row.key] = answer
    return values


def ask_setting(ask, row: Setting, check: Callable | None = None, default: Any = None, **wording: str) -> Any:
    """Ask one setting: yes/no for a boolean default, a pick among its choices, a number, or free text.

    ``check`` replaces the kind's own check of the answer, ``default`` the question's (when not None), and
    ``wording`` fills the ``{placeholders}`` of the question's text.
    """
    question = row.question
    text = question.text.format(**wording) if wording else question.text
    default = question.default if default is None else default
    if isinstance(default, bool):
        return ask.yes_no(text, default, check) if check else ask.yes_no(text, default)
    if row.kind == "int":
        return ask.text(text, default, int, check or at_least(1))
    if row.kind in ("float", "float_or_auto"):
        return ask.text(text, default, float)
    if row.choices:
        options = [(str(c).lower() if row.lower else str(c), c, None) for c in question.options or row.choices]
        return ask.select(text, options, default)
    return ask.text(text, default, check=check or (existing_file if question.must_exist else None))


def at_least(minimum: int) -> Callable[[int], str | None]:
    """A check of a whole number: at least ``minimum``."""
    return lambda value: None if value >= minimum else f"Enter a number of at least {minimum}."


def existing_file(path: str) -> str | None:
    """A check of a path: an existing file."""
    return None if Path(path).expanduser().is_file() else "No such file."
