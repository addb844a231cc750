"""Generated scenarios for the differential tests of the operations on nested structures (tests/differential.py).

A case is plain JSON: the structures it works on are *specs* (below), built into tensors and containers inside the
scenario, on each side, from the spec alone, so both sides see the same data. ``generate_*`` functions turn a seed
into cases; ``ops`` and ``collectives`` are the scenarios (``import accelerate`` is hasten or the reference copy).

Specs: ``["T", dtype, shape, seed]`` a tensor, ``["NT", dtype, [shapes], seed]`` a nested tensor, ``["v", x]`` a
plain JSON value, ``[kind, [items]]`` for ``list``/``tuple``/``pair`` (a namedtuple)/``empty_tuple``, and
``[kind, [[key, spec], ...]]`` for ``dict``/``udict`` (a ``UserDict``)/``benc`` (a ``UserDict`` with a ``to``
method, as Transformers' ``BatchEncoding``). In a tensor's shape, ``"B"`` is the batch dimension, filled in when a
template is instantiated.
"""

from __future__ import annotations

import random
from collections import UserDict, namedtuple

DTYPES = ["float32", "float16", "bfloat16", "float64", "int64", "int32", "bool", "uint8"]
FLOATS = ["float32", "float16", "bfloat16", "float64"]
Pair = namedtuple("Pair", "first second")


class Encoding(UserDict):
    """A mapping with a ``to`` method that moves its tensors, as Transformers' ``BatchEncoding``."""

    def to(self, device, non_blocking=False):
        import torch

        self.data = {
            k: v.to(device, non_blocking=non_blocking) if isinstance(v, torch.Tensor) else v
            for k, v in self.data.items()
        }
        return self


# ------------------------------------------------------------------------------------------------ building specs


def build(spec):
    """The structure a spec describes (tensors filled deterministically from their seed)."""
    import torch

    kind, body = spec[0], spec[1]
    if kind == "T":
        return _tensor(body, spec[2], spec[3])
    if kind == "NT":
        return torch.nested.nested_tensor([_tensor(body, shape, spec[3] + i) for i, shape in enumerate(spec[2])])
    if kind == "v":
        return body
    if kind in ("list", "tuple", "empty_tuple"):
        items = [build(item) for item in body]
        return items if kind == "list" else tuple(items)
    if kind == "pair":
        return Pair(*[build(item) for item in body])
    mapping = {key: build(value) for key, value in body}
    return {"dict": dict, "udict": UserDict, "benc": Encoding}[kind](mapping)


def _tensor(dtype: str, shape: list, seed: int):
    import torch

    generator = torch.Generator().manual_seed(seed)
    dtype = getattr(torch, dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=generator).bool()
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=generator) * 4).to(dtype)
    return torch.randint(0 if dtype == torch.uint8 else -50, 100, shape, generator=generator).to(dtype)


def plain(value):
    """``value`` in a form the harness describes fully: mappings of any class, nested tensors, shape records."""
    import torch

    if isinstance(value, torch.Tensor) and value.is_nested:
        return {"nested": [plain(t) for t in value.unbind()], "dtype": str(value.dtype)}
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return {"namedtuple": type(value).__name__, "items": [plain(v) for v in value]}
    if isinstance(value, (list, tuple)):
        return type(value)(plain(v) for v in value)
    if hasattr(value, "items") and hasattr(value, "keys"):
        return {"mapping": type(value).__name__, "items": [[k, plain(v)] for k, v in value.items()]}
    if hasattr(value, "shape") and hasattr(value, "dtype") and not isinstance(value, (int, float)):
        return {"record": type(value).__name__, "shape": list(value.shape), "dtype": str(value.dtype)}
    return value


# ---------------------------------------------------------------------------------------------- generating specs


