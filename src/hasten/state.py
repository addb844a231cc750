"""Process-wide state: who this process is (:class:`PartialState`), how it trains
(:class:`AcceleratorState`) and where gradient accumulation stands (:class:`GradientState`).

As in Accelerate, every instance of one of these classes shares the same attributes, so a second
``Accelerator()`` in the same process sees the first one's state. The sharing has one owner (the
class-level ``_shared_state`` dict of each class) and one public reset, :func:`reset_state`, which
tests and notebooks call to start over; ``_reset_state`` is kept for downstream test suites.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time
import warnings
from datetime import timedelta
from typing import Any, Mapping

import torch
import torch.distributed as dist

from . import environment, process_group_hooks
from .enums import DistributedType, member_values
from .errors import ConfigError, DistributedSetupError
from .gradient_state import GradientState  # noqa: F401  (Accelerate's accelerate.state.GradientState)
from .process_control import ProcessControl, do_nothing  # noqa: F401  (do_nothing: Accelerate's accelerate.state name)
from .settings.engines import Engine
from .settings.launch import DEBUG, MIXED_PRECISION, USE_CPU

_GPU_TYPES = {"cuda": DistributedType.MULTI_GPU, "xpu": DistributedType.MULTI_XPU}


class _NotInitialized(AttributeError):
    pass


_exit_hook_registered = False
_EXIT_DRAIN_SECONDS = 0.1


def _finish_process_group_at_exit() -> None:
    # A collective's worker thread (gloo's, NCCL's watchdog) drops its last reference to the collective's
    # tensors just after the caller's wait() returned, and that drop takes the GIL. Once interpreter
    # finalization has begun, a thread asking for the GIL is terminated, which aborts the whole process
    # (SIGABRT, "terminate called without an active exception") after a script that succeeded. So: tear
    # the group down while the interpreter is whole, then sleep, which hands the GIL to any such thread.
    # After an uncaught exception (``sys.last_value`` is set before atexit runs) the teardown is skipped:
    # other ranks may sit in a collective it would wait on. The sleep happens even when the script
    # destroyed the group itself: its threads live on while a DDP or FSDP module still references it.
    if dist.is_initialized() and getattr(sys, "last_value", None) is None:
        dist.destroy_process_group()
    time.sleep(_EXIT_DRAIN_SECONDS)


def _register_exit_teardown() -> None:
    """Finish the process group hasten created when the interpreter exits (registered once per process)."""
    global _exit_hook_registered
    if not _exit_hook_registered:
        atexit.register(_finish_process_group_at_exit)
        _exit_hook_registered = True


class PartialState(ProcessControl):
    """Who this process is: rank, world size, device, backend. Owns the process group.

    Created by ``Accelerator()``; can be used alone in scripts that only need process information.
    The launch context is read from torchrun/``hasten launch``, MPI (``mpirun``) or Slurm (``srun``)
    variables. On a machine without accelerators, a multi-process launch is a gloo ``MULTI_CPU`` run
    with no extra flag (Accelerate needs ``ACCELERATE_USE_CPU``; hasten does not).

    Args:
        cpu: use the CPU even when an accelerator is present (also ``HASTEN_USE_CPU=1``).
        **kwargs: passed to ``torch.distributed.init_process_group`` (``backend``, ``init_method``,
            ``timeout`` as ``timedelta`` or seconds).
    """

    _shared_state: dict[str, Any] = {}

    def __init__(self, cpu: bool = False, **kwargs):
        self.__dict__ = self._shared_state
        cpu = cpu or environment.launch_setting(USE_CPU)
        if self.__dict__.get("initialized"):
            if cpu and self.device.type != "cpu":
                raise ConfigError(
                    f"The process state was already created on {self.device}; cpu=True cannot change it. "
                    "Pass cpu=True to the first Accelerator/PartialState, or call hasten.state.reset_state() first."
                )
            return
        launch = environment.detect_launch()
        self.launch = launch
        self.num_processes = launch.world_size
        self.process_index = launch.rank
        self.local_process_index = launch.local_rank
        self.debug = environment.launch_setting(DEBUG)
        self.fork_launched = os.environ.get("FORK_LAUNCHED") == "1"
        self.device = environment.select_device(cpu, launch.local_rank)
        self.backend = None
        self._owns_process_group = False
        if self.device.type in ("cuda", "xpu"):
            getattr(torch, self.device.type).set_device(self.device)
        if launch.world_size > 1 or dist.is_initialized():
            self._init_process_group(dict(kwargs))
            process_group_hooks.guards().start_watching()
        self.distributed_type = self._distributed_type()
        if self.distributed_type == DistributedType.MULTI_CPU:
            self._set_cpu_threads()
            if self.device == torch.device("cpu"):
                self.device = torch.device("cpu", 0)  # Accelerate's device of a CPU process in a multi-process job
        self.initialized = True

    def _init_process_group(self, kwargs: dict) -> None:
        if not dist.is_available():
            raise DistributedSetupError(
                "torch.distributed is not available in this PyTorch build; a multi-process run needs it."
            )
        if dist.is_initialized():
            self.backend = dist.get_backend()
            self.num_processes, self.process_index = dist.get_world_size(), dist.get_rank()
            return
        environment.prepare_rendezvous(self.launch)
        backend = kwargs.pop("backend", None) or (
            "nccl" if self.device.type == "cuda" else "xccl" if self.device.type == "xpu" else "gloo"
        )
        if backend == "nccl" and self.device.type != "cuda":
            backend = "gloo"  # InitProcessGroupKwargs defaults to nccl, which cannot run on CPU tensors
        timeout = kwargs.pop("timeout", None)
        if isinstance(timeout, (int, float)):
            timeout = timedelta(seconds=timeout)
        init_method = kwargs.pop("init_method", None) or "env://"
        process_group_hooks.guards().create_group(
            lambda options: dist.init_process_group(
                backend=backend,
                init_method=init_method,
                rank=self.launch.rank,
                world_size=self.launch.world_size,
                **options,
                **kwargs,
            ),
            timeout,
        )
        self.backend = backend
        self._owns_process_group = True
        _register_exit_teardown()

    def _distributed_type(self) -> DistributedType:
        if self.num_processes <= 1:
            return DistributedType.NO
        return _GPU_TYPES.get(self.device.type, DistributedType.MULTI_CPU)

    def _set_cpu_threads(self) -> None:
        # Several CPU processes on one machine each default to all cores and fight over them.
        if "OMP_NUM_THREADS" in os.environ:
            return
        import psutil

        cores = psutil.cpu_count(logical=False) or os.cpu_count() or 1
        torch.set_num_threads(max(1, cores // max(self.launch.local_world_size, 1)))

    def __getattr__(self, name: str):
        # Only reached when the attribute is missing: a name the state never has, or any name before __init__ ran.
        if name.startswith("__") or self._shared_state.get("initialized"):
            raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")
        raise _NotInitialized(
            f"`PartialState` object has no attribute `{name}`: the process state is not initialized. This happens "
            "if `PartialState._reset_state()` (hasten.state.reset_state()) was called and no state was created again, "
            "or before the first Accelerator() or PartialState(): create an Accelerator() (or PartialState()) before "
            "using it."
        )

    def __eq__(self, other) -> bool:
        """Process states compare by their contents (an unpickled copy equals the live one)."""
        return isinstance(other, PartialState) and self.__dict__ == other.__dict__

    def __hash__(self) -> int:
        return hash(PartialState)  # one process state per process: every instance is the same one

    @property
    def debug(self) -> bool:
        """Debug mode: every hasten collective first checks that all ranks pass matching shapes
        (``hasten launch --debug`` / ``HASTEN_DEBUG_MODE``); settable at run time, as in Accelerate."""
        return bool(self.__dict__.get("_debug", False))

    @debug.setter
    def debug(self, value: bool) -> None:
        self.__dict__["_debug"] = bool(value)
        process_group_hooks.guards().set_debug(bool(value))

    @property
    def initialized_state(self) -> bool:
        """True once this process's state exists."""
        return bool(self._shared_state.get("initialized"))

    @property
    def default_device(self) -> torch.device:
        """The device hasten would pick for this process if none were forced."""
        return environment.select_device(False, self.local_process_index)

    @property
    def num_machines(self) -> int:
        """Number of machines in the job."""
        return self.launch.num_nodes

    def wait_for_everyone(self) -> None:
        """Block until every process reaches this point (a barrier; nothing happens on one process)."""
        if self.num_processes > 1:
            process_group_hooks.guards().barrier()

    def ensure_process_group(self) -> None:
        """Make sure a process group exists, creating a private one-process group when running alone.

        Engines such as DeepSpeed and FSDP need a process group even for one process. The group created
        here is owned by this state (``destroy_process_group`` and :func:`reset_state` remove it).
        """
        if dist.is_initialized():
            return
        self.backend = "nccl" if self.device.type == "cuda" else "gloo"
        dist.init_process_group(self.backend, store=dist.HashStore(), rank=0, world_size=1)
        self._owns_process_group = True
        _register_exit_teardown()

    def set_device(self) -> None:
        """Make this process's device the current one of its family (CUDA/XPU)."""
        if self.device.type in ("cuda", "xpu"):
            getattr(torch, self.device.type).set_device(self.device)

    def destroy_process_group(self, group=None) -> None:
        """Destroy the process group this state created (no-op if it created none)."""
        if self._owns_process_group and dist.is_initialized():
            dist.destroy_process_group(group)
            if group is None:
                self._owns_process_group = False

    def __repr__(self) -> str:
        return (
            f"Distributed environment: {self.distributed_type}{'  Backend: ' + self.backend if self.backend else ''}\n"
            f"Num processes: {self.num_processes}\n"
            f"Process index: {self.process_index}\n"
            f"Local process index: {self.local_process_index}\n"
            f"Device: {self.device}\n"
        )

    @classmethod
    def _reset_state(cls) -> None:
        """Forget this process's state (the process group is left as is). Prefer :func:`reset_state`."""
        cls._shared_state.clear()


