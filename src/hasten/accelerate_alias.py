"""``import accelerate`` answered by hasten: :func:`install_as_accelerate` and the launcher's shim folder.

Libraries built on Accelerate (transformers' ``Trainer``, peft, diffusers, trl) import ``accelerate``
and its submodules by name and check the installed ``accelerate`` distribution's version. Once
:func:`install_as_accelerate` has run, in that process:

- ``import accelerate`` gives a thin top-level module that forwards every attribute to ``hasten``,
  except ``__version__``, which is :data:`ACCELERATE_API_VERSION` (the Accelerate release whose API
  hasten provides); ``hasten.__version__`` stays hasten's own release number, because the two answer
  different questions (which hasten is installed, for bug reports and pip; which Accelerate API a
  caller can rely on, for version checks written against Accelerate);
- ``import accelerate.<x>`` gives the module ``hasten.<x>`` itself (the same object, so classes and
  state are shared), for every submodule hasten has, whenever it was added;
- ``importlib.metadata`` (and the ``importlib_metadata`` backport) finds an ``accelerate``
  distribution of version :data:`ACCELERATE_API_VERSION`.

``hasten launch --as_accelerate`` (or ``HASTEN_AS_ACCELERATE=1``) puts :data:`SHIM_DIR` first on the
workers' ``PYTHONPATH``. That folder holds an ``accelerate`` package whose ``__init__`` calls
:func:`install_as_accelerate`, and an ``accelerate-<version>.dist-info``, so every Python process of
the job, including the ones its workers start, finds ``accelerate`` before any line of user code runs.
Any launcher can do the same: ``PYTHONPATH=$(python -m hasten.accelerate_alias) torchrun train.py``.

The ``accelerate`` distribution built from the repository's ``alias/`` folder installs the same
``accelerate`` package into an environment for good (with the shim's metadata, a ``+hasten`` local
version and the ``accelerate`` command): every process there imports hasten as ``accelerate``.
Whichever of these put it there, one ``accelerate`` distribution of hasten's is reported, never two
(:func:`is_hasten_distribution`).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import logging
import os
import re
import sys
import types
from pathlib import Path

from .errors import HastenError

ACCELERATE_API_VERSION = "1.15.0"
"""The Accelerate release whose public API hasten provides (what ``accelerate.__version__`` says)."""

SHIM_DIR = Path(__file__).resolve().parent / "_accelerate_shim"
"""The folder that ``hasten launch --as_accelerate`` puts first on the workers' ``PYTHONPATH``."""

_NAME = "accelerate"
_DIST_INFO = SHIM_DIR / f"{_NAME}-{ACCELERATE_API_VERSION}.dist-info"
_SHIM_MARK = "__hasten_accelerate_shim__"


class AliasConflictError(HastenError, ImportError):
    """The real ``accelerate`` package was imported before hasten could take its name."""


def install_as_accelerate() -> None:
    """Make ``import accelerate`` (and every ``accelerate.<submodule>``) give hasten in this process.

    Also makes ``importlib.metadata.version("accelerate")`` report :data:`ACCELERATE_API_VERSION`
    (where hasten's ``accelerate`` distribution is installed, that distribution's version, which it
    extends), so transformers, peft, diffusers and trl accept hasten as their Accelerate. Call it before
    importing those libraries: some of them check for Accelerate once, at import time. Calling it
    again does nothing. An installed ``accelerate`` distribution that has not been imported yet is
    shadowed; one that is already imported cannot be replaced, and :class:`AliasConflictError` says so.

    Example::

        import hasten
        hasten.install_as_accelerate()
        from transformers import Trainer  # Trainer now runs on hasten
    """
    current = sys.modules.get(_NAME)
    if current is not None and not _is_ours(current):
        where = getattr(current, "__file__", None) or repr(current)
        raise AliasConflictError(
            f"install_as_accelerate(): the real Accelerate is already imported in this process (from {where}), so "
            "hasten cannot take its name. Call hasten.install_as_accelerate() before anything imports accelerate "
            "(transformers, peft and diffusers do), or launch with `hasten launch --as_accelerate`, or uninstall "
            "accelerate (pip uninstall accelerate)."
        )
    if not is_installed():
        sys.meta_path.insert(0, _AliasFinder())
    if current is not None and getattr(current, _SHIM_MARK, False):
        # The launcher's shim package replaces itself: the import machinery returns what sys.modules holds.
        sys.modules[_NAME] = _top_level_module()


def logger_for(path: str) -> logging.Logger:
    """The logger of hasten's module ``path`` (``"utils.environment"``), named as this process imports it:
    ``accelerate.<path>`` once :func:`install_as_accelerate` has run (where Accelerate logs the same message, so
    logging settings and tests written for Accelerate see it), else ``hasten.<path>``."""
    return logging.getLogger(f"{_NAME if is_installed() else 'hasten'}.{path}")


def is_installed() -> bool:
    """Whether :func:`install_as_accelerate` has run in this process."""
    return any(isinstance(finder, _AliasFinder) for finder in sys.meta_path)


def _is_ours(module: types.ModuleType) -> bool:
    return getattr(module, "__hasten_alias__", False) or getattr(module, _SHIM_MARK, False)