def random_template(rng: random.Random, depth: int = 0, leaves: tuple = ("tensor",) * 5 + ("value", "nested")) -> list:
    """A random structure template: containers of every kind nesting tensors with a batch dimension, values, nested
    tensors and (rarely) empty containers."""
    if depth >= 3 or rng.random() < 0.35:
        return _random_leaf(rng, rng.choice(leaves))
    kind = rng.choice(["list", "tuple", "pair", "dict", "udict", "benc", "dict", "list"])
    if kind == "pair":
        return ["pair", [random_template(rng, depth + 1, leaves) for _ in range(2)]]
    count = rng.choice([0, 1, 2, 2, 3]) if depth else rng.choice([1, 2, 3])
    if kind in ("list", "tuple"):
        return [kind, [random_template(rng, depth + 1, leaves) for _ in range(count)]]
    return [kind, [[f"k{i}", random_template(rng, depth + 1, leaves)] for i in range(count)]]


def _random_leaf(rng: random.Random, kind: str) -> list:
    if kind == "value":
        return ["v", rng.choice([1, 2.5, "text", None, True, -3])]
    if kind == "nested":
        return ["NT", rng.choice(FLOATS[:1] + ["int64"]), [[rng.randint(1, 3)] for _ in range(2)], rng.randrange(10**6)]
    dims = rng.choice([["B"], ["B", 3], ["B", 2, 2], ["B", 4]])
    return ["T", rng.choice(DTYPES), dims, rng.randrange(10**6)]


def instantiate(template: list, batch: int, salt: int = 0) -> list:
    """``template`` with its batch dimensions set to ``batch`` and its tensor seeds moved by ``salt``."""
    kind, body = template[0], template[1]
    if kind == "T":
        return ["T", body, [batch if d == "B" else d for d in template[2]], template[3] + salt]
    if kind == "NT":
        return ["NT", body, template[2], template[3] + salt]
    if kind == "v":
        return template
    if kind in ("list", "tuple", "pair", "empty_tuple"):
        return [kind, [instantiate(item, batch, salt) for item in body]]
    return [kind, [[key, instantiate(value, batch, salt)] for key, value in body]]


def zero_dim_tensor(rng: random.Random) -> list:
    return ["T", rng.choice(DTYPES), [], rng.randrange(10**6)]


# ----------------------------------------------------------------------------------------- one-process scenario


def double(tensor):
    return tensor * 2


def add(tensor, amount, scale=1):
    return (tensor + amount) * scale


def is_float_tensor(value):
    import torch

    return isinstance(value, torch.Tensor) and value.is_floating_point()


def has_shape(value):
    return hasattr(value, "shape")


def shapes_only(value):
    """``plain(value)`` with every tensor replaced by its dtype and shape (for uninitialised memory)."""
    import torch

    value = plain(value)
    if isinstance(value, torch.Tensor):
        return {"empty": str(value.dtype), "shape": list(value.shape)}
    if isinstance(value, (list, tuple)):
        return type(value)(shapes_only(v) for v in value)
    if isinstance(value, dict):
        return {k: shapes_only(v) for k, v in value.items()}
    return value


def ops(case: dict):
    """One operation of ``accelerate.utils.operations`` on built structures, in one process."""
    from accelerate.utils import operations as O

    op, data = case["op"], build(case["data"]) if "data" in case else None
    if op == "send_to_device":
        return plain(O.send_to_device(data, "cpu", non_blocking=case["non_blocking"], skip_keys=case["skip_keys"]))
    if op == "recursively_apply":
        test_type = {"tensor": O.is_torch_tensor, "float": is_float_tensor, "shape": has_shape}[case["test_type"]]
        func = {"double": double, "add": add}[case["func"]]
        extra = ([3], {"scale": 2}) if case["func"] == "add" else ([], {})
        return plain(
            O.recursively_apply(
                func, data, *extra[0], test_type=test_type, error_on_other_type=case["strict"], **extra[1]
            )
        )
    if op == "concatenate":
        return plain(O.concatenate([build(part) for part in case["parts"]], dim=case["dim"]))
    if op == "slice_tensors":
        return plain(O.slice_tensors(data, slice(*case["slice"])))
    if op in (
        "find_batch_size",
        "ignorant_find_batch_size",
        "listify",
        "convert_to_fp32",
        "is_namedtuple",
        "get_data_structure",
    ):
        return plain(getattr(O, op)(data))
    if op == "initialize_tensors":
        return shapes_only(O.initialize_tensors(O.get_data_structure(data)))
    if op == "honor_type":
        return plain(O.honor_type(data, (item for item in build(case["items"]))))
    if op == "pad_input_tensors":
        return plain(O.pad_input_tensors(data, case["batch_size"], case["num_processes"], dim=case["dim"]))
    if op == "pad_across_processes":
        result = O.pad_across_processes(data, dim=case["dim"], pad_index=case["pad_index"], pad_first=case["pad_first"])
        return {"same_object": result is data, "result": plain(result)}
    if op in ("gather", "reduce", "broadcast"):
        kwargs = {"reduction": case["reduction"], "scale": case["scale"]} if op == "reduce" else {}
        return plain(getattr(O, op)(data, **kwargs))
    raise ValueError(f"unknown op {op}")


