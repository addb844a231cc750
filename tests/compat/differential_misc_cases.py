"""Generated scenarios for the differential tests of Accelerate's smaller utilities (tests/differential.py):
``find_executable_batch_size``, the kwargs handlers, ``set_seed``, ``split_between_processes``, ``save``/``load``,
the files ``Accelerator.save_model`` writes and what save/load-state hooks receive. Cases are plain JSON;
``import accelerate`` is hasten or the reference copy.
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile

from compat.differential_ops_cases import build, instantiate, plain, random_template


def batch_size_search(case: dict):
    """``find_executable_batch_size`` where chosen sizes run out of memory (a ``RuntimeError`` with a device
    allocator's message, as a real OOM); the sizes tried, then the outcomes (an exception by its built-in type).

    The decorated function is called ``case["calls"]`` times (Accelerate keeps the size reached between calls).
    """
    import gc

    from accelerate.utils import find_executable_batch_size

    gc.freeze()  # both sides collect garbage before every attempt: keep that cheap by leaving the imports out of it
    tried, results = [], []
    custom = case["reduce"]
    state = {"size": case["start"]}

    def reduce_fn():
        state["size"] = state["size"] - custom if custom > 0 else state["size"] // 2
        return state["size"]

    @find_executable_batch_size(
        starting_batch_size=case["start"], reduce_batch_size_fn=reduce_fn if custom is not None else None
    )
    def train(batch_size, offset):
        tried.append(batch_size)
        state["size"] = batch_size
        if batch_size in case["oom_at"] or batch_size > case["fits_below"]:
            raise RuntimeError(case["message"])
        if batch_size in case["error_at"]:
            raise ValueError(f"a bug at {batch_size}")
        return batch_size + offset

    for call in range(case["calls"]):
        try:
            results.append(train(call * 1000))
        except Exception as error:  # noqa: BLE001 - the exception type is part of the result
            results.append(
                "raised " + next(cls.__name__ for cls in type(error).__mro__ if cls.__module__ == "builtins")
            )
    return {"tried": tried, "results": results}


OOM_MESSAGES = [
    "CUDA out of memory. Tried to allocate 2.00 GiB", "CPU out of memory.", "XPU out of memory.",
    "MPS backend out of memory (MPS allocated: 1 GB)", "DefaultCPUAllocator: can't allocate memory: you tried 1 GB",
    "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED. This error may appear if you passed in a non-contiguous input.",
]  # fmt: skip


def generate_batch_size_cases(seed: int, count: int) -> list[dict]:
    """``count`` searches: starting sizes, sizes that fail, a custom reduction or not, other errors, repeated calls."""
    cases = []
    for index in range(count):
        rng = random.Random(seed * 100_003 + index)
        start = rng.choice([0, 1, 2, 8, 16, 100, 128, 512])
        cases.append({
            "seed": seed * 100_003 + index, "start": start, "fits_below": rng.choice([0, 1, 4, 8, 50, 10**6]),
            "oom_at": sorted(rng.sample(range(1, 130), rng.randint(0, 4))),
            "error_at": rng.choice([[], [], [rng.randint(1, 20)]]),
            "reduce": rng.choice([None, None, 0, 1, 7]), "calls": rng.choice([1, 1, 2]),
            "message": rng.choice(OOM_MESSAGES),
        })  # fmt: skip
    return cases


# ------------------------------------------------------------------------------------------------ kwargs handlers


def _kwargs_value(value):
    import datetime

    if isinstance(value, datetime.timedelta):
        return {"timedelta": value.total_seconds()}
    if isinstance(value, dict):
        return {k: _kwargs_value(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_kwargs_value(v) for v in value]
    if hasattr(value, "value") and type(value).__module__ != "builtins":  # an enum member
        return {"enum": type(value).__name__, "value": value.value}
    return value


def kwargs_handler(case: dict):
    """A kwargs handler built with the case's arguments: ``to_kwargs()`` and ``to_dict()``."""
    import datetime

    from accelerate import utils

    arguments = dict(case["arguments"])
    if "timeout" in arguments and arguments["timeout"] is not None and case.get("timeout_as") == "timedelta":
        arguments["timeout"] = datetime.timedelta(seconds=arguments["timeout"])
    if "comm_hook" in arguments:
        arguments["comm_hook"] = utils.DDPCommunicationHookType(arguments["comm_hook"])
    handler = getattr(utils, case["cls"])(**arguments)
    return {"to_kwargs": _kwargs_value(handler.to_kwargs()), "to_dict": _kwargs_value(handler.to_dict())}


_HANDLER_FIELDS = {
    "GradScalerKwargs": {"init_scale": [65536.0, 1024.0, 2.0], "growth_factor": [2.0, 3.0],
                         "backoff_factor": [0.5, 0.25], "growth_interval": [2000, 10], "enabled": [True, False]},
    "DistributedDataParallelKwargs": {"dim": [0, 1], "broadcast_buffers": [True, False], "bucket_cap_mb": [25, 50],
                                      "find_unused_parameters": [False, True], "check_reduction": [False, True],
                                      "gradient_as_bucket_view": [False, True], "static_graph": [False, True],
                                      "comm_hook": ["no", "fp16", "power_sgd"],
                                      "comm_state_option": [{}, {"matrix_approximation_rank": 2}]},
    "InitProcessGroupKwargs": {"backend": ["nccl", "gloo", None], "init_method": [None, "env://"],
                               "timeout": [None, 600, 1800, 60]},
    "AutocastKwargs": {"enabled": [True, False], "cache_enabled": [None, True, False]},
    "ProfileKwargs": {"activities": [None, ["cpu"], ["cpu", "cuda"]],
                      "schedule_option": [None, {"wait": 1, "active": 2}],
                      "record_shapes": [False, True], "profile_memory": [False, True], "with_stack": [False, True],
                      "with_flops": [False, True], "with_modules": [False, True], "output_trace_dir": [None, "traces"]},
}  # fmt: skip


def generate_kwargs_cases(seed: int, count: int) -> list[dict]:
    """``count`` handlers with random subsets of their fields set (defaults included)."""
    cases, names = [], sorted(_HANDLER_FIELDS)
    for index in range(count):
        rng = random.Random(seed * 100_003 + index)
        cls = names[index % len(names)]
        fields = _HANDLER_FIELDS[cls]
        chosen = rng.sample(sorted(fields), rng.randint(0, min(4, len(fields))))
        case = {
            "seed": seed * 100_003 + index,
            "cls": cls,
            "arguments": {name: rng.choice(fields[name]) for name in chosen},
        }
        if cls == "InitProcessGroupKwargs":
            case["timeout_as"] = "timedelta"
        cases.append(case)
    return cases


# ------------------------------------------------------------------------------------------ seeds and splitting


def seeded_streams(case: dict):
    """``set_seed`` then a draw from every generator it seeds (on each process), after creating an ``Accelerator`` or
    only a ``PartialState``."""
    import random as python_random

    import numpy as np
    import torch

    from accelerate import Accelerator, PartialState
    from accelerate.state import AcceleratorState, GradientState
    from accelerate.utils import set_seed

    AcceleratorState._reset_state(reset_partial_state=True)  # every case starts with no state (the process group stays)
    GradientState._reset_state()
    Accelerator(cpu=True) if case["accelerator"] else PartialState(cpu=True)
    before = torch.are_deterministic_algorithms_enabled()
    set_seed(case["value"], device_specific=case["device_specific"], deterministic=case["deterministic"])
    draws = {"torch": torch.rand(3), "python": [python_random.random() for _ in range(2)],
             "numpy": np.random.rand(2).tolist(),
             "deterministic": torch.are_deterministic_algorithms_enabled()}  # fmt: skip
    torch.use_deterministic_algorithms(before)
    return draws


def generate_seed_cases(seed: int, count: int) -> list[dict]:
    """``count`` seeds with each combination of ``device_specific``, ``deterministic`` and the state created first."""
    rng = random.Random(seed)
    return [
        {"seed": seed * 100_003 + i, "value": rng.choice([0, 1, 42, 2**31 - 1, rng.randrange(10**6)]),
         "device_specific": bool(i % 2), "deterministic": bool(i // 2 % 2), "accelerator": bool(i // 4 % 2)}
        for i in range(count)
    ]  # fmt: skip


def split(case: dict):
    """``PartialState().split_between_processes`` on lists, tuples, tensors and dicts of them, padded or not."""
    from accelerate import PartialState

    state = PartialState(cpu=True)
    inputs = build(case["inputs"]) if case["kind"] != "range" else list(range(case["length"]))
    if case["kind"] == "dict":
        inputs = {key: build(value) for key, value in case["dict"]}
    with state.split_between_processes(inputs, apply_padding=case["apply_padding"]) as share:
        return plain(share)


def generate_split_cases(seed: int, count: int) -> list[dict]:
    """``count`` inputs of every kind and length (shorter than, equal to and longer than the number of processes)."""
    cases = []
    for index in range(count):
        rng = random.Random(seed * 100_003 + index)
        length = rng.randint(0, 7)
        kind = rng.choice(["range", "list", "tuple", "tensor", "dict"])
        case = {
            "seed": seed * 100_003 + index,
            "kind": kind,
            "length": length,
            "apply_padding": rng.random() < 0.5,
            "inputs": ["v", None],
        }
        if kind in ("list", "tuple"):
            case["inputs"] = [kind, [["v", rng.choice([1, "a", 2.5])] for _ in range(length)]]
        elif kind == "tensor":
            case["inputs"] = ["T", rng.choice(["float32", "int64"]), [length, 2], rng.randrange(10**6)]
        elif kind == "dict":
            case["dict"] = [
                ["a", ["list", [["v", i] for i in range(length)]]],
                ["b", ["T", "float32", [length], rng.randrange(10**6)]],
            ]
        cases.append(case)
    return cases


# ------------------------------------------------------------------------------------------------- save and load


def save_and_load(case: dict):
    """``accelerate.utils.save`` of a built structure (a state dict, maybe with tied tensors), then reading it back."""
    from collections import OrderedDict

    import safetensors.torch

    from accelerate.utils import load, save

    data = build(case["data"])
    if case["state_dict"]:
        data = OrderedDict((key, value) for key, value in data.items())
        if case["tie"] and len(data) > 1:
            first = next(iter(data))
            data[list(data)[-1]] = data[first]
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "obj.safetensors" if case["safe"] else "obj.bin")
        save(data, path, safe_serialization=case["safe"])
        back = safetensors.torch.load_file(path) if case["safe"] else load(path)
    return {"saved": plain(data), "loaded": plain(back)}


def generate_save_cases(seed: int, count: int) -> list[dict]:
    """``count`` round trips: state dicts (tied or not) in both formats, other structures with ``torch.save``."""
    cases = []
    for index in range(count):
        rng = random.Random(seed * 100_003 + index)
        state_dict = rng.random() < 0.7
        if state_dict:
            template = ["dict", [[f"w{i}", ["T", rng.choice(["float32", "float16", "int64", "bool"]),
                                            ["B", rng.randint(1, 3)], rng.randrange(10**6)]]
                                 for i in range(rng.randint(1, 4))]]  # fmt: skip
        else:
            template = random_template(rng, leaves=("tensor",) * 4 + ("value",))
        safe = state_dict and rng.random() < 0.6
        cases.append({"seed": seed * 100_003 + index, "data": instantiate(template, rng.randint(1, 3)),
                      "state_dict": state_dict, "tie": rng.random() < 0.5, "safe": safe})  # fmt: skip
    return cases


# ------------------------------------------------------------------------------------------------------ save_model


def _layered_model(case: dict):
    """A stack of linear layers of ``case["widths"]`` with values from the case's seed; maybe the last layer's weight
    tied to the first's, another dtype, a buffer on the root module (it comes first in the state dict)."""
    import torch

    generator = torch.Generator().manual_seed(case["seed"])
    widths = case["widths"]
    layers = [torch.nn.Linear(a, b, bias=case["bias"]) for a, b in zip(widths, widths[1:])]
    with torch.no_grad():
        for parameter in (p for layer in layers for p in layer.parameters()):
            parameter.copy_(torch.randn(parameter.shape, generator=generator))
    if case["tie"] and len(layers) > 1 and layers[0].weight.shape == layers[-1].weight.shape:
        layers[-1].weight = layers[0].weight
    model = torch.nn.Sequential(*layers).to(getattr(torch, case["dtype"]))
    if case["buffer"]:
        model.register_buffer("counter", torch.arange(3))
    return model


def _file_contents(path: str):
    """What a written weights file holds: an index's JSON, or each tensor's dtype, shape and a digest of its values
    (and a safetensors file's metadata). Metadata keys ``hasten_*`` are left out: hasten adds them on purpose
    (the save's id, so that shards of two saves are never mixed, and the names of tied tensors)."""
    import hashlib
    import json

    import safetensors
    import torch

    def tensor(value):
        return [str(value.dtype), list(value.shape), hashlib.sha1(value.float().numpy().tobytes()).hexdigest()]

    def ours_left_out(metadata):
        return {key: value for key, value in (metadata or {}).items() if not key.startswith("hasten_")}

    if path.endswith(".json"):
        with open(path, encoding="utf-8") as handle:
            index = json.load(handle)
        return {**index, "metadata": ours_left_out(index.get("metadata"))}
    if path.endswith(".safetensors"):
        with safetensors.safe_open(path, "pt") as handle:
            return {"metadata": ours_left_out(handle.metadata()), **{k: tensor(handle.get_tensor(k)) for k in handle}}
    return {key: tensor(value) for key, value in torch.load(path, weights_only=True).items()}


def save_model(case: dict):
    """``Accelerator.save_model`` of a prepared model: the files written (shard names and count) and what each holds."""
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    model = accelerator.prepare(_layered_model(case))
    options = {key: case[key] for key in ("max_shard_size", "safe_serialization") if case[key] is not None}
    with tempfile.TemporaryDirectory() as folder:
        accelerator.save_model(model, folder, **options)
        return {name: _file_contents(os.path.join(folder, name)) for name in sorted(os.listdir(folder))}


def generate_save_model_cases(seed: int, count: int) -> list[dict]:
    """``count`` models of 1 to 5 layers (tied or not, 3 dtypes, with a buffer or not) saved whole or in shards of
    1 KB to 1 MB (a layer larger than a shard included), as safetensors or ``.bin``."""
    rng = random.Random(seed)
    cases = []
    for _ in range(count):
        widths = [rng.choice([4, 8, 16, 32, 64]) for _ in range(rng.randint(2, 6))]
        if len(widths) > 2 and rng.random() < 0.3:  # the last layer's weight has the first's shape: it can be tied
            widths[-2:] = widths[:2][::-1]
        cases.append({"seed": rng.randrange(1000), "widths": widths, "bias": rng.random() < 0.7,
                      "tie": rng.random() < 0.4, "dtype": rng.choice(["float32", "float32", "float16", "bfloat16"]),
                      "buffer": rng.random() < 0.3, "max_shard_size": rng.choice([None, "1KB", "4KB", "10KB", 2000]),
                      "safe_serialization": rng.choice([None, True, False])})  # fmt: skip
    return cases


# ------------------------------------------------------------------------------------------------ checkpoint hooks


def hooks(case: dict):
    """What ``register_save_state_pre_hook``/``register_load_state_pre_hook`` hooks and ``Accelerator._models`` hold.

    The model has a ``save_pretrained`` method, as diffusers' models do; the save hook calls it on every model.
    """
    import torch

    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState
    from accelerate.utils import broadcast_object_list

    class Pretrained(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(3, 2)

        def save_pretrained(self, folder):
            os.makedirs(folder, exist_ok=True)
            torch.save(self.state_dict(), os.path.join(folder, "weights.bin"))

    AcceleratorState._reset_state()  # each case chooses its mixed precision afresh (the process group stays)
    GradientState._reset_state()
    accelerator = Accelerator(cpu=True, mixed_precision=case["mixed_precision"])
    seen = []

    def save_hook(models, weights, output_dir):
        seen.append(("save", [type(m).__name__ for m in models], len(weights)))
        for i, model in enumerate(models):
            model.save_pretrained(os.path.join(output_dir, f"pretrained_{i}"))
            if weights:
                weights.pop()

    def load_hook(models, input_dir):
        seen.append(("load", [type(m).__name__ for m in models]))
        while models:
            models.pop()

    accelerator.register_save_state_pre_hook(save_hook)
    accelerator.register_load_state_pre_hook(load_hook)
    model = Pretrained()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    prepared = accelerator.prepare(model, optimizer) if case["with_optimizer"] else accelerator.prepare(model)
    tracked = [(type(m).__name__, m is model) for m in accelerator._models]
    folder = [tempfile.mkdtemp(prefix="differential-hooks-") if accelerator.is_main_process else None]
    broadcast_object_list(folder)
    accelerator.save_state(os.path.join(folder[0], "checkpoint"))
    accelerator.wait_for_everyone()
    written = sorted(os.listdir(os.path.join(folder[0], "checkpoint", "pretrained_0")))
    accelerator.load_state(os.path.join(folder[0], "checkpoint"))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        shutil.rmtree(folder[0])
    return {"tracked": tracked, "returned": type(prepared[0] if case["with_optimizer"] else prepared).__name__,
            "seen": seen, "written": written}  # fmt: skip
