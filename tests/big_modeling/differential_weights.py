"""Differential scenarios for putting weights into models: load_checkpoint_in_model and set_module_tensor_to_device.

A checkpoint is written by the scenario itself (plain torch and safetensors, never the library under test) from a
seeded source model: one file or shards with an index (the index with or without its ``weight_map`` wrapper, found
through the folder or given directly), safetensors (saved from PyTorch, from another framework, or without
metadata) or ``.bin``, in the model's dtype or another, with keys left out or added. What comes back is what a
user sees: every tensor of the model (class, dtype, device, shape, values), which names share one tensor, and
what the offload folder gives back through ``OffloadedWeightsLoader``.
"""

from __future__ import annotations

import json
import os
import random
import tempfile

import torch
from big_modeling.differential_models import random_knobs, random_tree

LAYOUTS = ("file", "folder", "sharded_folder", "index_file", "bare_index_file")
DTYPES = (None, None, "float16", "bfloat16", "float32", "torch.float16", "torch:float16", "torch:bfloat16")


def _dtype_arg(name):
    if isinstance(name, str) and name.startswith("torch:"):
        return getattr(torch, name.split(":", 1)[1])
    return name


def _source_state(case: dict) -> dict:
    """The checkpoint's tensors: the seeded model's state dict, cast, with keys dropped and added."""
    source = random_tree(case["tree"], case["knobs"], device="cpu")
    state = {name: tensor.detach().clone().contiguous() for name, tensor in source.state_dict().items()}
    if case["source_dtype"]:
        state = {
            n: t.to(getattr(torch, case["source_dtype"])) if t.is_floating_point() else t for n, t in state.items()
        }
    for name in case["missing"]:
        state.pop(name, None)
    generator = torch.Generator().manual_seed(case["seed"])
    for index in range(case["extra"]):
        state[f"extra{index}.weight" if index % 2 else f"{next(iter(state), 'x').rsplit('.', 1)[0]}.unused{index}"] = (
            torch.randn(3, generator=generator)
        )
    return state


def _save(state: dict, path: str, fmt: str, framework: str | None = "pt") -> None:
    if fmt == "safetensors":
        from safetensors.torch import save_file

        save_file(state, path, metadata=None if framework is None else {"format": framework})
    else:
        torch.save(state, path)


def write_checkpoint(folder: str, case: dict) -> str:
    """Write the case's checkpoint under ``folder``; returns what to pass as ``checkpoint``."""
    state = _source_state(case)
    fmt, layout = case["format"], case["layout"]
    single = "model.safetensors" if fmt == "safetensors" else "pytorch_model.bin"
    if layout in ("file", "folder"):
        _save(state, os.path.join(folder, single), fmt, case.get("framework", "pt"))
        return os.path.join(folder, single) if layout == "file" else folder
    names = list(state)
    shards = max(1, min(case["shards"], len(names)))
    weight_map = {}
    for index in range(shards):
        part = names[index::shards]
        file = f"{single.rsplit('.', 1)[0]}-{index + 1:05d}-of-{shards:05d}.{fmt if fmt == 'safetensors' else 'bin'}"
        _save({name: state[name] for name in part}, os.path.join(folder, file), fmt, case.get("framework", "pt"))
        weight_map.update(dict.fromkeys(part, file))
    index_name = f"{single}.index.json"
    index = weight_map if layout == "bare_index_file" else {"metadata": {"total_size": 0}, "weight_map": weight_map}
    with open(os.path.join(folder, index_name), "w") as handle:
        json.dump(index, handle)
    return folder if layout == "sharded_folder" else os.path.join(folder, index_name)


def _tensors(model) -> list:
    out = []
    for name, tensor in list(model.named_parameters(remove_duplicate=False)) + list(
        model.named_buffers(remove_duplicate=False)
    ):
        out.append([name, type(tensor).__name__, tensor.requires_grad, tensor.detach()])
    return out


def _shared(model) -> list:
    groups: dict = {}
    for name, tensor in list(model.named_parameters(remove_duplicate=False)) + list(
        model.named_buffers(remove_duplicate=False)
    ):
        groups.setdefault(id(tensor), []).append(name)
    return sorted(sorted(names) for names in groups.values() if len(names) > 1)


def _offloaded(folder: str) -> list:
    from accelerate.utils import OffloadedWeightsLoader

    if not os.path.isfile(os.path.join(folder, "index.json")):
        return []
    loader = OffloadedWeightsLoader(save_folder=folder)
    return [[name, loader[name]] for name in sorted(loader)]


def scenario_load_checkpoint(case: dict):
    """load_checkpoint_in_model: the model's tensors afterwards, which share storage, what the offload folder holds."""
    from accelerate.utils import load_checkpoint_in_model

    with tempfile.TemporaryDirectory() as folder:
        checkpoint = write_checkpoint(folder, case)
        model = random_tree(case["tree"], case["knobs"], device="meta" if case["meta"] else "cpu")
        if not case["meta"]:
            with torch.no_grad():
                for tensor in list(model.parameters()) + list(model.buffers()):
                    tensor.zero_()
        if case["model_dtype"]:
            model.to(getattr(torch, case["model_dtype"]))
        offload = os.path.join(folder, "offload")
        load_checkpoint_in_model(
            model,
            checkpoint,
            device_map=dict(case["device_map"]) if case["device_map"] is not None else None,
            offload_folder=offload if case["offload_folder"] else None,
            dtype=_dtype_arg(case["dtype"]),
            offload_state_dict=case["offload_state_dict"],
            offload_buffers=case["offload_buffers"],
            keep_in_fp32_modules=case["keep_in_fp32"],
            strict=case["strict"],
        )
        return {"tensors": _tensors(model), "shared": _shared(model), "offloaded": _offloaded(offload)}


