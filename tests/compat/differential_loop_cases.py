"""Differential scenarios of the training loop and the data loaders (tests/compat/test_differential_loop.py runs them).

Each scenario is a function of one JSON case that imports ``accelerate`` (the reference copy of Accelerate 1.15 or
hasten through the alias, see tests/differential.py) and returns plain values, so that the two sides can be
compared exactly: losses and weights bitwise, batches index for index. Each ``*_cases(seed, count)`` generator
draws its cases from a seed, so a failing case is reproduced from its JSON alone.

Nothing here may draw from the global random generators except what the scenario is about: data and
configurations come from generators seeded by the case.
"""

from __future__ import annotations

import random
import tempfile

import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler, SequentialSampler, TensorDataset


# ------------------------------------------------------------------------------------------- samplers and datasets


class VaryingBatchSampler:
    """A batch sampler whose batches have the given sizes (consecutive indices); ``batch_size`` as declared."""

    def __init__(self, sizes, batch_size, drop_last=False):
        self.sizes, self.batch_size, self.drop_last = sizes, batch_size, drop_last

    def __iter__(self):
        start = 0
        for size in self.sizes:
            yield list(range(start, start + size))
            start += size

    def __len__(self):
        return len(self.sizes)


class Stream(IterableDataset):
    """An iterable dataset of ``(x, y)`` rows (or plain indices), optionally shuffled with its own ``generator``."""

    def __init__(self, x=None, y=None, n=None, shuffled=False, sized=True):
        self.x, self.y = x, y
        self.n = len(x) if x is not None else n
        self.sized = sized
        self.generator = torch.Generator().manual_seed(0) if shuffled else None

    def __iter__(self):
        order = torch.randperm(self.n, generator=self.generator).tolist() if self.generator is not None else range(self.n)
        for i in order:
            yield (self.x[i], self.y[i]) if self.x is not None else i

    def __len__(self):
        if not self.sized:
            raise TypeError("this stream has no length")
        return self.n


# ----------------------------------------------------------------------------------------------- BatchSamplerShard


def batch_sampler_shard_cases(seed: int, count: int) -> list[dict]:
    rng = random.Random(seed)
    return [{"seed": rng.randrange(2**31)} for _ in range(count)]


def batch_sampler_shard(case):
    """Every process's batches and length, for a batch sampler (fixed or varying sizes) on 2, 3 or 4 processes."""
    from accelerate.data_loader import BatchSamplerShard

    rng = random.Random(case["seed"])
    world = rng.choice([2, 3, 4])
    split, even, drop_last = rng.random() < 0.3, rng.random() < 0.5, rng.random() < 0.25
    if rng.random() < 0.4:
        size = rng.choice([1, 2, 3, 4, 6, 8]) * (world if split else 1)
        sampler = BatchSampler(SequentialSampler(range(rng.randint(0, 40))), size, drop_last)
    else:
        full = rng.choice([2, 3, 4, 8])
        sizes = [rng.choice([full, full, rng.randint(1, full)]) for _ in range(rng.randint(0, 12))]
        declared = full * world if split else rng.choice([full, None, full * world])
        sampler = VaryingBatchSampler(sizes, declared, drop_last)
    out = []
    for rank in range(world):
        try:
            shard = BatchSamplerShard(sampler, world, rank, split_batches=split, even_batches=even)
        except Exception as error:  # noqa: BLE001 - the exception type is compared
            out.append(("init", type(error).__name__))
            continue
        out.append((len(shard), [list(b) for b in shard], shard.total_length))
    return out


def iterable_dataset_shard(case):
    """Every process's samples and length, for an iterable dataset of 0 to 30 samples on 1 to 4 processes."""
    from accelerate.data_loader import IterableDatasetShard

    rng = random.Random(case["seed"])
    world = rng.choice([1, 2, 3, 4])
    split = rng.random() < 0.3
    size = rng.choice([1, 2, 3, 4]) * (world if split else 1)
    data, drop_last = Stream(n=rng.randint(0, 30)), rng.random() < 0.3
    out = []
    for rank in range(world):
        shard = IterableDatasetShard(data, size, drop_last, world, rank, split)
        out.append((len(shard), list(shard)))
    return out


