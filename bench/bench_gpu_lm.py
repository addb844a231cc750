"""GPU training throughput: a GPT-style language model, raw PyTorch vs hasten (vs accelerate when installed).

A GPT-2-small-shaped model (12 layers, width 768, 12 heads, vocabulary 50257, sequence 1024: ~124M
parameters, tied embeddings, ``scaled_dot_product_attention``) trains on random tokens on one GPU.
Two precisions, each in its own process (the precision is process-wide state in both frameworks):

* ``bf16``: autocast to bfloat16. Raw: ``torch.autocast`` around forward and loss.
  hasten: ``Accelerator(mixed_precision="bf16")``, forward under the prepared model's autocast.
* ``fp16``: autocast to float16 with loss scaling. Raw: ``torch.amp.GradScaler`` (scale, step,
  update). hasten: ``Accelerator(mixed_precision="fp16")`` and ``accelerator.backward``.

Rounds alternate the contestants (A B, then B A); each round builds the model from the same initial
weights, runs ``--warmup`` untimed steps and ``--steps`` timed steps (``torch.cuda.synchronize()`` at
both ends). Reported per contestant: tokens/s (median, min-max over rounds) and peak GPU memory
(``torch.cuda.max_memory_allocated``, reset before each round), then the ratio of tokens/s to raw
PyTorch last (target >= 0.99). Both loops use the same AdamW (fused where available), batches come
from the same pinned ``DataLoader``, and the script checks that their losses after the timed steps agree.

Without CUDA the script says so and exits 0. ``--smoke`` runs a tiny model on the CPU instead, to
check the script itself anywhere (its figures mean nothing).

Usage: python bench/bench_gpu_lm.py [--precisions bf16 fp16] [--rounds 5] [--steps 30] [--batch 8]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import describe, has_module, paired_ratio_range, ratio_of_medians, round_order  # noqa: E402

GPT2_SMALL = {"layers": 12, "width": 768, "heads": 12, "vocab": 50257, "sequence": 1024}
SMOKE = {"layers": 2, "width": 64, "heads": 4, "vocab": 512, "sequence": 64}


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


def _loader(config: dict, batch: int, steps: int, pin: bool):
    import torch

    generator = torch.Generator().manual_seed(1)
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


def _loss(logits, targets):
    import torch.nn.functional as F

    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


class Raw:
    """The hand-written loop: autocast, and a GradScaler under fp16."""

    name = "raw"

    def __init__(self, precision: str, device):
        import torch

        self.device = device
        self.dtype = torch.bfloat16 if precision == "bf16" else torch.float16
        self.scaler = torch.amp.GradScaler(device.type) if precision == "fp16" else None

    def run(self, init, config, args) -> tuple[float, float, float]:
        import torch

        model = _gpt(config).to(self.device)
        model.load_state_dict(init)
        optimizer = _optimizer(model, self.device)
        scaler = torch.amp.GradScaler(self.device.type) if self.scaler is not None else None
        loader = _loader(config, args.batch, args.warmup + args.steps, self.device.type == "cuda")
        _peak_reset(self.device)
        start = None
        for index, (inputs, targets) in enumerate(loader):
            if index == args.warmup:
                _sync(self.device)
                start = time.perf_counter()
            inputs = inputs.to(self.device, non_blocking=True)
            targets = targets.to(self.device, non_blocking=True)
            with torch.autocast(self.device.type, dtype=self.dtype):
                loss = _loss(model(inputs), targets)
            if scaler is None:
                loss.backward()
                optimizer.step()
            else:
                scaler.scale(loss).backward()
                scaler.step(optimizer)
                scaler.update()
            optimizer.zero_grad()
        _sync(self.device)
        return time.perf_counter() - start, _peak(self.device), float(loss.detach())


class Framework:
    """hasten's (or accelerate's) loop: the prepared model runs under autocast, ``backward`` scales."""

    def __init__(self, name: str, module: str, precision: str, device):
        import importlib

        self.name, self.device = name, device
        package = importlib.import_module(module)
        # the same batch transfer as the raw loop: pinned memory, non-blocking copies
        loading = importlib.import_module(f"{module}.utils").DataLoaderConfiguration(non_blocking=True)
        self.accelerator = package.Accelerator(mixed_precision=precision, dataloader_config=loading)

    def run(self, init, config, args) -> tuple[float, float, float]:
        model = _gpt(config)
        model.load_state_dict(init)
        optimizer = _optimizer(model.to(self.device), self.device)
        loader = _loader(config, args.batch, args.warmup + args.steps, self.device.type == "cuda")
        model, optimizer, loader = self.accelerator.prepare(model, optimizer, loader)
        _peak_reset(self.device)
        start = None
        for index, (inputs, targets) in enumerate(loader):
            if index == args.warmup:
                _sync(self.device)
                start = time.perf_counter()
            loss = _loss(model(inputs), targets)
            self.accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        _sync(self.device)
        result = time.perf_counter() - start, _peak(self.device), float(loss.detach())
        self.accelerator.free_memory()
        return result


def worker(args) -> None:
    """Run one precision's rounds in this process and write the results as JSON."""
    import torch

    device = torch.device("cpu" if args.smoke else "cuda")
    config = SMOKE if args.smoke else GPT2_SMALL
    torch.manual_seed(0)
    init = {k: v.clone() for k, v in _gpt(config).state_dict().items()}
    contestants = [Raw(args.precision, device), Framework("hasten", "hasten", args.precision, device)]
    if has_module("accelerate"):
        contestants.append(Framework("accelerate", "accelerate", args.precision, device))
    names = [c.name for c in contestants]
    by_name = {c.name: c for c in contestants}
    tokens = args.steps * args.batch * config["sequence"]
    results = {name: {"tokens_per_s": [], "peak_gib": [], "loss": []} for name in names}
    for round_index in range(-1, args.rounds):  # round -1 warms every contestant up (kernels, allocator), untimed
        for name in round_order(names, max(round_index, 0)):
            seconds, peak, loss = by_name[name].run(init, config, args)
            if round_index >= 0:
                results[name]["tokens_per_s"].append(tokens / seconds)
                results[name]["peak_gib"].append(peak)
                results[name]["loss"].append(loss)
        if round_index >= 0:
            print(f"[{args.precision}] round {round_index + 1}: " + "  ".join(f"{n} {results[n]['tokens_per_s'][-1]:,.0f} tok/s" for n in names), flush=True)
    params = sum(p.numel() for p in _gpt(config).parameters())
    gpu = "cpu (smoke)" if args.smoke else torch.cuda.get_device_name(device)
    Path(args.output).write_text(json.dumps({"results": results, "params": params, "device": gpu}))


