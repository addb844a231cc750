"""GPU training throughput: a GPT-style language model, raw PyTorch vs hasten (vs accelerate when installed).

**Throughput** (``--precisions bf16 fp16``): a GPT-2-small-shaped model (12 layers, width 768, 12 heads, vocabulary
50257, sequence 1024: ~124M parameters, tied embeddings, ``scaled_dot_product_attention``) trains on random tokens
on one GPU, each precision in its own process (the precision is process-wide state in both frameworks):

* ``raw``: ``torch.autocast`` around forward and loss; under fp16 a ``torch.amp.GradScaler`` (scale, step, update).
* ``hasten``: ``Accelerator(mixed_precision=...)``, the prepared model's autocast forward, whose outputs are
  converted to fp32 as Accelerate does, the loss outside autocast, ``accelerator.backward``.
* ``hasten-keep``: the same with ``AutocastKwargs(convert_outputs_to_fp32=False)`` and the loss under
  ``accelerator.autocast()``: the raw loop's math (no fp32 copy of the logits).
* ``accelerate``: as ``hasten``, with HuggingFace's Accelerate (when the workers can import it: ``--accelerate-path``,
  the repository's ``.reference/accelerate-*``, or the installed one; never hasten's ``accelerate`` alias).

Rounds alternate the contestants (A B C, then C B A); each round builds the model from the same initial weights,
runs ``--warmup`` untimed steps and ``--steps`` timed steps (``torch.cuda.synchronize()`` at both ends). Reported
per contestant: tokens/s (median, min-max over rounds) and peak memory (CUDA: ``max_memory_allocated``, reset before
each round; CPU: the tensor memory of one extra step above its start, from the profiler's allocation events), then
the ratio of tokens/s to raw PyTorch last. Every loop uses the same AdamW (fused where available) and the same
pinned ``DataLoader``; the script checks that their losses after the timed steps agree. The logits are a temporary
of the loss expression, freed before backward; ``--hold-logits`` keeps them until after backward in every loop,
as a loop that keeps ``outputs = model(inputs)`` does (then the default's fp32 copy is held through backward).

Compiled steps and fp8 are measured by ``bench/bench_gpu_compile.py``, which reuses this file's model and loader.

Without CUDA the script says so and exits 0. ``--smoke`` runs a tiny model on the CPU instead, to check the script
itself anywhere (its timings mean nothing; its CPU memory figures compare the contestants). ``--json PATH`` writes
every figure.

Usage: python bench/bench_gpu_lm.py [--precisions bf16 fp16] [--rounds 5] [--steps 30] [--batch 8]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import describe, paired_ratio_range, ratio_of_medians, round_order  # noqa: E402
from compiled_runs import real_accelerate, worker_environment  # noqa: E402

SIZES = {
    "gpt2": {"layers": 12, "width": 768, "heads": 12, "vocab": 50257, "sequence": 1024},
    "wide": {"layers": 8, "width": 4096, "heads": 32, "vocab": 50257, "sequence": 1024},
    "smoke": {"layers": 2, "width": 64, "heads": 4, "vocab": 512, "sequence": 64},
    "cpu-vocab": {"layers": 1, "width": 64, "heads": 4, "vocab": 8192, "sequence": 64},
}


def _gpt(config: dict):
    import torch
    import torch.nn.functional as F
    from torch import nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            width = config["width"]
            self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
            self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
            self.fc, self.out = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

        def forward(self, x):
            batch, length, width = x.shape
            q, k, v = self.qkv(self.norm1(x)).split(width, dim=2)
            shape = (batch, length, config["heads"], width // config["heads"])
            q, k, v = (t.view(shape).transpose(1, 2) for t in (q, k, v))
            attention = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(attention.transpose(1, 2).reshape(batch, length, width))
            return x + self.out(F.gelu(self.fc(self.norm2(x)), approximate="tanh"))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.tokens = nn.Embedding(config["vocab"], config["width"])
            self.positions = nn.Embedding(config["sequence"], config["width"])
            self.blocks = nn.ModuleList(Block() for _ in range(config["layers"]))
            self.norm = nn.LayerNorm(config["width"])
            self.head = nn.Linear(config["width"], config["vocab"], bias=False)
            self.head.weight = self.tokens.weight  # tied, as in GPT-2
            for module in self.modules():  # GPT-2's initialisation
                if isinstance(module, (nn.Linear, nn.Embedding)):
                    nn.init.normal_(module.weight, std=0.02)
                if isinstance(module, nn.Linear) and module.bias is not None:
                    nn.init.zeros_(module.bias)

        def forward(self, idx):
            x = self.tokens(idx) + self.positions(torch.arange(idx.shape[1], device=idx.device))
            for block in self.blocks:
                x = block(x)
            return self.head(self.norm(x))

    return GPT()


def _loader(config: dict, batch: int, steps: int, pin: bool, learnable: bool = False):
    """``steps`` batches of random tokens, or (``learnable``) of the stream ``next = (5 * token + 3) % vocab``."""
    import torch

    generator = torch.Generator().manual_seed(1)
    if learnable:
        columns = [torch.randint(0, config["vocab"], (batch * steps, 1), generator=generator)]
        for _ in range(config["sequence"]):
            columns.append((columns[-1] * 5 + 3) % config["vocab"])
        tokens = torch.cat(columns, dim=1)
    else:
        tokens = torch.randint(0, config["vocab"], (batch * steps, config["sequence"] + 1), generator=generator)
    dataset = torch.utils.data.TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
    return torch.utils.data.DataLoader(dataset, batch_size=batch, shuffle=False, pin_memory=pin)


def _optimizer(model, device):
    import torch

    fused = {"fused": True} if device.type == "cuda" else {}
    return torch.optim.AdamW(model.parameters(), lr=3e-4, **fused)


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _peak_reset(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def _peak(device) -> float:
    import torch

    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0


def _cpu_step_peak(step) -> float:
    """GiB of tensor memory ``step()`` holds at its peak above what was held when it started (CPU allocations, read
    from the profiler's allocation and free events)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiler:
        step()
    events = sorted(
        (e for e in profiler.profiler.kineto_results.events() if e.name() == "[memory]"), key=lambda e: e.start_ns()
    )
    held = peak = 0
    for event in events:
        held += event.nbytes()
        peak = max(peak, held)
    return peak / 2**30


def _loss(logits, targets):
    import torch.nn.functional as F

    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def _measure(device, loader, args, step) -> dict:
    """Run ``step(inputs, targets) -> loss`` over ``loader`` (``warmup + steps + 1`` batches): the seconds of the
    ``steps`` timed ones, the peak memory (CUDA: over the timed steps; CPU: of the last step, under the profiler)
    and every loss."""
    _peak_reset(device)
    start, seconds, peak, losses = None, None, None, []
    for index, (inputs, targets) in enumerate(loader):
        if index == args.warmup:
            _sync(device)
            start = time.perf_counter()
        if index == args.warmup + args.steps:
            _sync(device)
            seconds = time.perf_counter() - start
            peak = _peak(device) if device.type == "cuda" else _cpu_step_peak(lambda x=inputs, y=targets: step(x, y))
            continue
        losses.append(step(inputs, targets).detach())
    return {"seconds": seconds, "peak_gib": peak, "losses": [float(x) for x in losses]}


class Raw:
    """The hand-written loop: autocast around forward and loss, and a GradScaler under fp16."""

    name = "raw"

    def __init__(self, precision: str, device):
        import torch

        self.device, self.precision = device, precision
        self.dtype = torch.bfloat16 if precision == "bf16" else torch.float16

    def run(self, init, config, args) -> dict:
        import torch

        model = _gpt(config).to(self.device)
        model.load_state_dict(init)
        optimizer = _optimizer(model, self.device)
        scaler = torch.amp.GradScaler(self.device.type) if self.precision == "fp16" else None
        loader = _loader(config, args.batch, args.warmup + args.steps + 1, self.device.type == "cuda")

        def step(inputs, targets):
            inputs = inputs.to(self.device, non_blocking=True)
            targets = targets.to(self.device, non_blocking=True)
            with torch.autocast(self.device.type, dtype=self.dtype):
                logits = model(inputs)
                loss = _loss(logits, targets)
            if not args.hold_logits:
                del logits
            if scaler is None:
                loss.backward()
                optimizer.step()
            else:
                scaler.scale(loss).backward()
                scaler.step(optimizer)
                scaler.update()
            optimizer.zero_grad()
            return loss

        return _measure(self.device, loader, args, step)


class Framework:
    """hasten's (or accelerate's) loop: the prepared model runs under autocast, ``backward`` scales.

    ``keep``: outputs stay in the autocast dtype (hasten's ``convert_outputs_to_fp32=False``) and the loss runs
    under ``accelerator.autocast()``, as in the raw loop. ``compile_regions``: regional compilation with inductor
    (``TorchDynamoPlugin(backend="inductor", use_regional_compilation=True)``). ``../shared/probes/
    gpu_compile_side.py`` builds this class with these arguments: keep them.
    """

    def __init__(
        self, name: str, module: str, precision: str, device, keep: bool = False, compile_regions: bool = False
    ):
        import importlib

        self.name, self.device, self.keep = name, device, keep
        package = importlib.import_module(module)
        utils = importlib.import_module(f"{module}.utils")
        # the same batch transfer as the raw loop: pinned memory, non-blocking copies
        options = {"dataloader_config": utils.DataLoaderConfiguration(non_blocking=True), "kwargs_handlers": []}
        if keep:
            options["kwargs_handlers"].append(utils.AutocastKwargs(convert_outputs_to_fp32=False))
        if precision == "fp8" and device.type == "cpu":  # no float8 matmuls on this CPU: torchao's emulation
            from torchao.float8 import Float8LinearConfig

            options["kwargs_handlers"].append(utils.AORecipeKwargs(config=Float8LinearConfig(emulate=True)))
        if compile_regions:
            options["dynamo_plugin"] = utils.TorchDynamoPlugin(backend="inductor", use_regional_compilation=True)
        self.accelerator = package.Accelerator(mixed_precision=precision, **options)

    def run(self, init, config, args, learnable: bool = False) -> dict:
        accelerator = self.accelerator
        model = _gpt(config)
        model.load_state_dict(init)
        optimizer = _optimizer(model.to(self.device), self.device)
        loader = _loader(config, args.batch, args.warmup + args.steps + 1, self.device.type == "cuda", learnable)
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

        def step(inputs, targets):
            # keep: forward and loss under autocast, as the raw loop (the model's own autocast nests in it)
            with accelerator.autocast() if self.keep else contextlib.nullcontext():
                logits = model(inputs)
                loss = _loss(logits, targets)
            if not args.hold_logits:
                del logits
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            return loss

        result = _measure(self.device, loader, args, step)
        accelerator.free_memory()
        return result


def _device(args):
    import torch

    return torch.device("cpu" if args.smoke else "cuda")


def worker(args) -> None:
    """Run one precision's rounds in this process and write the results as JSON."""
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    device = _device(args)
    config = SIZES[args.size]
    torch.manual_seed(0)
    model = _gpt(config)  # built once; every round loads these weights
    init = {k: v.clone() for k, v in model.state_dict().items()}
    params = sum(p.numel() for p in model.parameters())
    del model
    gpu = "cpu (smoke)" if args.smoke else torch.cuda.get_device_name(device)
    results = _throughput_rounds(init, config, args, device)
    Path(args.output).write_text(json.dumps({"results": results, "params": params, "device": gpu, "config": config}))


def _throughput_rounds(init, config, args, device) -> dict:
    contestants = [Raw(args.precision, device), Framework("hasten", "hasten", args.precision, device)]
    contestants.append(Framework("hasten-keep", "hasten", args.precision, device, keep=True))
    if real_accelerate() is not None:
        contestants.append(Framework("accelerate", "accelerate", args.precision, device))
    names = [c.name for c in contestants]
    by_name = {c.name: c for c in contestants}
    tokens = args.steps * args.batch * config["sequence"]
    results = {name: {"tokens_per_s": [], "peak_gib": [], "loss": []} for name in names}
    for round_index in range(-1, args.rounds):  # round -1 warms every contestant up (kernels, allocator), untimed
        for name in round_order(names, max(round_index, 0)):
            outcome = by_name[name].run(init, config, args)
            if round_index >= 0:
                results[name]["tokens_per_s"].append(tokens / outcome["seconds"])
                results[name]["peak_gib"].append(outcome["peak_gib"])
                results[name]["loss"].append(outcome["losses"][-1])
        if round_index >= 0:
            line = "  ".join(f"{n} {results[n]['tokens_per_s'][-1]:,.0f} tok/s" for n in names)
            print(f"[{args.precision}] round {round_index + 1}: {line}", flush=True)
    return results


def _report(precision: str, data: dict) -> tuple[list[str], list[str]]:
    results, lines, ratios = data["results"], [], []
    where = (
        "peak memory"
        if "cuda" in data["device"] or "cpu" not in data["device"]
        else "step memory above its start (CPU)"
    )
    lines.append(f"{precision}: {data['params'] / 1e6:.1f}M parameters on {data['device']}")
    for name, values in results.items():
        lines.append(describe(f"{precision} {name:11s} throughput", values["tokens_per_s"], "tokens/s", 1.0, 0))
        lines.append(
            f"{precision} {name:11s} {where}: {max(values['peak_gib']):.3f} GiB; final loss {values['loss'][-1]:.4f}"
        )
    for name, values in results.items():
        if name == "raw":
            continue
        difference = max(abs(a - b) for a, b in zip(values["loss"], results["raw"]["loss"]))
        lines.append(f"{precision} {name:11s} final loss vs raw: max |diff| {difference:.2e}")
        if not math.isfinite(difference) or difference > 0.05:
            raise SystemExit(f"{name} and raw PyTorch disagree on {precision}: the loops do not do the same math.")
        median, low, high = paired_ratio_range(values["tokens_per_s"], results["raw"]["tokens_per_s"])
        ratio = ratio_of_medians(values["tokens_per_s"], results["raw"]["tokens_per_s"])
        memory = max(values["peak_gib"]) / max(max(results["raw"]["peak_gib"]), 1e-12)
        ratios.append(
            f"ratio {name}/raw {precision} tokens/s: {ratio:.3f} "
            f"(per-round median {median:.3f}, min-max {low:.3f}-{high:.3f}); "
            f"memory {memory:.3f}x raw"
        )
    return lines, ratios


def main() -> None:
    """Launch one worker per precision and print throughput, memory and the ratios last."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--precisions", nargs="*", default=["bf16", "fp16"], choices=["bf16", "fp16"])
    parser.add_argument(
        "--size", choices=sorted(SIZES), help="model of the throughput runs (default: gpt2; smoke with --smoke)"
    )
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds per contestant (after one warm-up round)")
    parser.add_argument("--steps", type=int, default=30, help="timed steps per round")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps at the start of each round")
    parser.add_argument("--batch", type=int, default=8, help="sequences per step")
    parser.add_argument("--threads", type=int, default=0, help="torch threads per worker (0: torch's default)")
    parser.add_argument("--hold-logits", action="store_true", help="every loop keeps the logits until after backward")
    parser.add_argument(
        "--accelerate-path",
        help="folder holding HuggingFace's accelerate package, put first on the workers' PYTHONPATH (default: "
        ".reference/accelerate-* of the repository when present, else the installed accelerate)",
    )
    parser.add_argument(
        "--smoke", action="store_true", help="tiny model on the CPU: checks the script, measures nothing"
    )
    parser.add_argument("--json", help="write every figure to this file")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--precision", help=argparse.SUPPRESS)
    parser.add_argument("--output", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    args.size = args.size or ("smoke" if args.smoke else "gpt2")
    import torch

    if not args.smoke and not torch.cuda.is_available():
        print(
            "bench_gpu_lm: no CUDA device on this machine; the GPU benchmark needs one "
            "(run it on an H100/H200 host). Skipped."
        )
        return
    lines, ratios, figures = [], [], {}
    env = worker_environment(args.accelerate_path)
    with tempfile.TemporaryDirectory() as folder:
        for precision in args.precisions:
            output = Path(folder) / f"{precision}.json"
            command = [sys.executable, str(Path(__file__).resolve()), "--worker", "--precision", precision]
            command += ["--output", str(output), "--rounds", str(args.rounds), "--steps", str(args.steps)]
            command += ["--warmup", str(args.warmup), "--batch", str(args.batch), "--size", args.size]
            command += ["--threads", str(args.threads)] + (["--smoke"] if args.smoke else [])
            command += ["--hold-logits"] if args.hold_logits else []
            subprocess.run(command, check=True, env=env)
            figures[precision] = json.loads(output.read_text())
            more_lines, more_ratios = _report(precision, figures[precision])
            lines += more_lines
            ratios += more_ratios
    print()
    print("\n".join(lines + ratios))
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
