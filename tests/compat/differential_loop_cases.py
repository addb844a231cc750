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
