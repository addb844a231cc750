"""Differential scenarios of ``torch.compile`` through ``prepare`` and of the regional compilation helpers;
tests/compat/test_differential_compile.py runs them against the reference copy of Accelerate 1.15.

``train`` prepares a generated model with ``TorchDynamoPlugin(backend=..., use_regional_compilation=...)`` on one
engine (one process, DDP, FSDP2 or DeepSpeed), trains it for a number of steps with bf16 mixed precision, gradient
accumulation and clipping, and returns what was compiled (the module names, without the ``_orig_mod``/``module``
levels that wrappers add) and dynamo's counters: unique graphs, frames compiled, graph breaks and recompilations.
``helpers`` runs the public helpers (``is_repeated_blocks``, ``has_repeated_blocks``, ``compile_regions``,
``compile_regions_deepspeed``, ``compile_regions_fsdp2``, ``has_compiled_regions``) on a generated model and
returns what they answered and what they compiled. Dynamo's counters do not depend on the backend, so the generated
cases use ``"eager"`` or ``"aot_eager"``.

Accelerate 1.15 runs FSDP and DeepSpeed only on GPUs (it labels CPU processes MULTI_CPU whatever the plugin); on
its side the FSDP2 scenario labels the state FSDP with the case's plugin, as a GPU run would have, and the
DeepSpeed scenario starts it as a DeepSpeed launch does without ``ACCELERATE_USE_CPU``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, SEQUENCE = 48, 8
SIDE = os.environ.get("HASTEN_DIFFERENTIAL_SIDE", "hasten")

# ---------------------------------------------------------------------------------------------------- models


class Block(nn.Module):
    """A pre-norm attention and MLP block."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))

    def forward(self, x):
        batch, length, width = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(batch, length, 3, self.heads, width // self.heads).permute(2, 0, 3, 1, 4)
        attention = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(x.shape)
        x = x + self.proj(attention)
        return x + self.mlp(self.norm2(x))


class ScaledBlock(Block):
    """A subclass of Block: a list that starts with a Block and holds ScaledBlocks is still repeated blocks."""

    def forward(self, x):
        return super().forward(x) * 0.5


class Feedforward(nn.Module):
    """A block of another class (a list mixing it with Blocks is not repeated blocks)."""

    def __init__(self, width: int, heads: int = 0):
        super().__init__()
        self.norm, self.fc = nn.LayerNorm(width), nn.Linear(width, width)

    def forward(self, x):
        return x + self.fc(self.norm(x))


class Stage(nn.Module):
    """A few blocks in a list of their own, and a norm: a stage of a nested model."""

    def __init__(self, width: int, heads: int, depth: int):
        super().__init__()
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(depth))
        self.norm = nn.LayerNorm(width)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.norm(x)


_LAYERS = {"block": Block, "scaled": ScaledBlock, "feedforward": Feedforward}


class GPT(nn.Module):
    """Token and position embeddings, a list of layers (the case's classes), a final norm and a head, tied to the
    token embedding or not; optional extras: a dropout, a module forward never calls, a nested stage list."""

    def __init__(self, spec: dict):
        super().__init__()
        width, heads = spec["width"], spec["heads"]
        self.tokens = nn.Embedding(VOCAB, width)
        self.positions = nn.Embedding(SEQUENCE, width)
        self.drop = nn.Dropout(0.0) if spec.get("dropout") else None
        self.blocks = nn.ModuleList(_LAYERS[name](width, heads) for name in spec["layers"])
        if spec.get("stages"):
            self.stages = nn.ModuleList(Stage(width, heads, depth) for depth in spec["stages"])
        if spec.get("groups"):
            self.groups = nn.ModuleList(nn.ModuleList(Block(width, heads) for _ in range(n)) for n in spec["groups"])
        if spec.get("unused"):
            self.unused = nn.Linear(width, width)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, VOCAB, bias=False)
        if spec.get("tied"):
            self.head.weight = self.tokens.weight

    def forward(self, ids):
        x = self.tokens(ids) + self.positions(torch.arange(ids.shape[1], device=ids.device))
        if self.drop is not None:
            x = self.drop(x)
        for block in self.blocks:
            x = block(x)
        for stage in getattr(self, "stages", ()):
            x = stage(x)
        for group in getattr(self, "groups", ()):
            for block in group:
                x = block(x)
        return self.head(self.norm(x))


class Flat(nn.Module):
    """No repeated blocks: an embedding and an MLP."""

    def __init__(self, spec: dict):
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, spec["width"])
        self.mlp = nn.Sequential(nn.Linear(spec["width"], spec["width"]), nn.Tanh(), nn.Linear(spec["width"], VOCAB))

    def forward(self, ids):
        return self.mlp(self.tokens(ids))


