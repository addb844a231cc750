"""Checking one setting's value against its kind (the ``kind`` of a :class:`~hasten.settings.Setting` or of a
config field): the one place that turns text from a flag, a file or a variable into a typed value."""

from __future__ import annotations

from typing import Any

from ..errors import ConfigError, did_you_mean

AUTO = "auto"
_TRUE = {"1", "true", "yes", "y", "on"}
_FALSE = {"0", "false", "no", "n", "off", ""}


def str_to_bool(value: str, to_bool: bool = False) -> int | bool:
    """Convert a string like ``"yes"``/``"0"`` to 1 or 0 (``True``/``False`` with ``to_bool``); anything else is a
    :class:`ConfigError`."""
    text = str(value).strip().lower()
    if text in _TRUE:
        return True if to_bool else 1
    if text in _FALSE:
        return False if to_bool else 0
    raise ConfigError(f"Expected a boolean (1/0, true/false, yes/no), got {value!r}.")


def bool_triple(text: str) -> tuple[int, ...]:
    """Comma-separated booleans (``"false,false,true"``) as a tuple of 1s and 0s (how the
    ``--fp8_override_linear_precision`` option reads its value)."""
    return tuple(str_to_bool(part) for part in str(text).split(","))


def float_or_auto(text: str) -> float | str:
    """``"auto"`` as given, any other text as a float (how the ``--gradient_clipping`` option reads its value)."""
    return AUTO if str(text).strip().lower() == AUTO else float(text)


class Invalid(Exception):
    """A value failed its field's check; the message says what was expected."""


def _as_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str):
        try:
            return bool(str_to_bool(value))
        except ConfigError:
            pass
    raise Invalid("expected a boolean (true/false, yes/no or 1/0)")


def _as_int(value: Any) -> int:
    if isinstance(value, bool):
        raise Invalid("expected an integer")
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            pass
    raise Invalid("expected an integer")


def _as_float(value: Any) -> float:
    if not isinstance(value, bool):
        try:
            return float(value)
        except (TypeError, ValueError):
            pass
    raise Invalid("expected a number")


def as_choice(value: Any, choices: tuple) -> Any:
    """``value`` as one of ``choices`` (case-insensitive; a number for numeric choices), else :class:`Invalid`."""
    if value is False and "no" in (str(c).lower() for c in choices):  # YAML 1.1 reads a bare `no` or `off` as false
        return next(c for c in choices if str(c).lower() == "no")
    if isinstance(choices[0], int):
        try:
            if _as_int(value) in choices:
                return _as_int(value)
        except Invalid:
            pass
    else:
        for choice in choices:
            if str(value).lower() == choice.lower():
                return choice
    raise Invalid(f"expected one of: {', '.join(map(str, choices))}.{did_you_mean(str(value), map(str, choices))}")


def _as_bool3(value: Any) -> tuple:
    if isinstance(value, str):
        value = [part for part in value.strip().strip("()[]").split(",") if part.strip()]
    if isinstance(value, (list, tuple)) and len(value) == 3:
        return tuple(_as_bool(part.strip() if isinstance(part, str) else part) for part in value)
    raise Invalid("expected three booleans (fprop, dgrad, wgrad), e.g. [false, false, true]")


def convert(value: Any, meta: dict) -> Any:
    """Check and normalise one value against its field's metadata (raises :class:`Invalid`)."""
    kind, choices = meta["kind"], meta.get("choices")
    if kind == "bool":
        return _as_bool(value)
    if kind == "int":
        return _as_int(value)
    if kind == "float":
        return _as_float(value)
    if kind == "float_or_auto":
        return AUTO if str(value).lower() == AUTO else _as_float(value)
    if kind == "choice":
        return as_choice(value, choices)
    if kind == "bool_or_strategy":
        try:
            return _as_bool(value)
        except Invalid:
            return as_choice(value, choices)
    if kind == "bool3":
        return _as_bool3(value)
    if kind == "list":
        if isinstance(value, (list, tuple)) and all(isinstance(item, (str, int, float)) for item in value):
            return [str(item) for item in value]
        raise Invalid("expected a list of strings")
    if kind == "str":
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise Invalid("expected a string")
    return value
