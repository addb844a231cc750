"""The two ends of bench/device_check.sh: what the machine is (``--environment FILE``), and the one JSON and the
one Markdown table of a run (``--report WORK OUT``), read from the parts' outputs in WORK, with the issues'
targets marked met or missed (the compiled part's tables and targets are ``bench_gpu_compile.report_lines``). The
table is what bench/README.md's GPU section shows."""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import xml.etree.ElementTree as ElementTree
from importlib import metadata
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_gpu_compile import report_lines as compiled_report  # noqa: E402
from compiled_runs import reference_accelerate  # noqa: E402

TARGET_KEEP = 0.99  # hasten-keep tokens/s over raw's, bf16 and fp16
TARGET_MEMORY = 1.02  # hasten-keep peak memory over raw's


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _accelerate() -> str | None:
    """The Accelerate the benchmarks compare with: the reference copy's version (bench workers put it first on their
    path), else the installed distribution's unless it is hasten's alias (``+hasten`` in its version)."""
    reference = reference_accelerate()
    if reference is not None:
        found = sorted(reference.glob("accelerate-*.dist-info"))
        version = found[-1].name.removeprefix("accelerate-").removesuffix(".dist-info") if found else "?"
        return f"{version} (the copy in {reference.name})"
    installed = _version("accelerate")
    return None if installed is None or "hasten" in installed else installed


def environment() -> dict:
    """The machine, the packages and whether fp8 training can run here (GPU of compute capability 8.9+ and torchao)."""
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    cards = [torch.cuda.get_device_name(i) for i in range(gpus)]
    capability = list(torch.cuda.get_device_capability(0)) if gpus else None
    try:
        import torchao.float8  # noqa: F401

        torchao, torchao_error = _version("torchao"), None
    except Exception as error:  # noqa: BLE001 - reported, not raised: the fp8 parts are skipped
        torchao, torchao_error = None, f"{type(error).__name__}: {error}"
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "gpus": gpus,
        "cards": cards,
        "capability": capability,
        "fp8_gpu": bool(capability and tuple(capability) >= (8, 9) and torchao),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "torchao": torchao,
        "torchao_error": torchao_error,
        "accelerate": _accelerate(),
        "cpu_count": __import__("os").cpu_count(),
    }


def _read_json(path: Path):
    return json.loads(path.read_text()) if path.is_file() else None


def _cuda_tests(path: Path) -> dict | None:
    if not path.is_file():
        return None
    root = ElementTree.parse(path).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    cases = {"passed": [], "failed": [], "skipped": []}
    for case in suite.iter("testcase"):
        name = case.get("name")
        if case.find("failure") is not None or case.find("error") is not None:
            cases["failed"].append(name)
        elif case.find("skipped") is not None:
            cases["skipped"].append(f"{name} ({case.find('skipped').get('message', '')})")
        else:
            cases["passed"].append(name)
    return cases


def _throughput_rows(figures: dict) -> tuple[list[str], dict]:
    rows, marks = [], {}
    for precision, data in figures.items():
        results = data["results"]
        raw = results["raw"]
        for name, values in results.items():
            speeds = values["tokens_per_s"]
            speed, low, high = statistics.median(speeds), min(speeds), max(speeds)
            ratio = speed / statistics.median(raw["tokens_per_s"])
            memory = max(values["peak_gib"]) / max(raw["peak_gib"])
            rows.append(
                f"| {precision} | {name} | {speed:,.0f} ({low:,.0f}-{high:,.0f}) "
                f"| {ratio:.3f} | {max(values['peak_gib']):.3f} | {memory:.3f} |"
            )
            marks[(precision, name)] = (ratio, memory)
    return rows, marks


def _verdict(met: bool) -> str:
    return "met" if met else "MISSED"