class ProcessStateOnDemand:
    """The process's :class:`PartialState`, looked up at each attribute read (so created, if need be, only then).

    What hasten's objects hold instead of a state handed in when a user builds them without an ``Accelerator``
    (``DataLoaderShard(...)``, ``prepare_data_loader`` alone, the public RNG helpers): they ask which process they are
    on only when they need to, as Accelerate's do, so building one creates no state. Use :data:`PROCESS_STATE`.
    """

    __slots__ = ()

    def __getattr__(self, name: str):
        if name.startswith("__"):  # copy and pickle probe for hooks: they must not create a state
            raise AttributeError(name)
        return getattr(PartialState(), name)

    def __repr__(self) -> str:
        return "<the process's PartialState, looked up when read>"

    def __reduce__(self) -> str:
        return "PROCESS_STATE"  # unpickled as the one instance


PROCESS_STATE = ProcessStateOnDemand()
"""The one :class:`ProcessStateOnDemand`."""


class AcceleratorState(ProcessControl):
    """How this process trains: everything in :class:`PartialState` plus precision and strategy settings.

    Attributes of the partial state (``device``, ``num_processes``, ...) are readable here too.

    Args:
        mixed_precision: ``"no"``, ``"fp16"``, ``"bf16"`` or ``"fp8"``; None reads
            ``HASTEN_MIXED_PRECISION`` and defaults to ``"no"``.
        cpu: force the CPU.
        dynamo_plugin, deepspeed_plugin, fsdp_plugin, parallelism_config: strategy settings (kept as given; see
            :meth:`record_engine`).
        **kwargs: passed on to :class:`PartialState`.
    """

    _shared_state: dict[str, Any] = {}

    def __init__(
        self,
        mixed_precision: str | None = None,
        cpu: bool = False,
        dynamo_plugin=None,
        deepspeed_plugin=None,
        fsdp_plugin=None,
        torch_tp_plugin=None,
        megatron_lm_plugin=None,
        parallelism_config=None,
        _from_accelerator: bool = False,
        **kwargs,
    ):
        self.__dict__ = self._shared_state
        if self.__dict__.get("initialized"):
            if _from_accelerator:
                self.dynamo_plugin = dynamo_plugin  # the Accelerator then records its engine (record_engine)
            else:
                self._check_unchanged(mixed_precision)
            return
        self._partial = PartialState(cpu, **kwargs)
        self.mixed_precision = resolve_mixed_precision(mixed_precision)
        self.torch_tp_plugin = torch_tp_plugin
        self.megatron_lm_plugin = megatron_lm_plugin
        self.dynamo_plugin = dynamo_plugin
        named = dict(deepspeed_plugin=deepspeed_plugin, fsdp_plugin=fsdp_plugin, parallelism_config=parallelism_config)
        self.record_engine(None, named)
        self.initialized = True

    def record_engine(self, engine: Engine | None, arguments: Mapping[str, Any], mixed_precision: str | None = None):
        """Record the engine in use and its settings (the latest ``Accelerator``'s, as its plan settled them).

        Every registered engine's argument becomes an attribute (``deepspeed_plugin``, ``fsdp_plugin``,
        ``parallelism_config``, ...: the value in ``arguments`` or None). ``engine`` None is the registered engine
        whose plugin is given, if any. ``distributed_type`` is the engine's when it fixes one (DEEPSPEED, FSDP),
        else the launch's. With ``mixed_precision``: an engine whose own configuration settles the precision
        (DeepSpeed's) sets it; for any other, a precision other than the state's is an error.
        """
        if engine is None:
            given = (e for e in environment.ENGINES if e.plugin and arguments.get(e.plugin.name) is not None)
            engine = next(given, None)
        for argument in (argument for registered in environment.ENGINES for argument in registered.arguments):
            setattr(self, argument.name, arguments.get(argument.name))
        fixed = engine.distributed_type if engine is not None else None
        if fixed is None:
            self.distributed_type = self._partial.distributed_type
        else:
            self.distributed_type = DistributedType(fixed) if fixed in member_values(DistributedType) else fixed
        if mixed_precision is None or engine is None or not engine.settles_precision:
            self._check_unchanged(mixed_precision)
        elif self.mixed_precision != str(mixed_precision):
            self.mixed_precision = str(mixed_precision)

    def destroy_process_group(self, group=None) -> None:
        """Destroy ``group`` (default: the process group hasten created); see
        :meth:`PartialState.destroy_process_group`."""
        partial = self.__dict__.get("_partial") or PartialState()  # after _reset_state() the process state lives on
        partial.destroy_process_group(group)

    def get_deepspeed_plugin(self, name: str):
        """The DeepSpeed plugin passed under ``name`` in ``Accelerator(deepspeed_plugins={name: plugin})``."""
        plugins = self.deepspeed_plugin
        if isinstance(plugins, dict) and name in plugins:
            return plugins[name]
        known = (
            f"the plugins are named {sorted(plugins)}" if isinstance(plugins, dict) else "no named plugins were given"
        )
        raise ConfigError(
            f"No DeepSpeed plugin named {name!r}: {known} (hasten runs one DeepSpeed plugin per Accelerator)."
        )

    def select_deepspeed_plugin(self, name: str | None = None) -> None:
        """Make the plugin called ``name`` (or the only one) the active one."""
        plugins = self.deepspeed_plugin
        plugin = self.get_deepspeed_plugin(name) if name is not None or isinstance(plugins, dict) else plugins
        if plugin is None:
            raise ConfigError("select_deepspeed_plugin: DeepSpeed is not in use (no deepspeed_plugin was given).")
        plugin.select()

    def _check_unchanged(self, mixed_precision: str | None) -> None:
        if mixed_precision is not None and str(mixed_precision) != self.mixed_precision:
            raise ConfigError(
                f"AcceleratorState already exists with mixed_precision={self.mixed_precision!r}; a second "
                f"Accelerator asked for {str(mixed_precision)!r}. Use one setting per process, or call "
                "hasten.state.reset_state() before creating the new Accelerator."
            )

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")
        partial = self.__dict__.get("_partial")
        if partial is None:
            raise _NotInitialized(
                f"`AcceleratorState` object has no attribute `{name}`: it is not initialized. This happens if "
                "`AcceleratorState._reset_state()` (hasten.state.reset_state()) was called, or before the first "
                "Accelerator(), and no `Accelerator` was created again: create an Accelerator() first (objects "
                "prepared by the old one belong to the old state)."
            )
        try:
            return getattr(partial, name)
        except _NotInitialized:
            raise
        except AttributeError:
            raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'") from None

    @property
    def debug(self) -> bool:
        """Debug mode of the process state (see :attr:`PartialState.debug`); settable."""
        return self._partial.debug

    @debug.setter
    def debug(self, value: bool) -> None:
        self._partial.debug = value

    @property
    def num_processes(self) -> int:
        return self._partial.num_processes

    @property
    def process_index(self) -> int:
        return self._partial.process_index

    @property
    def local_process_index(self) -> int:
        return self._partial.local_process_index

    @property
    def partial_state(self) -> PartialState:
        """The :class:`PartialState` this state builds on."""
        return self._partial

    def wait_for_everyone(self) -> None:
        """Barrier across all processes."""
        self._partial.wait_for_everyone()

    @property
    def is_fsdp2(self) -> bool:
        """True when the FSDP strategy is in use (hasten's FSDP is always FSDP2)."""
        return self.distributed_type == DistributedType.FSDP

    def __repr__(self) -> str:
        return repr(self._partial) + f"Mixed precision type: {self.mixed_precision}\n"

    @classmethod
    def _reset_state(cls, reset_partial_state: bool = False) -> None:
        """Forget the training settings; with ``reset_partial_state`` the process state too."""
        cls._shared_state.clear()
        if reset_partial_state:
            PartialState._reset_state()


