"""Dump a package's public API as JSON: modules, names, kinds and call signatures.

``python dump_api_surface.py accelerate`` walks the installed ``accelerate`` package (the reference copy), reads
each module's source to find the names it defines (and, for packages, the names it re-exports), and prints
``{module: {name: description}}`` (a class's description holds its public methods' signatures).
``python dump_api_surface.py hasten < reference.json`` describes, for every ``(module, name)`` of a reference dump,
the object ``hasten`` has at the same path (``accelerate`` replaced by ``hasten``), or says that it is missing. The
test that compares the two lives in tests/compat/test_accelerate_surface.py.
"""

from __future__ import annotations

import ast
import contextlib
import enum
import importlib
import inspect
import json
import pkgutil
import sys
import types
import warnings

# Parts of the reference package that are not compared, each with why.
SKIPPED_MODULES = {
    "accelerate.test_utils.scripts": (
        "Accelerate's own multi-process test scripts (hasten's self-check is hasten.test_utils.scripts.test_script)"
    ),
    "accelerate.test_utils.examples": (
        "compares Accelerate's example scripts with their feature variants; hasten's examples are its own"
    ),
    "accelerate.commands": (
        "CLI internals; the command line is `hasten`, with Accelerate's flags (see INCLUDED_COMMANDS)"
    ),
}
# The command modules whose helpers libraries do import (transformers, trl), compared name by name.
INCLUDED_COMMANDS = {
    "accelerate.commands.config": ("default_config_file", "load_config_from_file"),
    "accelerate.commands.launch": ("launch_command_parser", "launch_command"),
}
# Classes whose properties are checked on an instance (an instance attribute is invisible on the class), built
# with these arguments in the dumping process.
INSTANCE_CHECKED = {
    "accelerate.accelerator.Accelerator": {"cpu": True},
    "accelerate.state.PartialState": {"cpu": True},
    "accelerate.state.AcceleratorState": {"cpu": True},
    "accelerate.state.GradientState": {},
}
_PRIMITIVES = (str, int, float, bool, type(None))


def _describe_default(value) -> str | None:
    if value is inspect.Parameter.empty:
        return None
    if isinstance(value, enum.Enum):
        return f"{type(value).__name__}.{value.name}"
    if _is_plain(value):
        return repr(value)
    return f"<{type(value).__name__}>"


def _is_plain(value) -> bool:
    if isinstance(value, _PRIMITIVES):
        return True
    if isinstance(value, (list, tuple, set, frozenset)):
        return all(_is_plain(item) for item in value)
    if isinstance(value, dict):
        return all(_is_plain(k) and _is_plain(v) for k, v in value.items())
    return False


def _plain_value(value):
    if isinstance(value, (set, frozenset)):
        return sorted(_plain_value(item) for item in value)
    if isinstance(value, (list, tuple)):
        return [_plain_value(item) for item in value]
    if isinstance(value, dict):
        return {str(k): _plain_value(v) for k, v in value.items()}
    return value


def _signature(obj) -> list | None:
    try:
        signature = inspect.signature(obj)
    except (TypeError, ValueError):
        return None
    return [[p.name, p.kind.name, _describe_default(p.default)] for p in signature.parameters.values()]


def _method_signature(obj) -> list | None:
    signature = _signature(obj)
    if signature and signature[0][0] in ("self", "cls") and signature[0][1] == "POSITIONAL_OR_KEYWORD":
        return signature[1:]
    return signature


def public_methods(cls, package: str) -> dict:
    """Signatures (without ``self``/``cls``) of the public methods that ``package``'s classes define on ``cls``.

    Properties and attributes are left out: an instance attribute cannot be seen without an instance.
    """
    methods = {}
    for name in dir(cls):
        if name.startswith("_"):
            continue
        owner = next((klass for klass in cls.__mro__ if name in vars(klass)), None)
        if owner is None or owner.__module__.split(".")[0] != package:
            continue
        raw = vars(owner)[name]
        if isinstance(raw, (staticmethod, classmethod)) or (callable(raw) and not isinstance(raw, type)):
            methods[name] = _method_signature(getattr(cls, name))
    return methods


def describe(obj, package: str | None = None) -> dict:
    """Kind and signature of a class (with its public methods) or function; kind and (plain) value of anything else."""
    if isinstance(obj, type):
        return {
            "kind": "class",
            "signature": _signature(obj),
            "methods": public_methods(obj, package or obj.__module__.split(".")[0]),
        }
    if callable(obj):
        return {"kind": "function", "signature": _signature(obj)}
    if _is_plain(obj):
        return {"kind": "value", "value": _plain_value(obj)}
    return {"kind": "value"}


