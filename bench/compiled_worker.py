"""One worker process of ``bench/bench_gpu_compile.py``: trains ``bench_gpu_lm``'s language model with each
contestant given (``--specs precision/mode/name[+profile] ...``, see ``compiled_runs.NAMES``) in turn, compiled,
and appends one JSON line per contestant to ``--output`` (a ``start`` event, then its ``result``), so that what was
measured survives a later contestant's failure.

Every contestant builds the model on the device from seed 0 (the same weights in every process), with the same
fused AdamW and the same learnable token stream (``next = 5 * token + 3``), runs ``--warmup`` untimed steps (the
first one compiles: its seconds are reported), then ``--segments`` timed segments of ``--segment-steps`` steps
(tokens/s per segment), records the loss of every step and the peak memory of the timed steps, what dynamo did
(graphs, graph breaks, recompilations; ``profile_compiled.DynamoWatch``) and which modules run compiled; a
``+profile`` contestant then runs ``profile_compiled.collect`` on a few more steps. ``--prewarm`` runs one forward
and backward per contestant (no optimizer step) only to fill torch's compile caches.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import importlib
import json
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_gpu_lm import SIZES, _gpt, _loader, _loss, _optimizer, _sync  # noqa: E402
from compiled_runs import Spec, real_accelerate  # noqa: E402
from profile_compiled import PROFILE_STEPS, DynamoWatch, collect, compiled_modules  # noqa: E402

SMALL_IN, SMALL_OUT = 4096, 1024  # "sized" filter: in <= 4096 and out <= 1024 is too small (torchao, H100, tensorwise)


class Unavailable(Exception):
    """A contestant that cannot run here (the reason is reported, the others run)."""


def sized_filter(model):
    """A float8 module filter: every ``nn.Linear`` but the model's last one (the output head), those whose sizes are
    not multiples of 16, and those too small for float8 matmuls to pay (in_features <= 4096 and out_features <= 1024,
    the threshold torchao measured on H100 for tensorwise scaling)."""
    from torch import nn

    linears = [name for name, module in model.named_modules() if isinstance(module, nn.Linear)]
    last = linears[-1] if linears else None

    def convert(module, fqn: str) -> bool:
        if fqn == last or module.in_features % 16 or module.out_features % 16:
            return False
        return not (module.in_features <= SMALL_IN and module.out_features <= SMALL_OUT)

    return convert


def _recipe(spec: Spec, utils, model, device):
    """The ``AORecipeKwargs`` of an fp8 contestant (None: the library's default, nothing passed); on a CPU the same
    recipe with emulated float8 matmuls."""
    from torchao.float8 import Float8LinearConfig

    emulate = device.type != "cuda"
    if spec.name.endswith("-rowwise"):
        config = Float8LinearConfig.from_recipe_name("rowwise")
        return utils.AORecipeKwargs(config=dataclasses.replace(config, emulate=emulate))
    gather = not spec.name.endswith("-noag")
    extra = {"module_filter_func": sized_filter(model)} if spec.name.endswith("-sized") else {}
    if emulate:  # the library default's config (pad, all-gather) with emulation
        config = Float8LinearConfig(emulate=True, pad_inner_dim=True, enable_fsdp_float8_all_gather=gather)
        return utils.AORecipeKwargs(config=config, **extra)
    if spec.library == "hasten" and not extra:
        return None
    return utils.AORecipeKwargs(enable_fsdp_float8_all_gather=gather, **extra)


def _library(name: str):
    if name == "accelerate" and real_accelerate() is None:
        raise Unavailable(
            "HuggingFace's Accelerate is not importable here (absent, or `accelerate` is hasten's alias): pass "
            "--accelerate-path FOLDER (the folder holding its accelerate/ package)"
        )
    return importlib.import_module(name), importlib.import_module(f"{name}.utils")


def _raw_regions(module, blocks_only: bool) -> list[tuple]:
    """``(parent, name)`` of the modules raw PyTorch compiles: the items of every ``nn.ModuleList`` of one class,
    and (unless ``blocks_only``) every other child that holds no such list, as Accelerate's regional compilation
    chooses. (``nn.Module.compile`` in place would leave built-in leaves such as ``nn.Linear`` uncompiled: dynamo
    skips their frames; ``torch.compile(child)`` put in the child's place compiles them.)"""
    from torch import nn

    def repeated(m) -> bool:
        return isinstance(m, nn.ModuleList) and len(m) > 0 and len({type(item) for item in m}) == 1

    regions = []
    for name, child in module.named_children():
        if repeated(child):
            regions += [(child, index) for index, _ in child.named_children()]
        elif any(repeated(m) for m in child.modules()):
            regions += _raw_regions(child, blocks_only)
        elif not blocks_only:
            regions.append((module, name))
    return regions


def _raw(spec: Spec, model, device, backend: str, loader):
    """Raw PyTorch: compile as ``spec`` says, autocast around forward and loss, GradScaler under fp16."""
    import torch

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[spec.precision]
    optimizer = _optimizer(model, device)
    if spec.mode == "whole":
        model = torch.compile(model, backend=backend)
    else:
        for parent, name in _raw_regions(model, blocks_only=spec.name == "raw-blocks"):
            setattr(parent, name, torch.compile(getattr(parent, name), backend=backend))
    scaler = torch.amp.GradScaler(device.type) if spec.precision == "fp16" else None

    def step(inputs, targets, update: bool = True):
        inputs, targets = inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True)
        with torch.autocast(device.type, dtype=dtype):
            loss = _loss(model(inputs), targets)
        (scaler.scale(loss) if scaler else loss).backward()
        if update:
            if scaler:
                scaler.step(optimizer)
                scaler.update()
            else:
                optimizer.step()
        optimizer.zero_grad()
        return loss

    return model, optimizer, loader, step, None


def _framework(spec: Spec, model, device, backend: str, loader):
    """hasten or Accelerate: ``Accelerator(mixed_precision, dynamo_plugin, kwargs_handlers)`` and its loop."""
    package, utils = _library(spec.library)
    keep = spec.name == "hasten-keep"
    handlers = [utils.AutocastKwargs(convert_outputs_to_fp32=False)] if keep else []
    recipe = _recipe(spec, utils, model, device) if spec.precision == "fp8" else None
    handlers += [recipe] if recipe is not None else []
    plugin = utils.TorchDynamoPlugin(backend=backend, use_regional_compilation=spec.mode == "regional")
    accelerator = package.Accelerator(
        mixed_precision=spec.precision,
        dynamo_plugin=plugin,
        kwargs_handlers=handlers,
        cpu=device.type == "cpu",
        dataloader_config=utils.DataLoaderConfiguration(non_blocking=True),
    )
    model, optimizer, loader = accelerator.prepare(model, _optimizer(model, device), loader)

    def step(inputs, targets, update: bool = True):
        with accelerator.autocast() if keep else contextlib.nullcontext():
            loss = _loss(model(inputs), targets)
        accelerator.backward(loss)
        if update:
            optimizer.step()
        optimizer.zero_grad()
        return loss

    return model, optimizer, loader, step, accelerator


def _fp8_facts(model, optimizer) -> dict:
    """How many layers compute in float8, and how much of the model the optimizer does not update (parameter
    tensors and their values)."""
    inner = getattr(optimizer, "optimizer", optimizer)
    held = {id(p) for group in inner.param_groups for p in group["params"]}
    module = getattr(model, "_orig_mod", model)
    params = list(module.parameters())
    missing = [p for p in params if id(p) not in held]
    return {
        "float8_layers": sum(type(m).__name__ == "Float8Linear" for m in module.modules()),
        "params_not_in_optimizer": len(missing),
        "values_not_in_optimizer": sum(p.numel() for p in missing),
        "params": len(params),
        "values": sum(p.numel() for p in params),
    }


def _timed(step, batches, device, args, note) -> dict:
    """Warm-up steps (the first one compiles; ``note`` is told its seconds), then the timed segments; losses of every
    step, peak memory."""
    import torch

    losses = []
    start = time.perf_counter()
    losses.append(step(*next(batches)).detach())
    _sync(device)
    first = time.perf_counter() - start
    note(first_step_s=first)
    for _ in range(args.warmup - 1):
        losses.append(step(*next(batches)).detach())
    _sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    seconds = []
    for _ in range(args.segments):
        start = time.perf_counter()
        for _ in range(args.segment_steps):
            losses.append(step(*next(batches)).detach())
        _sync(device)
        seconds.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    return {"first_step_s": first, "seconds": seconds, "peak_gib": peak, "losses": [float(x) for x in losses]}


def run_one(spec: Spec, args, device, watch: DynamoWatch, note) -> dict:
    """Build, prepare and train one contestant; its result (without the status). ``note(**fields)`` reports progress
    (the first step's seconds) before the result."""
    import torch

    config = dict(SIZES[args.size], **({"layers": args.layers} if args.layers else {}))
    steps = 1 if args.prewarm else args.warmup + args.segments * args.segment_steps
    steps += PROFILE_STEPS if spec.profile and not args.prewarm else 0
    torch.manual_seed(0)
    with torch.device(device):
        model = _gpt(config)
    loader = _loader(config, args.batch, steps, device.type == "cuda", learnable=True)
    watch.start()
    setup = _raw if spec.library == "raw" else _framework
    model, optimizer, loader, step, accelerator = setup(spec, model, device, args.backend, loader)
    batches = iter(loader)
    if args.prewarm:
        start = time.perf_counter()
        step(*next(batches), update=False)
        _sync(device)
        result = {"first_step_s": time.perf_counter() - start}
    else:
        result = _timed(step, batches, device, args, note)
        tokens = args.segment_steps * args.batch * config["sequence"]
        result["tokens_per_s"] = [tokens / s for s in result.pop("seconds")]
    result["dynamo"] = watch.stop()
    result["compiled"] = compiled_modules(model)
    if spec.precision == "fp8":
        result["fp8"] = _fp8_facts(model, optimizer)
    if spec.profile and not args.prewarm:
        result["profile"] = collect(step, batches, device)
    if accelerator is not None:
        accelerator.free_memory()
    return result


def _forget(device) -> None:
    """Drop compiled code, framework state and cached device memory between contestants."""
    import torch

    torch._dynamo.reset()
    for module, reset in (("hasten.state", "reset_state"), ("accelerate.state", None)):
        if module in sys.modules:
            state = sys.modules[module]
            if reset:
                getattr(state, reset)()
            else:
                state.AcceleratorState._reset_state(True)
                state.GradientState._reset_state()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _progress_writer(write, text: str):
    """``note(**fields)`` for :func:`run_one`: a ``progress`` event of contestant ``text``."""
    return lambda **fields: write({"event": "progress", "spec": text, **fields})


def main(argv: list[str] | None = None) -> int:
    """Run every ``--specs`` contestant in turn; one ``start`` and one ``result`` JSON line each in ``--output``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--specs", nargs="+", required=True)
    parser.add_argument("--output", required=True)
    parser.add_argument("--size", default="wide", choices=sorted(SIZES))
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--segments", type=int, default=3)
    parser.add_argument("--segment-steps", type=int, default=6)
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--layers", type=int, help="override the model's number of layers")
    parser.add_argument("--cpu", action="store_true")
    parser.add_argument("--prewarm", action="store_true")
    args = parser.parse_args(argv)
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device("cpu" if args.cpu else "cuda")
    watch = DynamoWatch()
    watch.install()
    with open(args.output, "a") as out:

        def write(event: dict) -> None:
            out.write(json.dumps(event) + "\n")
            out.flush()

        for text in args.specs:
            spec = Spec.parse(text)
            write({"event": "start", "spec": text})
            try:
                event = {"status": "ok", **run_one(spec, args, device, watch, _progress_writer(write, text))}
            except Unavailable as error:
                event = {"status": "skipped", "reason": str(error)}
            except Exception as error:  # noqa: BLE001 - reported; the next contestant still runs
                traceback.print_exc()
                event = {"status": "failed", "reason": f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"}
            _forget(device)
            write({"event": "result", "spec": text, **event})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
