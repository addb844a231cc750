"""Differential scenarios of training loops, resumes and ``gather_for_metrics`` on 1 and 2 processes (run by
tests/compat/test_differential_loop.py; the data loader scenarios and the shared helpers are in
differential_loop_cases.py, whose docstring says how cases work).

Losses, weights, the ids of every batch and the global generators' next values are returned, so that the two sides
compare bit for bit.
"""

from __future__ import annotations

import random
import tempfile

import torch
from compat.differential_loop_cases import CustomSampler, Stream, make_model, probes
from torch.utils.data import DataLoader, RandomSampler, TensorDataset

# ------------------------------------------------------------------------------------------------- training loops


def training_cases(seed: int, count: int, nproc: int = 1) -> list[dict]:
    """Training loops: shuffling (plain, seedable, the user's generators), dropout, accumulation, split/even
    batches, iterable datasets (sharded or dispatched), several epochs, schedulers (stepped with the optimizer or
    not), bf16 autocast, gradient clipping by norm or by value."""
    rng = random.Random(seed)
    cases = []
    for _ in range(count):
        split = nproc > 1 and rng.random() < 0.3
        size = rng.choice([1, 2, 3, 4]) * (nproc if split else 1)
        dataset = rng.choice(["map", "map", "map", "iterable"])
        case = {
            "seed": rng.randrange(10_000),
            "n": rng.randint(4, 33),
            "batch_size": size,
            "dataset": dataset,
            "sampler": rng.choice(
                ["sequential", "shuffle", "shuffle", "shuffle", "sampler_generator", "loader_generator", "custom"]
            ),
            "shuffled_stream": dataset == "iterable" and rng.random() < 0.5,
            "dispatch": rng.choice([None, None, False, True])
            if dataset == "iterable"
            else rng.choice([None, None, None, True]),
            "dropout": rng.random() < 0.6,
            "accumulation": rng.choice([1, 1, 2, 3]),
            "split_batches": split,
            "even_batches": rng.random() < 0.8,
            "seedable": rng.random() < 0.3,
            "data_seed": rng.choice([None, None, 7]),
            "epochs": rng.randint(1, 3),
            "drop_last": rng.random() < 0.15,
            "optimizer": rng.choice(["sgd", "adam"]),
            "scheduler": rng.choice([None, "linear"]),
            "seed_before_accelerator": rng.random() < 0.3,
            "device_specific": rng.random() < 0.1,
            "num_workers": 1 if rng.random() < 0.04 else 0,
            "mixed_precision": rng.choice(["no", "no", "bf16"]),
            "clip": rng.choice([None, None, "norm", "value"]),  # "norm_every_step": ALLOWED only
            "step_scheduler_with_optimizer": rng.random() < 0.7,
        }
        if nproc > 1 and not case["even_batches"]:
            _make_rounds_even(case, nproc)
        if nproc > 1 and case["seedable"] and case["data_seed"] is None:  # hasten shares rank 0's seed (ALLOWED)
            case["device_specific"] = False
        cases.append(case)
    return cases


def _make_rounds_even(case: dict, nproc: int) -> None:
    """With ``even_batches=False`` the processes must run the same number of steps (Accelerate has no Join on CPU):
    choose a dataset size whose last round gives every process a (possibly short) batch."""
    size = case["batch_size"]
    case["dataset"], case["drop_last"] = "map", False
    if case["split_batches"]:
        piece = size // nproc
        case["n"] = size * random.Random(case["seed"]).randint(1, 4) + (piece * (nproc - 1) + 1 if piece else 0)
    else:
        batches = nproc * random.Random(case["seed"]).randint(1, 4)
        case["n"] = size * (batches - 1) + random.Random(case["seed"] + 1).randint(1, size)


