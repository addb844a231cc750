"""One path per setting: outside the settings layer no code spells a setting by hand.

The settings layer is ``hasten/settings/`` (the rows), ``hasten/environment/`` (the one reader of the variables) and
``hasten/config.py`` (the config file built from the rows). Everywhere else a top-level launch setting is reached
through its row (``MIXED_PRECISION.key``, ``.variable``, ``.choices``, ``environment.launch_setting(MIXED_PRECISION)``)
and a variable through the layer (``environment.variable_name("HANG_TIMEOUT")``), so renaming a key or a variable is one
edit and a search for the row finds every use. This test reads the source's string literals (docstrings and comments
are prose, keyword arguments are not literals) and fails on:

- a top-level config key of the launch table used as a string (``"mixed_precision"``, ``"num_processes"``, ...);
- a ``HASTEN_*`` or ``ACCELERATE_*`` variable name, or the prefix alone;
- the variable name of a launch table row without its prefix (``"MIXED_PRECISION"``, ``"DEBUG_MODE"``) or of the
  gradient accumulation row, which every engine reads.

``ALLOWED`` lists, with the reason, the few literals that are the same word but not the setting.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from hasten.settings import ACCELERATE_PREFIX, PREFIX
from hasten.settings.deepspeed import GRADIENT_ACCUMULATION_STEPS
from hasten.settings.launch import LAUNCH

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "hasten"
LAYER = ("settings/", "environment/", "config.py")
KEYS = {row.key for row in LAUNCH.rows if row.key}
NAMES = {row.env_name for row in (*LAUNCH.rows, GRADIENT_ACCUMULATION_STEPS) if row.env_name}
VARIABLE = re.compile(rf"\b(?:{PREFIX}|{ACCELERATE_PREFIX})[A-Z0-9_]*")

# (file under src/hasten, literal) -> why it is not the setting. Reviewed: add an entry only for a word that means
# something else where it stands.
ALLOWED = {
    ("data_loader/loaders.py", "num_processes"): (
        "a loader's saved state records how many processes shared the epoch (its checkpoint format), and "
        "BatchSamplerShard's attribute of that name is Accelerate's"
    ),
    ("strategies/deepspeed/schema.py", "debug"): "a key of DeepSpeed's JSON config (its comms_logger's)",
    ("compat/constants.py", "rdzv_backend"): "TORCH_LAUNCH_PARAMS, Accelerate's list of torchrun's options",
    ("commands/main.py", "commands"): "the title of the subcommands' -h section",
}


def _docstrings(tree: ast.AST) -> set[int]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


def _why(text: str) -> str | None:
    """What makes ``text`` a settings literal, or None."""
    if text in KEYS:
        return "a top-level config key"
    if text in NAMES:
        return "a setting's variable name"
    match = VARIABLE.search(text)
    return f"the variable name {match.group()!r}" if match else None


def _literals() -> list[tuple[str, int, str, str]]:
    """(file, line, literal, why) for every settings literal outside the layer."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        name = path.relative_to(PACKAGE).as_posix()
        if name.startswith(LAYER):
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=name)
        prose = _docstrings(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in prose:
                why = _why(node.value)
                if why:
                    found.append((name, node.lineno, node.value, why))
    return found


def test_no_setting_is_spelled_outside_the_settings_layer():
    found = _literals()
    stray = [f"  {name}:{line}: {text!r} is {why}" for name, line, text, why in found if (name, text) not in ALLOWED]
    assert not stray, (
        "Settings spelled by hand outside hasten/settings, hasten/environment and hasten/config.py:\n"
        + "\n".join(stray)
        + "\nGo through the row instead (hasten.settings.launch: MIXED_PRECISION.key, .variable, .choices; "
        "environment.launch_setting(row); environment.variable_name(name) for a message or a launcher's variable), or, "
        "for a word that is not the setting, add it to ALLOWED with the reason."
    )


@pytest.mark.parametrize(("name", "text"), sorted(ALLOWED))
def test_every_allowed_literal_is_still_there(name, text):
    assert any((found, literal) == (name, text) for found, _, literal, _ in _literals()), (
        f"{text!r} no longer appears in {name}: remove it from ALLOWED"
    )


def test_the_scan_sees_what_it_looks_for():
    """The rules catch a key, a variable (also inside an f-string's text) and a bare name, and leave prose alone."""
    assert _why("num_processes") and _why("MIXED_PRECISION") and _why("GRADIENT_ACCUMULATION_STEPS")
    assert _why("set HASTEN_DEBUG_MODE=1") and _why("ACCELERATE_USE_FSDP") and _why(PREFIX)
    assert _why("num_processes=2 is the total") is None and _why("mixed precision") is None
    source = 'def f():\n    """HASTEN_X in a docstring."""\n    return f"{a} HASTEN_Y={b}"\n'
    tree = ast.parse(source)
    texts = [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and id(n) not in _docstrings(tree)]
    assert [t for t in texts if _why(t)] == [" HASTEN_Y="]
