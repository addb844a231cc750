"""Running the compiled benchmark's contestants in worker processes (``bench/compiled_worker.py``), for
``bench/bench_gpu_compile.py`` and ``bench/profile_compiled.py``: which contestants exist (:class:`Spec`), the
settings every worker shares (:class:`RunOptions`), the workers' environment (HuggingFace's Accelerate first on the
path, never hasten's alias), and :func:`run_specs` / :func:`prewarm`, which watch the workers and keep going when one
contestant fails, hangs or runs out of time. Imports neither torch nor hasten.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from _common import real_accelerate, reference_accelerate, worker_environment  # noqa: F401  (re-exported)

ROOT = Path(__file__).resolve().parent.parent
WORKER = Path(__file__).resolve().parent / "compiled_worker.py"

NAMES = (
    "raw",  # raw PyTorch: autocast around forward and loss; regional: the regions Accelerate compiles, in place
    "raw-blocks",  # raw PyTorch, only the repeated blocks compiled (torch's regional compilation recipe)
    "hasten",  # Accelerator(mixed_precision, dynamo_plugin): outputs converted to fp32, loss outside autocast
    "hasten-keep",  # hasten with AutocastKwargs(convert_outputs_to_fp32=False), loss under accelerator.autocast()
    "accelerate",  # HuggingFace's Accelerate, as hasten
    "hasten-fp8",  # mixed_precision="fp8", hasten's defaults (Accelerate's layer filter, tensorwise scaling)
    "hasten-fp8-sized",  # fp8, every linear layer but the head, less those too small for float8 to pay
    "hasten-fp8-rowwise",  # fp8, torchao's rowwise recipe
    "accelerate-fp8",  # Accelerate's fp8 with its defaults (torchao backend)
    "accelerate-fp8-noag",  # Accelerate's fp8 with enable_fsdp_float8_all_gather=False
)


@dataclasses.dataclass(frozen=True)
class Spec:
    """One contestant: precision (bf16, fp16, fp8), compilation (regional or whole), name (:data:`NAMES`), and
    whether its step is profiled after the timed steps."""

    precision: str
    mode: str
    name: str
    profile: bool = False

    @property
    def text(self) -> str:
        """``precision/mode/name`` (``+profile`` when profiled): the form workers take on their command line."""
        return f"{self.precision}/{self.mode}/{self.name}" + ("+profile" if self.profile else "")

    @property
    def key(self) -> str:
        """``precision/mode/name``."""
        return f"{self.precision}/{self.mode}/{self.name}"

    @property
    def library(self) -> str:
        """``raw``, ``hasten`` or ``accelerate``."""
        return self.name.split("-")[0]

    @classmethod
    def parse(cls, text: str) -> Spec:
        """The spec of ``precision/mode/name[+profile]``."""
        body, _, flag = text.partition("+")
        precision, mode, name = body.split("/")
        if precision not in ("bf16", "fp16", "fp8") or mode not in ("regional", "whole") or name not in NAMES:
            raise ValueError(f"not a contestant: {text!r} (precision/mode/name with a name from {NAMES})")
        return cls(precision, mode, name, profile=flag == "profile")


@dataclasses.dataclass
class RunOptions:
    """What every worker of one run shares: the model (``bench_gpu_lm.SIZES``), sequences per step, untimed steps,
    timed segments and steps per segment, the torch.compile backend, torch threads, and whether to run on the CPU."""

    size: str = "wide"
    batch: int = 4
    warmup: int = 3
    segments: int = 3
    segment_steps: int = 6
    backend: str = "inductor"
    threads: int = 0
    cpu: bool = False
    layers: int | None = None  # override of the model's layer count (prewarm of regional contestants)

    @classmethod
    def for_run(cls, dry_run: bool, **overrides) -> RunOptions:
        """The GPU defaults, or (``dry_run``) a tiny model on the CPU with the ``aot_eager`` backend; ``overrides``
        that are not None replace fields."""
        options = (
            cls(size="smoke", batch=2, warmup=1, segments=2, segment_steps=2, backend="aot_eager", threads=1, cpu=True)
            if dry_run
            else cls()
        )
        return dataclasses.replace(options, **{k: v for k, v in overrides.items() if v is not None})

    def to_args(self) -> list[str]:
        """The worker's command-line arguments."""
        args = ["--size", self.size, "--batch", str(self.batch), "--warmup", str(self.warmup)]
        args += ["--segments", str(self.segments), "--segment-steps", str(self.segment_steps)]
        args += ["--backend", self.backend, "--threads", str(self.threads)]
        args += ["--layers", str(self.layers)] if self.layers else []
        return args + (["--cpu"] if self.cpu else [])


