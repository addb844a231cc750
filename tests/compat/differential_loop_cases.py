"""Differential scenarios of the data loaders, the gradient state and the enums, and the helpers the training
scenarios share (differential_training_cases.py); tests/compat/test_differential_loop.py runs them.

Each scenario is a function of one JSON case that imports ``accelerate`` (the reference copy of Accelerate 1.15 or
hasten through the alias, see tests/differential.py) and returns plain values, so that the two sides can be
compared exactly: losses and weights bitwise, batches index for index. Each ``*_cases(seed, count)`` generator
draws its cases from a seed, so a failing case is reproduced from its JSON alone.

Nothing here may draw from the global random generators except what the scenario is about: data and
configurations come from generators seeded by the case.
"""

from __future__ import annotations

import random

import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler, SequentialSampler
from torch.utils.data.distributed import DistributedSampler

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
        order = (
            torch.randperm(self.n, generator=self.generator).tolist() if self.generator is not None else range(self.n)
        )
        for i in order:
            yield (self.x[i], self.y[i]) if self.x is not None else i

    def __len__(self):
        if not self.sized:
            raise TypeError("this stream has no length")
        return self.n


class CustomSampler(torch.utils.data.Sampler):
    """A user's sampler with a ``generator`` attribute it shuffles with (Accelerate seeds and synchronises it)."""

    def __init__(self, n):
        self.n, self.generator = n, None

    def __iter__(self):
        yield from torch.randperm(self.n, generator=self.generator).tolist()

    def __len__(self):
        return self.n


def make_model(dropout: bool, inputs: int):
    layers = [torch.nn.Linear(inputs, 8), torch.nn.ReLU()]
    if dropout:
        layers.append(torch.nn.Dropout(0.3))
    return torch.nn.Sequential(*layers, torch.nn.Linear(8, 1))


def probes():
    """What the global generators give next: where each stream stands after the run."""
    import numpy as np

    return torch.rand(2), np.random.rand(2).tolist(), random.random()


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
    """Every process's samples and length, for an iterable dataset of 0 to 30 samples on 1 to 4 processes (a key of
    ``case`` other than the seed fixes that setting)."""
    from accelerate.data_loader import IterableDatasetShard

    rng = random.Random(case["seed"])
    world = case.get("world", rng.choice([1, 2, 3, 4]))
    split = case.get("split", rng.random() < 0.3)
    size = case.get("batch_size", rng.choice([1, 2, 3, 4]) * (world if split else 1))
    data, drop_last = Stream(n=case.get("n", rng.randint(0, 30))), rng.random() < 0.3
    out = []
    for rank in range(world):
        shard = IterableDatasetShard(data, size, drop_last, world, rank, split)
        out.append((len(shard), list(shard)))
    return out


def skip_batch_sampler(case):
    """``SkipBatchSampler`` and ``skip_first_batches`` on a plain (unprepared) loader, skipping at most every batch
    (``case["skip"]`` fixes the number skipped)."""
    from accelerate.data_loader import SkipBatchSampler, skip_first_batches

    rng = random.Random(case["seed"])
    base = BatchSampler(SequentialSampler(range(rng.randint(0, 30))), rng.randint(1, 5), rng.random() < 0.3)
    skip = case.get("skip", rng.randint(0, len(base)))
    sampler = SkipBatchSampler(base, skip)
    loader = skip_first_batches(DataLoader(list(range(40)), batch_sampler=base), skip)
    return len(sampler), list(sampler), sampler.total_length, [b.tolist() for b in loader]