def skip_batch_sampler(case):
    """``SkipBatchSampler`` and ``skip_first_batches`` on a plain (unprepared) loader."""
    from accelerate.data_loader import SkipBatchSampler, skip_first_batches

    rng = random.Random(case["seed"])
    base = BatchSampler(SequentialSampler(range(rng.randint(0, 30))), rng.randint(1, 5), rng.random() < 0.3)
    skip = rng.randint(0, 8)
    sampler = SkipBatchSampler(base, skip)
    loader = skip_first_batches(DataLoader(list(range(40)), batch_sampler=base), skip)
    return len(sampler), list(sampler), sampler.total_length, [b.tolist() for b in loader]


# ------------------------------------------------------------------------------------------------- training loops


def training_cases(seed: int, count: int, nproc: int = 1) -> list[dict]:
    """Training loops: shuffling (plain, seedable, the user's generators), dropout, accumulation, split/even
    batches, iterable datasets (sharded or dispatched), several epochs, schedulers."""
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
            "sampler": rng.choice(["sequential", "shuffle", "shuffle", "shuffle", "sampler_generator", "loader_generator", "custom"]),
            "shuffled_stream": dataset == "iterable" and rng.random() < 0.5,
            "dispatch": rng.choice([None, None, False, True]) if dataset == "iterable" else rng.choice([None, None, None, True]),
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
        }
        if nproc > 1 and not case["even_batches"]:
            _make_rounds_even(case, nproc)
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


class _CustomSampler(torch.utils.data.Sampler):
    """A user's sampler with a ``generator`` attribute it shuffles with (Accelerate seeds and synchronises it)."""

    def __init__(self, n):
        self.n, self.generator = n, None

    def __iter__(self):
        yield from torch.randperm(self.n, generator=self.generator).tolist()

    def __len__(self):
        return self.n


def _make_loader(case: dict, ids, x, y) -> DataLoader:
    common = {"batch_size": case["batch_size"], "drop_last": case["drop_last"], "num_workers": case["num_workers"]}
    if case["dataset"] == "iterable":
        stream = Stream(torch.stack([ids.double(), x[:, 0]], 1).float(), y, shuffled=case["shuffled_stream"])
        return DataLoader(stream, **common)
    data = TensorDataset(ids, x, y)
    kind = case["sampler"]
    if kind == "sampler_generator":
        return DataLoader(data, sampler=RandomSampler(data, generator=torch.Generator().manual_seed(case["seed"] + 1)), **common)
    if kind == "loader_generator":
        return DataLoader(data, shuffle=True, generator=torch.Generator().manual_seed(case["seed"] + 2), **common)
    if kind == "custom":
        return DataLoader(data, sampler=_CustomSampler(len(data)), **common)
    return DataLoader(data, shuffle=kind == "shuffle", **common)


def _model(dropout: bool, inputs: int):
    layers = [torch.nn.Linear(inputs, 8), torch.nn.ReLU()]
    if dropout:
        layers.append(torch.nn.Dropout(0.3))
    return torch.nn.Sequential(*layers, torch.nn.Linear(8, 1))


def _accelerator(case: dict):
    from accelerate import Accelerator, DataLoaderConfiguration

    config = DataLoaderConfiguration(
        split_batches=case["split_batches"], even_batches=case["even_batches"], dispatch_batches=case["dispatch"],
        use_seedable_sampler=case["seedable"], data_seed=case["data_seed"],
    )
    return Accelerator(gradient_accumulation_steps=case["accumulation"], dataloader_config=config)


def _probes():
    """What the global generators give next: where each stream stands after the run."""
    import numpy as np

    return torch.rand(2), np.random.rand(2).tolist(), random.random()