def _stop(process: subprocess.Popen) -> None:
    """End ``process`` and everything it started (its own process group)."""
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _tail(path: Path, lines: int = 15) -> str:
    text = path.read_text(errors="replace").splitlines() if path.is_file() else []
    return "\n".join(line for line in text[-lines:] if not line.startswith("USDT"))


def _progress(event: dict) -> str:
    head = f"[{event['spec']}] {event['status']}"
    if event["status"] != "ok":
        return f"{head}: {event.get('reason', '')}"
    if "tokens_per_s" not in event:
        return f"{head}: compiled in {event['first_step_s']:.1f} s (first step)"
    speeds = sorted(event["tokens_per_s"])
    dyn = event.get("dynamo", {})
    return (
        f"{head}: {speeds[len(speeds) // 2]:,.0f} tokens/s, first step {event['first_step_s']:.1f} s, graphs "
        f"{dyn.get('graphs')}, breaks {dyn.get('graph_breaks')}, recompiles {dyn.get('recompiles')}"
    )


class _Worker:
    """One worker process over some specs, and what it has reported so far."""

    def __init__(self, specs: list[Spec], options: RunOptions, folder: Path, env: dict, prewarm: bool, tag: str):
        self.output, self.log = folder / f"{tag}.jsonl", folder / f"{tag}.log"
        command = [sys.executable, str(WORKER), "--output", str(self.output), *options.to_args()]
        command += (["--prewarm"] if prewarm else []) + ["--specs", *[spec.text for spec in specs]]
        with open(self.log, "w") as log:
            self.process = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True
            )
        self.started = time.monotonic()
        self.current: tuple[str, float] | None = None
        self.first_step: float | None = None
        self._read = 0

    def events(self) -> list[dict]:
        """The events written since the last call; tracks the contestant running now."""
        if not self.output.is_file():
            return []
        lines = self.output.read_text().splitlines()
        fresh = [json.loads(line) for line in lines[self._read :] if line.strip()]
        self._read += len(fresh)
        for event in fresh:
            if event["event"] == "start":
                self.current, self.first_step = (event["spec"], time.monotonic()), None
            elif event["event"] == "progress":
                self.first_step = event.get("first_step_s")
            else:
                self.current = None
        return [event for event in fresh if event["event"] == "result"]

    def where(self) -> str:
        """Where the running contestant is, and the end of the worker's log, for a contestant stopped on time."""
        phase = (
            f"its first step (compilation) took {self.first_step:.0f} s"
            if self.first_step is not None
            else "it had not finished its first step (building, preparing, compiling)"
        )
        return f"{phase}; log: {_tail(self.log, 4)}"


def run_specs(
    specs: list[Spec],
    options: RunOptions,
    folder: Path,
    env: dict,
    limit: float,
    deadline: float | None,
    prewarm: bool = False,
) -> list[dict]:
    """Run ``specs`` in turn in worker processes and return one result per spec, in order.

    A contestant running longer than ``limit`` seconds, or past ``deadline`` (``time.monotonic()``), is stopped
    (status ``timeout`` or ``budget``); one whose worker died is ``crashed`` (with the end of its log); a new worker
    then runs the ones left. Specs not started before ``deadline`` are ``budget``.
    """
    results: dict[str, dict] = {}
    remaining, attempt = list(specs), 0
    while remaining:
        if deadline is not None and time.monotonic() > deadline - 5:
            break
        tag = f"{'prewarm' if prewarm else 'run'}-{remaining[0].text.replace('/', '-')}-{attempt}"
        worker = _Worker(remaining, options, folder, env, prewarm, tag)
        _watch(worker, results, limit, deadline)
        if deadline is not None and time.monotonic() > deadline:
            break
        left = [spec for spec in remaining if spec.text not in results]
        if len(left) == len(remaining):  # the worker died before it finished anything: it would again
            reason = f"worker exit {worker.process.returncode} before any result: {_tail(worker.log)}"
            results.update({spec.text: {"spec": spec.text, "status": "crashed", "reason": reason} for spec in left})
        remaining, attempt = [spec for spec in remaining if spec.text not in results], attempt + 1
    for spec in specs:
        results.setdefault(spec.text, {"spec": spec.text, "status": "budget", "reason": "the time budget was spent"})
    return [dict(results[spec.text], spec=dataclasses.asdict(spec)) for spec in specs]