def _targets(marks: dict) -> list[str]:
    lines = []
    for precision in sorted({p for p, _ in marks}):
        keep = marks.get((precision, "hasten-keep"))
        if keep:
            lines.append(
                f"- {precision}, hasten-keep >= {TARGET_KEEP} of raw tokens/s: {keep[0]:.3f} "
                f"-> {_verdict(keep[0] >= TARGET_KEEP)}"
            )
            lines.append(
                f"- {precision}, hasten-keep peak memory within 2 % of raw: {keep[1]:.3f}x "
                f"-> {_verdict(keep[1] <= TARGET_MEMORY)}"
            )
        default, accelerate = marks.get((precision, "hasten")), marks.get((precision, "accelerate"))
        if default and accelerate:
            verdict = "met" if default[0] > accelerate[0] else "MISSED"
            lines.append(
                f"- {precision}, hasten (fp32 outputs) ahead of Accelerate: {default[0]:.3f} vs {accelerate[0]:.3f} "
                f"-> {verdict}"
            )
    return lines


def report(work: Path, out: Path) -> None:
    """Write device_check.json and device_check.md to ``out`` and print the table."""
    env = _read_json(work / "environment.json") or {}
    parts = (
        [json.loads(line) for line in (work / "parts.jsonl").read_text().splitlines()]
        if (work / "parts.jsonl").is_file()
        else []
    )
    throughput, compiled = _read_json(work / "lm_throughput.json"), _read_json(work / "compiled.json")
    tests = _cuda_tests(work / "cuda_tests.xml")
    card = ", ".join(env.get("cards") or ["no GPU (dry run on a CPU)"])
    lines = [
        f"### GPU checks (`bench/device_check.sh`), {env.get('date', '?')}, {card}",
        "",
        f"torch {env.get('torch')}, CUDA {env.get('cuda')}, torchao {env.get('torchao')}, "
        f"accelerate {env.get('accelerate')}, "
        f"Python {env.get('python')}, {env.get('cpu_count')} CPU cores.",
        "",
        "| part | status | seconds |",
        "|---|---|---|",
    ]
    lines += [
        f"| {p['part']} | {p['status']}{' (' + p['reason'] + ')' if 'reason' in p else ''} | {p.get('seconds', '')} |"
        for p in parts
    ]
    if tests is not None:
        lines += [
            "",
            f"CUDA tests: {len(tests['passed'])} passed, {len(tests['failed'])} failed, "
            f"{len(tests['skipped'])} skipped.",
        ]
        lines += [f"- failed: {name}" for name in tests["failed"]] + [f"- skipped: {name}" for name in tests["skipped"]]
    if compiled:
        lines += ["", *compiled_report(compiled)]
    marks = {}
    if throughput:
        rows, marks = _throughput_rows(throughput)
        some = next(iter(throughput.values()))
        lines += [
            "",
            f"Eager LM throughput: {some['params'] / 1e6:.1f}M parameters, sequences of "
            f"{some['config']['sequence']} tokens "
            "(tokens/s median and min-max over the rounds; peak memory; ratios to raw PyTorch).",
            "",
        ]
        lines += [
            "| precision | contestant | tokens/s | vs raw | peak GiB | memory vs raw |",
            "|---|---|---|---|---|---|",
            *rows,
        ]
        lines += ["", "Targets:", *_targets(marks)]
    table = "\n".join(lines) + "\n"
    (out / "device_check.md").write_text(table)
    everything = {
        "environment": env,
        "parts": parts,
        "cuda_tests": tests,
        "lm_throughput": throughput,
        "compiled": compiled,
    }
    (out / "device_check.json").write_text(json.dumps(everything, indent=1))
    print(table)


def main(argv: list[str]) -> int:
    """``--environment FILE`` or ``--report WORK OUT``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--environment", metavar="FILE")
    parser.add_argument("--report", nargs=2, metavar=("WORK", "OUT"))
    args = parser.parse_args(argv)
    if args.environment:
        found = environment()
        Path(args.environment).write_text(json.dumps(found))
        print(json.dumps(found, indent=1))
    if args.report:
        report(Path(args.report[0]), Path(args.report[1]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
