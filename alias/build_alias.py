"""PEP 517 build backend of hasten's ``accelerate`` distribution (pip runs it for ``pip install ./alias``).

The wheel is assembled here, without setuptools, so that a build needs nothing from a package index (build
isolation included). It holds:

- the ``accelerate`` package of hasten's shim folder (``src/hasten/_accelerate_shim/accelerate``), which installs
  hasten's import alias when imported;
- the shim's METADATA (one text for both), with the version ``<Accelerate API version>+hasten.<hasten version>``
  (a PEP 440 local version: requirements such as ``accelerate>=1.1`` or ``accelerate==1.15.0`` accept it) and the
  requirement ``hasten==<hasten version>``;
- ``entry_points.txt`` of this folder: the ``accelerate`` command and Accelerate's other console scripts.

pip runs this backend with the Python it installs for (under build isolation too: the isolation changes
``sys.path``, not ``sys.prefix``), so that interpreter's site-packages is where the wheel will go. Before building,
the backend looks there, and if HuggingFace's Accelerate is installed it stops with a message saying how to replace
it, instead of letting pip replace it silently. ``HASTEN_REPLACE_ACCELERATE=1`` lets pip replace it. It also stops
when the hasten release it pins is not installed there: hasten is not on a package index, so pip would only say
that no version satisfies ``hasten==<version>``; the message says to install hasten from the checkout first.
``HASTEN_ALIAS_WITHOUT_HASTEN=1`` builds anyway (a wheel for an environment that gets hasten another way).
"""

from __future__ import annotations

import ast
import base64
import hashlib
import importlib.metadata
import os
import re
import site
import sys
import sysconfig
import zipfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
HASTEN_SRC = HERE.parent / "src" / "hasten"
SHIM_DIR = HASTEN_SRC / "_accelerate_shim"
REPLACE_VARIABLE = "HASTEN_REPLACE_ACCELERATE"
WITHOUT_HASTEN_VARIABLE = "HASTEN_ALIAS_WITHOUT_HASTEN"
_FIXED_TIME = (1980, 1, 1, 0, 0, 0)  # the earliest time a zip can hold: the same sources give the same wheel


class UnsupportedOperation(Exception):
    """PEP 517's answer for a build this backend does not do (an sdist)."""


def get_requires_for_build_wheel(config_settings=None) -> list[str]:
    """Nothing: the wheel is built with the standard library only."""
    return []


def prepare_metadata_for_build_wheel(metadata_directory, config_settings=None) -> str:
    """Write the ``.dist-info`` folder of the wheel into ``metadata_directory``; returns its name."""
    refuse_to_replace_accelerate()
    refuse_without_hasten()
    files = _dist_info_files()
    name = _dist_info_name()
    for relative, data in files.items():
        target = Path(metadata_directory) / name / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
    return name


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None) -> str:
    """Build ``accelerate-<version>-py3-none-any.whl`` into ``wheel_directory``; returns its file name."""
    refuse_to_replace_accelerate()
    refuse_without_hasten()
    info = _dist_info_name()
    contents = {f"accelerate/{path.name}": path.read_bytes() for path in sorted((SHIM_DIR / "accelerate").glob("*.py"))}
    contents.update({f"{info}/{relative}": data for relative, data in _dist_info_files().items()})
    record = [f"{path},sha256={_digest(data)},{len(data)}" for path, data in contents.items()]
    contents[f"{info}/RECORD"] = ("\n".join([*record, f"{info}/RECORD,,"]) + "\n").encode()
    wheel_name = f"accelerate-{_version()}-py3-none-any.whl"
    with zipfile.ZipFile(Path(wheel_directory) / wheel_name, "w", compression=zipfile.ZIP_DEFLATED) as wheel:
        for path, data in contents.items():
            entry = zipfile.ZipInfo(path, date_time=_FIXED_TIME)
            entry.external_attr = 0o644 << 16
            wheel.writestr(entry, data, compress_type=zipfile.ZIP_DEFLATED)
    return wheel_name


def build_sdist(sdist_directory, config_settings=None) -> str:
    """Not built: the distribution is versioned from the hasten sources beside it, which an sdist would lose."""
    raise UnsupportedOperation(
        "hasten's accelerate distribution has no sdist: its version and metadata come from the hasten source tree "
        "around alias/. Build a wheel (`pip wheel ./alias` or `python -m build --wheel alias`) or install it with "
        "`pip install ./alias`."
    )


