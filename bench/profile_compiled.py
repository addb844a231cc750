"""Why one compiled training step is faster than another: hasten's and Accelerate's compiled steps side by side.

Collected per contestant (``bench/compiled_worker.py`` calls :func:`DynamoWatch` around a contestant's whole run and
:func:`collect` after its timed steps; ``bench/bench_gpu_compile.py`` prints :func:`compare_lines`):

* dynamo: graphs compiled, graph breaks with their reasons, recompilations with the guard that failed (the
  ``recompiles`` and ``graph_breaks`` logs of ``torch._logging``), and which modules were compiled;
* host-device synchronisations per step (``torch.cuda.set_sync_debug_mode("warn")``, with the line that asked);
* time per step: wall (synchronised), host (the Python of the step returning, without waiting for the GPU) and GPU
  (the sum of the kernels' durations under ``torch.profiler``), so a launch-bound step shows (GPU busy well below
  100 %, host time close to wall time);
* kernel time by kernel name (top N) and by kind (matmul, attention, compiled Triton, eager elementwise, optimizer,
  ...): what one step runs that the other does not.

On a CPU (``--dry-run``) the same code runs on a tiny model with the ``aot_eager`` backend: the "kernels" are the
CPU operators and there is no synchronisation count; it checks the script, measures nothing.

Usage (from the repository root)::

    python bench/profile_compiled.py [--precision bf16] [--mode regional|whole] [--size wide] [--dry-run]

runs ``hasten`` and ``accelerate`` in one process each and prints what differs.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import sys
import tempfile
import time
import warnings
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from compiled_runs import RunOptions, Spec, run_specs, worker_environment  # noqa: E402

_KINDS = (  # (kind, substrings of a lower-cased kernel name); the first match wins
    ("optimizer", ("adam", "multi_tensor", "fused_sgd")),
    ("attention", ("flash", "fmha", "attention", "sdpa", "efficient_attention")),
    ("matmul", ("gemm", "xmma", "nvjet", "cutlass", "cublas", "sm90_", "sm80_", "_scaled_mm", "aten::mm", "addmm")),
    ("compiled pointwise (Triton)", ("triton_poi",)),
    ("compiled reduction (Triton)", ("triton_red", "triton_per")),
    ("compiled other (Triton)", ("triton_",)),
    ("eager norm/softmax/loss", ("layer_norm", "softmax", "cross_entropy", "nll_loss", "log_softmax")),
    ("eager reduction", ("reduce", "amax", "aten::max", "aten::sum")),
    ("eager elementwise", ("elementwise", "vectorized", "unrolled", "copy", "aten::to", "aten::add", "aten::mul")),
    ("memcpy/memset", ("memcpy", "memset")),
)


def kernel_kind(name: str) -> str:
    """The kind of a kernel (or CPU operator) by its name: matmul, attention, compiled Triton, eager, ..."""
    lowered = name.lower()
    for kind, needles in _KINDS:
        if any(needle in lowered for needle in needles):
            return kind
    return "other"


class DynamoWatch:
    """What dynamo did between :meth:`start` and :meth:`stop`: graphs, graph breaks, recompilations (with reasons).

    The ``recompiles`` and ``graph_breaks`` logs are switched on and captured here instead of printed (one line each
    is kept: the function recompiled and the first guard that failed, or the break's reason).
    """

    def __init__(self):
        self.records: list[tuple[str, str]] = []
        self._before: dict = {}

    def install(self) -> None:
        """Switch the two logs on (once per process) and route their records here."""
        import torch

        torch._logging.set_logs(recompiles=True, graph_breaks=True)
        watch = self

        class _Capture(logging.Handler):
            def emit(self, record):
                if record.name.endswith(("__recompiles", "__graph_breaks")):
                    watch.records.append((record.name.rsplit("__", 1)[1], record.getMessage()))

        def _quiet(record) -> bool:
            return not record.name.endswith(("__recompiles", "__graph_breaks"))

        for name in ("torch", "torch._dynamo"):
            logger = logging.getLogger(name)
            for handler in logger.handlers:
                handler.addFilter(_quiet)
            logger.addHandler(_Capture())

    def start(self) -> None:
        """Remember dynamo's counters now."""
        from torch._dynamo.utils import counters

        self.records.clear()
        self._before = {group: dict(counters[group]) for group in ("stats", "graph_break")}

    def stop(self) -> dict:
        """Graphs, graph breaks and recompilations since :meth:`start`."""
        from torch._dynamo.utils import counters

        def grown(group: str) -> dict:
            before = self._before.get(group, {})
            return {
                key: value - before.get(key, 0) for key, value in counters[group].items() if value != before.get(key)
            }

        breaks = grown("graph_break")
        recompiles = [_recompile_reason(text) for kind, text in self.records if kind == "recompiles"]
        logged_breaks = [_first_lines(text, 2) for kind, text in self.records if kind == "graph_breaks"]
        return {
            "graphs": grown("stats").get("unique_graphs", 0),
            "graph_breaks": sum(breaks.values()),
            "break_reasons": (logged_breaks or [_first_lines(reason, 1) for reason in breaks])[:10],
            "recompiles": len(recompiles),
            "recompile_reasons": recompiles[:10],
        }


def _recompile_reason(text: str) -> str:
    """``f in file:line`` of a recompilation and the first guard that failed, on one line."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    function, _, where = (lines[0].replace("Recompiling function ", "") if lines else "?").partition(" in ")
    guard = next((line[1:].strip() for line in lines[1:] if line.startswith("-")), "")
    return f"{function} in {Path(where).name}: {guard}"[:300]


def _first_lines(text: str, count: int) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip() and "User stack trace" not in line]
    return " | ".join(lines[:count])[:300]


def compiled_modules(model) -> list[str]:
    """The qualified names of the modules of ``model`` that run compiled: ``torch.compile`` wrappers and modules
    compiled in place (``nn.Module.compile``); ``(model)`` for the model itself."""
    from torch._dynamo.eval_frame import OptimizedModule

    found: list[str] = []

    def walk(module, prefix: str) -> None:
        if isinstance(module, OptimizedModule):
            found.append(prefix or "(model)")
            return
        if getattr(module, "_compiled_call_impl", None) is not None:
            found.append(prefix or "(model)")
        for name, child in module._modules.items():
            if child is not None:
                walk(child, f"{prefix}.{name}" if prefix else name)

    walk(model, "")
    return found


def summarise_modules(names: list[str]) -> str:
    """``blocks.0`` .. ``blocks.7`` as ``blocks.* (8)``; the others by name."""
    counts = Counter(re.sub(r"\.\d+(?=\.|$)", ".*", name) for name in names)
    return ", ".join(f"{name} ({count})" if count > 1 else name for name, count in counts.items()) or "none"


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def count_syncs(step, batches, device, steps: int = 1) -> dict | None:
    """Host-device synchronisations per step (CUDA only: None elsewhere), with the lines that asked for them."""
    import torch

    if device.type != "cuda":
        return None
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(steps):
                step(*next(batches))
    finally:
        torch.cuda.set_sync_debug_mode(0)
    where = Counter(f"{Path(w.filename).name}:{w.lineno}" for w in caught if "synchroniz" in str(w.message).lower())
    return {"per_step": sum(where.values()) / steps, "where": dict(where.most_common(8))}


def host_and_wall(step, batches, device, steps: int = 3) -> dict:
    """Milliseconds per step: wall (synchronised at both ends) and host (until ``step`` returns)."""
    _sync(device)
    start, host = time.perf_counter(), 0.0
    for _ in range(steps):
        begin = time.perf_counter()
        step(*next(batches))
        host += time.perf_counter() - begin
    _sync(device)
    return {"wall_ms": (time.perf_counter() - start) * 1e3 / steps, "host_ms": host * 1e3 / steps}


def kernel_table(step, batches, device, steps: int = 2, top: int = 40) -> dict:
    """Kernel time per step by kernel name under ``torch.profiler`` (CPU operators' self time on a CPU)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as profiler:
        for _ in range(steps):
            step(*next(batches))
        _sync(device)
    rows = []
    for event in profiler.key_averages():
        if cuda and event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        micros = getattr(event, "self_device_time_total", 0) if cuda else event.self_cpu_time_total
        if micros > 0:
            rows.append([event.key, micros / 1e3 / steps, event.count / steps])
    rows.sort(key=lambda row: -row[1])
    kinds: Counter = Counter()
    for name, millis, _ in rows:
        kinds[kernel_kind(name)] += millis
    return {
        "unit": "CUDA kernels" if cuda else "CPU operators (self time)",
        "total_ms": sum(row[1] for row in rows),
        "kernels": [[name, round(ms, 4), round(calls, 2)] for name, ms, calls in rows[:top]],
        "kinds": {kind: round(ms, 4) for kind, ms in kinds.most_common()},
    }


def collect(step, batches, device) -> dict:
    """Synchronisations, host/wall time and the kernel table of a few more steps of ``step`` over ``batches``."""
    result = {"syncs": count_syncs(step, batches, device), "time": host_and_wall(step, batches, device)}
    result["kernels"] = kernel_table(step, batches, device)
    busy = result["kernels"]["total_ms"] / max(result["time"]["wall_ms"], 1e-9)
    result["time"]["gpu_busy"] = round(busy, 3) if device.type == "cuda" else None
    return result


PROFILE_STEPS = 6  # batches collect() takes: 1 synchronisation count + 3 timed + 2 profiled


def _kind_rows(a: dict, b: dict) -> list[str]:
    kinds_a, kinds_b = a["kernels"]["kinds"], b["kernels"]["kinds"]
    names = sorted(set(kinds_a) | set(kinds_b), key=lambda k: -abs(kinds_a.get(k, 0) - kinds_b.get(k, 0)))
    return [
        f"| {kind} | {kinds_a.get(kind, 0):.3f} | {kinds_b.get(kind, 0):.3f} "
        f"| {kinds_a.get(kind, 0) - kinds_b.get(kind, 0):+.3f} |"
        for kind in names
    ]


def _kernel_rows(a: dict, b: dict, top: int) -> list[str]:
    table_a = {name: (ms, calls) for name, ms, calls in a["kernels"]["kernels"]}
    table_b = {name: (ms, calls) for name, ms, calls in b["kernels"]["kernels"]}
    names = sorted(
        set(table_a) | set(table_b), key=lambda n: -abs(table_a.get(n, (0, 0))[0] - table_b.get(n, (0, 0))[0])
    )
    rows = []
    for name in names[:top]:
        (ms_a, calls_a), (ms_b, calls_b) = table_a.get(name, (0, 0)), table_b.get(name, (0, 0))
        short = name if len(name) <= 70 else name[:67] + "..."
        rows.append(f"| `{short}` | {ms_a:.3f} ({calls_a:g}) | {ms_b:.3f} ({calls_b:g}) | {ms_a - ms_b:+.3f} |")
    return rows


def _side_row(label: str, a, b) -> str:
    return f"| {label} | {a} | {b} |"


def compare_lines(name_a: str, a: dict, name_b: str, b: dict, top: int = 12) -> list[str]:
    """Markdown lines: what differs between two contestants' results (``dynamo`` and ``profile`` fields)."""
    dyn_a, dyn_b = a.get("dynamo", {}), b.get("dynamo", {})
    prof_a, prof_b = a.get("profile") or {}, b.get("profile") or {}
    lines = [f"| | {name_a} | {name_b} |", "|---|---|---|"]
    lines.append(
        _side_row(
            "compiled modules", summarise_modules(a.get("compiled", [])), summarise_modules(b.get("compiled", []))
        )
    )
    for key in ("graphs", "graph_breaks", "recompiles"):
        lines.append(_side_row(key.replace("_", " "), dyn_a.get(key, "?"), dyn_b.get(key, "?")))
    if prof_a and prof_b:
        syncs = [p["syncs"]["per_step"] if p.get("syncs") else "n/a (CPU)" for p in (prof_a, prof_b)]
        lines.append(_side_row("host-device synchronisations per step", *syncs))
        for key, label in (("wall_ms", "wall ms per step"), ("host_ms", "host ms per step (until the step returns)")):
            lines.append(_side_row(label, f"{prof_a['time'][key]:.2f}", f"{prof_b['time'][key]:.2f}"))
        lines.append(
            _side_row(
                f"{prof_a['kernels']['unit']} ms per step",
                f"{prof_a['kernels']['total_ms']:.2f}",
                f"{prof_b['kernels']['total_ms']:.2f}",
            )
        )
        busy = [p["time"].get("gpu_busy") for p in (prof_a, prof_b)]
        lines.append(
            _side_row("GPU busy (kernel time / wall)", *[f"{x:.0%}" if x is not None else "n/a" for x in busy])
        )
    for label, dyn in ((name_a, dyn_a), (name_b, dyn_b)):
        for reason in dyn.get("break_reasons", []):
            lines.append(f"- {label}: graph break: {reason}")
        for reason in dyn.get("recompile_reasons", []):
            lines.append(f"- {label}: recompiled: {reason}")
    for label, prof in ((name_a, prof_a), (name_b, prof_b)):
        for where, count in ((prof.get("syncs") or {}).get("where") or {}).items():
            lines.append(f"- {label}: synchronisation at {where} ({count}x)")
    if prof_a and prof_b:
        lines += ["", f"Kernel time by kind, ms per step ({name_a} - {name_b} last):", ""]
        lines += [f"| kind | {name_a} | {name_b} | difference |", "|---|---|---|---|", *_kind_rows(prof_a, prof_b)]
        lines += ["", "Kernels that differ most, ms per step (calls per step):", ""]
        lines += [
            f"| kernel | {name_a} | {name_b} | difference |",
            "|---|---|---|---|",
            *_kernel_rows(prof_a, prof_b, top),
        ]
    return lines


def main(argv: list[str] | None = None) -> int:
    """Run hasten and Accelerate compiled, one process each, and print what differs."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--precision", default="bf16", choices=["bf16", "fp16"])
    parser.add_argument("--mode", default="regional", choices=["regional", "whole"])
    parser.add_argument("--size", help="model (bench_gpu_lm.SIZES; default: wide, smoke with --dry-run)")
    parser.add_argument("--batch", type=int, help="sequences per step (default 4, 2 with --dry-run)")
    parser.add_argument(
        "--accelerate-path",
        help="folder holding HuggingFace's accelerate package (default: "
        ".reference/accelerate-* when present, else the installed one)",
    )
    parser.add_argument("--dry-run", action="store_true", help="tiny model on the CPU, aot_eager: checks the script")
    parser.add_argument("--json", help="write both contestants' results to this file")
    args = parser.parse_args(argv)
    options = RunOptions.for_run(args.dry_run, size=args.size, batch=args.batch)
    specs = [Spec(args.precision, args.mode, name, profile=True) for name in ("hasten", "accelerate")]
    with tempfile.TemporaryDirectory() as folder:
        results = run_specs(
            specs, options, Path(folder), env=worker_environment(args.accelerate_path), limit=900, deadline=None
        )
    by_name = {r["spec"]["name"]: r for r in results}
    for result in results:
        if result["status"] != "ok":
            print(f"{result['spec']['name']}: {result['status']}: {result.get('reason', '')}")
    if all(by_name.get(n, {}).get("status") == "ok" for n in ("hasten", "accelerate")):
        print("\n".join(compare_lines("hasten", by_name["hasten"], "accelerate", by_name["accelerate"])))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0 if all(r["status"] == "ok" for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