def _make_loader(case: dict, ids, x, y) -> DataLoader:
    common = {"batch_size": case["batch_size"], "drop_last": case["drop_last"], "num_workers": case["num_workers"]}
    if case["dataset"] == "iterable":
        stream = Stream(torch.stack([ids.double(), x[:, 0]], 1).float(), y, shuffled=case["shuffled_stream"])
        return DataLoader(stream, **common)
    data = TensorDataset(ids, x, y)
    kind = case["sampler"]
    if kind == "sampler_generator":
        return DataLoader(
            data, sampler=RandomSampler(data, generator=torch.Generator().manual_seed(case["seed"] + 1)), **common
        )
    if kind == "loader_generator":
        return DataLoader(data, shuffle=True, generator=torch.Generator().manual_seed(case["seed"] + 2), **common)
    if kind == "custom":
        return DataLoader(data, sampler=CustomSampler(len(data)), **common)
    return DataLoader(data, shuffle=kind == "shuffle", **common)


def _accelerator(case: dict):
    from accelerate import Accelerator, DataLoaderConfiguration

    config = DataLoaderConfiguration(
        split_batches=case["split_batches"],
        even_batches=case["even_batches"],
        dispatch_batches=case["dispatch"],
        use_seedable_sampler=case["seedable"],
        data_seed=case["data_seed"],
    )
    return Accelerator(
        gradient_accumulation_steps=case["accumulation"],
        dataloader_config=config,
        mixed_precision=case.get("mixed_precision", "no"),
        step_scheduler_with_optimizer=case.get("step_scheduler_with_optimizer", True),
    )


def training_loop(case):
    """Train a small model on a prepared loader: every loss, the ids of every batch, final weights, learning rates,
    the gradient norms ``clip_grad_norm_`` returned and the state of the global generators afterwards."""
    from accelerate.utils import set_seed

    if case["seed_before_accelerator"]:
        set_seed(case["seed"], device_specific=case["device_specific"])
        accelerator = _accelerator(case)
    else:
        accelerator = _accelerator(case)
        set_seed(case["seed"], device_specific=case["device_specific"])
    data = torch.Generator().manual_seed(case["seed"])
    ids, x = torch.arange(case["n"]), torch.randn(case["n"], 3, generator=data)
    y = x.sum(1, keepdim=True) + 0.1 * torch.randn(case["n"], 1, generator=data)
    inputs = 2 if case["dataset"] == "iterable" else 3
    model = make_model(case["dropout"], inputs)
    optimizer = (
        torch.optim.SGD(model.parameters(), lr=0.05)
        if case["optimizer"] == "sgd"
        else torch.optim.Adam(model.parameters(), lr=0.01)
    )
    loader = _make_loader(case, ids, x, y)
    objects = [model, optimizer, loader]
    if case["scheduler"]:
        objects.append(torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step)))
    prepared = accelerator.prepare(*objects)
    model, optimizer, loader = prepared[:3]
    scheduler = prepared[3] if case["scheduler"] else None
    losses, seen, rates, norms = [], [], [], []
    for _ in range(case["epochs"]):
        for batch in loader:
            if case["dataset"] == "iterable":
                features, target = batch
                batch_ids, features = features[:, 0].long(), features[:, 1:]
                features = torch.cat([features, features], 1)
            else:
                batch_ids, features, target = batch
            with accelerator.accumulate(model):
                loss = torch.nn.functional.mse_loss(model(features), target)
                accelerator.backward(loss)
                if case.get("clip") == "norm" and accelerator.sync_gradients or case.get("clip") == "norm_every_step":
                    norms.append(accelerator.clip_grad_norm_(model.parameters(), 0.5))
                elif case.get("clip") == "value":
                    accelerator.clip_grad_value_(model.parameters(), 0.05)
                optimizer.step()
                if scheduler is not None:
                    scheduler.step()
                optimizer.zero_grad()
            losses.append(loss.detach())
            seen.append(batch_ids.tolist())
            rates.append(optimizer.param_groups[0]["lr"])
    weights = {name: tensor.detach().clone() for name, tensor in accelerator.unwrap_model(model).state_dict().items()}
    return {
        "losses": torch.stack(losses) if losses else None,
        "ids": seen,
        "lr": rates,
        "weights": weights,
        "norms": norms,
        "probes": probes(),
        "lengths": (
            len(loader),
            loader.total_batch_size if case["dataset"] == "map" and not case["dispatch"] else None,
        ),
    }