def refuse_to_replace_accelerate() -> None:
    """Stop the build if HuggingFace's Accelerate is installed where pip installs (unless told to replace it)."""
    if os.environ.get(REPLACE_VARIABLE) == "1":
        return
    paths = sysconfig.get_paths()
    folders = list(dict.fromkeys([paths["purelib"], paths["platlib"]]))
    for found in importlib.metadata.distributions(name="accelerate", path=folders):
        if _is_hasten_distribution(found):
            continue
        where = found.locate_file("")
        raise SystemExit(
            "\nNot installing hasten's `accelerate` distribution: "
            f"HuggingFace's Accelerate {found.version} is installed in {where}, and pip would replace it.\n"
            "  To replace it with hasten:      pip uninstall accelerate   then run this install again\n"
            f"                                 (or {REPLACE_VARIABLE}=1 pip install ./alias   to let pip replace it)\n"
            "  To keep the real Accelerate:    do not install this; run hasten under Accelerate's name\n"
            "                                 per process (hasten.install_as_accelerate())\n"
            "                                 or per job (hasten launch --as_accelerate).\n"
            '  See hasten\'s docs/migration.md, "Installing hasten as Accelerate".\n'
        )


def refuse_without_hasten() -> None:
    """Stop the build, saying what to do, if the hasten release this distribution pins is not installed where the
    Python running pip finds its packages (unless told to build anyway)."""
    if os.environ.get(WITHOUT_HASTEN_VARIABLE) == "1":
        return
    wanted = _hasten_version()
    folders = _site_folders()
    found = sorted({d.version for d in importlib.metadata.distributions(name="hasten", path=folders)})
    if wanted in found:
        return
    where = folders[0]
    have = f"hasten {', '.join(found)} is installed in {where}" if found else f"hasten is not installed in {where}"
    checkout = HERE.parent
    raise SystemExit(
        f"\nNot installing hasten's `accelerate` distribution: it requires hasten=={wanted} (the hasten of "
        f"{checkout}), and {have}.\n"
        f"  Install hasten from this checkout first:  pip install {checkout}\n"
        f"                                            (or pip install -e {checkout} to work on it)\n"
        f"  then run this install again:              pip install {HERE}\n"
        f"  To build the wheel for an environment that gets hasten another way:\n"
        f"                                            {WITHOUT_HASTEN_VARIABLE}=1 pip wheel {HERE}\n"
    )


def _site_folders() -> list[str]:
    """Where the Python running pip finds installed distributions: its site-packages, the user's site-packages
    outside a virtual environment, the base installation's in one made with --system-site-packages."""
    paths = sysconfig.get_paths()
    folders = [paths["purelib"], paths["platlib"]]
    if sys.prefix == sys.base_prefix:
        folders.append(site.getusersitepackages())
    elif "include-system-site-packages = true" in _venv_config():
        base = sysconfig.get_paths(vars={"base": sys.base_prefix, "platbase": sys.base_exec_prefix})
        folders += [base["purelib"], base["platlib"]]
    return list(dict.fromkeys(folders))


def _venv_config() -> str:
    config = Path(sys.prefix) / "pyvenv.cfg"
    return config.read_text().lower() if config.is_file() else ""


def _is_hasten_distribution(distribution) -> bool:
    # The rule of hasten.accelerate_alias.is_hasten_distribution (hasten itself may not be importable here).
    return any(re.match(r"hasten\b(?![-.])", requirement) for requirement in distribution.requires or ())


def _hasten_version() -> str:
    source = HASTEN_SRC / "_version.py"
    if not source.is_file():
        raise UnsupportedOperation(
            f"{source} not found: build hasten's accelerate distribution from hasten's repository (alias/)."
        )
    for node in ast.parse(source.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__version__" for t in node.targets):
            return ast.literal_eval(node.value)
    raise UnsupportedOperation(f"{source} defines no __version__")


def _shim_metadata() -> Path:
    found = sorted(SHIM_DIR.glob("accelerate-*.dist-info/METADATA"))
    if len(found) != 1:
        raise UnsupportedOperation(f"expected one accelerate-*.dist-info/METADATA in {SHIM_DIR}, found {len(found)}")
    return found[0]


def _version() -> str:
    api = re.search(r"^Version: (\S+)$", _shim_metadata().read_text(), re.MULTILINE).group(1)
    local = re.sub(r"[^a-z0-9]+", ".", _hasten_version().lower()).strip(".")
    return f"{api}+hasten.{local}"


def _dist_info_name() -> str:
    return f"accelerate-{_version()}.dist-info"


def _dist_info_files() -> dict[str, bytes]:
    """METADATA (the shim's, with this distribution's version and hasten pinned), entry points, top level."""
    header, _, body = _shim_metadata().read_text().partition("\n\n")
    lines = []
    for line in header.splitlines():
        if line.startswith("Version: "):
            line = f"Version: {_version()}"
        elif line == "Requires-Dist: hasten":
            line = f"Requires-Dist: hasten=={_hasten_version()}"
        lines.append(line)
    metadata = "\n".join(lines) + "\n\n" + body
    wheel = "Wheel-Version: 1.0\nGenerator: hasten alias/build_alias.py\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    return {
        "METADATA": metadata.encode(),
        "WHEEL": wheel.encode(),
        "entry_points.txt": (HERE / "entry_points.txt").read_bytes(),
        "top_level.txt": b"accelerate\n",
    }


def _digest(data: bytes) -> str:
    return base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
