"""Differential scenarios for the device-map planners and model sizes, and the seeded generators of their cases.

Each ``scenario_*`` takes one JSON case and runs it through ``accelerate`` (the reference copy of Accelerate 1.15 or
hasten, depending on the side; see tests/differential.py); each ``*_cases(seed, count)`` generates cases. The models
come from :mod:`differential_models` (a seed and knobs in the case). ``max_memory`` travels as ``[key, value]``
pairs, since JSON objects have string keys only and the planners take integer GPU indices.
"""

from __future__ import annotations

import random

import torch
from big_modeling.differential_models import no_split_choice, random_knobs, random_tree, total_size

SIZE_UNITS = (
    ("KB", 10**3),
    ("MB", 10**6),
    ("GB", 10**9),
    ("KiB", 2**10),
    ("MiB", 2**20),
    ("GiB", 2**30),
    ("kB", 10**3 / 8),
    ("Mb", 10**6 / 8),
    ("mb", 10**6 / 8),
    ("gib", 2**30),
    ("kib", 2**10),
)
DEVICE_SETS = (
    [0],
    [0, 1],
    ["cpu"],
    [0, "cpu"],
    [0, 1, "cpu"],
    [0, 1, "cpu", "disk"],
    ["cpu", "disk"],
    [1, 0, "cpu"],
    [0, "disk"],
    ["disk", "cpu", 1, 0],
    [0, 1, 2, "cpu"],
    [0, "mps"],
)
DTYPES = (None, None, "float16", "bfloat16", "float32", "torch.float16", "torch:float16", "float8_e4m3fn")


def _memory(pairs: list) -> dict:
    return {key: value for key, value in pairs}


def _pairs(mapping: dict) -> list:
    return [[key, value] for key, value in mapping.items()]


def _dtype_arg(name):
    """Dtypes travel as strings; ``"torch:NAME"`` means the ``torch.NAME`` object itself."""
    if isinstance(name, str) and name.startswith("torch:"):
        return getattr(torch, name.split(":", 1)[1])
    return name


def size_string(rng: random.Random, size: int):
    """``size`` bytes as an int, or as a string in a random unit ("60KB", "1.5GiB", "10Mb" in bits, ...)."""
    units = [(unit, factor) for unit, factor in SIZE_UNITS if size / factor >= 1]
    if rng.random() < 0.4 or not units:
        return int(size)
    unit, factor = rng.choice(units)
    value = size / factor
    text = f"{value:.0f}" if value >= 100 or rng.random() < 0.5 else f"{value:.2f}".rstrip("0").rstrip(".")
    return f"{text}{unit}"


def random_budgets(rng: random.Random, total: int) -> list:
    """``[device, size]`` pairs: a device set sharing from a fifth of the model to more than all of it (some zero)."""
    devices = rng.choice(DEVICE_SETS)
    weights = [0 if rng.random() < 0.1 else rng.random() for _ in devices]
    scale = total * rng.uniform(0.2, 1.5) / (sum(weights) or 1)
    return [[device, size_string(rng, int(weight * scale))] for device, weight in zip(devices, weights)]


def _special_dtypes(rng: random.Random, model) -> dict:
    names = [name for name, _ in model.named_parameters()] + [name for name, _ in model.named_buffers()]
    if not names or rng.random() < 0.7:
        return {}
    chosen = rng.sample(names, rng.randint(1, min(3, len(names))))
    return {name: rng.choice(("float16", "float32", "torch.bfloat16", "float64", "int8")) for name in chosen}


def planner_cases(seed: int, count: int) -> list[dict]:
    """Cases for infer_auto_device_map / get_balanced_memory: a tree, budgets on a device set, every option."""
    rng = random.Random(seed)
    cases = []
    for index in range(count):
        tree_seed = rng.randrange(10**6)
        knobs = random_knobs(rng)
        model = random_tree(tree_seed, knobs)
        cases.append(
            {
                "seed": seed * 100_000 + index,
                "tree": tree_seed,
                "knobs": knobs,
                "max_memory": random_budgets(rng, total_size(model)),
                "no_split": no_split_choice(rng, model),
                "dtype": rng.choice(DTYPES),
                "special_dtypes": _special_dtypes(rng, model),
                "clean_result": rng.random() < 0.7,
                "offload_buffers": rng.random() < 0.3,
                "fallback_allocation": rng.random() < 0.4,
                "low_zero": rng.random() < 0.3,
                "balanced_disk": rng.random() < 0.1,
            }
        )
    return cases