def _structure(rng: random.Random, leaves=None) -> list:
    """A random structure: mostly a template at a random batch size, sometimes a bare 0-d tensor or an empty
    container."""
    roll = rng.random()
    if roll < 0.05:
        return zero_dim_tensor(rng)
    if roll < 0.09:
        return rng.choice([["list", []], ["dict", []], ["tuple", []]])
    template = random_template(rng, leaves=leaves) if leaves else random_template(rng)
    return instantiate(template, rng.randint(1, 5))


def _one_op_case(rng: random.Random, op: str) -> dict:
    case = {"op": op}
    if op == "concatenate":
        template = random_template(rng, leaves=("tensor",) * 8 + ("value",))
        parts = rng.choice([1, 2, 2, 3])
        case.update(
            parts=[instantiate(template, rng.randint(1, 4), salt=i) for i in range(parts)],
            dim=rng.choice([0, 0, 0, -1]),
        )
        return case
    case["data"] = _structure(rng)
    if op == "send_to_device":
        case.update(non_blocking=rng.random() < 0.3, skip_keys=rng.choice([None, "k0", ["k1"], ["k0", "k2"]]))
    elif op == "recursively_apply":
        case.update(
            test_type=rng.choice(["tensor", "tensor", "float", "shape"]),
            func=rng.choice(["double", "add"]),
            strict=rng.random() < 0.4,
        )
    elif op == "slice_tensors":
        case["slice"] = rng.choice([[0, 1], [1, None], [None, 2], [None, None, 2], [-2, None]])
    elif op == "honor_type":
        case["data"] = rng.choice([["list", []], ["tuple", []], ["pair", [["v", 0], ["v", 0]]]])
        case["items"] = ["list", [_structure(rng) for _ in range(2)]]
    elif op == "pad_input_tensors":
        batch = rng.randint(1, 7)
        case.update(
            data=instantiate(random_template(rng, leaves=("tensor",)), batch),
            batch_size=batch,
            num_processes=rng.randint(1, 4),
            dim=0,
        )
    elif op == "pad_across_processes":
        case.update(dim=rng.choice([0, 1, -1, 3, -4]), pad_index=rng.choice([0, -1, 5]), pad_first=rng.random() < 0.5)
        if rng.random() < 0.2:  # a nested tensor before a value that is not a tensor
            case["data"] = ["list", [_random_leaf(rng, "nested"), _random_leaf(rng, "value")]]
    elif op == "reduce":
        case.update(reduction=rng.choice(["sum", "mean", "max", "none"]), scale=rng.choice([1.0, 1.0, 0.5]))
    return case


ONE_PROCESS_OPS = [
    "send_to_device", "recursively_apply", "concatenate", "slice_tensors", "find_batch_size",
    "ignorant_find_batch_size",
    "listify", "convert_to_fp32", "is_namedtuple", "get_data_structure", "initialize_tensors", "honor_type",
    "pad_input_tensors", "pad_across_processes", "gather", "reduce", "broadcast",
]  # fmt: skip


def generate_ops_cases(seed: int, count: int) -> list[dict]:
    """``count`` one-process cases, every operation in turn, from ``seed`` (each case carries its own seed)."""
    cases = []
    for index in range(count):
        case_seed = seed * 100_003 + index
        case = _one_op_case(random.Random(case_seed), ONE_PROCESS_OPS[index % len(ONE_PROCESS_OPS)])
        cases.append({"seed": case_seed, **case})
    return cases


