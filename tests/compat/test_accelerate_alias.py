"""``hasten.install_as_accelerate()``, the shim folder, ``hasten launch --as_accelerate``, and the ``accelerate``
distribution built from ``alias/`` (its wheel, unpacked onto ``PYTHONPATH``; tests/test_install.py installs it
with pip into a fresh venv).

Each check runs in a fresh Python process: the alias changes ``sys.meta_path`` and ``sys.modules``. The venv
running the tests may have hasten's accelerate distribution installed (``make setup`` installs it): then the
version ``importlib.metadata`` reports for ``accelerate`` is that distribution's (:func:`_expected_distribution`).
"""

from __future__ import annotations

import fnmatch
import importlib.metadata
import json
import os
import re
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest
import tomllib
from helpers import ROOT, SCRIPTS, clean_env, hasten_launch, requires

from hasten.accelerate_alias import ACCELERATE_API_VERSION, SHIM_DIR
from hasten.commands.launch import prepare_launch
from hasten.commands.main import build_parser
from hasten.config import Hardware

SRC = ROOT / "src"
ALIAS = ROOT / "alias"


def _python(code: str, *path: Path | str, check: bool = True) -> subprocess.CompletedProcess:
    env = clean_env(PYTHONPATH=os.pathsep.join(map(str, [*path, SRC])))
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True, timeout=120
    )
    if check and proc.returncode != 0:
        raise AssertionError(proc.stderr[-4000:])
    return proc


def _json(code: str, *path) -> dict:
    return json.loads(_python(code, *path).stdout.strip().splitlines()[-1])


def _expected_distribution() -> str:
    """The version ``importlib.metadata`` gives for ``accelerate`` under the alias in this venv: that of hasten's
    accelerate distribution when it is installed (it is reported, once), else the shim's."""
    code = """
        import importlib.metadata as m, json
        context = m.DistributionFinder.Context(name="accelerate")
        first = next(iter(m.MetadataPathFinder.find_distributions(context)), None)
        print(json.dumps(first.version if first is not None else None))
        """
    installed = _json(code)
    return installed if installed is not None and "+hasten." in installed else ACCELERATE_API_VERSION


