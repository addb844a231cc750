"""Start a training function on several processes from a notebook, a REPL or a test.

:func:`notebook_launcher` runs ``function(*args)`` in ``num_processes`` processes (one per GPU by
default) through torch's elastic agent, forking this process where the platform allows it.
:func:`debug_launcher` runs it on CPU processes, for tests of distributed code.

Example::

    from hasten.launchers import notebook_launcher

    def training_loop(learning_rate):
        accelerator = Accelerator()     # created inside the function, in every process
        ...

    notebook_launcher(training_loop, (1e-3,), num_processes=2)
"""

from __future__ import annotations

import errno
import functools
import os
import pickle
import socket
import sys
from typing import Any, Callable

from . import environment
from .errors import ConfigError, HastenError
from .settings.launch import MIXED_PRECISION, USE_CPU


def notebook_launcher(
    function: Callable,
    args: tuple = (),
    num_processes: int | None = None,
    mixed_precision: str = "no",
    use_port: str = "29500",
    master_addr: str = "127.0.0.1",
    node_rank: int = 0,
    num_nodes: int = 1,
    rdzv_backend: str = "static",
    rdzv_endpoint: str = "",
    rdzv_conf: dict | None = None,
    rdzv_id: str = "none",
    max_restarts: int = 0,
    monitor_interval: float = 0.1,
    log_line_prefix_template: str | None = None,
    start_method: str | None = None,
) -> None:
    """Run ``function(*args)`` on ``num_processes`` processes of this machine (times ``num_nodes`` machines).

    The processes are forked from this one (``start_method="fork"``, the default where available), so
    the function may be defined in a notebook cell; nothing may have touched CUDA in this process
    before, and no ``Accelerator`` may exist yet: create it inside ``function``. With one process
    (the default without GPUs) the function runs right here.

    Args:
        function: the training function, called once in every process.
        args: positional arguments of ``function``.
        num_processes: processes on this machine; default one per GPU, or 1 without GPUs.
        mixed_precision: ``"no"``, ``"fp16"``, ``"bf16"`` or ``"fp8"`` (``HASTEN_MIXED_PRECISION`` of the processes).
        use_port: rendezvous port on ``master_addr``.
        master_addr: address of the machine with ``node_rank`` 0.
        node_rank: rank of this machine.
        num_nodes: number of machines (run the same call on each).
        rdzv_backend, rdzv_endpoint, rdzv_conf, rdzv_id, max_restarts, monitor_interval,
            log_line_prefix_template: passed to torch's elastic agent.
        start_method: ``"fork"`` or ``"spawn"`` (a hasten addition); spawn needs a picklable
            function defined in an importable module.

    Raises:
        ConfigError: a bad argument, CUDA already initialised before forking, an Accelerator that
            already exists, a busy port, or an unpicklable function with ``spawn``.
        HastenError: a process failed; the message names it and ends with its error.
    """
    import torch.multiprocessing as mp

    _check_no_state()
    precision = _notebook_precision(mixed_precision)
    num_processes = _notebook_processes(num_processes, num_nodes)
    if num_processes == 1 and num_nodes == 1:
        with environment.patch_environment(**{MIXED_PRECISION.variable: precision}):
            function(*args)
        return
    method = start_method or ("fork" if "fork" in mp.get_all_start_methods() else "spawn")
    _check_start_method(method, function, args)
    endpoint = rdzv_endpoint or f"{master_addr}:{use_port}"
    if rdzv_backend == "static" and node_rank == 0 and not rdzv_endpoint:
        check_port_free(
            master_addr, int(use_port), f"Pass another port: notebook_launcher(..., use_port=...) (got {use_port!r})."
        )
    options = _agent_options(
        rdzv_backend, rdzv_conf, rdzv_id, node_rank, max_restarts, monitor_interval, log_line_prefix_template
    )
    env = {MIXED_PRECISION.variable: precision, "FORK_LAUNCHED": "1" if method == "fork" else "0"}
    _launch(
        function,
        args,
        num_processes,
        num_nodes,
        endpoint,
        method,
        env,
        master_addr if num_nodes == 1 else None,
        options,
    )


