"""Differential scenario of ``skip_first_batches`` (run by tests/compat/test_differential_skip.py): what it returns
for prepared loaders (sharded, dispatched, split, over a batch sampler or an iterable dataset) and for plain ones.

The scenario reports what code that receives the returned loader looks at (transformers' Trainer, user scripts):
its type relationships, ``len()``, ``batch_size``/``drop_last``/``dataset``, ``set_epoch``, the batches of a first
and a second iteration, ``end_of_dataloader`` at each batch, the original loader's next iteration, and a
``save_state`` taken in the middle of the skipped iteration then loaded into a fresh run. Cases are drawn from a
seed (see differential_loop_cases.py for how cases work).
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile

import torch
from compat.differential_loop_cases import Stream, VaryingBatchSampler
from torch.utils.data import DataLoader, TensorDataset

KINDS = ("prepared", "prepared_batch_sampler", "prepared_iterable", "plain", "plain_batch_sampler", "plain_iterable")


def skip_cases(seed: int, count: int, nproc: int = 1) -> list[dict]:
    """Cases of every kind of input, with dispatching, split batches, shuffling and ``drop_last``; skips from 0 to
    12 batches (the scenario caps them at the loader's batches)."""
    rng = random.Random(seed)
    cases = []
    for _ in range(count):
        kind = rng.choice(KINDS)
        prepared = kind.startswith("prepared")
        split = prepared and nproc > 1 and kind != "prepared_batch_sampler" and rng.random() < 0.5
        size = rng.choice([1, 2, 3]) * (nproc if split else 1)
        shuffle = kind in ("prepared", "plain") and rng.random() < 0.4
        dispatch = [None, False, True] if kind == "prepared_iterable" else [None, True]
        if nproc > 1 and not split and kind != "prepared_iterable":
            dispatch = [None]  # a dispatched map-style loader skips global steps: an allowed difference
        n = rng.randint(size * nproc * 2, 24)
        dispatched = rng.choice(dispatch) if prepared else None
        if split and (dispatched or (dispatched is None and kind == "prepared_iterable")):
            n -= n % nproc  # a dispatched last batch padded from the epoch's first rows is an allowed difference
        cases.append(
            {
                "seed": rng.randrange(10_000),
                "kind": kind,
                "n": n,
                "batch_size": size,
                "dispatch": dispatched,
                "split_batches": split,
                "shuffle": shuffle,
                "drop_last": kind != "prepared_batch_sampler" and rng.random() < 0.2,
                "skip": rng.randint(0, 12),
                "set_epoch": prepared and rng.random() < 0.3,
                "save_at": rng.choice([None, 0, 1]) if prepared and not shuffle else None,
            }
        )
    return cases


def _raw_loader(case: dict) -> DataLoader:
    n, size = case["n"], case["batch_size"]
    if case["kind"].endswith("iterable"):
        return DataLoader(Stream(n=n), batch_size=size, drop_last=case["drop_last"])
    dataset = TensorDataset(torch.arange(n))
    if case["kind"].endswith("batch_sampler"):
        sizes = [size + (i % 2) for i in range(n // (size + 1))]
        return DataLoader(dataset, batch_sampler=VaryingBatchSampler(sizes, size))
    generator = torch.Generator().manual_seed(case["seed"]) if case["shuffle"] else None
    return DataLoader(
        dataset, batch_size=size, shuffle=case["shuffle"], drop_last=case["drop_last"], generator=generator
    )


def _setup(case: dict):
    from accelerate import Accelerator, DataLoaderConfiguration
    from accelerate.utils import set_seed

    config = DataLoaderConfiguration(dispatch_batches=case["dispatch"], split_batches=case["split_batches"])
    accelerator = Accelerator(dataloader_config=config)
    set_seed(case["seed"])
    loader = _raw_loader(case)
    if case["kind"].startswith("prepared"):
        loader = accelerator.prepare(loader)
    return accelerator, loader


def _ids(batch) -> list:
    value = batch[0] if isinstance(batch, (list, tuple)) else batch
    return value.tolist() if isinstance(value, torch.Tensor) else value


def _run(accelerator, loader, save_at=None, folder=None) -> list:
    out = []
    for index, batch in enumerate(loader):
        out.append((_ids(batch), accelerator.gradient_state.end_of_dataloader))
        if index == save_at:
            accelerator.save_state(folder)
    return out


def _attempt(function):
    try:
        return function()
    except Exception as error:  # noqa: BLE001 - the exception type is what is compared
        return ("raised", type(error).__name__)


def _types(skipped, loader) -> dict:
    from accelerate.data_loader import DataLoaderDispatcher, DataLoaderShard, SkipDataLoader

    return {
        "DataLoader": isinstance(skipped, DataLoader),
        "DataLoaderShard": isinstance(skipped, DataLoaderShard),
        "DataLoaderDispatcher": isinstance(skipped, DataLoaderDispatcher),
        "SkipDataLoader": isinstance(skipped, SkipDataLoader),
        "same_object": skipped is loader,
    }


def _attributes(skipped, loader, report: list) -> dict:
    """What code reads of the skipped loader; ``report`` adds the allowed differences' observables."""
    extra = {
        "name": lambda: type(skipped).__name__,
        "total_batch_size": lambda: skipped.total_batch_size,
        "device": lambda: str(getattr(skipped, "device", None)),
        "original_iteration": lambda: loader.iteration,
    }
    return {name: _attempt(extra[name]) for name in report} | {
        "len": _attempt(lambda: len(skipped)),
        "batch_size": skipped.batch_size,
        "drop_last": skipped.drop_last,
        "same_dataset": skipped.dataset is loader.dataset,
        "has_set_epoch": hasattr(skipped, "set_epoch"),
        "iteration": getattr(skipped, "iteration", None),
    }


def _folder(case: dict) -> str:
    side = os.environ.get("HASTEN_DIFFERENTIAL_SIDE", "side")
    port = os.environ.get("MASTER_PORT", os.getpid())
    return os.path.join(tempfile.gettempdir(), f"differential-skip-{side}-{port}-{case['seed']}")


def skip_view(case):
    """What ``accelerator.skip_first_batches(loader, case["skip"])`` returns and how it iterates, saves and resumes."""
    from accelerate.data_loader import DataLoaderDispatcher

    accelerator, loader = _setup(case)
    batches = len(list(loader))  # one full epoch first: the skipped loader starts in epoch 1
    # Accelerate fails on a dispatched loader left with one batch or none (as in test_differential_loop.py's
    # ALLOWED), and does not move on to the next epoch after an iteration with no batch (ALLOWED)
    least = 2 if isinstance(loader, DataLoaderDispatcher) else 1
    skip = case["skip"] if case.get("uncapped") else max(0, min(case["skip"], batches - least))
    report = case.get("report", [])
    skipped = accelerator.skip_first_batches(loader, skip)
    out = {"types": _types(skipped, loader), "before": _attributes(skipped, loader, report)}
    if case["set_epoch"]:
        skipped.set_epoch(1)
    save_at = case["save_at"]
    if save_at is not None and skip + save_at + 1 > batches - (least if least > 1 else 0):
        save_at = None  # no batch to save at, or the resumed dispatched loader would be left with one or none
    folder = _folder(case)
    out["first"] = _run(accelerator, skipped, save_at, folder)
    out["second"] = _run(accelerator, skipped)
    out["after"] = _attributes(skipped, loader, report)
    out["original"] = _run(accelerator, loader)
    if save_at is not None:
        resumed_accelerator, resumed = _setup(case)
        resumed_accelerator.load_state(folder)
        again = resumed_accelerator.skip_first_batches(resumed, skip + save_at + 1)
        out["resumed"] = _run(resumed_accelerator, again)
        resumed_accelerator.wait_for_everyone()
        if resumed_accelerator.is_main_process:
            shutil.rmtree(folder, ignore_errors=True)
    return out