def training_loop(case):
    """Train a small model on a prepared loader: every loss, the ids of every batch, final weights, learning rates
    and the state of the global generators afterwards."""
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
    model = _model(case["dropout"], inputs)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05) if case["optimizer"] == "sgd" else torch.optim.Adam(model.parameters(), lr=0.01)
    loader = _make_loader(case, ids, x, y)
    objects = [model, optimizer, loader]
    if case["scheduler"]:
        objects.append(torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step)))
    prepared = accelerator.prepare(*objects)
    model, optimizer, loader = prepared[:3]
    scheduler = prepared[3] if case["scheduler"] else None
    losses, seen, rates = [], [], []
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
                optimizer.step()
                if scheduler is not None:
                    scheduler.step()
                optimizer.zero_grad()
            losses.append(loss.detach())
            seen.append(batch_ids.tolist())
            rates.append(optimizer.param_groups[0]["lr"])
    weights = {name: tensor.detach().clone() for name, tensor in accelerator.unwrap_model(model).state_dict().items()}
    return {"losses": torch.stack(losses) if losses else None, "ids": seen, "lr": rates, "weights": weights, "probes": _probes(),
            "lengths": (len(loader), loader.total_batch_size if case["dataset"] == "map" and not case["dispatch"] else None)}


# ------------------------------------------------------------------------------ prepare_data_loader, ranks simulated


def prepare_cases(seed: int, count: int) -> list[dict]:
    """``prepare_data_loader`` called for every rank of 1 to 4 processes in one process (the draws of each call
    happen in turn), two epochs each."""
    rng = random.Random(seed)
    cases = []
    for _ in range(count):
        world = rng.choice([1, 2, 3, 4])
        split = rng.random() < 0.25
        cases.append({
            "seed": rng.randrange(10_000), "world": world, "n": rng.randint(0, 30), "split_batches": split,
            "batch_size": rng.choice([1, 2, 3, 4]) * (world if split else 1), "even_batches": rng.random() < 0.6,
            "sampler": rng.choice(["sequential", "shuffle", "shuffle", "sampler_generator", "loader_generator", "custom", "batch_sampler"]),
            "seedable": rng.random() < 0.3, "data_seed": rng.choice([None, 3]), "drop_last": rng.random() < 0.2,
            "rng_types": rng.choice([None, ["generator"], [], ["torch", "generator"]]),
        })
    return cases


def prepare_loader(case):
    """Batches of two epochs on each simulated rank, what ``rng_types`` became, and where the global generator stands."""
    from accelerate import Accelerator
    from accelerate.data_loader import get_sampler, prepare_data_loader
    from accelerate.utils import set_seed

    Accelerator(cpu=True)  # Accelerate's loaders synchronise generators through AcceleratorState, also on one process
    set_seed(case["seed"])
    data = list(range(case["n"]))
    out = []
    for rank in range(case["world"]):
        kind = case["sampler"]
        common = {"batch_size": case["batch_size"], "drop_last": case["drop_last"]}
        if kind == "sampler_generator":
            loader = DataLoader(data, sampler=RandomSampler(data, generator=torch.Generator().manual_seed(1)), **common)
        elif kind == "loader_generator":
            loader = DataLoader(data, shuffle=True, generator=torch.Generator().manual_seed(2), **common)
        elif kind == "custom":
            loader = DataLoader(data, sampler=_CustomSampler(len(data)), **common)
        elif kind == "batch_sampler":
            loader = DataLoader(data, batch_sampler=BatchSampler(RandomSampler(data), case["batch_size"], case["drop_last"]))
        else:
            loader = DataLoader(data, shuffle=kind == "shuffle", **common)
        rng_types = list(case["rng_types"]) if case["rng_types"] is not None else None
        try:
            prepared = prepare_data_loader(
                loader, num_processes=case["world"], process_index=rank, split_batches=case["split_batches"], rng_types=rng_types,
                even_batches=case["even_batches"], use_seedable_sampler=case["seedable"], data_seed=case["data_seed"],
            )
        except Exception as error:  # noqa: BLE001 - the exception type is compared
            out.append(type(error).__name__)
            continue
        epochs = [[b.tolist() for b in prepared] for _ in range(2)]
        out.append({"epochs": epochs, "rng_types": rng_types, "len": len(prepared), "sampler": type(get_sampler(prepared)).__name__ if case["world"] == 1 else None})
    return out, _probes()


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
        cases.append({
            "seed": rng.randrange(10_000), "n": n, "batch_size": size, "split_batches": split, "kind": kind,
            "epochs": 1 if kind == "seedable" else rng.randint(1, 2), "save_after": rng.randint(1, 2),
            "accumulation": rng.choice([1, 2]), "optimizer": rng.choice(["sgd", "adam"]), "scheduler": rng.random() < 0.5,
        })
    return cases