def _notebook_precision(mixed_precision: str) -> str:
    """``notebook_launcher``'s ``mixed_precision``, checked, in lower case."""
    precision = str(mixed_precision).lower()
    if precision not in MIXED_PRECISION.choices:
        raise ConfigError(
            f"notebook_launcher(mixed_precision={mixed_precision!r}): choose one of "
            f"{', '.join(MIXED_PRECISION.choices)}."
        )
    return precision


def _notebook_processes(num_processes: int | None, num_nodes: int) -> int:
    """The processes ``notebook_launcher`` starts on this machine: ``num_processes``, else one per GPU (1 without
    GPUs), checked with ``num_nodes``."""
    if num_processes is None:
        import torch

        num_processes = torch.cuda.device_count() if torch.cuda.is_available() else 1
    if num_processes < 1 or num_nodes < 1:
        raise ConfigError(
            f"notebook_launcher needs num_processes >= 1 and num_nodes >= 1, got {num_processes} and {num_nodes}."
        )
    return num_processes


def _agent_options(
    rdzv_backend: str,
    rdzv_conf: dict | None,
    rdzv_id: str,
    node_rank: int,
    max_restarts: int,
    monitor_interval: float,
    log_line_prefix_template: str | None,
) -> dict:
    """The options of torch's elastic agent that ``notebook_launcher`` passes on (the static rendezvous is also
    told this machine's rank)."""
    configs = dict(rdzv_conf or {})
    if rdzv_backend == "static":
        configs["rank"] = node_rank
    options = dict(rdzv_backend=rdzv_backend, rdzv_configs=configs, run_id=rdzv_id, max_restarts=max_restarts)
    options.update(monitor_interval=monitor_interval, log_line_prefix_template=log_line_prefix_template)
    return options


def debug_launcher(function: Callable, args: tuple = (), num_processes: int = 2) -> None:
    """Run ``function(*args)`` on ``num_processes`` CPU processes of this machine (for tests).

    The processes are forked where the platform allows it and rendezvous on a free port of 127.0.0.1.

    Raises:
        ConfigError: see :func:`notebook_launcher`.
        HastenError: a process failed; the message names it and ends with its error.
    """
    import torch.multiprocessing as mp

    _check_no_state()
    if num_processes < 1:
        raise ConfigError(f"debug_launcher needs num_processes >= 1, got {num_processes}.")
    method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
    _check_start_method(method, function, args)
    env = {
        USE_CPU.variable: "1",
        MIXED_PRECISION.variable: MIXED_PRECISION.default,
        "FORK_LAUNCHED": "1" if method == "fork" else "0",
    }
    options = dict(
        rdzv_backend="c10d", rdzv_configs={}, run_id="hasten-debug-launcher", max_restarts=0, monitor_interval=0.1
    )
    _launch(function, args, num_processes, 1, "127.0.0.1:0", method, env, "127.0.0.1", options)