def one_process_cases(seed: int, count: int) -> list[dict]:
    """Cases of the scenarios that run on one process, mixed, for :func:`mixed` (one subprocess for all of them):
    shares of 30 % batch samplers, 15 % iterable shards, 10 % skipping, 20 % ``prepare_data_loader``,
    15 % enums, 10 % the gradient state."""
    rng = random.Random(seed)
    shares = [
        ("batch_sampler_shard", batch_sampler_shard_cases, 30),
        ("iterable_dataset_shard", batch_sampler_shard_cases, 15),
        ("skip_batch_sampler", batch_sampler_shard_cases, 10),
        ("prepare_loader", prepare_cases, 20),
        ("enum_member", enum_cases, 15),
        ("gradient_state", gradient_state_cases, 10),
    ]
    cases = []
    for name, generate, share in shares:
        cases += [
            {"scenario": name, "case": case} for case in generate(rng.randrange(2**31), max(1, count * share // 100))
        ]
    return cases


def mixed(case):
    """Run ``case["case"]`` with the scenario named ``case["scenario"]``, of this module or of
    differential_training_cases.py (so one subprocess serves many scenarios)."""
    from compat import differential_training_cases

    scenario = globals().get(case["scenario"]) or getattr(differential_training_cases, case["scenario"])
    return scenario(case["case"])


# ------------------------------------------------------------------------------ prepare_data_loader, ranks simulated


def prepare_cases(seed: int, count: int) -> list[dict]:
    """``prepare_data_loader`` called for every rank of 1 to 4 processes in one process (the draws of each call
    happen in turn), two epochs each."""
    rng = random.Random(seed)
    cases = []
    for _ in range(count):
        world = rng.choice([1, 2, 3, 4])
        split = rng.random() < 0.25
        cases.append(
            {
                "seed": rng.randrange(10_000),
                "world": world,
                "n": rng.randint(0, 30),
                "split_batches": split,
                "batch_size": rng.choice([1, 2, 3, 4]) * (world if split else 1),
                "even_batches": rng.random() < 0.6,
                "sampler": rng.choice(
                    [
                        "sequential",
                        "shuffle",
                        "shuffle",
                        "sampler_generator",
                        "loader_generator",
                        "custom",
                        "batch_sampler",
                    ]
                ),
                "seedable": rng.random() < 0.3,
                "data_seed": rng.choice([None, 3]),
                "drop_last": rng.random() < 0.2,
                "rng_types": rng.choice([None, ["generator"], [], ["torch", "generator"]]),
            }
        )
    return cases


def prepare_loader(case):
    """Batches of two epochs on each simulated rank, the loader's ``iteration`` after each, what ``rng_types``
    became, and where the global generator stands."""
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
            loader = DataLoader(data, sampler=CustomSampler(len(data)), **common)
        elif kind == "batch_sampler":
            loader = DataLoader(
                data, batch_sampler=BatchSampler(RandomSampler(data), case["batch_size"], case["drop_last"])
            )
        elif kind == "sampler_is_batch_sampler":
            loader = DataLoader(
                data,
                sampler=BatchSampler(SequentialSampler(data), case["batch_size"], case["drop_last"]),
                batch_size=None,
            )
        elif kind == "distributed_sampler":
            loader = DataLoader(
                data, sampler=DistributedSampler(data, num_replicas=case["world"], rank=rank, shuffle=False), **common
            )
        else:
            loader = DataLoader(data, shuffle=kind == "shuffle", **common)
        rng_types = list(case["rng_types"]) if case["rng_types"] is not None else None
        try:
            prepared = prepare_data_loader(
                loader,
                num_processes=case["world"],
                process_index=rank,
                split_batches=case["split_batches"],
                rng_types=rng_types,
                even_batches=case["even_batches"],
                use_seedable_sampler=case["seedable"],
                data_seed=case["data_seed"],
            )
        except Exception as error:  # noqa: BLE001 - the exception type is compared
            out.append(type(error).__name__)
            continue
        epochs, iterations = [], []
        for _ in range(2):
            epochs.append([b.tolist() for b in prepared])
            iterations.append(prepared.iteration)
        out.append(
            {
                "epochs": epochs,
                "iterations": iterations,
                "rng_types": rng_types,
                "len": len(prepared),
                "sampler": type(get_sampler(prepared)).__name__
                if case["world"] == 1 or case.get("report_sampler")
                else None,
            }
        )
    return out, probes()


# ----------------------------------------------------------------------------------- GradientState and its plugin


def gradient_state_cases(seed: int, count: int) -> list[dict]:
    """Accumulation settings given as a plugin (any subset of its fields, defaults included) or as a step count."""
    rng = random.Random(seed)
    cases = []
    for _ in range(count):
        fields = {}
        for name, choices in (
            ("num_steps", [None, 1, 2, 3]),
            ("adjust_scheduler", [True, False]),
            ("sync_with_dataloader", [True, False]),
            ("sync_each_batch", [True, False]),
        ):
            if rng.random() < 0.5:
                fields[name] = rng.choice(choices)
        cases.append(
            {
                "plugin": fields if rng.random() < 0.7 else None,
                "steps": rng.choice([1, 1, 2, 3]),
                "n": rng.randint(3, 9),
                "epochs": rng.randint(1, 2),
            }
        )
    return cases


def gradient_state(case):
    """The plugin's and the gradient state's view of the settings, and what a loop with accumulation does with them:
    ``sync_gradients`` at each step, the scheduler's step count and learning rate."""
    from accelerate import Accelerator
    from accelerate.utils import GradientAccumulationPlugin

    plugin = GradientAccumulationPlugin(**case["plugin"]) if case["plugin"] is not None else None
    accelerator = Accelerator(gradient_accumulation_steps=case["steps"], gradient_accumulation_plugin=plugin)
    state = accelerator.gradient_state
    seen = {
        "plugin_kwargs": dict(state.plugin_kwargs),
        "num_steps": state.num_steps,
        "adjust_scheduler": state.adjust_scheduler,
        "sync_with_dataloader": state.sync_with_dataloader,
        "steps": accelerator.gradient_accumulation_steps,
        "outside": (state.sync_gradients, state.end_of_dataloader, state.remainder, state.in_dataloader),
        "repr": repr(state),
    }
    if plugin is not None:
        seen["to_kwargs"] = plugin.to_kwargs()
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    model, optimizer, loader, scheduler = accelerator.prepare(
        model, optimizer, DataLoader(torch.randn(case["n"], 2), batch_size=2), scheduler
    )
    steps = []
    for _ in range(case["epochs"]):
        for batch in loader:
            with accelerator.accumulate(model):
                accelerator.backward(model(batch).sum())
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
                steps.append(
                    (
                        state.sync_gradients,
                        state.end_of_dataloader,
                        state.remainder,
                        scheduler.scheduler._step_count,
                        scheduler.get_last_lr(),
                    )
                )
    seen["loop"] = steps
    seen["weight"] = model.weight.detach().clone()
    return seen


# ------------------------------------------------------------------------------------------------------------ enums


ENUMS = (
    "DistributedType",
    "PrecisionType",
    "RNGType",
    "LoggerType",
    "DynamoBackend",
    "ComputeEnvironment",
    "SageMakerDistributedType",
    "DDPCommunicationHookType",
    "CustomDtype",
    "FP8BackendType",
)


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
        "str": str(member),
        "repr": repr(member),
        "format": f"{member}",
        "format_spec": attempt(lambda: format(member, ">12")),
        "value": member.value,
        "name": member.name,
        "is_str": isinstance(member, str),
        "eq_value": member == member.value,
        "eq_name": member == member.name,
        "value_in": attempt(lambda: member.value in cls),
        "member_in": attempt(lambda: member in cls),
        "lookup": attempt(lambda: cls(member.value) is member),
        "json": attempt(lambda: json.dumps(member)),
        "list": attempt(lambda: [value for value in cls.list() if value not in HASTEN_EXTRA_MEMBERS.values()]),
        "members": [m.name for m in members],
        "hash_eq": attempt(lambda: {member.value: 1}.get(member)),
    }