def _resume_parts(case: dict):
    from accelerate import Accelerator, DataLoaderConfiguration
    from accelerate.utils import set_seed

    config = DataLoaderConfiguration(split_batches=case["split_batches"], use_seedable_sampler=case["kind"] == "seedable")
    accelerator = Accelerator(gradient_accumulation_steps=case["accumulation"], dataloader_config=config)
    set_seed(case["seed"])
    data = torch.Generator().manual_seed(case["seed"])
    x = torch.randn(case["n"], 3, generator=data)
    dataset = TensorDataset(torch.arange(case["n"]), x, x.sum(1, keepdim=True))
    model = _model(False, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05) if case["optimizer"] == "sgd" else torch.optim.Adam(model.parameters(), lr=0.01)
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
    return os.path.join(tempfile.gettempdir(), f"differential-resume-{side}-{os.environ.get('MASTER_PORT', os.getpid())}-{case['seed']}")


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
            "seed": rng.randrange(10_000), "n": rng.randint(1, 30), "batch_size": size, "split_batches": split,
            "even_batches": rng.random() < 0.8, "dataset": dataset, "drop_last": rng.random() < 0.15,
            "dispatch": rng.choice([None, False, True]) if dataset == "iterable" else rng.choice([None, None, True]),
            "output": rng.choice(["batch", "batch", "repeat", "scalar", "dict", "objects", "gather_object"]),
            "after_loop": rng.random() < 0.25,
        }
        if nproc > 1 and not case["even_batches"]:  # unequal last batches: Accelerate's gather fails (not comparable)
            case["n"] = size * (1 if split else nproc) * rng.randint(1, 4)
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
    if kind in ("objects", "gather_object"):
        return [f"s{int(i)}" for i in ids]
    return ids


def gather_metrics(case):
    """What ``gather_for_metrics`` returns for each batch (or once after the loop), with the gradient state's
    ``remainder`` and ``end_of_dataloader`` at each batch."""
    from accelerate import Accelerator, DataLoaderConfiguration

    config = DataLoaderConfiguration(split_batches=case["split_batches"], even_batches=case["even_batches"], dispatch_batches=case["dispatch"])
    accelerator = Accelerator(dataloader_config=config)
    ids = torch.arange(case["n"])
    data = Stream(n=case["n"]) if case["dataset"] == "iterable" else ids
    loader = accelerator.prepare(DataLoader(data, batch_size=case["batch_size"], drop_last=case["drop_last"]))
    rows = case["batch_size"] // accelerator.num_processes if case["split_batches"] else case["batch_size"]
    use_object = case["output"] == "gather_object"
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


# ----------------------------------------------------------------------------------- GradientState and its plugin


def gradient_state_cases(seed: int, count: int) -> list[dict]:
    """Accumulation settings given as a plugin (any subset of its fields, defaults included) or as a step count."""
    rng = random.Random(seed)
    cases = []
    for _ in range(count):
        fields = {}
        for name, choices in (("num_steps", [None, 1, 2, 3]), ("adjust_scheduler", [True, False]), ("sync_with_dataloader", [True, False]), ("sync_each_batch", [True, False])):
            if rng.random() < 0.5:
                fields[name] = rng.choice(choices)
        cases.append({"plugin": fields if rng.random() < 0.7 else None, "steps": rng.choice([1, 1, 2, 3]), "n": rng.randint(3, 9), "epochs": rng.randint(1, 2)})
    return cases


