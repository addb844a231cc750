"""hasten's ``accelerate`` distribution (``alias/``), installed with pip into a fresh virtual environment.

One venv for the whole module (creating one costs seconds; installing torch into it would cost a minute): pip and
hasten are installed into it for real; torch, hasten's other requirements and the libraries built on Accelerate
come from this test run's environment through a folder of links named by a ``.pth`` file, so pip lists exactly
what the venv can import. Nothing is downloaded: the alias builds with the standard library only.

The steps run in order, as a user would take them: HuggingFace's Accelerate is installed (a stand-in wheel), the
alias refuses to replace it and says how; after ``pip uninstall accelerate`` it installs; ``import accelerate``,
the ``accelerate`` command and ``python -m accelerate.commands.<x>`` are hasten's; ``pip check`` is clean; a real
Accelerate elsewhere on the path is never mixed in; ``pip uninstall accelerate`` restores the environment.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata
import json
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest
from helpers import ROOT, SCRIPTS, clean_env, free_port, requires

import hasten

pytestmark = pytest.mark.slow

# Installed into the venv from this run's environment when they are there; pip check covers their requirements.
ECOSYSTEM = ("peft", "trl", "diffusers", "sentence-transformers", "setfit")
HASTEN_VERSION = hasten.__version__


class Venv:
    """A scratch virtual environment: runs its python, pip and console scripts."""

    def __init__(self, root: Path):
        self.root = root
        self.bin = root / "bin"
        self.python = self.bin / "python"
        self.site = Path(
            self._run(
                [str(self.python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]
            ).stdout.strip()
        )

    @staticmethod
    def _run(cmd, env=None, check=True, timeout=300, cwd=None) -> subprocess.CompletedProcess:
        proc = subprocess.run(
            list(map(str, cmd)),
            check=False,
            env=env or _env(),
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=cwd,
        )
        if check and proc.returncode != 0:
            raise AssertionError(
                f"{' '.join(map(str, cmd))} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
            )
        return proc

    def pip(self, *args, check=True, env=None) -> subprocess.CompletedProcess:
        return self._run(
            [self.python, "-m", "pip", "--disable-pip-version-check", "--no-input", *args], env=env, check=check
        )

    def python_json(self, code: str, env=None):
        out = self._run([self.python, "-c", textwrap.dedent(code)], env=env).stdout
        return json.loads(out.strip().splitlines()[-1])

    def command(self, name: str, *args, check=True, env=None, cwd=None) -> subprocess.CompletedProcess:
        return self._run([self.bin / name, *args], env=env, check=check, cwd=cwd)


def _env(**extra) -> dict[str, str]:
    """No PYTHONPATH (the venv imports only what is installed in it), pip offline and without its cache."""
    env = clean_env(PIP_NO_INDEX="1", PIP_NO_CACHE_DIR="1")
    env.pop("PYTHONPATH", None)
    env.update(extra)
    return env


def _closure(names) -> list[importlib.metadata.Distribution]:
    """The installed distributions ``names`` need (their requirements, recursively, extras followed), without hasten
    and accelerate themselves; names not installed here are left out."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    found, seen, todo = {}, set(), [(name, ()) for name in names]
    while todo:
        name, extras = todo.pop()
        key = canonicalize_name(name)
        if (key, extras) in seen or key == "accelerate":
            continue
        seen.add((key, extras))
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        if key != "hasten":
            found[key] = dist
        for text in dist.requires or ():
            requirement = Requirement(text)
            if requirement.marker is None or any(
                requirement.marker.evaluate({"extra": extra}) for extra in ("", *extras)
            ):
                todo.append((requirement.name, tuple(sorted(requirement.extras))))
    return list(found.values())


def _link_distributions(dists, folder: Path) -> None:
    """Link each distribution's top-level files and folders (its package, its .dist-info) into ``folder``."""
    folder.mkdir()
    for dist in dists:
        tops = {Path(str(file)).parts[0] for file in dist.files or () if not str(file).startswith("..")}
        for top in tops:
            source = Path(dist.locate_file(top))
            if source.exists() and not (folder / top).exists():
                (folder / top).symlink_to(source)