def scenario_infer_auto_device_map(case: dict):
    """The device map, and the caller's ``max_memory`` afterwards (Accelerate converts its size strings in place)."""
    from accelerate import infer_auto_device_map

    model = random_tree(case["tree"], case["knobs"])
    max_memory = _memory(case["max_memory"])
    device_map = infer_auto_device_map(
        model,
        max_memory=max_memory,
        no_split_module_classes=case["no_split"],
        dtype=_dtype_arg(case["dtype"]),
        special_dtypes=case["special_dtypes"] or None,
        clean_result=case["clean_result"],
        offload_buffers=case["offload_buffers"],
        fallback_allocation=case["fallback_allocation"],
    )
    return device_map, max_memory


def _balanced_budgets(case: dict) -> dict:
    """The case's budgets, without "disk" unless the case keeps it (Accelerate's get_balanced_memory fails on it)."""
    return _memory([pair for pair in case["max_memory"] if pair[0] != "disk" or case["balanced_disk"]])


def scenario_get_balanced_memory(case: dict):
    """Balanced budgets and the caller's ``max_memory`` afterwards."""
    from accelerate.utils import get_balanced_memory

    model = random_tree(case["tree"], case["knobs"])
    max_memory = _balanced_budgets(case)
    budgets = get_balanced_memory(
        model,
        max_memory=max_memory,
        no_split_module_classes=case["no_split"],
        dtype=_dtype_arg(case["dtype"]),
        special_dtypes=case["special_dtypes"] or None,
        low_zero=case["low_zero"],
    )
    return budgets, max_memory


def scenario_balanced_then_map(case: dict):
    """What ``device_map="balanced"`` does: balanced budgets fed to the planner."""
    from accelerate import infer_auto_device_map
    from accelerate.utils import get_balanced_memory

    model = random_tree(case["tree"], case["knobs"])
    budgets = get_balanced_memory(model, _balanced_budgets(case), case["no_split"], low_zero=case["low_zero"])
    return infer_auto_device_map(model, budgets, case["no_split"], offload_buffers=case["offload_buffers"])


def scenario_module_sizes(case: dict):
    """compute_module_sizes (all tensors and buffers only), the largest layer, tensors, ties, total buffer size."""
    from accelerate.utils import compute_module_sizes, find_tied_parameters, get_max_layer_size, named_module_tensors
    from accelerate.utils.modeling import compute_module_total_buffer_size, get_non_persistent_buffers

    model = random_tree(case["tree"], case["knobs"])
    dtype, special = _dtype_arg(case["dtype"]), case["special_dtypes"] or None
    sizes = compute_module_sizes(model, dtype=dtype, special_dtypes=special)
    top = (
        list(model.named_parameters(recurse=False))
        + list(model.named_children())
        + list(model.named_buffers(recurse=False))
    )
    tensors = {
        (include, recurse, remove): [name for name, _ in named_module_tensors(model, include, recurse, remove)]
        for include in (True, False)
        for recurse in (True, False)
        for remove in (True, False)
    }
    return {
        "sizes": sizes,
        "buffers": compute_module_sizes(model, dtype=dtype, special_dtypes=special, buffers_only=True),
        "total_buffers": compute_module_total_buffer_size(model, dtype=dtype, special_dtypes=special),
        "max_layer": get_max_layer_size(top, sizes, case["no_split"]),
        "tensors": [[list(key), names] for key, names in tensors.items()],
        "tied": find_tied_parameters(model),
        "non_persistent": [
            [recurse, fqns, get_non_persistent_buffers(model, recurse, fqns)]
            for recurse in (True, False)
            for fqns in (True, False)
        ],
    }


def memory_cases(seed: int, count: int) -> list[dict]:
    """Cases for get_max_memory: device sets with int and string budgets, odd keys and malformed sizes."""
    rng = random.Random(seed)
    odd_keys = ("cuda:0", "gpu", "xpu", 3, -1, "Cpu", "meta")
    odd_sizes = (
        "10",
        "1e3MB",
        "5 GB",
        " 7MB",
        "1.5TB",
        "-3MB",
        "abc",
        "0KB",
        "+2KiB",
        "2_000KB",
        "nanGB",
        1.5,
        -7,
        True,
        None,
    )
    cases = []
    for index in range(count):
        pairs = random_budgets(rng, rng.choice((10**3, 10**5, 10**7, 10**9, 3 * 10**10)))
        if rng.random() < 0.25:
            pairs.append([rng.choice(odd_keys), size_string(rng, 10**6)])
        if rng.random() < 0.25:
            pairs[rng.randrange(len(pairs))][1] = rng.choice(odd_sizes)
        cases.append({"seed": seed * 100_000 + index, "max_memory": pairs})
    return cases


