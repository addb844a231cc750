"""State handed in, not fetched: the process-wide state is looked up only at Accelerate's public boundaries.

The ``Accelerator`` builds ``PartialState``, ``AcceleratorState`` and ``GradientState`` once and hands each part what
it needs (the strategy, the optimizer and scheduler wrappers, the prepared loaders). A lookup (``PartialState()``,
``AcceleratorState()``, ``GradientState()``, the on-demand view ``state.PROCESS_STATE``, or a state class's
``_shared_state``) is left only where no Accelerator can hand anything in: Accelerate's public functions and the
classes users build themselves, which fall back to the process's state. This test reads every module outside the
state's own (``state.py``, ``gradient_state.py``) and fails on a lookup in a function not listed in ``BOUNDARIES``,
each with its reason; docs/architecture.md ("State handed in") lists the same boundaries. The last two tests check the
handing itself: the parts hold the Accelerator's own state objects, and a loader built by hand creates no state before
it reads one.
"""

from __future__ import annotations

import ast
import functools
import pickle
import re
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "hasten"
OWNERS = ("state.py", "gradient_state.py")
STATES = {"PartialState", "AcceleratorState", "GradientState"}
SCRIPTS = "test_utils/scripts/"  # Accelerate's test scripts, run by `hasten test`: user code, with no Accelerator

_USER_BUILT = "built by a user without an Accelerator, as Accelerate's is: the process's state unless one is handed in"

# (file under src/hasten, function) -> why the process-wide state is looked up there.
BOUNDARIES = {
    ("accelerator.py", "Accelerator.__init__"): "the builder: creates the three states once and hands them down",
    ("optimizer.py", "AcceleratedOptimizer.__init__"): f"AcceleratedOptimizer(optimizer) {_USER_BUILT}",
    ("optimizer.py", "AcceleratedOptimizer.__setstate__"): "an unpickled optimizer: no Accelerator hands one in",
    ("scheduler.py", "AcceleratedScheduler.__init__"): f"AcceleratedScheduler(...) {_USER_BUILT}",
    ("data_loader/loaders.py", "DataLoaderStateMixin._init_state"): (
        f"DataLoaderShard(...) or DataLoaderDispatcher(...) {_USER_BUILT} (the process state read only when needed)"
    ),
    ("data_loader/prepare.py", "prepare_data_loader"): "the public function, called without an Accelerator",
    ("runtime/rng.py", "set_seed"): "public (device_specific adds the process index)",
    ("runtime/rng.py", "synchronize_rng_state"): "public; broadcast_rng_state takes the state handed in",
    ("runtime/rng.py", "synchronize_rng_states"): "public; broadcast_rng_states takes the state handed in",
    ("runtime/progress.py", "tqdm"): "public (hasten.utils.tqdm: shown on each machine's main process)",
    ("runtime/weights/saving.py", "_should_write"): "save(), public: which process writes",
    ("big_modeling/hooks.py", "CpuOffload.__init__"): "CpuOffload(), public hook: the process's default device",
    ("launchers.py", "test_launch"): "hasten test's first check: creating the process state is the test",
    ("logging.py", "MultiProcessAdapter._state"): "get_logger()'s adapter, public: which process logs",
    ("utils/_process.py", "wait_for_everyone"): "public (hasten.utils.wait_for_everyone)",
    ("compat/modeling.py", "get_mixed_precision_context_manager"): "public (accelerate.utils): the state's precision",
    ("compat/operations.py", "copy_tensor_to_devices"): "public (accelerate.utils): the process's device",
    ("test_utils/testing.py", "are_the_same_tensors"): "public test helper (accelerate.test_utils)",
    ("checkpointing/custom.py", "save_custom_state"): "public (accelerate.checkpointing.save_custom_state)",
}


def _lookup(node: ast.AST) -> str | None:
    """What makes ``node`` a lookup of the process-wide state, or None."""
    if isinstance(node, ast.Call):
        func = node.func
        name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
        if name in STATES:
            return f"{name}(...)"
    if isinstance(node, ast.Name) and node.id == "PROCESS_STATE" and isinstance(node.ctx, ast.Load):
        return "PROCESS_STATE"
    if isinstance(node, ast.Attribute) and node.attr in ("PROCESS_STATE", "_shared_state"):
        return node.attr
    return None


