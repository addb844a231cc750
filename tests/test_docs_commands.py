"""Every shell command of README.md and docs/quick_tour.md runs as written, in the environment the text names.

Each fenced ``bash`` block is one shell session, run line by line as written (``set -e``) from a copy of the
repository root (its top-level entries linked into a scratch folder, so that what the commands write stays there),
in the venv that ``make`` builds, activated. ``train.py`` of the quick tour is its script of "The four lines";
``ds_config.json`` is the user's DeepSpeed config (the test writes a small one). The environment adds a free port
for ``torchrun`` (``PET_MASTER_PORT``: other jobs may hold its default one) and an empty config folder. The commands
of the quick tour's table of examples run in tests/test_examples.py. A command that cannot run here is listed in
:data:`SKIPPED` with the reason.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import ROOT, clean_env, free_port, requires

DOCS = {"README.md": ROOT / "README.md", "quick_tour.md": ROOT / "docs" / "quick_tour.md"}
VENV = Path(sys.prefix)
# A command (as written, without its comment) -> why it is not run here.
SKIPPED = {
    "make": (
        "the full set-up (pip installs from the network, DeepSpeed's op build: tens of minutes); this venv is its "
        "result, and the commands after it run in it"
    ),
}
# Top-level entries of the repository that the commands must not see (or write into) through the scratch copy.
_NOT_LINKED = {".git", "runs", "my_model", "my_model_sharded", "ckpt"}
_DS_CONFIG = {"train_micro_batch_size_per_gpu": "auto", "zero_optimization": {"stage": 2}}


def shell_blocks(path: Path) -> list[list[str]]:
    """The fenced bash blocks of ``path``, each as its lines."""
    return [block.strip().splitlines() for block in re.findall(r"```bash\n(.*?)```", path.read_text(), re.DOTALL)]


def command(line: str) -> str:
    """A line without its comment."""
    return re.sub(r"\s+#.*$", "", line).strip()


def four_lines_script() -> str:
    """The quick tour's script of "The four lines": the ``train.py`` its commands launch."""
    text = DOCS["quick_tour.md"].read_text()
    section = text[text.index("## The four lines") :]
    return re.search(r"```python\n(.*?)```", section, re.DOTALL).group(1)


def _workdir(tmp_path: Path) -> Path:
    """A scratch repository root: the checkout's top-level entries linked in, the quick tour's files added."""
    work = tmp_path / "checkout"
    work.mkdir()
    for entry in ROOT.iterdir():
        if entry.name not in _NOT_LINKED:
            (work / entry.name).symlink_to(entry)
    (work / "train.py").write_text(four_lines_script())
    (work / "ds_config.json").write_text(json.dumps(_DS_CONFIG))
    return work


def _env(tmp_path: Path) -> dict[str, str]:
    """The user's shell in the activated venv, with an empty config folder and a free port for torchrun."""
    env = clean_env(
        HASTEN_HOME=str(tmp_path / "hasten_home"),
        XDG_CACHE_HOME=str(tmp_path / "cache"),
        PET_MASTER_PORT=str(free_port()),
        VIRTUAL_ENV=str(VENV),
    )
    env.pop("HF_HOME", None)
    env.pop("PYTHONPATH", None)
    env["PATH"] = f"{VENV / 'bin'}:{env.get('PATH', '')}"
    return env


def _cases() -> list:
    """One case per block; a block that runs `make demo` needs its install done (else it would reinstall hasten)."""
    return [
        pytest.param(
            name,
            index,
            id=f"{name}-{index}",
            marks=[requires("make demo installed")] if any(command(line) == "make demo" for line in block) else [],
        )
        for name, path in DOCS.items()
        for index, block in enumerate(shell_blocks(path))
    ]


def test_every_command_runs_here_or_is_skipped_with_a_reason():
    lines = [command(line) for path in DOCS.values() for block in shell_blocks(path) for line in block]
    assert len(lines) >= 14 and all(lines), lines
    assert set(SKIPPED) <= set(lines), "an entry of SKIPPED no longer appears in the docs"
    assert all(reason for reason in SKIPPED.values())
    compile(four_lines_script(), "train.py", "exec")


@pytest.mark.slow
@pytest.mark.parametrize(("doc", "index"), _cases())
def test_the_commands_of_a_block_run_as_written(tmp_path, doc, index):
    lines = shell_blocks(DOCS[doc])[index]
    script = ["set -e"]
    for line in lines:
        reason = SKIPPED.get(command(line))
        script.append(f"echo {shlex.quote(f'skipped `{command(line)}`: {reason}')}" if reason else line)
    work = _workdir(tmp_path)
    proc = subprocess.run(
        ["bash", "-c", "\n".join(script)],
        cwd=work,
        env=_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=1200,
        check=False,
    )
    assert proc.returncode == 0, (
        f"{doc}, block {index}:\n" + "\n".join(lines) + f"\n--- stdout ---\n{proc.stdout[-6000:]}\n"
        f"--- stderr ---\n{proc.stderr[-8000:]}"
    )
