"""Compiled training steps on one GPU, side by side: raw PyTorch's ``torch.compile``, hasten and Accelerate,
regional and whole-model compilation, bf16 and fp16; fp8 (torchao float8 layers) through hasten and Accelerate.

The model is ``bench_gpu_lm``'s "wide" LM (8 layers of width 4096, ~1.8B parameters, vocabulary 50,257, sequence
1024; the model of issue 30), batch 4 x 1024 tokens, fused AdamW, a learnable token stream; each contestant is
described in ``compiled_runs.NAMES`` and run by ``compiled_worker.py`` (one worker process per group of
contestants, each contestant from the same weights, compiled from scratch). Reported: tokens/s (median and
min-max over the timed segments), peak memory, the first step's seconds (compilation), what dynamo did (graphs,
graph breaks, recompilations) and which modules run compiled, the loss of every step; then the ratios against the
issue's targets:

* hasten compiled >= Accelerate compiled (tokens/s), regional and whole model, bf16 and fp16;
* hasten with ``AutocastKwargs(convert_outputs_to_fp32=False)`` >= 0.99 of raw PyTorch compiled the same way;
* hasten fp8 >= 1.3x hasten bf16 (both regionally compiled; each fp8 variant), and >= Accelerate's fp8;

and the profile of hasten's and Accelerate's bf16 regional steps side by side (``profile_compiled.py``).

Time: a cold compilation of the wide model takes tens of seconds, so first every distinct contestant is compiled
ahead in parallel (``--prewarm-slots``; one forward and backward each, nothing timed) to fill torch's compile
caches; the timed runs, one at a time, then find their graphs there. Groups run in the order of ``GROUPS`` within
``--budget`` seconds; a contestant that fails, hangs (``--contestant-limit``) or is cut by the budget is reported as
such and the others run. ``--dry-run``: a tiny model on the CPU with the ``aot_eager`` backend and emulated float8,
to check every part of the script (it measures nothing).

Usage: python bench/bench_gpu_compile.py [--dry-run] [--only bf16-regional fp8 ...] [--budget S] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from compiled_runs import RunOptions, Spec, prewarm, run_specs, worker_environment  # noqa: E402
from profile_compiled import compare_lines, summarise_modules  # noqa: E402

TARGET_VS_ACCELERATE = 1.0  # hasten compiled tokens/s over Accelerate compiled
TARGET_KEEP_VS_RAW = 0.99  # hasten-keep over raw PyTorch compiled the same way
TARGET_FP8 = 1.3  # hasten fp8 over hasten bf16, both regionally compiled

_ROW_ORDER = ("raw", "raw-blocks", "hasten-keep", "hasten", "accelerate")
_FP8_NAMES = ("hasten-fp8", "hasten-fp8-sized", "hasten-fp8-rowwise", "accelerate-fp8-noag", "accelerate-fp8")
GROUPS = {  # in the order they run: the headline comparison first; Accelerate's default fp8, which did not
    # finish within 95 s on the H200, last (its cold compilation is timed by the prewarm in any case)
    "bf16-regional": [
        ("bf16", "regional", n, n in ("hasten", "accelerate"))
        for n in ("accelerate", "hasten", "hasten-keep", "raw", "raw-blocks")
    ],
    "fp8": [("fp8", "regional", n, False) for n in _FP8_NAMES[:-1]],
    "bf16-whole": [("bf16", "whole", n, False) for n in ("accelerate", "hasten", "hasten-keep", "raw")],
    "fp16-regional": [("fp16", "regional", n, False) for n in ("accelerate", "hasten", "hasten-keep", "raw")],
    "fp16-whole": [("fp16", "whole", n, False) for n in ("accelerate", "hasten", "hasten-keep", "raw")],
    "fp8-accelerate-default": [("fp8", "regional", "accelerate-fp8", False)],
}
_SAME_GRAPHS = {"hasten-keep", "raw-blocks", "hasten-fp8-sized"}  # regional: graphs another contestant compiles


def plan(only: list[str] | None) -> list[tuple[str, list[Spec]]]:
    """The groups to run (all, or those named in ``only``), each a list of contestants."""
    unknown = sorted(set(only or []) - set(GROUPS))
    if unknown:
        raise SystemExit(f"bench_gpu_compile: unknown group(s) {unknown}; choose from {list(GROUPS)}")
    return [(name, [Spec(*row) for row in rows]) for name, rows in GROUPS.items() if not only or name in only]


def prewarm_units(groups: list[tuple[str, list[Spec]]]) -> list[Spec]:
    """The contestants to compile ahead: those whose graphs no other contestant compiles, whole-model ones first
    (the slowest to compile), then Accelerate's default fp8 (its float8 weights are tensor subclasses), then the
    rest in the order they run."""
    specs = [
        Spec(s.precision, s.mode, s.name)
        for _, group in groups
        for s in group
        if not (s.mode == "regional" and s.name in _SAME_GRAPHS)
    ]
    return sorted(specs, key=lambda s: (s.mode != "whole", s.name != "accelerate-fp8"))


def _median(result: dict) -> float | None:
    return statistics.median(result["tokens_per_s"]) if result.get("status") == "ok" else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def _fmt(value, pattern: str = "{:.3f}", missing: str = "-") -> str:
    return pattern.format(value) if value is not None else missing


def _verdict(value: float | None, target: float) -> str:
    return "not measured" if value is None else ("met" if value >= target else "MISSED")


def _index(results: list[dict]) -> dict:
    return {(r["spec"]["precision"], r["spec"]["mode"], r["spec"]["name"]): r for r in results}


def _speed_cell(result: dict) -> str:
    if result["status"] != "ok":
        return f"{result['status']}: {result.get('reason', '')[:80]}"
    speeds = result["tokens_per_s"]
    return f"{statistics.median(speeds):,.0f} ({min(speeds):,.0f}-{max(speeds):,.0f})"


def _loss_gap(result: dict, reference: dict) -> str:
    """The largest difference between two loss curves (the same weights and batches: the same math gives nearly
    the same numbers); ``NOT FINITE`` when a loss is NaN or infinite."""
    losses, others = result.get("losses") or [], reference.get("losses") or []
    if any(not math.isfinite(x) for x in losses):
        return "NOT FINITE"
    pairs = list(zip(losses, others))
    return f"{max(abs(a - b) for a, b in pairs):.2e}" if pairs else "-"


def compiled_table(results: list[dict]) -> list[str]:
    """The bf16/fp16 rows: tokens/s, ratios to raw and to Accelerate, memory, compile, dynamo, compiled modules."""
    index = _index(results)
    lines = [
        "| precision | compilation | contestant | tokens/s (segments min-max) | vs raw | vs Accelerate | peak GiB "
        "| first step s | graphs / breaks / recompiles | max loss diff vs raw | compiled modules |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for precision in ("bf16", "fp16"):
        for mode in ("regional", "whole"):
            raw_result = index.get((precision, mode, "raw"), {})
            raw, acc = _median(raw_result), _median(index.get((precision, mode, "accelerate"), {}))
            for name in _ROW_ORDER:
                result = index.get((precision, mode, name))
                if result is None:
                    continue
                speed, dyn = _median(result), result.get("dynamo", {})
                modules = summarise_modules(result.get("compiled", [])) if result["status"] == "ok" else "-"
                lines.append(
                    f"| {precision} | {mode} | {name} | {_speed_cell(result)} | {_fmt(_ratio(speed, raw))} "
                    f"| {_fmt(_ratio(speed, acc))} | {_fmt(result.get('peak_gib'), '{:.2f}')} "
                    f"| {_fmt(result.get('first_step_s'), '{:.1f}')} "
                    f"| {dyn.get('graphs', '-')} / {dyn.get('graph_breaks', '-')} / {dyn.get('recompiles', '-')} "
                    f"| {_loss_gap(result, raw_result)} | {modules} |"
                )
    return lines


def targets(results: list[dict]) -> list[str]:
    """The issue's targets, each with its ratio and verdict."""
    index, lines = _index(results), []
    for precision in ("bf16", "fp16"):
        for mode in ("regional", "whole"):
            speed = {n: _median(index.get((precision, mode, n), {})) for n in _ROW_ORDER}
            ratio = _ratio(speed["hasten"], speed["accelerate"])
            lines.append(
                f"- {precision} {mode}: hasten / Accelerate tokens/s >= {TARGET_VS_ACCELERATE}: "
                f"{_fmt(ratio)} -> {_verdict(ratio, TARGET_VS_ACCELERATE)}"
            )
            ratio = _ratio(speed["hasten-keep"], speed["raw"])
            lines.append(
                f"- {precision} {mode}: hasten-keep / raw tokens/s >= {TARGET_KEEP_VS_RAW}: "
                f"{_fmt(ratio)} -> {_verdict(ratio, TARGET_KEEP_VS_RAW)}"
            )
    bf16 = _median(index.get(("bf16", "regional", "hasten"), {}))
    for name in _FP8_NAMES[:3]:
        ratio = _ratio(_median(index.get(("fp8", "regional", name), {})), bf16)
        lines.append(
            f"- {name} / hasten bf16 (regional) tokens/s >= {TARGET_FP8}: {_fmt(ratio)} "
            f"-> {_verdict(ratio, TARGET_FP8)}"
        )
    fp8 = _median(index.get(("fp8", "regional", "hasten-fp8"), {}))
    for name in ("accelerate-fp8", "accelerate-fp8-noag"):
        other = index.get(("fp8", "regional", name), {})
        ratio = _ratio(fp8, _median(other))
        frozen = (other.get("fp8") or {}).get("params_not_in_optimizer")
        note = f" ({name} does not update {_not_updated(other['fp8'])}: less optimizer work)" if frozen else ""
        lines.append(f"- hasten-fp8 / {name} tokens/s >= 1.0: {_fmt(ratio)} -> {_verdict(ratio, 1.0)}{note}")
    raw, blocks = (_median(index.get(("bf16", "regional", n), {})) for n in ("raw", "raw-blocks"))
    lines.append(
        f"- (diagnostic) raw PyTorch, Accelerate's regions / blocks only, bf16: {_fmt(_ratio(raw, blocks))} "
        "(what compiling the embeddings, final norm and head besides the blocks is worth)"
    )
    return lines