def _hf_model(spec: dict):
    """A tiny Transformers Llama or GPT-2 built from its config class (no download)."""
    import transformers

    if spec["kind"] == "llama":
        config = transformers.LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=spec["width"],
            intermediate_size=2 * spec["width"],
            num_hidden_layers=len(spec["layers"]),
            num_attention_heads=spec["heads"],
            num_key_value_heads=max(1, spec["heads"] // 2),
            max_position_embeddings=SEQUENCE,
            tie_word_embeddings=bool(spec.get("tied")),
            attn_implementation="sdpa",
        )
        return transformers.LlamaForCausalLM(config)
    config = transformers.GPT2Config(
        vocab_size=VOCAB,
        n_embd=spec["width"],
        n_layer=len(spec["layers"]),
        n_head=spec["heads"],
        n_positions=SEQUENCE,
        tie_word_embeddings=bool(spec.get("tied", True)),
        attn_implementation="sdpa",
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return transformers.GPT2LMHeadModel(config)


def build_model(spec: dict) -> nn.Module:
    """The model a case describes, its weights drawn from the case's seed."""
    torch.manual_seed(spec.get("seed", 0))
    if spec["kind"] in ("llama", "gpt2"):
        return _hf_model(spec)
    if spec["kind"] == "flat":
        return Flat(spec)
    return GPT(spec)


def block_classes(spec: dict) -> list[str]:
    """The class names FSDP wraps on its own: the model's decoder layers (the final norm of a model without any)."""
    if spec["kind"] in ("llama", "gpt2"):
        return {"llama": ["LlamaDecoderLayer"], "gpt2": ["GPT2Block"]}[spec["kind"]]
    if spec["kind"] == "flat":
        return ["Sequential"]
    return ["Block"] if has_blocks(spec) else ["LayerNorm"]


def has_blocks(spec: dict) -> bool:
    """Whether the model holds repeated blocks (a list of Blocks, or of Blocks and their subclasses)."""
    if spec["kind"] in ("llama", "gpt2"):
        return True
    layers = spec.get("layers", [])
    repeated = bool(layers) and layers[0] == "block" and "feedforward" not in layers
    return spec["kind"] != "flat" and (repeated or bool(spec.get("stages")) or bool(spec.get("groups")))


def logits(model, ids):
    out = model(ids)
    return out.logits if hasattr(out, "logits") else out


def random_spec(rng: random.Random, repeated: bool = False, unused: bool = True) -> dict:
    """A generated model: GPT-style (lists of one class, of a class and its subclasses, of several classes, empty;
    a list of stages that hold lists of their own; a tied head; a dropout, a module never called), a Transformers
    Llama or GPT-2 (tied or not), or a model without repeated blocks; with ``repeated``, one with repeated blocks;
    without ``unused``, no module that forward never calls (DDP refuses parameters without gradients).

    Lists that Accelerate's ``compile_regions`` would compile as a whole beside repeated blocks (a list of lists, a
    list of several classes or an empty list next to the stages) are left out: its twin cannot iterate them
    (test_differential_compile.ALLOWED)."""
    kinds = ["gpt", "gpt", "nested", "llama", "gpt2"] + ([] if repeated else ["gpt", "flat"])
    kind = rng.choice(kinds)
    heads = rng.choice([1, 2, 4])
    depth = rng.randint(1, 3)
    spec = {"kind": kind, "width": heads * rng.choice([4, 8]), "heads": heads, "seed": rng.randrange(1000)}
    spec["layers"] = ["block"] * depth
    spec["tied"] = rng.random() < 0.4
    if kind in ("gpt", "nested"):
        shapes = ["same", "same", "subclass_after"]
        if kind == "gpt" and not repeated:
            shapes += ["subclass_first", "mixed", "empty"]
        spec["layers"] = {
            "same": ["block"] * depth,
            "subclass_after": ["block"] + ["scaled"] * depth,
            "subclass_first": ["scaled"] + ["block"] * depth,
            "mixed": ["block", "feedforward"] * depth,
            "empty": [],
        }[rng.choice(shapes)]
        spec["dropout"] = rng.random() < 0.3
        spec["unused"] = unused and rng.random() < 0.2
    if kind == "nested":
        spec["stages"] = [rng.randint(1, 2) for _ in range(rng.randint(1, 2))]
    return spec


# ---------------------------------------------------------------------------------------------------- what compiled


def _is_wrapper(module) -> bool:
    """DDP or DeepSpeed's engine: its ``module`` child is the model, a level the names leave out."""
    return isinstance(module, nn.parallel.DistributedDataParallel) or type(module).__name__ == "DeepSpeedEngine"


_CONTAINERS = (nn.ModuleList, nn.ModuleDict)


def compiled_names(model) -> list[str]:
    """The names of the modules compiled on their own (``torch.compile`` wrappers, or ``nn.Module.compile`` in place),
    as the user's model names them; containers compiled in place are left out (they are never called)."""
    found = []

    def walk(module, parts):
        if isinstance(module, torch._dynamo.eval_frame.OptimizedModule):
            found.append(".".join(parts))
            walk(module._orig_mod, parts)
            return
        if getattr(module, "_compiled_call_impl", None) is not None and not isinstance(module, _CONTAINERS):
            found.append(".".join(parts))
        for name, child in module._modules.items():
            if child is not None:
                walk(child, parts if _is_wrapper(module) and name == "module" else [*parts, name])

    walk(model, [])
    return sorted(found)


class _Recompiles(logging.Handler):
    """Counts dynamo's "Recompiling function ..." records."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def emit(self, record):
        self.count += 1


@contextlib.contextmanager
def dynamo_counting():
    """Fresh dynamo caches and counters; yields a function returning the counts so far."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch._logging.set_logs(recompiles=True)
    logger = logging.getLogger("torch._dynamo.guards.__recompiles")
    handler = _Recompiles()
    logger.addHandler(handler)
    logger.propagate = False

    def counts() -> dict:
        return {
            "unique_graphs": counters["stats"]["unique_graphs"],
            "frames": counters["frames"]["total"],
            "graph_breaks": sum(counters["graph_break"].values()),
            "recompiles": handler.count,
        }

    try:
        yield counts
    finally:
        logger.removeHandler(handler)
        logger.propagate = True
        torch._logging.set_logs()
        torch._dynamo.reset()


# ---------------------------------------------------------------------------------------------------- helpers


def helpers(case: dict) -> dict:
    """What the public helpers answer for each module of a generated model, what they compile, the twin that
    ``compile_regions`` makes (its attributes, and its outputs: the model's)."""
    from types import MethodType

    from accelerate.utils.other import (
        compile_regions,
        compile_regions_deepspeed,
        compile_regions_fsdp2,
        has_compiled_regions,
        has_repeated_blocks,
        is_repeated_blocks,
    )

    spec = case["model"]
    model = build_model(spec)
    if case.get("patched_forward"):
        model.forward = MethodType(type(model).forward, model)
    result = {
        "is_repeated_blocks": [name for name, m in model.named_modules() if is_repeated_blocks(m)],
        "has_repeated_blocks": [name for name, m in model.named_modules() if has_repeated_blocks(m)],
        "has_compiled_regions": has_compiled_regions(model),
    }
    twin = compile_regions(model, backend="eager")
    ids = torch.randint(0, VOCAB, (2, SEQUENCE), generator=torch.Generator().manual_seed(case["seed"]))
    with torch.no_grad():
        same_outputs = torch.equal(logits(twin, ids), logits(model, ids))
    result["compile_regions"] = {
        "same_object": twin is model,
        "same_class": type(twin) is type(model),
        "compiled": compiled_names(twin),
        "original_untouched": compiled_names(model),
        "keeps_original": twin.__dict__.get("_orig_mod") is model,
        "shares_attributes": [twin.__dict__.get(key) is model.__dict__.get(key) for key in ("_parameters", "_buffers")],
        "forward_bound_to_twin": getattr(twin.__dict__.get("forward"), "__self__", None) is twin,
        "state_dict": list(twin.state_dict()),
        "has_compiled_regions": has_compiled_regions(twin),
        "child_types": [type(child).__name__ for child in twin.children()],
        "same_outputs": same_outputs,
    }
    for name, helper in (("fsdp2", compile_regions_fsdp2), ("deepspeed", compile_regions_deepspeed)):
        fresh = build_model(spec)
        returned = helper(fresh, backend="eager")
        result[name] = {
            "returned": "model" if returned is fresh else repr(returned),
            "compiled": compiled_names(fresh),
            "state_dict": list(fresh.state_dict()),
        }
    return result


def in_place_regions(case: dict) -> bool:
    """``has_compiled_regions`` of a model compiled in place by ``compile_regions_fsdp2``."""
    from accelerate.utils.other import compile_regions_fsdp2, has_compiled_regions

    return has_compiled_regions(compile_regions_fsdp2(build_model(case["model"]), backend="eager"))


def helper_cases(seed: int, count: int) -> list[dict]:
    rng = random.Random(seed)
    return [
        {"seed": seed * 1000 + i, "model": random_spec(rng), "patched_forward": rng.random() < 0.3}
        for i in range(count)
    ]


# ---------------------------------------------------------------------------------------------------- training


def _plugins(case: dict) -> dict:
    from accelerate.utils import DeepSpeedPlugin, FullyShardedDataParallelPlugin

    engine = case["engine"]
    if engine == "fsdp2":
        return {
            "fsdp_plugin": FullyShardedDataParallelPlugin(
                fsdp_version=2,
                auto_wrap_policy="transformer_based_wrap",
                transformer_cls_names_to_wrap=block_classes(case["model"]),
                activation_checkpointing=case.get("activation_checkpointing", False),
                state_dict_type="SHARDED_STATE_DICT",
            )
        }
    if engine == "deepspeed":
        return {
            "deepspeed_plugin": DeepSpeedPlugin(
                zero_stage=case["zero_stage"],
                gradient_accumulation_steps=case["accumulation"],
                gradient_clipping=1.0 if case["clip"] else None,
            )
        }
    return {}


@contextlib.contextmanager
def _engine_environment(case: dict):
    """What a DeepSpeed launch sets: no ``ACCELERATE_USE_CPU`` (Accelerate's CPU flag turns DeepSpeed off); the
    variables are put back afterwards."""
    saved = dict(os.environ)
    if case["engine"] == "deepspeed":
        os.environ.pop("ACCELERATE_USE_CPU", None)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _label_fsdp_on_cpu(accelerator, plugin) -> None:
    """Accelerate's state labels CPU processes MULTI_CPU even with an FSDP plugin; label it FSDP, as on GPUs."""
    from accelerate.utils import DistributedType

    state = accelerator.state
    state.distributed_type = DistributedType.FSDP
    plugin.set_mixed_precision(state.mixed_precision)
    state.fsdp_plugin = plugin


def train(case: dict) -> dict:
    """Prepare, train ``case["steps"]`` steps, and report what was compiled and dynamo's counts."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState, PartialState
    from accelerate.utils import TorchDynamoPlugin

    AcceleratorState._reset_state(reset_partial_state=True)  # each case its own settings (the process group stays)
    GradientState._reset_state()
    with _engine_environment(case), dynamo_counting() as counts:
        plugins = _plugins(case)
        if case["engine"] == "deepspeed":  # without it Accelerate gives each CPU process a world of its own
            PartialState(backend="gloo")
        dynamo = TorchDynamoPlugin(backend=case["backend"], use_regional_compilation=case["regional"])
        accelerator = Accelerator(
            mixed_precision="bf16",
            gradient_accumulation_steps=case["accumulation"],
            dynamo_plugin=dynamo,
            **plugins,
        )
        if case["engine"] == "fsdp2" and SIDE == "accelerate":
            _label_fsdp_on_cpu(accelerator, plugins["fsdp_plugin"])
        model = build_model(case["model"])
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        generator = torch.Generator().manual_seed(case["seed"])
        tokens = torch.randint(0, VOCAB, (case["steps"] * case["batch"], SEQUENCE + 1), generator=generator)
        data = torch.utils.data.TensorDataset(tokens[:, :-1], tokens[:, 1:])
        loader = torch.utils.data.DataLoader(data, batch_size=case["batch"])
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        prepared = compiled_names(model)
        losses, first_window = [], None
        for ids, targets in loader:
            with accelerator.accumulate(model):
                loss = F.cross_entropy(logits(model, ids).float().flatten(0, 1), targets.flatten())
                accelerator.backward(loss)
                if accelerator.sync_gradients and case["clip"] and case["engine"] != "deepspeed":
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                optimizer.zero_grad()
            losses.append(loss.detach().float())
            if accelerator.sync_gradients and first_window is None:
                first_window = counts()
        final = counts()
        result = {
            "compiled": prepared,
            **final,
            "recompiles_after_first_update": final["recompiles"] - first_window["recompiles"],
            "finite": bool(torch.isfinite(torch.stack(losses)).all()),
        }
        accelerator.free_memory()
    return result


def training_cases(seed: int, count: int, engine: str, backend: str = "eager", steps: int = 50) -> list[dict]:
    """Generated training runs on one engine (``"single"``, ``"ddp"``, ``"fsdp2"`` or ``"deepspeed"``).

    FSDP2 runs compile models with repeated blocks by region, without activation checkpointing: a model compiled
    whole there, and checkpointed blocks, are allowed differences (test_differential_compile.ALLOWED)."""
    rng = random.Random(seed)
    cases = []
    for i in range(count):
        case = {
            "seed": seed * 1000 + i,
            "engine": engine,
            "model": random_spec(rng, repeated=engine == "fsdp2", unused=engine == "single"),
            "backend": backend if backend != "mixed" else rng.choice(["eager", "aot_eager"]),
            "regional": engine == "fsdp2" or i % 3 != 2,  # two of three, the first one included
            "accumulation": rng.choice([1, 2, 3]),
            "clip": rng.random() < 0.7,
            "batch": rng.choice([1, 2]),
            "steps": steps,
        }
        if engine == "deepspeed":
            case["zero_stage"] = 2 + i % 2
        cases.append(case)
    return cases