# --------------------------------------------------------------------------------------- save_state / load_state


def resume_cases(seed: int, count: int, nproc: int = 1) -> list[dict]:
    """Resume in the middle of the first epoch where both libraries promise the uninterrupted run's data: without
    shuffling, with the seedable sampler (one epoch), or (several processes) with the shared sampler generator."""
    rng = random.Random(seed)
    cases = []
    for _ in range(count):
        split = nproc > 1 and rng.random() < 0.3
        size = rng.choice([1, 2, 3]) * (nproc if split else 1)
        n = rng.randint(3 * size * nproc, 8 * size * nproc)
        kinds = ["sequential", "seedable"] + (["shuffle", "shuffle"] if nproc > 1 else [])
        kind = rng.choice(kinds)
        cases.append(
            {
                "seed": rng.randrange(10_000),
                "n": n,
                "batch_size": size,
                "split_batches": split,
                "kind": kind,
                "epochs": 1 if kind == "seedable" else rng.randint(1, 2),
                "save_after": rng.randint(1, 2),
                "accumulation": rng.choice([1, 2]),
                "optimizer": rng.choice(["sgd", "adam"]),
                "scheduler": rng.random() < 0.5,
                "dropout": False,
            }
        )
    return cases


def _resume_parts(case: dict):
    from accelerate import Accelerator, DataLoaderConfiguration
    from accelerate.utils import set_seed

    config = DataLoaderConfiguration(
        split_batches=case["split_batches"], use_seedable_sampler=case["kind"] == "seedable"
    )
    accelerator = Accelerator(gradient_accumulation_steps=case["accumulation"], dataloader_config=config)
    set_seed(case["seed"])
    data = torch.Generator().manual_seed(case["seed"])
    x = torch.randn(case["n"], 3, generator=data)
    dataset = TensorDataset(torch.arange(case["n"]), x, x.sum(1, keepdim=True))
    model = make_model(case["dropout"], 3)
    optimizer = (
        torch.optim.SGD(model.parameters(), lr=0.05)
        if case["optimizer"] == "sgd"
        else torch.optim.Adam(model.parameters(), lr=0.01)
    )
    loader = DataLoader(dataset, batch_size=case["batch_size"], shuffle=case["kind"] != "sequential")
    objects = [model, optimizer, loader]
    if case["scheduler"]:
        objects.append(torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5))
    return accelerator, accelerator.prepare(*objects)


def _train(accelerator, parts, batches, record):
    model, optimizer = parts[0], parts[1]
    scheduler = parts[3] if len(parts) > 3 else None
    for batch_ids, features, target in batches:
        with accelerator.accumulate(model):
            loss = torch.nn.functional.mse_loss(model(features), target)
            accelerator.backward(loss)
            optimizer.step()
            if scheduler is not None:
                scheduler.step()
            optimizer.zero_grad()
        record.append((batch_ids.tolist(), loss.detach()))


def _checkpoint_folder(case: dict) -> str:
    import os

    side = os.environ.get("HASTEN_DIFFERENTIAL_SIDE", "side")
    return os.path.join(
        tempfile.gettempdir(), f"differential-resume-{side}-{os.environ.get('MASTER_PORT', os.getpid())}-{case['seed']}"
    )


def resume(case):
    """An uninterrupted run that saves a checkpoint after ``save_after`` batches, then a fresh run that loads it and
    skips those batches: every batch and loss of both, and both runs' final weights."""
    import shutil

    folder = _checkpoint_folder(case)
    accelerator, parts = _resume_parts(case)
    first, loader = [], parts[2]
    for epoch in range(case["epochs"]):
        for step, batch in enumerate(loader):
            _train(accelerator, parts, [batch], first)
            if epoch == 0 and step + 1 == case["save_after"]:
                accelerator.save_state(folder)
    uninterrupted = {k: v.detach().clone() for k, v in accelerator.unwrap_model(parts[0]).state_dict().items()}
    accelerator, parts = _resume_parts(case)
    accelerator.load_state(folder)
    resumed, loader = [], parts[2]
    for epoch in range(case["epochs"]):
        active = accelerator.skip_first_batches(loader, case["save_after"]) if epoch == 0 else loader
        _train(accelerator, parts, active, resumed)
    weights = {k: v.detach().clone() for k, v in accelerator.unwrap_model(parts[0]).state_dict().items()}
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        shutil.rmtree(folder, ignore_errors=True)
    return {"first": first, "resumed": resumed, "uninterrupted": uninterrupted, "weights": weights}