def scenario_get_max_memory(case: dict):
    """Budgets in order, the caller's dict afterwards; and each size through convert_file_size_to_int."""
    from accelerate.utils import convert_file_size_to_int, get_max_memory

    sizes = []
    for _, value in case["max_memory"]:
        try:
            sizes.append(convert_file_size_to_int(value))
        except Exception as error:  # noqa: BLE001 - the exception type is part of the result
            sizes.append(f"raised {_builtin_name(error)}")
    max_memory = _memory(case["max_memory"])
    try:
        budgets = get_max_memory(max_memory)
    except (ValueError, TypeError, AttributeError, KeyError) as error:
        budgets = f"raised {_builtin_name(error)}"
    return budgets, max_memory, sizes


def _builtin_name(error: Exception) -> str:
    """The first built-in exception class of ``error``'s type (hasten's errors subclass the built-in ones)."""
    return next(cls.__name__ for cls in type(error).__mro__ if cls.__module__ == "builtins")


def default_memory_cases(seed: int, count: int) -> list[dict]:
    """get_max_memory() takes nothing: one case, whatever ``count``."""
    return [{"seed": seed}]


def scenario_max_memory_defaults(case: dict):
    """get_max_memory() with nothing given: which devices, and that the budgets are positive integers."""
    from accelerate.utils import get_max_memory

    budgets = get_max_memory()
    return [[key, type(value).__name__, value > 0] for key, value in budgets.items()]


def device_map_cases(seed: int, count: int) -> list[dict]:
    """Cases for check_device_map / clean_device_map: maps over a tree's modules and tensors, with gaps and typos."""
    rng = random.Random(seed)
    cases = []
    for index in range(count):
        tree_seed, knobs = rng.randrange(10**6), random_knobs(rng)
        model = random_tree(tree_seed, knobs)
        names = [name for name, _ in model.named_modules() if name] + [name for name, _ in model.named_parameters()]
        names += [name for name, _ in model.named_buffers()]
        chosen = rng.sample(names, rng.randint(0, min(len(names), 12)))
        device_map = [[name, rng.choice((0, 1, "cpu", "disk", 0))] for name in chosen]
        roll = rng.random()
        if roll < 0.15:
            device_map.append(["", rng.choice((0, "cpu"))])
        elif roll < 0.3 and names:
            device_map.append([rng.choice(names) + "x", 0])
        elif roll < 0.5:
            device_map = [[name, rng.choice((0, "cpu"))] for name, _ in model.named_children()]
        cases.append(
            {
                "seed": seed * 100_000 + index,
                "tree": tree_seed,
                "knobs": knobs,
                "device_map": device_map,
                "module": rng.choice(["", *[n for n, _ in model.named_modules() if n][:5]]),
            }
        )
    return cases


def scenario_device_map_checks(case: dict):
    """check_device_map's outcome (None, or the exception's built-in type) and clean_device_map's result."""
    from accelerate.utils.modeling import check_device_map, clean_device_map

    model = random_tree(case["tree"], case["knobs"])
    device_map = _memory(case["device_map"])
    try:
        checked = check_device_map(model, dict(device_map))
    except (ValueError, TypeError, KeyError) as error:
        checked = f"raised {_builtin_name(error)}"
    whole = dict(device_map)
    cleaned = clean_device_map(whole)
    partial = clean_device_map(dict(device_map), case["module"])
    return checked, cleaned, whole, partial


def scenario_dtype_byte_size(case: dict):
    """dtype_byte_size of one torch dtype, given as the dtype object."""
    from accelerate.utils import dtype_byte_size

    return dtype_byte_size(getattr(torch, case["dtype"]))


def dtype_cases(seed: int, count: int) -> list[dict]:
    """Cases for dtype_byte_size: ``count`` dtypes of torch's (all of them when ``count`` is larger), seeded order."""
    names = sorted(name for name in dir(torch) if isinstance(getattr(torch, name, None), torch.dtype))
    random.Random(seed).shuffle(names)
    return [{"seed": seed * 100_000 + index, "dtype": name} for index, name in enumerate(names[:count])]


def tree_cases(seed: int, count: int) -> list[dict]:
    """Cases that only need a tree (module sizes, tensors, ties) with a dtype and special dtypes."""
    rng = random.Random(seed)
    cases = []
    for index in range(count):
        tree_seed, knobs = rng.randrange(10**6), random_knobs(rng)
        model = random_tree(tree_seed, knobs)
        cases.append(
            {
                "seed": seed * 100_000 + index,
                "tree": tree_seed,
                "knobs": knobs,
                "dtype": rng.choice(DTYPES),
                "special_dtypes": _special_dtypes(rng, model),
                "no_split": no_split_choice(rng, model),
            }
        )
    return cases