def gradient_state(case):
    """The plugin's and the gradient state's view of the settings, and what a loop with accumulation does with them:
    ``sync_gradients`` at each step, the scheduler's step count and learning rate."""
    from accelerate import Accelerator
    from accelerate.utils import GradientAccumulationPlugin

    plugin = GradientAccumulationPlugin(**case["plugin"]) if case["plugin"] is not None else None
    accelerator = Accelerator(gradient_accumulation_steps=case["steps"], gradient_accumulation_plugin=plugin)
    state = accelerator.gradient_state
    seen = {"plugin_kwargs": dict(state.plugin_kwargs), "num_steps": state.num_steps, "adjust_scheduler": state.adjust_scheduler,
            "sync_with_dataloader": state.sync_with_dataloader, "steps": accelerator.gradient_accumulation_steps,
            "outside": (state.sync_gradients, state.end_of_dataloader, state.remainder, state.in_dataloader), "repr": repr(state)}
    if plugin is not None:
        seen["to_kwargs"] = plugin.to_kwargs()
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, DataLoader(torch.randn(case["n"], 2), batch_size=2), scheduler)
    steps = []
    for _ in range(case["epochs"]):
        for batch in loader:
            with accelerator.accumulate(model):
                accelerator.backward(model(batch).sum())
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
                steps.append((state.sync_gradients, state.end_of_dataloader, state.remainder, scheduler.scheduler._step_count, scheduler.get_last_lr()))
    seen["loop"] = steps
    seen["weight"] = model.weight.detach().clone()
    return seen


# ------------------------------------------------------------------------------------------------------------ enums


ENUMS = ("DistributedType", "PrecisionType", "RNGType", "LoggerType", "DynamoBackend", "ComputeEnvironment", "SageMakerDistributedType",
         "DDPCommunicationHookType", "CustomDtype", "FP8BackendType")


# hasten's own members, left out of the comparison (tests/compat/test_differential_loop.py's ALLOWED says why)
HASTEN_EXTRA_MEMBERS = {"JSONL": "jsonl"}


def enum_cases(seed: int, count: int) -> list[dict]:
    """One case per enumeration and probe (the reference names the members; both sides take the same positions)."""
    rng = random.Random(seed)
    return [{"enum": rng.choice(ENUMS), "member": rng.randrange(20)} for _ in range(count)]


def enum_member(case):
    """``str``, ``repr``, ``format``, value, name, equality with its value and name, ``in``, ``list()``, JSON."""
    import json

    import accelerate.utils.dataclasses as utils

    cls = getattr(utils, case["enum"])
    members = [m for m in cls if m.name not in HASTEN_EXTRA_MEMBERS]
    member = members[case["member"] % len(members)]

    def attempt(function):
        try:
            return function()
        except Exception as error:  # noqa: BLE001 - the exception type is compared
            return ("raised", type(error).__name__)

    return {
        "str": str(member), "repr": repr(member), "format": f"{member}", "format_spec": attempt(lambda: format(member, ">12")),
        "value": member.value, "name": member.name, "is_str": isinstance(member, str), "eq_value": member == member.value,
        "eq_name": member == member.name, "value_in": attempt(lambda: member.value in cls), "member_in": attempt(lambda: member in cls),
        "lookup": attempt(lambda: cls(member.value) is member), "json": attempt(lambda: json.dumps(member)),
        "list": attempt(lambda: [value for value in cls.list() if value not in HASTEN_EXTRA_MEMBERS.values()]),
        "members": [m.name for m in members], "hash_eq": attempt(lambda: {member.value: 1}.get(member)),
    }
