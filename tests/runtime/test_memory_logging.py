"""OOM retry, memory release, logging and progress bars in a single process."""

import logging

import pytest
import torch

from hasten import Accelerator, find_executable_batch_size
from hasten.errors import DistributedSetupError
from hasten.logging import get_logger
from hasten.runtime.memory import BatchSizeExhaustedError, release_memory, should_reduce_batch_size
from hasten.utils import tqdm


def test_oom_recognition():
    assert should_reduce_batch_size(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate"))
    assert should_reduce_batch_size(
        RuntimeError(
            "[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory: you tried to allocate "
            "1234 bytes"
        )
    )
    assert should_reduce_batch_size(RuntimeError("MPS backend out of memory (MPS allocated: 1 GB)"))
    assert should_reduce_batch_size(MemoryError())
    assert not should_reduce_batch_size(RuntimeError("shape mismatch"))
    assert not should_reduce_batch_size(ValueError("out of memory"))


def test_find_executable_batch_size_multiplies_by_0_9_on_oom():
    tried = []

    @find_executable_batch_size(starting_batch_size=16)
    def run(batch_size, scale):
        tried.append(batch_size)
        if batch_size > 10:
            raise torch.OutOfMemoryError("CUDA out of memory.")
        return batch_size * scale

    assert run(10) == 100 and tried == [16, 14, 12, 10], "int(size * 0.9) after each OOM, as Accelerate 1.15"
    assert run(1) == 10 and tried[-1] == 10, "the size reached is kept for the next call"


def test_a_custom_reduction_is_called_without_argument():
    sizes = iter([5, 3])

    @find_executable_batch_size(starting_batch_size=8, reduce_batch_size_fn=lambda: next(sizes))
    def run(batch_size):
        if batch_size > 3:
            raise RuntimeError("CUDA out of memory. Tried to allocate 1 GiB")
        return batch_size

    assert run() == 3


def test_batch_size_one_failing_keeps_the_cause():
    @find_executable_batch_size(starting_batch_size=2)
    def run(batch_size):
        raise RuntimeError("CUDA out of memory. Tried to allocate 8 GiB")

    with pytest.raises(BatchSizeExhaustedError, match="No executable batch size found, reached zero") as info:
        run()
    assert "Tried to allocate 8 GiB" in str(info.value.__cause__)
    with pytest.raises(RuntimeError, match="must be at least 1"):
        find_executable_batch_size(lambda batch_size: batch_size, starting_batch_size=0)()


def test_other_errors_are_not_retried_and_batch_size_argument_is_rejected():
    @find_executable_batch_size(starting_batch_size=8)
    def run(batch_size):
        raise KeyError("bug")

    with pytest.raises(KeyError):
        run()

    @find_executable_batch_size(starting_batch_size=8)
    def needs_one(batch_size):
        return batch_size

    with pytest.raises(TypeError, match="Batch size was passed into `needs_one`"):
        needs_one(8)


def test_release_memory():
    a, b = torch.ones(3), torch.ones(3)
    assert release_memory(a, b) == [None, None]


def test_logger_before_state_is_a_clear_error():
    logger = get_logger("early")
    with pytest.raises(RuntimeError, match="Create the Accelerator"):
        logger.warning("too early")


def test_logger_before_state_raises_even_when_its_level_is_disabled():
    logger = get_logger("early-quiet")
    logger.logger.setLevel(logging.ERROR)
    with pytest.raises(DistributedSetupError, match="before the process state exists"):
        logger.debug("too early, and below the level")


def test_logger_levels(monkeypatch, caplog):
    monkeypatch.setenv("HASTEN_LOG_LEVEL", "DEBUG")
    Accelerator()
    logger = get_logger("levels")
    assert logger.logger.level == logging.DEBUG
    with caplog.at_level(logging.DEBUG, logger="levels"):
        logger.debug("visible", main_process_only=True)
        logger.info("everyone", main_process_only=False, in_order=True)
        logger.warning_once("once")
        logger.warning_once("once")
    assert [r.getMessage() for r in caplog.records] == ["visible", "everyone", "once"]


def test_tqdm_on_main_process():
    Accelerator()
    bar = tqdm(range(3), main_process_only=True)
    assert not bar.disable
    assert list(bar) == [0, 1, 2]
    with pytest.raises(TypeError, match="as a keyword"):
        tqdm(True, range(3))


def test_find_executable_batch_size_accepts_callables_without_a_name():
    import functools

    def train(batch_size, scale):
        if batch_size > 8:
            raise RuntimeError("CUDA out of memory. Tried to allocate 1 GiB")
        return batch_size * scale

    assert (
        find_executable_batch_size(functools.partial(train, scale=2), starting_batch_size=32)() == 16
    )  # 32, 28, 25, 22, 19, 17, 15, 13, 11, 9, then 8 fits
    with pytest.raises(TypeError, match="Batch size was passed into `train`"):
        find_executable_batch_size(functools.partial(train), starting_batch_size=32)(4, 2)