def _lookups_in(tree: ast.AST) -> list[tuple[str, int, str]]:
    """(enclosing function's qualified name or "<module>", line, what) for every lookup in ``tree``."""
    found = []

    def visit(node: ast.AST, scope: list[str], function: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                inner = [*scope, child.name]
                is_function = not isinstance(child, ast.ClassDef)
                visit(child, inner, ".".join(inner) if is_function and function == "<module>" else function)
                continue
            what = _lookup(child)
            if what:
                found.append((function, child.lineno, what))
            visit(child, scope, function)

    visit(tree, [], "<module>")
    return found


@functools.cache
def _found() -> list[tuple[str, str, int, str]]:
    """(file, function, line, what) for every lookup outside the state's own modules and Accelerate's test scripts."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        name = path.relative_to(PACKAGE).as_posix()
        if name in OWNERS or name.startswith(SCRIPTS):
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=name)
        found.extend((name, function, line, what) for function, line, what in _lookups_in(tree))
    return found


def test_the_state_is_looked_up_only_at_the_listed_boundaries():
    stray = [
        f"  {name}:{line}: {what} in {function}"
        for name, function, line, what in _found()
        if (name, function) not in BOUNDARIES
    ]
    assert not stray, (
        "The process-wide state is looked up outside the listed boundaries:\n"
        + "\n".join(stray)
        + "\nHand the state in instead: the Accelerator holds `state` and `gradient_state`, a strategy its "
        "`state` and `gradient_state`, a prepared loader `_process` and `gradient_state`. A public function or a "
        "class users build without an Accelerator may fall back to the process's state: add it to BOUNDARIES with "
        "the reason, and to docs/architecture.md's 'State handed in'."
    )


@pytest.mark.parametrize(("name", "function"), sorted(BOUNDARIES))
def test_every_boundary_still_looks_the_state_up(name, function):
    assert any((found, where) == (name, function) for found, where, _, _ in _found()), (
        f"{name}: {function} no longer looks the state up: remove it from BOUNDARIES and docs/architecture.md"
    )


def test_the_boundaries_are_the_ones_architecture_md_lists():
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    section = text.split("## State handed in", 1)[1].split("\n## ", 1)[0]
    for name, function in BOUNDARIES:
        leaf = function.split(".")[-1] if not function.endswith("__init__") else function.split(".")[0]
        assert re.search(rf"`{re.escape(name)}`", section) and leaf in section, (
            f"docs/architecture.md's 'State handed in' does not list {name} ({function})"
        )


def test_the_scan_sees_what_it_looks_for():
    """Calls by name and by module, the on-demand view, the shared holders; inside methods, nested functions and
    module level; a handed-in state read as an attribute is not a lookup."""
    source = (
        "import hasten.state as s\n"
        "X = GradientState()\n"
        "class A:\n"
        "    def f(self):\n"
        "        def g():\n"
        "            return s.PartialState().device\n"
        "        return PROCESS_STATE.device, s.AcceleratorState._shared_state\n"
        "    def h(self, state):\n"
        "        return state.device, self.gradient_state.sync_gradients\n"
    )
    found = _lookups_in(ast.parse(source))
    assert found == [
        ("<module>", 2, "GradientState(...)"),
        ("A.f", 6, "PartialState(...)"),
        ("A.f", 7, "PROCESS_STATE"),
        ("A.f", 7, "_shared_state"),
    ]


def test_what_the_accelerator_builds_is_what_its_parts_hold():
    """One process: the strategy, the wrappers and the prepared loader hold the Accelerator's own state objects."""
    from torch.utils.data import DataLoader

    from hasten import Accelerator

    accelerator = Accelerator()
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
    _, optimizer, scheduler, loader = accelerator.prepare(
        model, optimizer, scheduler, DataLoader(range(4), batch_size=2)
    )
    handed = accelerator.gradient_state
    assert accelerator._strategy.gradient_state is handed
    assert optimizer.gradient_state is handed and scheduler.gradient_state is handed and loader.gradient_state is handed
    assert loader._process is accelerator.state


def test_a_loader_built_by_hand_creates_no_state_until_it_needs_one():
    """Without an Accelerator a loader holds the on-demand view: building it creates no PartialState (as in
    Accelerate); reading it does."""
    from hasten.data_loader import DataLoaderShard
    from hasten.state import PROCESS_STATE, process_state_exists

    loader = DataLoaderShard(range(4), batch_size=2)
    assert loader._process is PROCESS_STATE
    assert [batch.tolist() for batch in loader] == [[0, 1], [2, 3]]
    with pytest.raises(AttributeError):
        PROCESS_STATE.__deepcopy__  # noqa: B018 - copy's probe for a hook
    assert pickle.loads(pickle.dumps(PROCESS_STATE)) is PROCESS_STATE
    assert not process_state_exists()
    assert PROCESS_STATE.num_processes == 1 and process_state_exists()


def test_save_state_and_load_state_read_the_state_handed_in(tmp_path, monkeypatch):
    """One process: with every lookup of the process state made to fail, the Accelerator's save_state and load_state
    still work (the checkpoint pipeline reads the state the Accelerator hands it)."""
    from hasten import Accelerator
    from hasten.state import PartialState, reset_state

    reset_state()
    accelerator = Accelerator()
    model = torch.nn.Linear(2, 1)
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))

    def looked_up(*args, **kwargs):
        raise AssertionError("the checkpoint pipeline looked the process state up")

    with monkeypatch.context() as patch:
        patch.setattr(PartialState, "__init__", looked_up)
        saved = accelerator.save_state(tmp_path / "checkpoint")
        with torch.no_grad():
            model.weight.zero_()
        accelerator.load_state(saved)
    reset_state()
    assert model.weight.abs().sum() > 0, "the weights saved came back"