def _top_level_names(tree: ast.Module, is_package: bool) -> list[str]:
    names: list[str] = []

    def visit(statements):
        for node in statements:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.append(node.name)
            elif isinstance(node, ast.Assign):
                for target in node.targets:
                    elements = target.elts if isinstance(target, ast.Tuple) else [target]
                    names.extend(t.id for t in elements if isinstance(t, ast.Name))
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                names.append(node.target.id)
            elif (
                isinstance(node, ast.ImportFrom)
                and is_package
                and (node.level > 0 or (node.module or "").startswith("accelerate"))
            ):
                names.extend(alias.asname or alias.name for alias in node.names if alias.name != "*")
            elif isinstance(node, ast.If):
                visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body)
                for handler in node.handlers:
                    visit(handler.body)
                visit(node.orelse)

    visit(tree.body)
    return [name for name in dict.fromkeys(names) if not name.startswith("_")]


def _skipped(module_name: str) -> bool:
    if module_name in INCLUDED_COMMANDS:
        return False
    return any(module_name == prefix or module_name.startswith(prefix + ".") for prefix in SKIPPED_MODULES)


def dump_reference(package_name: str) -> dict:
    package = importlib.import_module(package_name)
    modules = [package_name] + [info.name for info in pkgutil.walk_packages(package.__path__, package_name + ".")]
    modules += [name for name in INCLUDED_COMMANDS if name not in modules]
    surface = {}
    for module_name in sorted(set(modules)):
        if _skipped(module_name):
            continue
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            surface[module_name] = {"__import_error__": f"{type(exc).__name__}: {exc}"}
            continue
        with open(module.__file__, encoding="utf-8") as handle:
            tree = ast.parse(handle.read())
        names = INCLUDED_COMMANDS.get(module_name) or _top_level_names(tree, module.__file__.endswith("__init__.py"))
        entries = {}
        for name in names:
            if not hasattr(module, name) or isinstance(getattr(module, name), types.ModuleType):
                continue
            entries[name] = describe(getattr(module, name), package_name)
        surface[module_name] = entries
    return surface


def _instance(path: str, package: str):
    module_name, _, class_name = path.rpartition(".")
    module = importlib.import_module(package + module_name[len("accelerate") :])
    return getattr(module, class_name)(**INSTANCE_CHECKED[path])


def reference_properties() -> dict:
    """``{class path: [public property names]}`` of the :data:`INSTANCE_CHECKED` classes of Accelerate."""
    properties = {}
    for path in INSTANCE_CHECKED:
        cls = type(_instance(path, "accelerate"))
        properties[path] = sorted(
            n for n in dir(cls) if not n.startswith("_") and isinstance(inspect.getattr_static(cls, n, None), property)
        )
    return properties


def missing_properties(reference: dict, package: str) -> dict:
    """``{class path: [names an instance of the package's class lacks]}`` for the properties in ``reference``."""
    missing = {}
    for path, names in reference.items():
        instance = _instance(path, package)
        missing[path] = []
        for name in names:
            try:
                getattr(instance, name)
            except AttributeError:
                missing[path].append(name)
            except Exception:  # the property exists but cannot answer in this process (e.g. no DeepSpeed plugin)
                continue
    return missing


def dump_mirror(reference: dict, source: str, target: str) -> dict:
    surface = {}
    for module_name, entries in reference.items():
        mirrored = target + module_name[len(source) :]
        try:
            module = importlib.import_module(mirrored)
        except ImportError as exc:
            surface[module_name] = {"__import_error__": f"{type(exc).__name__}: {exc}"}
            continue
        described = {}
        for name, expected in entries.items():
            try:
                described[name] = describe(getattr(module, name), target)
            except (AttributeError, ImportError):
                described[name] = {"kind": "missing"}
                continue
            if "methods" in expected and "methods" in described[name]:
                ours = described[name]["methods"]
                cls = getattr(module, name)
                for method in expected["methods"]:
                    if method not in ours:
                        ours[method] = (
                            _method_signature(getattr(cls, method))
                            if callable(getattr(cls, method, None))
                            else "missing"
                        )
        surface[module_name] = described
    return surface


def main() -> None:
    warnings.simplefilter("ignore")
    package = sys.argv[1]
    with contextlib.redirect_stdout(sys.stderr):  # whatever an import prints must not end up in the JSON
        result = _dump(package)
    json.dump(result, sys.stdout, indent=1, sort_keys=True)


def _dump(package: str) -> dict:
    if package == "accelerate":
        result = dump_reference(package)
        result["__properties__"] = reference_properties()
    else:
        reference = json.load(sys.stdin)
        properties = reference.pop("__properties__")
        result = dump_mirror(reference, "accelerate", package)
        result["__missing_properties__"] = missing_properties(properties, package)
    return result


if __name__ == "__main__":
    main()