# ------------------------------------------------------------------------------------------------ gather_for_metrics


def gather_cases(seed: int, count: int, nproc: int = 1) -> list[dict]:
    """Evaluation loops whose outputs have the loader's rows, or other rows (a loss repeated to the batch size,
    a scalar), nested structures and objects; inside the loop or once after it."""
    rng = random.Random(seed)
    cases = []
    for _ in range(count):
        split = nproc > 1 and rng.random() < 0.3
        size = rng.choice([1, 2, 3, 4]) * (nproc if split else 1)
        dataset = rng.choice(["map", "map", "iterable"])
        case = {
            "seed": rng.randrange(10_000),
            "n": rng.randint(1, 30),
            "batch_size": size,
            "split_batches": split,
            "even_batches": rng.random() < 0.8,
            "dataset": dataset,
            "drop_last": rng.random() < 0.15,
            "dispatch": rng.choice([None, False, True]) if dataset == "iterable" else rng.choice([None, None, True]),
            "output": rng.choice(
                ["batch", "batch", "repeat", "scalar", "dict", "objects", "gather_object", "gather_object_tensor"]
            ),
            "after_loop": rng.random() < 0.25,
        }
        if nproc > 1 and not case["even_batches"]:  # unequal last batches: Accelerate's gather fails (not comparable)
            case["n"] = size * (1 if split else nproc) * rng.randint(1, 4)
        if case["drop_last"]:  # at least one batch (an empty dispatched loader is an allowed difference)
            case["n"] = max(case["n"], size * (1 if split else nproc))
        cases.append(case)
    return cases


def _output(case: dict, ids: torch.Tensor, rows: int):
    kind = case["output"]
    if kind == "repeat":  # the Trainer repeats the evaluation loss to the batch size
        return torch.full((rows,), float(ids.sum()))
    if kind == "scalar":
        return ids.double().mean()
    if kind == "dict":
        return {"ids": ids, "double": (2 * ids).float()}
    if kind == "gather_object_tensor":  # the Trainer's eval_use_gather_object: tensors through the object gather
        return torch.full((rows,), float(ids.sum()))
    if kind in ("objects", "gather_object"):
        return [f"s{int(i)}" for i in ids]
    return ids


def gather_metrics(case):
    """What ``gather_for_metrics`` returns for each batch (or once after the loop), with the gradient state's
    ``remainder`` and ``end_of_dataloader`` at each batch."""
    from accelerate import Accelerator, DataLoaderConfiguration

    config = DataLoaderConfiguration(
        split_batches=case["split_batches"], even_batches=case["even_batches"], dispatch_batches=case["dispatch"]
    )
    accelerator = Accelerator(dataloader_config=config)
    ids = torch.arange(case["n"])
    data = Stream(n=case["n"]) if case["dataset"] == "iterable" else ids
    loader = accelerator.prepare(DataLoader(data, batch_size=case["batch_size"], drop_last=case["drop_last"]))
    rows = case["batch_size"] // accelerator.num_processes if case["split_batches"] else case["batch_size"]
    use_object = case["output"] in ("gather_object", "gather_object_tensor")
    results, states, collected = [], [], []
    for batch in loader:
        output = _output(case, batch, rows)
        states.append((accelerator.gradient_state.remainder, accelerator.gradient_state.end_of_dataloader))
        if case["after_loop"]:
            collected.append(output)
        else:
            results.append(accelerator.gather_for_metrics(output, use_gather_object=use_object))
    if case["after_loop"] and collected:
        if isinstance(collected[0], torch.Tensor) and collected[0].ndim:
            collected = torch.cat(collected)
        results.append(accelerator.gather_for_metrics(collected, use_gather_object=use_object))
    return results, states
