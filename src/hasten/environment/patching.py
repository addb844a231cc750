"""Changing ``os.environ`` for a while: Accelerate's helpers that set, clear or purge variables for the duration of a
block or a test, and that write an environment file."""

from __future__ import annotations

import contextlib
import functools
import os

from ..accelerate_alias import logger_for
from ..settings import ACCELERATE_PREFIX, PREFIX


@contextlib.contextmanager
def patch_environment(**kwargs):
    """Set environment variables (keys upper-cased) for the duration of the block, then restore them."""
    saved = {}
    for key, value in kwargs.items():
        key = key.upper()
        saved[key] = os.environ.get(key)
        os.environ[key] = str(value)
    try:
        yield
    finally:
        for key, old in saved.items():
            if old is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = old


@contextlib.contextmanager
def clear_environment():
    """Empty ``os.environ`` for the duration of the block, then restore it exactly."""
    saved = dict(os.environ)
    os.environ.clear()
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


_LAUNCH_PREFIXES = (ACCELERATE_PREFIX, PREFIX)


@contextlib.contextmanager
def _restored_launch_variables():
    saved = {k: v for k, v in os.environ.items() if k.startswith(_LAUNCH_PREFIXES)}
    try:
        yield
    finally:
        for key in [k for k in os.environ if k.startswith(_LAUNCH_PREFIXES)]:
            if key not in saved:
                del os.environ[key]
        os.environ.update(saved)


def purge_accelerate_environment(func_or_cls):
    """Decorator: ``ACCELERATE_*`` and ``HASTEN_*`` variables set while the function (or each ``test*`` method of
    the class and of its subclasses) runs are removed afterwards, and changed ones restored.

    Objects such as transformers' ``TrainingArguments(fp16=True)`` export ``ACCELERATE_MIXED_PRECISION``; in a
    test suite that would leak into the next test.
    """

    def wrap(function):
        if getattr(function, "_hasten_purges_environment", False):
            return function

        @functools.wraps(function)
        def wrapper(*args, **kwargs):
            with _restored_launch_variables():
                return function(*args, **kwargs)

        wrapper._hasten_purges_environment = True
        return wrapper

    def wrap_tests(cls):
        for name in dir(cls):
            if name.startswith("test") and callable(getattr(cls, name)):
                setattr(cls, name, wrap(getattr(cls, name)))
        return cls

    if not isinstance(func_or_cls, type):
        return wrap(func_or_cls)
    original = func_or_cls.__init_subclass__

    def init_subclass(cls, **kwargs):
        if hasattr(original, "__func__"):  # the class's own __init_subclass__
            original.__func__(cls, **kwargs)
        else:
            original(**kwargs)
        wrap_tests(cls)

    func_or_cls.__init_subclass__ = classmethod(init_subclass)
    return wrap_tests(func_or_cls)


def convert_dict_to_env_variables(current_env: dict) -> list[str]:
    """``KEY=value\\n`` lines for an environment file, leaving out (with a warning) entries that are empty or hold a
    character that would break the file (``;``, a newline, ``<``, ``>`` or a space); each is logged as a warning on
    the logger of ``utils.environment`` (see :func:`hasten.accelerate_alias.logger_for`)."""
    lines = []
    for key, value in current_env.items():
        text = f"{key}{value}"
        if key and value and not any(char in text for char in ";\n<> "):
            lines.append(f"{key}={value}\n")
        else:
            logger_for("utils.environment").warning(
                f"Skipping the environment variable {key}={value!r}: it is empty or holds a forbidden character."
            )
    return lines