def _watch(worker: _Worker, results: dict, limit: float, deadline: float | None) -> None:
    while True:
        done = worker.process.poll() is not None
        for event in worker.events():
            results[event["spec"]] = event
            print(_progress(event), flush=True)
        now = time.monotonic()
        running = worker.current
        if running and now - running[1] > limit:
            _stop(worker.process)
            reason = f"no result within {limit:.0f} s: {worker.where()}"
            results[running[0]] = {"spec": running[0], "status": "timeout", "reason": reason}
        elif deadline is not None and now > deadline:
            _stop(worker.process)
            if running:
                results[running[0]] = {
                    "spec": running[0],
                    "status": "budget",
                    "reason": f"stopped after {now - running[1]:.0f} s, the time budget spent: {worker.where()}",
                }
        elif not done:
            time.sleep(0.5)
            continue
        elif running:
            results[running[0]] = {
                "spec": running[0],
                "status": "crashed",
                "reason": f"worker exit {worker.process.returncode}: {_tail(worker.log)}",
            }
        if running and running[0] in results and results[running[0]]["status"] != "ok":
            print(_progress(results[running[0]]), flush=True)
        return


WHOLE_SLOTS = 3  # a whole-model prewarm holds the full model: three times a regional one's shallow model


def prewarm(units: list[Spec], options: RunOptions, folder: Path, env: dict, slots: int, deadline: float) -> list:
    """Compile the contestants ``units`` ahead, several workers at once, so that the timed runs find their graphs in
    torch's compile caches (inductor's FX graph cache, AOTAutograd's cache, Triton's kernels): one forward and
    backward each, no optimizer step, nothing timed. A regional contestant is compiled on a 2-layer model of the
    same width (its block and other graphs are the same as on the full model, in less memory) and takes one of
    ``slots``; a whole-model one needs the full model and takes :data:`WHOLE_SLOTS`. Returns each contestant's result
    (its ``first_step_s`` is its cold compilation, slowed by the others compiling beside it); workers still running
    at ``deadline`` are stopped."""
    env = dict(env, TORCHINDUCTOR_COMPILE_THREADS=str(max(2, (os.cpu_count() or 2) // max(slots, 1))))
    shallow = dataclasses.replace(options, layers=2)
    waiting, running, results = list(units), [], []
    while waiting or running:
        used = sum(weight for _, _, weight in running)
        while waiting and time.monotonic() < deadline:
            spec = waiting[0]
            weight = WHOLE_SLOTS if spec.mode == "whole" else 1
            if running and used + weight > slots:
                break
            waiting.pop(0)
            worker_options = options if spec.mode == "whole" else shallow
            tag = f"prewarm-{spec.text.replace('/', '-')}"
            running.append((spec, _Worker([spec], worker_options, folder, env, prewarm=True, tag=tag), weight))
            used += weight
        for entry in list(running):
            results += _prewarm_poll(entry[1], deadline)
            if entry[1].process.poll() is not None:
                running.remove(entry)
        if waiting and time.monotonic() >= deadline:
            results += [{"spec": spec.text, "status": "budget", "reason": "not prewarmed"} for spec in waiting]
            waiting = []
        time.sleep(0.5)
    return results


def _prewarm_poll(worker: _Worker, deadline: float) -> list[dict]:
    results = worker.events()
    for event in results:
        print("prewarm " + _progress(event), flush=True)
    finished = worker.process.poll() is not None
    if finished or time.monotonic() > deadline:
        _stop(worker.process)
        if worker.current:
            status = "crashed" if finished else "budget"
            results.append({"spec": worker.current[0], "status": status, "reason": worker.where()})
            print(f"prewarm [{worker.current[0]}] {status}", flush=True)
    return results