def _alias_wheel(folder: Path) -> Path:
    """hasten's accelerate wheel, built by the backend of ``alias/`` (as pip runs it) into ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    name = _python(f"import build_alias; print(build_alias.build_wheel({str(folder)!r}))", ALIAS).stdout.strip()
    return folder / name


def _fake_accelerate(folder: Path, version: str = "0.27.0") -> Path:
    """A stand-in for the real Accelerate, installed in ``folder`` (package + dist-info)."""
    (folder / "accelerate").mkdir(parents=True)
    (folder / "accelerate" / "__init__.py").write_text(f"__version__ = {version!r}\nREAL = True\n")
    info = folder / f"accelerate-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: accelerate\nVersion: {version}\n")
    return folder


def test_install_maps_every_submodule_to_hasten_and_reports_the_api_version():
    result = _json(
        """
        import importlib.metadata, json, sys
        import hasten
        from hasten.accelerate_alias import _AliasFinder
        hasten.install_as_accelerate()
        hasten.install_as_accelerate()
        import accelerate
        set_seed = accelerate.utils.set_seed  # Accelerate imports its submodules at `import accelerate`
        import accelerate.utils, accelerate.state, accelerate.commands.launch
        from accelerate import Accelerator
        from accelerate.data_loader import skip_first_batches
        import hasten.utils, hasten.state, hasten.data_loader, hasten.commands.launch
        print(json.dumps({
            "finders": sum(isinstance(f, _AliasFinder) for f in sys.meta_path),
            "version": accelerate.__version__, "hasten_version": hasten.__version__,
            "own": accelerate.__hasten_version__,
            "same": [accelerate.utils is hasten.utils, accelerate.state is hasten.state,
                     accelerate.commands.launch is hasten.commands.launch, Accelerator is hasten.Accelerator,
                     skip_first_batches is hasten.data_loader.skip_first_batches, set_seed is hasten.utils.set_seed],
            "specs": [hasten.utils.__spec__.name, hasten.commands.launch.__spec__.name],
            "dir": "Accelerator" in dir(accelerate), "all": accelerate.__all__ == hasten.__all__,
            "distribution": importlib.metadata.version("accelerate"),
        }))
        """
    )
    assert result["finders"] == 1  # idempotent
    assert result["version"] == ACCELERATE_API_VERSION == "1.15.0"
    assert result["distribution"] == _expected_distribution()
    assert result["hasten_version"] == result["own"] != ACCELERATE_API_VERSION
    assert all(result["same"]) and result["dir"] and result["all"]
    assert result["specs"] == ["hasten.utils", "hasten.commands.launch"]  # hasten's modules keep their own spec


@requires("transformers")
def test_metadata_satisfies_the_version_checks_of_transformers_and_the_backport():
    result = _json(
        """
        import importlib.metadata, importlib.util, json
        import hasten
        hasten.install_as_accelerate()
        from transformers.utils.import_utils import is_accelerate_available
        out = {"spec": importlib.util.find_spec("accelerate") is not None,
               "name": importlib.metadata.distribution("accelerate").metadata["Name"],
               "top_level": importlib.metadata.packages_distributions()["accelerate"],
               "transformers": is_accelerate_available("1.1.0")}
        if importlib.util.find_spec("importlib_metadata"):
            import importlib_metadata
            out["backport"] = importlib_metadata.version("accelerate")
        print(json.dumps(out))
        """
    )
    assert result["spec"] and result["name"] == "accelerate" and result["top_level"] == ["accelerate"]
    assert result["transformers"] is True
    assert result.get("backport", _expected_distribution()) == _expected_distribution()


def test_a_module_hasten_lacks_is_a_clear_module_not_found_error():
    proc = _python("import hasten; hasten.install_as_accelerate(); import accelerate.no_such_module", check=False)
    assert "ModuleNotFoundError: No module named 'accelerate.no_such_module'" in proc.stderr
    assert "hasten has no module 'hasten.no_such_module'" in proc.stderr
    proc = _python(
        "import hasten; hasten.install_as_accelerate(); import accelerate; accelerate.no_such_name", check=False
    )
    assert "AttributeError: module 'accelerate' (hasten) has no attribute 'no_such_name'" in proc.stderr


def test_refuses_when_the_real_accelerate_is_already_imported(tmp_path):
    site = _fake_accelerate(tmp_path / "site")
    proc = _python("import accelerate\nimport hasten\nhasten.install_as_accelerate()", site, check=False)
    assert "AliasConflictError" in proc.stderr and "the real Accelerate is already imported" in proc.stderr
    assert str(site / "accelerate" / "__init__.py") in proc.stderr


def test_an_installed_accelerate_not_yet_imported_is_shadowed(tmp_path):
    site = _fake_accelerate(tmp_path / "site")
    result = _json(
        """
        import importlib.metadata, json
        import hasten
        hasten.install_as_accelerate()
        import accelerate
        print(json.dumps(
            [accelerate.__version__, importlib.metadata.version("accelerate"), hasattr(accelerate, "REAL")]
        ))
        """,
        site,
    )
    assert result == [ACCELERATE_API_VERSION, ACCELERATE_API_VERSION, False]


def test_shim_folder_on_the_path_answers_before_any_hasten_code_runs():
    result = _json(
        """
        import importlib.metadata as m, importlib.util, json, sys
        before = [importlib.util.find_spec("accelerate") is not None, m.version("accelerate"), "hasten" in sys.modules]
        import accelerate.utils
        import hasten.utils
        reported = [d._path.as_posix() for d in m.distributions() if d.metadata["Name"] == "accelerate"]
        context = m.DistributionFinder.Context(name="accelerate")
        on_path = [d._path.as_posix() for d in m.MetadataPathFinder.find_distributions(context)]
        print(json.dumps({"before": before, "version": accelerate.__version__, "alias": accelerate.__hasten_alias__,
                          "utils": accelerate.utils is hasten.utils, "reported": reported, "on_path": on_path}))
        """,
        SHIM_DIR,
    )
    assert result["before"] == [True, ACCELERATE_API_VERSION, False]
    assert result["version"] == ACCELERATE_API_VERSION and result["alias"] and result["utils"]
    # The finder adds nothing to what the path holds: the shim's dist-info first (an installed one after it, if any).
    shim_info = SHIM_DIR / f"accelerate-{ACCELERATE_API_VERSION}.dist-info"
    assert result["reported"] == result["on_path"] and result["on_path"][0] == shim_info.as_posix()


def test_module_run_prints_the_shim_folder_whose_metadata_matches():
    assert _python(
        "import runpy; runpy.run_module('hasten.accelerate_alias', run_name='__main__')"
    ).stdout.strip() == str(SHIM_DIR)
    metadata = (SHIM_DIR / f"accelerate-{ACCELERATE_API_VERSION}.dist-info" / "METADATA").read_text()
    assert f"Version: {ACCELERATE_API_VERSION}\n" in metadata and "Name: accelerate\n" in metadata


def test_python_m_runs_the_accelerate_command_modules_under_the_alias():
    """``python -m accelerate.commands.<x>`` (the entry points libraries and job files use) runs hasten's command
    named ``accelerate``, under the shim folder and after install_as_accelerate alike."""
    for module in ("accelerate_cli", "config", "env", "estimate", "merge", "test", "launch"):
        env = clean_env(PYTHONPATH=os.pathsep.join(map(str, [SHIM_DIR, SRC])))
        cmd = [sys.executable, "-m", f"accelerate.commands.{module}", "--help"]
        proc = subprocess.run(cmd, check=False, env=env, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0 and proc.stdout.startswith("usage: accelerate"), (module, proc.stderr[-2000:])
    proc = _python(
        """
        import runpy, sys
        import hasten
        hasten.install_as_accelerate()
        sys.argv = ["env"]
        runpy.run_module("accelerate.commands.env", run_name="__main__")
        """,
        check=False,
    )
    assert proc.returncode == 0 and "- hasten version: " in proc.stdout, proc.stderr[-2000:]
    proc = _python("import runpy; runpy.run_module('hasten.commands.launch', run_name='__main__')", check=False)
    assert proc.stderr.startswith("usage: hasten launch")


def test_alias_wheel_carries_the_shim_package_and_metadata_with_a_hasten_local_version(tmp_path):
    import hasten

    with zipfile.ZipFile(_alias_wheel(tmp_path)) as wheel:
        names = sorted(wheel.namelist())
        version = f"{ACCELERATE_API_VERSION}+hasten.{hasten.__version__}"
        info = f"accelerate-{version}.dist-info"
        info_files = ("METADATA", "WHEEL", "RECORD", "entry_points.txt", "top_level.txt")
        assert names == sorted(["accelerate/__init__.py", *(f"{info}/{name}" for name in info_files)])
        assert wheel.read("accelerate/__init__.py") == (SHIM_DIR / "accelerate" / "__init__.py").read_bytes()
        metadata = wheel.read(f"{info}/METADATA").decode()
        scripts = wheel.read(f"{info}/entry_points.txt").decode()
    shim = (SHIM_DIR / f"accelerate-{ACCELERATE_API_VERSION}.dist-info" / "METADATA").read_text()
    expected = shim.replace(f"Version: {ACCELERATE_API_VERSION}\n", f"Version: {version}\n")
    expected = expected.replace("Requires-Dist: hasten\n", f"Requires-Dist: hasten=={hasten.__version__}\n")
    assert metadata == expected != shim
    from packaging.specifiers import SpecifierSet

    # What libraries require of accelerate accepts it.
    assert all(version in SpecifierSet(spec) for spec in (">=1.1.0", "==1.15.0", "~=1.15", "<2"))
    assert "accelerate = accelerate.commands.accelerate_cli:main" in scripts
    assert "accelerate-launch = accelerate.commands.launch:main" in scripts
    # sentence-transformers and setfit train only when accelerate's metadata names a huggingface home page.
    assert re.search(r"^Home-page: \S*huggingface", metadata, re.MULTILINE)
    assert re.search(r"^Summary: hasten, installed under Accelerate's name", metadata, re.MULTILINE)


def test_the_installed_alias_is_hasten_and_reported_once_and_a_path_first_real_accelerate_shadows_it(tmp_path):
    with zipfile.ZipFile(_alias_wheel(tmp_path / "wheel")) as wheel:
        wheel.extractall(tmp_path / "site")
    code = """
        import importlib.metadata as m, json
        import accelerate, hasten
        on_path = m.MetadataPathFinder.find_distributions(m.DistributionFinder.Context(name="accelerate"))
        print(json.dumps({"hasten": accelerate.Accelerator is hasten.Accelerator, "module": accelerate.__version__,
                          "reported": [d._path.as_posix() for d in m.distributions() if d.name == "accelerate"],
                          "on_path": [d._path.as_posix() for d in on_path],
                          "version": m.version("accelerate"), "home": m.metadata("accelerate")["Home-page"]}))
        """
    result = _json(code, tmp_path / "site")
    assert result["hasten"] and result["module"] == ACCELERATE_API_VERSION
    # Reported once: what the path holds (this copy first; the venv's own, if make setup installed one, after it).
    assert result["reported"] == result["on_path"] and result["on_path"][0].startswith((tmp_path / "site").as_posix())
    assert result["version"].startswith(f"{ACCELERATE_API_VERSION}+hasten.") and "huggingface" in result["home"]
    # A real Accelerate earlier on the path (the reference copy of tests/differential.py) is what imports, whole.
    real = _fake_accelerate(tmp_path / "real", version="1.15.0")
    code = (
        "import accelerate, importlib.metadata as m, json; print(json.dumps([accelerate.REAL, "
        "m.version('accelerate')]))"
    )
    shadowed = _json(code, real, tmp_path / "site")
    assert shadowed == [True, "1.15.0"]


def test_is_hasten_distribution_tells_the_alias_from_huggingface_accelerate(tmp_path):
    from hasten.accelerate_alias import is_hasten_distribution

    def distribution(requires: str):
        folder = tmp_path / f"d{len(list(tmp_path.iterdir()))}"
        folder.mkdir()
        (folder / "METADATA").write_text(f"Metadata-Version: 2.1\nName: accelerate\nVersion: 1.15.0\n{requires}")
        return importlib.metadata.PathDistribution(folder)

    shim_info = SHIM_DIR / f"accelerate-{ACCELERATE_API_VERSION}.dist-info"
    assert is_hasten_distribution(importlib.metadata.PathDistribution(shim_info))
    assert is_hasten_distribution(distribution("Requires-Dist: hasten==0.1.0\n"))
    assert not is_hasten_distribution(distribution("Requires-Dist: numpy>=1.17\nRequires-Dist: torch>=2.0.0\n"))
    assert not is_hasten_distribution(distribution("Requires-Dist: hasten-tools\n"))
    assert not is_hasten_distribution(distribution(""))


def test_the_shim_is_packaged():
    package_data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["hasten"]
    hasten_dir = SRC / "hasten"
    files = [
        p.relative_to(hasten_dir).as_posix()
        for p in SHIM_DIR.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    ]
    assert len(files) == 3
    assert all(any(fnmatch.fnmatch(f, pattern) for pattern in package_data) for f in files), (files, package_data)


# ------------------------------------------------------------------------------ hasten launch


@pytest.fixture
def _home(monkeypatch, tmp_path):
    monkeypatch.setenv("HASTEN_HOME", str(tmp_path / "home"))


def _plan(*flags: str):
    args = build_parser(["launch"]).parse_args(
        ["launch", *flags, "--num_processes", "2", str(SCRIPTS / "eco_alias_probe.py")]
    )
    return prepare_launch(args, hardware=Hardware("cpu", 0))


def test_launch_flag_puts_the_shim_first_on_the_workers_path(_home, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(["/somewhere", str(SHIM_DIR)]))
    plan = _plan("--as_accelerate")
    assert plan.env["PYTHONPATH"] == os.pathsep.join([str(SHIM_DIR), "/somewhere"])
    assert (
        plan.env["HASTEN_AS_ACCELERATE"] == "1" and str(plan.launch_sources["as_accelerate"]) == "flag --as_accelerate"
    )


def test_launch_environment_setting_does_the_same(_home, monkeypatch):
    monkeypatch.delenv("PYTHONPATH", raising=False)
    monkeypatch.setenv("HASTEN_AS_ACCELERATE", "1")
    plan = _plan()
    assert plan.env["PYTHONPATH"] == str(SHIM_DIR) and plan.args.as_accelerate
    assert str(plan.launch_sources["as_accelerate"]) == "environment HASTEN_AS_ACCELERATE"
    monkeypatch.setenv("HASTEN_AS_ACCELERATE", "0")
    assert "PYTHONPATH" not in _plan().env


@pytest.mark.slow
def test_launched_workers_and_the_processes_they_start_import_hasten_as_accelerate(tmp_path):
    # HuggingFace's Accelerate stays installed (a stand-in on the path): the job still runs on hasten.
    real = _fake_accelerate(tmp_path / "site")
    env = clean_env(PYTHONPATH=os.pathsep.join(map(str, [real, SRC])))
    launch_args = ("--as_accelerate", "--cpu", "--num_processes", "2", "-q")
    proc = hasten_launch(SCRIPTS / "eco_alias_probe.py", launch_args=launch_args, env=env)
    reports = sorted(
        (json.loads(line[6:]) for line in proc.stdout.splitlines() if line.startswith("ALIAS ")),
        key=lambda r: r["rank"],
    )
    assert [r["rank"] for r in reports] == [0, 1], proc.stdout
    for report in reports:
        assert report["version"] == report["distribution"] == ACCELERATE_API_VERSION
        assert report["accelerator"] == "hasten.accelerator"
        assert report["child"] == [ACCELERATE_API_VERSION, ACCELERATE_API_VERSION, "hasten.accelerator"]
