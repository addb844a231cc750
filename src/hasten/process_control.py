"""What every process-aware object offers: printing once, ordering processes, running on some processes only.

:class:`ProcessControl` is shared by the states (``PartialState``, ``AcceleratorState``) and the
``Accelerator``; it needs only ``process_index``, ``local_process_index``, ``num_processes`` and
``wait_for_everyone`` from the class it is mixed into. It belongs to the state, below the runtime: it knows
this process's rank and nothing of collectives (``wait_for_everyone`` is the subclass's).
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Mapping
from typing import Callable

import torch

from .errors import ConfigError


class ProcessControl:
    """Helpers that depend only on this process's rank: printing, ordering and per-rank decorators.

    Shared by :class:`PartialState`, :class:`AcceleratorState` and the ``Accelerator``; subclasses
    provide ``num_processes``, ``process_index``, ``local_process_index`` and ``wait_for_everyone``.
    """

    num_processes: int
    process_index: int
    local_process_index: int

    def wait_for_everyone(self) -> None:  # pragma: no cover - overridden
        raise NotImplementedError

    @property
    def is_main_process(self) -> bool:
        """True on the process of global rank 0."""
        return self.process_index == 0

    @property
    def is_local_main_process(self) -> bool:
        """True on the first process of each machine."""
        return self.local_process_index == 0

    @property
    def is_last_process(self) -> bool:
        """True on the process with the highest global rank."""
        return self.process_index == self.num_processes - 1

    @property
    def use_distributed(self) -> bool:
        """True when more than one process takes part in the job."""
        return self.num_processes > 1

    def print(self, *args, **kwargs) -> None:
        """``print`` on the local main process only (once per machine)."""
        if self.is_local_main_process:
            print(*args, **kwargs)

    @contextlib.contextmanager
    def _goes_first(self, is_first: bool):
        if not is_first:
            self.wait_for_everyone()
        yield
        if is_first:
            self.wait_for_everyone()

    def main_process_first(self):
        """Context manager: the main process runs the block first, the others wait, then run it."""
        return self._goes_first(self.is_main_process)

    def local_main_process_first(self):
        """Context manager: each machine's local main process runs the block before the others."""
        return self._goes_first(self.is_local_main_process)

    def _run_if(self, function: Callable | None, condition: Callable[[], bool]):
        if function is None:
            return functools.partial(self._run_if, condition=condition)

        @functools.wraps(function)
        def wrapper(*args, **kwargs):
            if condition():
                return function(*args, **kwargs)
            return None

        return wrapper

    def on_main_process(self, function: Callable | None = None):
        """Decorator: run ``function`` only on the main process (returns None elsewhere)."""
        return self._run_if(function, lambda: self.is_main_process)

    def on_local_main_process(self, function: Callable | None = None):
        """Decorator: run ``function`` only on each machine's local main process."""
        return self._run_if(function, lambda: self.is_local_main_process)

    def on_last_process(self, function: Callable):
        """Decorator: run ``function`` only on the last process."""
        return self._run_if(function, lambda: self.is_last_process)

    def on_process(self, function: Callable | None = None, process_index: int | None = None):
        """Decorator: run ``function`` only on the process of global rank ``process_index``."""
        if process_index is None:
            raise ConfigError("on_process needs process_index=<global rank>, e.g. @state.on_process(process_index=1).")
        return self._run_if(function, lambda: self.process_index == process_index)

    def on_local_process(self, function: Callable | None = None, local_process_index: int | None = None):
        """Decorator: run ``function`` only on the process of local rank ``local_process_index``."""
        if local_process_index is None:
            raise ConfigError("on_local_process needs local_process_index=<local rank>.")
        return self._run_if(function, lambda: self.local_process_index == local_process_index)

    @contextlib.contextmanager
    def split_between_processes(self, inputs, apply_padding: bool = False):
        """Context manager yielding this process's contiguous share of ``inputs``.

        ``inputs`` is a list, tuple, tensor or dict of those (split value by value). The first
        processes get one extra element when the length does not divide; with ``apply_padding`` the
        others repeat their last element so that every share has the same length (for a later gather).
        """
        yield split_for_process(inputs, self.num_processes, self.process_index, apply_padding)


def do_nothing(*args, **kwargs):
    """Accept any arguments and do nothing (what a process-filtered call becomes on the other processes)."""
    return None


def split_for_process(inputs, num_processes: int, process_index: int, apply_padding: bool = False):
    """This process's contiguous share of ``inputs`` (list, tuple, tensor, or dict of those)."""
    if isinstance(inputs, Mapping):
        lengths = {k: len(v) for k, v in inputs.items()}
        if len(set(lengths.values())) > 1:
            raise ValueError(
                f"split_between_processes needs every value of the dict to have the same length; got {lengths}."
            )
        return type(inputs)(
            {k: split_for_process(v, num_processes, process_index, apply_padding) for k, v in inputs.items()}
        )
    length = len(inputs)
    per_process, extras = divmod(length, num_processes)
    start = process_index * per_process + min(process_index, extras)
    end = start + per_process + (1 if process_index < extras else 0)
    if _is_hf_dataset(inputs):  # slicing one gives a dict of columns: select its rows instead, as Accelerate does
        rows = list(range(start, end))
        if apply_padding and extras and length:
            rows += [length - 1] * (per_process + 1 - len(rows))
        return inputs.select(rows)
    share = inputs[start:end]
    if not apply_padding or extras == 0 or length == 0:
        return share
    missing = per_process + 1 - (end - start)
    if missing == 0:
        return share
    filler = inputs[-1:] if end - start == 0 else share[-1:]
    if isinstance(share, torch.Tensor):
        return torch.cat([share] + [filler] * missing, dim=0)
    return share + type(share)(filler) * missing


def _is_hf_dataset(inputs) -> bool:
    """A ``datasets.Dataset`` (checked only when the user's code imported ``datasets``)."""
    datasets = sys.modules.get("datasets")
    return datasets is not None and isinstance(inputs, getattr(datasets, "Dataset", ()))