def check_port_free(host: str, port: int, fix: str) -> None:
    """Raise :class:`ConfigError` (ending with ``fix``) unless ``host:port`` can be bound on this machine."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as exc:
        raise ConfigError(f"The rendezvous address {host!r} cannot be resolved: {exc}.") from None
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise ConfigError(
                    f"Port {port} on {host} is already in use (another job, or a previous one still shutting down). "
                    f"{fix}"
                ) from None
            if exc.errno == errno.EADDRNOTAVAIL:
                raise ConfigError(
                    f"{host} is not an address of this machine, but the rendezvous of machine rank 0 must be hosted "
                    "here. Start machine rank 0 on the machine that has this address, or name an address of this one."
                ) from None
            raise


def _check_no_state() -> None:
    from .state import is_initialized, process_state_exists

    if is_initialized() or process_state_exists():
        raise ConfigError(
            "An Accelerator (or PartialState) already exists in this process, so the new processes would inherit it. "
            "Create the Accelerator inside the function you launch; in a notebook, restart the kernel and run "
            "only the cells that define things before calling the launcher."
        )


def _check_start_method(method: str, function: Callable, args: tuple) -> None:
    if method == "fork":
        import torch

        if torch.cuda.is_initialized():
            raise ConfigError(
                "CUDA was initialised in this process before the launcher could fork it, and a forked process cannot "
                "use CUDA then. Restart the notebook kernel and make sure no cell touches the GPU (a "
                ".cuda()/.to('cuda') call, torch.cuda.* queries that create a context) before the launcher; do that "
                "inside the function."
            )
        return
    name = getattr(function, "__qualname__", repr(function))
    try:
        pickle.dumps((function, args))
    except Exception as exc:
        raise ConfigError(
            f"start_method={method!r} sends {name} and its args to new processes by pickling, and that failed ({exc}). "
            "Define the function at the top level of an importable module (not a lambda, a nested function or a "
            "notebook cell), or use start_method='fork'."
        ) from None
    main = sys.modules.get("__main__")
    if getattr(function, "__module__", None) == "__main__" and not getattr(main, "__file__", None):
        raise ConfigError(
            f"start_method={method!r}: {name} is defined in an interactive session, which new processes cannot import. "
            "Move it into a module file, or use start_method='fork'."
        )


def _launch(
    function: Callable,
    args: tuple,
    nproc: int,
    nodes: int,
    endpoint: str,
    method: str,
    env: dict,
    local_addr: str | None,
    options: dict,
) -> None:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(
        min_nodes=nodes,
        max_nodes=nodes,
        nproc_per_node=nproc,
        rdzv_endpoint=endpoint,
        start_method=method,
        local_addr=local_addr,
        **options,
    )
    entrypoint = _NamedEntrypoint(functools.partial(_run_tied_to_parent, os.getpid(), function), named_after=function)
    with environment.patch_environment(**env):
        try:
            elastic_launch(config, entrypoint=entrypoint)(*args)
        except ChildFailedError as exc:
            rank, failure = exc.get_first_failure()
            raise HastenError(
                f"Process {rank} of {nproc * nodes} failed (exit code {failure.exitcode}) while running "
                f"{getattr(function, '__qualname__', function)}:\n{_failure_detail(failure)}"
            ) from exc


class _NamedEntrypoint:
    """A callable with the ``__name__``/``__qualname__`` torch elastic reads, around one without
    (``functools.partial``)."""

    def __init__(self, function: Callable, named_after: Callable):
        self.function = function
        name = getattr(named_after, "__name__", None)
        self.__name__ = name or getattr(getattr(named_after, "func", None), "__name__", type(named_after).__name__)
        self.__qualname__ = self.__name__

    def __call__(self, *args, **kwargs):
        return self.function(*args, **kwargs)


def _run_tied_to_parent(parent_pid: int, function: Callable, *args: Any) -> Any:
    """Run ``function(*args)`` in a started process that ends when the launching process does (however it ends)."""
    from .commands.worker_bootstrap import die_with_parent

    die_with_parent(parent_pid)
    return function(*args)


def _failure_detail(failure: Any) -> str:
    """The child's traceback from torch elastic's error record, or its one-line message."""
    record = failure.error_file_data
    inner = record.get("message") if isinstance(record, dict) else None
    if isinstance(inner, dict) and inner.get("extraInfo", {}).get("py_callstack"):
        return str(inner["extraInfo"]["py_callstack"]).rstrip()
    return str(failure.message)


def test_launch():
    """Set up this process's distributed state (what ``hasten test`` checks first): creates ``PartialState``."""
    from .state import PartialState

    PartialState()
