"""Reading a launch config file's text into a mapping, with one clear line for each way it can be wrong.

A folder, a missing file, a binary file, unparsable YAML or JSON, and a key set twice (which PyYAML
and ``json`` would silently resolve to the last value) are each a :class:`~hasten.errors.ConfigError`
naming the file; checking the keys and values is :mod:`hasten.config`'s job.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from .command import command_name


def read_config_data(path: Path) -> dict:
    """The mapping stored in the YAML (or ``.json``) file ``path``; an empty file is an empty mapping."""
    text = _read_text(path)
    try:
        if path.suffix == ".json":
            return json.loads(text, object_pairs_hook=_unique_json_keys) if text.strip() else {}
        return _parse_yaml(text) or {}
    except _DuplicateKey as exc:
        where = f" (lines {exc.lines[0]} and {exc.lines[1]})" if exc.lines else ""
        raise ConfigError(
            f"Launch config file {path} sets {exc.key!r} twice{where}; only one value can be in force. Delete one of "
            "them."
        ) from None
    except ValueError as exc:  # json.JSONDecodeError and yaml.YAMLError's parser errors
        raise ConfigError(
            f"Launch config file {path} is not valid {'JSON' if path.suffix == '.json' else 'YAML'}: {exc}"
        ) from None
    except Exception as exc:
        if type(exc).__module__.startswith("yaml"):
            raise ConfigError(f"Launch config file {path} is not valid YAML: {exc}") from None
        raise


def _read_text(path: Path) -> str:
    if path.is_dir():
        inside = sorted(p.name for p in path.iterdir() if p.suffix in (".yaml", ".yml", ".json"))
        example = f" such as {path / inside[0]}" if inside else ""
        raise ConfigError(
            f"--config_file {path} is a folder, not a file. Pass the config file itself{example}, or leave "
            f"--config_file out to use the default file written by `{command_name()} config`."
        )
    if not path.is_file():
        raise ConfigError(
            f"Launch config file {path} does not exist. Pass an existing file with --config_file, or create one "
            f"with `{command_name()} config` (interactive) or `{command_name()} config default`."
        )
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"Launch config file {path} is not a text file (byte {exc.start} is not UTF-8 text): a launch config is "
            f"YAML or JSON text. Pass the file written by `{command_name()} config`, or check that --config_file "
            "names the right file."
        ) from None


class _DuplicateKey(Exception):
    def __init__(self, key: Any, lines: tuple[int, int] | None = None):
        super().__init__(key)
        self.key, self.lines = key, lines


def _unique_json_keys(pairs: list[tuple[str, Any]]) -> dict:
    seen: dict[str, Any] = {}
    for key, value in pairs:
        if key in seen:
            raise _DuplicateKey(key)
        seen[key] = value
    return seen


@functools.cache
def _unique_key_loader() -> type:
    """A safe YAML loader that refuses a key set twice in one mapping (PyYAML keeps the last one silently)."""
    import yaml

    class UniqueKeyLoader(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):
            lines: dict[Any, int] = {}
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=True)
                line = key_node.start_mark.line + 1
                try:
                    first = lines.setdefault(key, line)
                except TypeError:  # an unhashable key: PyYAML's own error follows
                    continue
                if first != line:
                    raise _DuplicateKey(key, (first, line))
            return super().construct_mapping(node, deep)

    return UniqueKeyLoader


def _parse_yaml(text: str) -> Any:
    import yaml

    return yaml.load(text, Loader=_unique_key_loader())  # noqa: S506 - a SafeLoader subclass