# ---------------------------------------------------------------------------------------- multi-process scenario


def collectives(case: dict):
    """One collective on every process: each process builds the case's template with its own values (same shapes,
    except the batch dimension of ``pad_across_processes``, which differs per process)."""
    from accelerate import PartialState
    from accelerate.utils import operations as O

    rank, op = PartialState(cpu=True).process_index, case["op"]
    if op in ("gather_object", "broadcast_object_list"):
        mine = [rank, *build(case["object"])] if case["as_list"] else {"rank": rank, "value": build(case["object"])}
        if op == "gather_object":
            return plain(O.gather_object(mine))
        return plain(O.broadcast_object_list(mine if case["as_list"] else [mine, rank], from_process=case["from"]))
    batch = case["batches"][rank] if op == "pad_across_processes" else case["batch"]
    data = build(instantiate(case["template"], batch, salt=rank * 7919))
    if op == "gather":
        return plain(O.gather(data))
    if op == "reduce":
        return plain(O.reduce(data, reduction=case["reduction"], scale=case["scale"]))
    if op == "broadcast":
        result = O.broadcast(data, from_process=case["from"])
        return plain(result)
    if op == "pad_across_processes":
        return plain(
            O.pad_across_processes(data, dim=case["dim"], pad_index=case["pad_index"], pad_first=case["pad_first"])
        )
    raise ValueError(f"unknown op {op}")


MULTI_PROCESS_OPS = ["gather", "reduce", "broadcast", "pad_across_processes", "gather_object", "broadcast_object_list"]


def _collective_case(rng: random.Random, op: str) -> dict:
    if op in ("gather_object", "broadcast_object_list"):
        values = [["v", rng.choice([1, "a", 2.5, None, True])] for _ in range(rng.randint(0, 3))]
        return {"op": op, "object": ["list", values], "as_list": rng.random() < 0.7, "from": rng.choice([0, 1])}
    leaves = ("tensor",) * 6 + ("value",) if op == "gather" else ("tensor",)
    case = {"op": op, "template": random_template(rng, leaves=leaves), "batch": rng.randint(1, 4)}
    if op == "reduce":
        dtypes = rng.choice([FLOATS, FLOATS, DTYPES])
        case["template"] = _retype(case["template"], rng, dtypes)
        case.update(
            reduction=rng.choice(["sum", "mean", "max", "sum", "mean", "none", "min"]),
            scale=rng.choice([1.0, 1.0, 1.0, 0.5]),
        )
    elif op == "broadcast":
        case["from"] = rng.choice([0, 1])
    elif op == "pad_across_processes":
        case.update(
            batches=[rng.randint(1, 4), rng.randint(1, 4)],
            dim=rng.choice([0, 0, 1, -1, 4]),
            pad_index=rng.choice([0, -1, 7]),
            pad_first=rng.random() < 0.5,
        )
        if rng.random() < 0.3:
            case["template"] = ["T", rng.choice(DTYPES), [2, "B"], rng.randrange(10**6)]
    return case


def _retype(template: list, rng: random.Random, dtypes: list) -> list:
    kind, body = template[0], template[1]
    if kind == "T":
        return ["T", rng.choice(dtypes), template[2], template[3]]
    if kind in ("list", "tuple", "pair"):
        return [kind, [_retype(item, rng, dtypes) for item in body]]
    if kind in ("dict", "udict", "benc"):
        return [kind, [[key, _retype(value, rng, dtypes)] for key, value in body]]
    return template


def generate_collective_cases(seed: int, count: int) -> list[dict]:
    """``count`` two-process cases, every collective in turn, from ``seed``."""
    cases = []
    for index in range(count):
        case_seed = seed * 100_003 + index
        cases.append(
            {
                "seed": case_seed,
                **_collective_case(random.Random(case_seed), MULTI_PROCESS_OPS[index % len(MULTI_PROCESS_OPS)]),
            }
        )
    return cases