def _not_updated(facts: dict) -> str:
    if not facts:
        return "-"
    share = facts.get("values_not_in_optimizer", 0) / max(facts.get("values", 0), 1)
    return f"{facts['params_not_in_optimizer']} of {facts['params']} tensors ({share:.0%} of the values)"


def fp8_lines(results: list[dict]) -> list[str]:
    """The fp8 table (against hasten bf16, regional) and the loss curves side by side."""
    index = _index(results)
    base = index.get(("bf16", "regional", "hasten"), {"status": "missing"})
    rows = [("hasten bf16", base)] + [
        (n, index[("fp8", "regional", n)]) for n in _FP8_NAMES if ("fp8", "regional", n) in index
    ]
    lines = [
        "| contestant | tokens/s (segments min-max) | vs hasten bf16 | peak GiB | first step s | float8 layers "
        "| parameters the optimizer does not update | loss at the last step | max loss diff vs bf16 |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, result in rows:
        facts = result.get("fp8", {})
        lines.append(
            f"| {name} | {_speed_cell(result) if 'status' in result and result['status'] != 'missing' else '-'} "
            f"| {_fmt(_ratio(_median(result), _median(base)))} | {_fmt(result.get('peak_gib'), '{:.2f}')} "
            f"| {_fmt(result.get('first_step_s'), '{:.1f}')} | {facts.get('float8_layers', '-')} "
            f"| {_not_updated(facts)} "
            f"| {_fmt((result.get('losses') or [None])[-1], '{:.4f}')} | {_loss_gap(result, base)} |"
        )
    curves = [(name, r["losses"]) for name, r in rows if r.get("status") == "ok"]
    if curves:
        steps = max(len(c) for _, c in curves)
        shown = sorted(set(range(0, steps, max(1, steps // 8))) | {steps - 1})
        lines += ["", "| step | " + " | ".join(n for n, _ in curves) + " |", "|---" * (len(curves) + 1) + "|"]
        for step in shown:
            cells = [f"{c[step]:.4f}" if step < len(c) else "" for _, c in curves]
            lines.append(f"| {step} | " + " | ".join(cells) + " |")
    return lines


def report_lines(data: dict) -> list[str]:
    """The whole report in Markdown: tables, targets, fp8, the profile comparison, compile times, what is missing."""
    options, results = data["options"], data["results"]
    lines = [
        f"Compiled steps: model `{options['size']}` ({data.get('params', 0) / 1e6:,.1f}M parameters), batch "
        f"{options['batch']} x {data.get('sequence')}, backend {options['backend']}, {options['warmup']} warm-up "
        f"steps, {options['segments']} timed segments of {options['segment_steps']} steps; {data.get('device')}; "
        f"{data.get('seconds', 0):.0f} s in all.",
        "",
        *compiled_table(results),
        "",
        "Targets:",
        *targets(results),
        "",
        "fp8 (regionally compiled; outputs converted to fp32 as Accelerate does):",
        "",
        *fp8_lines(results),
    ]
    index = _index(results)
    pair = [index.get(("bf16", "regional", n), {}) for n in ("hasten", "accelerate")]
    if all(p.get("status") == "ok" and p.get("profile") for p in pair):
        lines += [
            "",
            "Profile, bf16 regional (hasten vs Accelerate):",
            "",
            *compare_lines("hasten", pair[0], "accelerate", pair[1]),
        ]
    cold = [r for r in data.get("prewarm", []) if r.get("status") == "ok"]
    if cold:
        lines += [
            "",
            "Cold compilation (prewarm: first forward and backward, several workers at once, s): "
            + ", ".join(f"{r['spec']} {r['first_step_s']:.0f}" for r in cold),
        ]
    missing = [r for r in results if r["status"] != "ok"]
    lines += [
        f"- not measured: {r['spec']['precision']}/{r['spec']['mode']}/{r['spec']['name']}: {r['status']} "
        f"({r.get('reason', '')[:200]})"
        for r in missing
    ]
    return lines


def _arguments(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny model on the CPU (aot_eager, emulated fp8)")
    parser.add_argument("--only", nargs="+", help=f"groups to run (default: all, in this order: {list(GROUPS)})")
    parser.add_argument("--budget", type=float, help="seconds for everything (default 315; 900 with --dry-run)")
    parser.add_argument("--contestant-limit", type=float, default=150, help="seconds one contestant may take")
    parser.add_argument(
        "--prewarm-slots",
        type=int,
        help="memory slots of the parallel compile-ahead workers: a regional contestant (a 2-layer model, ~10 GB on "
        "the wide LM) takes 1, a whole-model one 3 (default 10; 2 with --dry-run; 0: no prewarm)",
    )
    parser.add_argument("--prewarm-units", type=int, help="compile ahead only the first N contestants (dry run: 2)")
    parser.add_argument("--size", help="model (bench_gpu_lm.SIZES; default wide, smoke with --dry-run)")
    parser.add_argument("--batch", type=int, help="sequences per step (default 4)")
    parser.add_argument("--warmup", type=int, help="untimed steps per contestant, the first compiles (default 3)")
    parser.add_argument("--segments", type=int, help="timed segments per contestant (default 3)")
    parser.add_argument("--segment-steps", type=int, help="steps per timed segment (default 6)")
    parser.add_argument(
        "--accelerate-path",
        help="folder holding HuggingFace's accelerate package (default: "
        ".reference/accelerate-* when present, else the installed one)",
    )
    parser.add_argument("--json", help="write every figure to this file")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Prewarm, run the groups within the budget, print the report (Markdown) and write the JSON."""
    args = _arguments(argv)
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        print("bench_gpu_compile: no CUDA device on this machine (run with --dry-run to check the script). Skipped.")
        return 0
    start = time.monotonic()
    deadline = start + (args.budget or (900 if args.dry_run else 315))
    options = RunOptions.for_run(
        args.dry_run,
        size=args.size,
        batch=args.batch,
        warmup=args.warmup,
        segments=args.segments,
        segment_steps=args.segment_steps,
    )
    groups, env = plan(args.only), worker_environment(args.accelerate_path)
    slots = args.prewarm_slots if args.prewarm_slots is not None else (2 if args.dry_run else 10)
    units = prewarm_units(groups)
    if args.dry_run and not args.prewarm_units:  # one whole-model and one regional contestant check the path
        units = [u for u in units if u.mode == "whole"][:1] + [u for u in units if u.mode == "regional"][:1]
    units = units[: args.prewarm_units or None]
    data = {
        "options": vars(options),
        "device": "cpu (dry run)" if args.dry_run else torch.cuda.get_device_name(),
        "prewarm": [],
        "results": [],
    }
    with tempfile.TemporaryDirectory() as folder:
        if slots and units:
            prewarm_deadline = min(deadline - 60, start + 0.45 * (deadline - start))
            data["prewarm"] = prewarm(units, options, Path(folder), env, slots, prewarm_deadline)
        for name, specs in groups:
            print(f"== {name}", flush=True)
            data["results"] += run_specs(specs, options, Path(folder), env, args.contestant_limit, deadline)
    _describe_model(data, options)
    data["seconds"] = time.monotonic() - start
    print("\n" + "\n".join(report_lines(data)))
    if args.json:
        Path(args.json).write_text(json.dumps(data, indent=1))
    return 0


def _describe_model(data: dict, options: RunOptions) -> None:
    from bench_gpu_lm import SIZES

    config = SIZES[options.size]
    width, layers, vocab = config["width"], config["layers"], config["vocab"]
    data["sequence"] = config["sequence"]
    data["params"] = layers * (12 * width * width + 13 * width) + (vocab + config["sequence"]) * width + 2 * width


if __name__ == "__main__":
    raise SystemExit(main())