def _device_map(rng: random.Random, model) -> list | None:
    roll = rng.random()
    if roll < 0.25:
        return None
    if roll < 0.4:
        return [["", rng.choice(("cpu", "disk", "cpu"))]]
    entries = []
    for name, child in model.named_children():
        if rng.random() < 0.3 and any(True for _ in child.named_children()):
            entries += [[f"{name}.{sub}", rng.choice(("cpu", "disk"))] for sub, _ in child.named_children()]
            entries += [[f"{name}.{own}", "cpu"] for own, _ in child.named_parameters(recurse=False)]
            entries += [[f"{name}.{own}", rng.choice(("cpu", "disk"))] for own, _ in child.named_buffers(recurse=False)]
        else:
            entries.append([name, rng.choice(("cpu", "disk", "cpu"))])
    entries += [[name, "cpu"] for name, _ in model.named_parameters(recurse=False)]
    entries += [[name, rng.choice(("cpu", "disk"))] for name, _ in model.named_buffers(recurse=False)]
    return entries


def load_cases(seed: int, count: int) -> list[dict]:
    """Cases for load_checkpoint_in_model over random trees, layouts, formats, dtypes, maps and key mismatches."""
    rng = random.Random(seed)
    cases = []
    for index in range(count):
        tree_seed, knobs = rng.randrange(10**6), random_knobs(rng)
        knobs["depth"] = min(knobs["depth"], 3)
        model = random_tree(tree_seed, knobs)
        keys = list(model.state_dict())
        modules = [name for name, _ in model.named_modules() if name]
        device_map = _device_map(rng, model)
        cases.append(
            {
                "seed": seed * 100_000 + index,
                "tree": tree_seed,
                "knobs": knobs,
                "format": rng.choice(("safetensors", "safetensors", "bin")),
                "layout": rng.choice(LAYOUTS),
                "shards": rng.randint(1, 3),
                "source_dtype": rng.choice((None, None, None, "float16", "bfloat16", "float64")),
                "model_dtype": rng.choice((None, None, None, "float16")),
                "missing": rng.sample(keys, min(len(keys), rng.choice((0, 0, 0, 1, 2)))),
                "extra": rng.choice((0, 0, 0, 1, 2)),
                "meta": rng.random() < (0.15 if device_map is None else 0.7),
                "device_map": device_map,
                "offload_folder": device_map is not None
                and (rng.random() < 0.9 or not any(d == "disk" for _, d in device_map)),
                "dtype": rng.choice(DTYPES),
                "offload_state_dict": rng.random() < 0.25,
                "offload_buffers": rng.random() < 0.3,
                "keep_in_fp32": rng.sample(modules, min(len(modules), rng.choice((0, 0, 1, 2))))
                if rng.random() < 0.3
                else None,
                "strict": rng.random() < 0.2,
            }
        )
    return cases


def scenario_set_module_tensor(case: dict):
    """set_module_tensor_to_device on one tensor: the tensor afterwards (class, grad, dtype, device, values)."""
    from accelerate.utils import set_module_tensor_to_device

    model = random_tree(case["tree"], case["knobs"], device="meta" if case["meta"] else "cpu")
    target = dict(list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers()))[case["name"]]
    value = None
    if case["value"] is not None:
        generator = torch.Generator().manual_seed(case["seed"])
        shape = target.shape if case["value"] != "wrong_shape" else (*target.shape, 2)
        value = torch.randn(shape, generator=generator).to(getattr(torch, case["value_dtype"]))
        if case["value"] == "list":
            value = value.tolist()
    set_module_tensor_to_device(model, case["name"], case["device"], value=value, dtype=_dtype_arg(case["dtype"]))
    after = dict(list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers()))[case["name"]]
    return [type(after).__name__, after.requires_grad, after.detach(), _shared(model)]


def tensor_cases(seed: int, count: int) -> list[dict]:
    """Cases for set_module_tensor_to_device: a tensor of a tree (on meta or not), a device (cpu, cpu:0, meta), a value
    (a tensor, a list, one of the wrong shape, none) and a dtype (an object or, sometimes, a name)."""
    rng = random.Random(seed)
    cases = []
    for index in range(count):
        tree_seed, knobs = rng.randrange(10**6), random_knobs(rng)
        model = random_tree(tree_seed, knobs)
        names = [name for name, _ in model.named_parameters(remove_duplicate=False)] + [
            name for name, _ in model.named_buffers()
        ]
        cases.append(
            {
                "seed": seed * 100_000 + index,
                "tree": tree_seed,
                "knobs": knobs,
                "name": rng.choice(names),
                "meta": rng.random() < 0.4,
                "device": rng.choice(("cpu", "meta", "cpu", "cpu:0")),
                "value": rng.choice((None, None, "tensor", "tensor", "tensor", "tensor", "list", "wrong_shape")),
                "value_dtype": rng.choice(("float32", "float32", "float16", "float64", "int64", "bfloat16")),
                "dtype": rng.choice(
                    (None, None, None, "torch:float16", "torch:bfloat16", "float16", "torch:int8", "torch:float64")
                ),
            }
        )
    return cases