def _wheel(folder: Path, files: dict[str, str], name: str, version: str) -> Path:
    """A wheel of ``files`` (plus its dist-info), as pip installs it."""
    info = f"{name}-{version}.dist-info"
    files = {
        **files,
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = [
        f"{path},sha256={base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b'=').decode()},"
        f"{len(text.encode())}"
        for path, text in files.items()
    ]
    files[f"{info}/RECORD"] = "\n".join([*record, f"{info}/RECORD,,"]) + "\n"
    path = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as wheel:
        for member, text in files.items():
            wheel.writestr(member, text)
    return path


def _real_accelerate_wheel(folder: Path) -> Path:
    """A stand-in for HuggingFace's Accelerate 1.15.0: its name, version, home page, and a module hasten lacks."""
    metadata = (
        "Metadata-Version: 2.1\nName: accelerate\nVersion: 1.15.0\nSummary: Accelerate\n"
        "Home-page: https://github.com/huggingface/accelerate\n"
    )
    files = {
        "accelerate/__init__.py": "__version__ = '1.15.0'\nREAL = True\n",
        "accelerate/real_only.py": "",
        "accelerate-1.15.0.dist-info/METADATA": metadata,
    }
    return _wheel(folder, files, "accelerate", "1.15.0")


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Venv:
    """A fresh venv with pip, hasten (built from this checkout), its requirements and the ecosystem libraries linked
    in, and HuggingFace's Accelerate (the stand-in) installed."""
    scratch = tmp_path_factory.mktemp("install")
    checkout = scratch / "checkout"  # what pip builds from (setuptools writes build/ and *.egg-info beside it)
    checkout.mkdir()
    for part in ("pyproject.toml", "README.md", "src", "alias"):
        copy = shutil.copytree if (ROOT / part).is_dir() else shutil.copy
        copy(
            ROOT / part,
            checkout / part,
            **({"ignore": shutil.ignore_patterns("__pycache__", "*.egg-info")} if copy is shutil.copytree else {}),
        )
    Venv._run([sys.executable, "-m", "venv", scratch / "venv"])
    env = Venv(scratch / "venv")
    env.checkout = checkout
    links = env.root / "linked"
    _link_distributions(_closure(["hasten", "setuptools", "wheel", *ECOSYSTEM]), links)
    (env.site / "linked-from-the-test-run.pth").write_text(f"{links}\n")
    if (env.site / "setuptools").is_dir():  # the venv's own (Python < 3.12), older than the one hasten builds with
        env.pip("uninstall", "-y", "setuptools")
    env.pip("install", "--no-build-isolation", "--no-deps", checkout)  # hasten; its requirements are linked in
    env.pip("install", _real_accelerate_wheel(scratch))
    return env


def _installed(env: Venv) -> dict[str, str]:
    return {row["name"].lower(): row["version"] for row in json.loads(env.pip("list", "--format", "json").stdout)}


def test_without_hasten_says_to_install_hasten_first(tmp_path):
    """pip would only say that no version satisfies hasten==<version> (hasten is on no package index)."""
    Venv._run([sys.executable, "-m", "venv", tmp_path / "bare"])
    bare = Venv(tmp_path / "bare")
    proc = bare.pip("install", ROOT / "alias", check=False)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "Could not find a version" not in output, output
    assert (
        f"it requires hasten=={HASTEN_VERSION} (the hasten of {ROOT}), and hasten is not installed in {bare.site}."
        in output
    ), output
    assert (
        f"pip install {ROOT}\n" in output
        and f"then run this install again:              pip install {ROOT / 'alias'}" in output
    )
    assert "accelerate" not in _installed(bare)


def test_refuses_to_replace_huggingface_accelerate_and_says_how(venv):
    proc = venv.pip("install", venv.checkout / "alias", check=False)
    assert proc.returncode != 0
    output = proc.stdout + proc.stderr
    assert f"HuggingFace's Accelerate 1.15.0 is installed in {venv.site}, and pip would replace it." in output, output
    assert "pip uninstall accelerate" in output and "HASTEN_REPLACE_ACCELERATE=1 pip install ./alias" in output
    assert "hasten.install_as_accelerate()" in output and "hasten launch --as_accelerate" in output
    assert _installed(venv)["accelerate"] == "1.15.0"  # untouched
    assert venv.python_json("import accelerate, json; print(json.dumps(accelerate.REAL))") is True


def test_installs_after_the_real_accelerate_is_uninstalled(venv):
    venv.pip("uninstall", "-y", "accelerate")
    venv.pip("install", venv.checkout / "alias")
    installed = _installed(venv)
    assert installed["accelerate"] == f"1.15.0+hasten.{HASTEN_VERSION}" and installed["hasten"] == HASTEN_VERSION
    assert venv.pip("check").stdout.strip() == "No broken requirements found."
    show = venv.pip("show", "accelerate").stdout
    assert "Requires: hasten\n" in show and "Summary: hasten, installed under Accelerate's name" in show
    assert "Home-page: https://github.com/huggingface/accelerate" in show


def test_every_process_imports_hasten_as_accelerate_and_libraries_accept_it(venv):
    result = venv.python_json(
        """
        import importlib.metadata as m, json, sys
        import accelerate, accelerate.utils, accelerate.commands.launch
        import hasten, hasten.utils, hasten.commands.launch
        meta = m.metadata("accelerate")
        out = {
            "same": [accelerate.Accelerator is hasten.Accelerator, accelerate.utils is hasten.utils,
                     accelerate.commands.launch is hasten.commands.launch],
            "version": accelerate.__version__, "distribution": m.version("accelerate"),
            "distributions": [d.version for d in m.distributions() if d.metadata["Name"] == "accelerate"],
            "home_page": meta["Home-page"], "name": meta["Name"],
            "requirements_met": {},
        }
        from packaging.requirements import Requirement
        for name in ("peft", "trl", "sentence-transformers"):
            try:
                requires = m.requires(name) or []
            except m.PackageNotFoundError:
                continue
            accelerate_requirements = [Requirement(r) for r in requires if Requirement(r).name == "accelerate"]
            met = [r.specifier.contains(m.version("accelerate")) for r in accelerate_requirements]
            out["requirements_met"][name] = all(met)
        print(json.dumps(out))
        """
    )
    assert all(result["same"]) and result["version"] == "1.15.0"
    assert result["distributions"] == [result["distribution"]] == [f"1.15.0+hasten.{HASTEN_VERSION}"]  # reported once
    # sentence-transformers (and setfit through it) train only when accelerate's metadata names a huggingface home page.
    assert result["name"] == "accelerate" and "huggingface" in result["home_page"]
    assert all(result["requirements_met"].values()), result["requirements_met"]


@requires("sentence_transformers")  # the fresh venv links what this venv has installed
def test_plain_imports_of_the_ecosystem_libraries_get_hasten(venv):
    result = venv.python_json(
        """
        import json, sys
        from sentence_transformers.util import is_training_available
        import transformers.utils
        print(json.dumps([is_training_available(), transformers.utils.is_accelerate_available(),
                          sys.modules["accelerate"].__hasten_alias__]))
        """
    )
    assert result == [True, True, True]


def test_the_accelerate_command_is_hasten_with_accelerates_flags(venv, tmp_path):
    usage = venv.command("accelerate", "--help").stdout
    assert usage.startswith("usage: accelerate ") and all(
        c in usage for c in ("launch", "config", "env", "test", "estimate-memory", "merge-weights")
    )
    assert venv.command("accelerate", "launch", "--help").stdout.startswith(
        "usage: accelerate launch [options] training_script"
    )
    assert venv.command("accelerate-launch", "--help").stdout.startswith(
        "usage: accelerate launch [options] training_script"
    )
    assert f"- hasten version: {HASTEN_VERSION}" in venv.command("accelerate", "env").stdout
    estimate = venv.command("accelerate-estimate-memory", "--num_params", "1e9").stdout
    assert "1000M total parameters" in estimate
    config = tmp_path / "default.yaml"
    venv.command("accelerate", "config", "default", "--config_file", config)
    assert "distributed_type" in config.read_text()
    wrong = venv.command("accelerate", "launch", "--num_processes", "2", check=False)
    assert wrong.returncode == 2 and "accelerate launch needs the training script" in wrong.stderr
    for module in ("accelerate_cli", "config", "env", "estimate", "merge", "test", "launch"):
        proc = venv._run([venv.python, "-m", f"accelerate.commands.{module}", "--help"])
        assert proc.stdout.startswith("usage: accelerate"), (module, proc.stdout[:200])


def test_accelerate_launch_runs_a_two_process_job_on_hasten(venv):
    proc = venv.command(
        "accelerate",
        "launch",
        "--cpu",
        "--num_processes",
        "2",
        "--main_process_port",
        str(free_port()),
        "-q",
        SCRIPTS / "eco_alias_probe.py",
    )
    reports = sorted(
        (json.loads(line[6:]) for line in proc.stdout.splitlines() if line.startswith("ALIAS ")),
        key=lambda r: r["rank"],
    )
    assert [r["rank"] for r in reports] == [0, 1], proc.stdout + proc.stderr
    version = f"1.15.0+hasten.{HASTEN_VERSION}"
    for report in reports:
        assert (report["version"], report["distribution"], report["accelerator"]) == (
            "1.15.0",
            version,
            "hasten.accelerator",
        )
        assert report["child"] == ["1.15.0", version, "hasten.accelerator"]  # a process the worker starts, too


def test_a_real_accelerate_elsewhere_on_the_path_is_never_mixed_in(venv, tmp_path):
    with zipfile.ZipFile(_real_accelerate_wheel(tmp_path)) as wheel:
        wheel.extractall(tmp_path / "real")
    code = """
        import importlib, importlib.metadata as m, json
        import accelerate
        try:
            importlib.import_module("accelerate.real_only")
            real_only = "imported"
        except ModuleNotFoundError as error:
            real_only = str(error)
        real = getattr(accelerate, "REAL", False)
        print(json.dumps([real, accelerate.__version__, m.version("accelerate"), real_only]))
        """
    # First on the path (PYTHONPATH, as tests/differential.py puts its reference copy): the real one, whole.
    first = venv.python_json(code, env=_env(PYTHONPATH=str(tmp_path / "real")))
    assert first == [True, "1.15.0", "1.15.0", "imported"]
    # After the alias (a .pth appends it): hasten, whole; the real package's modules are not reachable.
    (venv.site / "zz-real-accelerate.pth").write_text(f"{tmp_path / 'real'}\n")
    try:
        after = venv.python_json(code)
    finally:
        (venv.site / "zz-real-accelerate.pth").unlink()
    assert after[:3] == [False, "1.15.0", f"1.15.0+hasten.{HASTEN_VERSION}"]
    assert (
        "No module named 'accelerate.real_only'" in after[3] and "hasten has no module 'hasten.real_only'" in after[3]
    )


def test_uninstall_restores_the_environment(venv):
    venv.pip("uninstall", "-y", "accelerate")
    assert "accelerate" not in _installed(venv)
    assert not (venv.site / "accelerate").exists() and not list(venv.bin.glob("accelerate*"))
    result = venv.python_json(
        """
        import importlib.util, json
        import hasten
        print(json.dumps([importlib.util.find_spec("accelerate") is None, hasten.__version__]))
        """
    )
    assert result == [True, HASTEN_VERSION]
    # What needs accelerate says so again, as before the alias was installed.
    broken = [line for line in venv.pip("check", check=False).stdout.splitlines() if line.startswith(tuple(ECOSYSTEM))]
    assert all(line.endswith("requires accelerate, which is not installed.") for line in broken), broken
