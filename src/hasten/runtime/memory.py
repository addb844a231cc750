"""Out-of-memory handling: recognising OOM errors, releasing memory, and retrying at a smaller batch size."""

from __future__ import annotations

import functools
import gc
import inspect
import traceback
from typing import Callable

import torch

from ..errors import HastenError

_OOM_MESSAGES = (
    "CUDA out of memory",
    "XPU out of memory",
    "NPU out of memory",
    "MPS backend out of memory",
    "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED",
    "CUDNN_STATUS_ALLOC_FAILED",
    "DefaultCPUAllocator: can't allocate memory",
    "DefaultCPUAllocator: not enough memory",
    "out of memory",
)


def should_reduce_batch_size(exception: BaseException) -> bool:
    """True when ``exception`` means the device (CUDA, XPU, NPU, MPS) or the CPU allocator ran out of memory."""
    if isinstance(exception, (MemoryError, getattr(torch, "OutOfMemoryError", MemoryError))):
        return True
    if isinstance(exception, RuntimeError) and len(exception.args) == 1:
        return any(message in str(exception.args[0]) for message in _OOM_MESSAGES)
    return False


def clear_device_cache(garbage_collection: bool = False) -> None:
    """Return cached device memory to the driver (CUDA, XPU, MPS), after a garbage collection if asked."""
    if garbage_collection:
        gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    if hasattr(torch, "xpu") and torch.xpu.is_available():
        torch.xpu.empty_cache()
    if hasattr(torch, "mps") and torch.backends.mps.is_available():
        torch.mps.empty_cache()


def release_memory(*objects):
    """Drop the given references, collect garbage and empty device caches.

    Returns a list of ``None`` of the same length, to rebind the caller's names:
    ``model, optimizer = release_memory(model, optimizer)``.
    """
    objects = list(objects)
    for i in range(len(objects)):
        objects[i] = None
    clear_device_cache(garbage_collection=True)
    return objects


class BatchSizeExhaustedError(HastenError, RuntimeError):
    """Even batch size 1 ran out of memory."""


def _name(function) -> str:
    """A callable's name for messages: ``functools.partial`` objects and callable instances have no ``__name__``."""
    inner = function.func if isinstance(function, functools.partial) else function
    return getattr(inner, "__name__", None) or type(inner).__name__


def _run_attempt(function, batch_size: int, args, kwargs):
    """Run one attempt; return (agreed outcome, result, OOM error) with every rank agreeing on the outcome."""
    from . import oom_recovery

    attempt = oom_recovery.Attempt() if oom_recovery.distributed() else None
    try:
        result = function(batch_size, *args, **kwargs)
    except Exception as caught:  # noqa: BLE001 - only OOMs are retried; the rest re-raised below
        oom = should_reduce_batch_size(caught)
        if attempt is None:
            if oom:
                return "oom", None, _without_frames(caught)
            raise
        if not oom and not attempt.aborting():
            attempt.give_up()  # a real error: tell the others and end now, without waiting for them
            raise
        if attempt.finish("oom" if oom else "error") == "oom":
            return "oom", None, _without_frames(caught) if oom else None
        raise
    if attempt is None:
        return "ok", result, None
    agreed = attempt.finish("ok")
    if agreed == "error":
        raise oom_recovery.PeerFailedError(
            f"find_executable_batch_size: rank(s) {attempt.failed_ranks} failed with an error that is not an "
            f"out-of-memory error at batch size {batch_size}; this rank stops too. See that rank's traceback."
        )
    return agreed, result, None


def _without_frames(error: BaseException) -> BaseException:
    """Release the failed attempt's frames (its model, activations) before the retry; keep the message."""
    traceback.clear_frames(error.__traceback__)
    return error


def find_executable_batch_size(
    function: Callable | None = None,
    starting_batch_size: int = 128,
    reduce_batch_size_fn: Callable[[], int] | None = None,
):
    """Decorator that retries ``function(batch_size, ...)`` with a smaller batch size after each out-of-memory error.

    The decorated function takes the batch size as its first argument; call it without that argument.
    As in Accelerate 1.15, each OOM multiplies the batch size by 0.9 (rounded down: 128, 115, 103, ...);
    ``reduce_batch_size_fn``, called with no argument, returns the next size instead. The size reached is
    kept: a second call of the decorated function starts from it. A size of 0 ends the search with a
    ``RuntimeError`` (the last OOM as its cause). In a multi-process run, all ranks agree after every
    attempt, through the rendezvous store: if any rank ran out of memory, every rank retries at the smaller
    size, so ranks never diverge. This holds when the OOM strikes on one rank while the others wait in a
    collective of the attempt (DDP's gradient all-reduce): the process group is then aborted and rebuilt
    (see :mod:`hasten.runtime.oom_recovery`), so objects holding it must be prepared inside the decorated
    function. ``function`` may be any callable (``functools.partial`` too).
    """
    if function is None:
        return functools.partial(
            find_executable_batch_size,
            starting_batch_size=starting_batch_size,
            reduce_batch_size_fn=reduce_batch_size_fn,
        )
    batch_size = starting_batch_size

    def reduce() -> int:
        if reduce_batch_size_fn is not None:
            return reduce_batch_size_fn()
        return int(batch_size * 0.9)

    @functools.wraps(function)
    def decorator(*args, **kwargs):
        nonlocal batch_size
        clear_device_cache(garbage_collection=True)
        _check_call(function, args)
        error = None
        while True:
            if batch_size == 0:
                raise BatchSizeExhaustedError(
                    "No executable batch size found, reached zero. "
                    + (
                        f"Every batch size from {starting_batch_size} down ran out of memory: the model does not fit. "
                        "Reduce its size, use mixed precision, or shard it (FSDP/DeepSpeed)."
                        if starting_batch_size > 0
                        else "find_executable_batch_size(starting_batch_size=...) must be at least 1."
                    )
                ) from error
            outcome, result, error = _run_attempt(function, batch_size, args, kwargs)
            if outcome == "ok":
                return result
            clear_device_cache(garbage_collection=True)
            batch_size = reduce()

    return decorator


def _check_call(function, args: tuple) -> None:
    """Refuse a call that passes the batch size itself (the decorator passes it)."""
    params = list(inspect.signature(function).parameters)
    if len(params) < len(args) + 1:
        name = _name(function)
        raise TypeError(
            f"Batch size was passed into `{name}` as the first argument when called. Remove it "
            f"and call `{name}({', '.join(repr(a) for a in args[1:]) if args else ''})` instead: the "
            "decorator passes the batch size itself."
        )