def _report(precision: str, data: dict) -> tuple[list[str], list[str]]:
    results, lines, ratios = data["results"], [], []
    lines.append(f"{precision}: {data['params'] / 1e6:.1f}M parameters on {data['device']}")
    for name, values in results.items():
        lines.append(describe(f"{precision} {name:10s} throughput", values["tokens_per_s"], "tokens/s", 1.0, 0))
        lines.append(f"{precision} {name:10s} peak memory: {max(values['peak_gib']):.2f} GiB; final loss {values['loss'][-1]:.4f}")
    for name, values in results.items():
        if name == "raw":
            continue
        difference = max(abs(a - b) for a, b in zip(values["loss"], results["raw"]["loss"]))
        lines.append(f"{precision} {name:10s} final loss vs raw: max |diff| {difference:.2e}")
        if not math.isfinite(difference) or difference > 0.05:
            raise SystemExit(f"{name} and raw PyTorch disagree on {precision}: the loops do not do the same math.")
        median, low, high = paired_ratio_range(values["tokens_per_s"], results["raw"]["tokens_per_s"])
        ratios.append(
            f"ratio {name}/raw {precision} tokens/s: {ratio_of_medians(values['tokens_per_s'], results['raw']['tokens_per_s']):.3f} "
            f"(per-round median {median:.3f}, min-max {low:.3f}-{high:.3f}; target >= 0.99)"
        )
    return lines, ratios


def main() -> None:
    """Launch one worker per precision and print throughput, memory and the ratios to raw last."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--precisions", nargs="+", default=["bf16", "fp16"], choices=["bf16", "fp16"])
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds per contestant (after one warm-up round)")
    parser.add_argument("--steps", type=int, default=30, help="timed steps per round")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps at the start of each round")
    parser.add_argument("--batch", type=int, default=8, help="sequences of 1024 tokens per step")
    parser.add_argument("--smoke", action="store_true", help="tiny model on the CPU: checks the script, measures nothing")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--precision", help=argparse.SUPPRESS)
    parser.add_argument("--output", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    import torch

    if not args.smoke and not torch.cuda.is_available():
        print("bench_gpu_lm: no CUDA device on this machine; the GPU benchmark needs one (run it on an H100/H200 host). Skipped.")
        return
    lines, ratios = [], []
    with tempfile.TemporaryDirectory() as folder:
        for precision in args.precisions:
            output = Path(folder) / f"{precision}.json"
            command = [sys.executable, str(Path(__file__).resolve()), "--worker", "--precision", precision, "--output", str(output)]
            command += ["--rounds", str(args.rounds), "--steps", str(args.steps), "--warmup", str(args.warmup), "--batch", str(args.batch)]
            subprocess.run(command + (["--smoke"] if args.smoke else []), check=True, env=os.environ.copy())
            more_lines, more_ratios = _report(precision, json.loads(output.read_text()))
            lines += more_lines
            ratios += more_ratios
    print()
    print("\n".join(lines + ratios))


if __name__ == "__main__":
    main()