def requested_mixed_precision(value: str | None) -> str:
    """The precision a new Accelerator asks for: ``value``, else the existing state's, else the environment's.

    The engine may still settle it differently (a DeepSpeed config that enables bf16) before the
    ``AcceleratorState`` is built.
    """
    if value is None and is_initialized():
        return AcceleratorState().mixed_precision
    return resolve_mixed_precision(value)


def resolve_mixed_precision(value: str | None) -> str:
    """Validate a mixed precision choice; None reads ``HASTEN_MIXED_PRECISION`` (default ``"no"``)."""
    if value is None:
        value = environment.launch_setting(MIXED_PRECISION)
    text = str(value).lower()
    if text not in MIXED_PRECISION.choices:
        raise ConfigError(f"mixed_precision={value!r} is not supported; choose one of {list(MIXED_PRECISION.choices)}.")
    return text


def is_initialized() -> bool:
    """True once an ``AcceleratorState`` exists in this process."""
    return bool(AcceleratorState._shared_state.get("initialized"))


def process_state_exists() -> bool:
    """True once a ``PartialState`` exists in this process (asking creates none, unlike ``PartialState()``)."""
    return bool(PartialState._shared_state.get("initialized"))


def reset_state(destroy_process_group: bool = False) -> None:
    """Forget all process-wide state, so that the next ``Accelerator()`` starts from scratch.

    Args:
        destroy_process_group: also destroy the process group hasten created.
    """
    if destroy_process_group and process_state_exists():
        PartialState().destroy_process_group()
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    process_group_hooks.guards().reset()
    _warned.clear()


def warn_once(key: str, message: str, category=UserWarning) -> None:
    """Emit ``message`` once per process for ``key``."""
    if key in _warned:
        return
    _warned.add(key)
    warnings.warn(message, category, stacklevel=3)


_warned: set[str] = set()


class ThreadLocalSharedDict(threading.local):
    """A class-level dict descriptor whose contents are per thread (Accelerate's shared-state holder for TPU
    threads). hasten's states are per process, so :data:`SharedDict` is a plain ``dict``."""

    def __init__(self, thread_local: bool = False):
        self._storage = {}

    def __get__(self, obj, objtype=None):
        return self._storage

    def __set__(self, obj, value):
        self._storage = value


SharedDict = dict