def _top_level_module() -> types.ModuleType:
    """The module ``accelerate``: hasten's attributes, Accelerate's version number."""
    import hasten

    module = types.ModuleType(_NAME, "hasten, imported under Accelerate's name (hasten.install_as_accelerate).")
    module.__spec__ = importlib.machinery.ModuleSpec(
        _NAME, _AliasLoader("hasten", hasten.__spec__), origin=hasten.__file__, is_package=True
    )
    module.__spec__.submodule_search_locations = list(hasten.__path__)
    module.__file__ = hasten.__file__
    module.__path__ = list(hasten.__path__)
    module.__package__ = _NAME
    module.__loader__ = module.__spec__.loader
    module.__version__ = ACCELERATE_API_VERSION
    module.__hasten_version__ = hasten.__version__
    module.__hasten_alias__ = True
    module.__all__ = list(hasten.__all__)

    def __getattr__(name: str):
        try:
            return getattr(hasten, name)
        except AttributeError:
            pass
        # Accelerate's __init__ imports its submodules, so `import accelerate; accelerate.utils.x` works there.
        if not name.startswith("_") and importlib.util.find_spec(f"hasten.{name}") is not None:
            return importlib.import_module(f"{_NAME}.{name}")
        raise AttributeError(f"module 'accelerate' (hasten) has no attribute {name!r}")

    def __dir__():
        return sorted(set(dir(hasten)) | {"__version__"})

    module.__getattr__ = __getattr__
    module.__dir__ = __dir__
    return module


class _AliasLoader(importlib.abc.Loader):
    """Loads ``accelerate.<x>`` as the already importable ``hasten.<x>`` module object."""

    def __init__(self, target: str, target_spec: importlib.machinery.ModuleSpec):
        self.target = target
        self.target_spec = target_spec

    def create_module(self, spec):
        if spec.name == _NAME:
            return _top_level_module()
        return importlib.import_module(self.target)

    def exec_module(self, module) -> None:
        # The import machinery stamped the alias spec on hasten's module; give it its own back.
        if sys.modules.get(self.target) is module:
            module.__spec__ = self.target_spec

    # runpy (``python -m accelerate.commands.launch``), inspect and linecache ask the loader for these.
    def is_package(self, fullname: str) -> bool:
        """Whether ``hasten.<x>`` behind ``accelerate.<x>`` is a package."""
        return self.target_spec.submodule_search_locations is not None

    def get_code(self, fullname: str):
        """The code object of the hasten module (run as ``__main__`` by ``python -m accelerate.<x>``)."""
        return self.target_spec.loader.get_code(self.target)

    def get_source(self, fullname: str) -> str | None:
        """The source text of the hasten module."""
        return self.target_spec.loader.get_source(self.target)


class _AliasFinder(importlib.abc.MetaPathFinder):
    """Maps ``accelerate[.x]`` to ``hasten[.x]``, and answers ``importlib.metadata`` for ``accelerate``."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != _NAME and not fullname.startswith(_NAME + "."):
            return None
        real_name = "hasten" + fullname[len(_NAME) :]
        real = importlib.util.find_spec(real_name)
        if real is None:
            raise ModuleNotFoundError(
                f"No module named {fullname!r}: accelerate is hasten here (hasten.install_as_accelerate), and hasten "
                f"has no module {real_name!r}.",
                name=fullname,
            )
        loader = _AliasLoader(real_name, real)
        spec = importlib.machinery.ModuleSpec(
            fullname, loader, origin=real.origin, is_package=real.submodule_search_locations is not None
        )
        if real.submodule_search_locations is not None:
            spec.submodule_search_locations = list(real.submodule_search_locations)
        return spec

    def find_distributions(self, context=None):
        name = getattr(context, "name", None)
        if name is not None and re.sub(r"[-_.]+", "_", name).lower() != _NAME:
            return iter(())
        # When the first `accelerate` on sys.path is already hasten's (the shim folder on PYTHONPATH, or the
        # installed alias distribution), the path finder reports it: reporting the shim again would list it twice.
        context = importlib.metadata.DistributionFinder.Context(name=_NAME)
        first = next(iter(importlib.metadata.MetadataPathFinder.find_distributions(context)), None)
        if first is not None and is_hasten_distribution(first):
            return iter(())
        return iter((importlib.metadata.PathDistribution(_DIST_INFO),))


def is_hasten_distribution(distribution: importlib.metadata.Distribution) -> bool:
    """Whether an ``accelerate`` distribution is hasten's (the shim's or the alias distribution: both require hasten)
    rather than HuggingFace's Accelerate."""
    return any(re.match(r"hasten\b(?![-.])", requirement) for requirement in distribution.requires or ())


def shim_pythonpath(existing: str | None) -> str:
    """``PYTHONPATH`` with :data:`SHIM_DIR` first (once), for processes that must import hasten as accelerate."""
    parts = [part for part in (existing or "").split(os.pathsep) if part and Path(part).resolve() != SHIM_DIR]
    return os.pathsep.join([str(SHIM_DIR), *parts])


if __name__ == "__main__":
    print(SHIM_DIR)
