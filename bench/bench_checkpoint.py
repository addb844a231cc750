"""Checkpoint throughput: ``save_state``/``load_state`` vs the raw safetensors floor, warm and cold, side by side.

A model of N blocks (LayerNorm + Linear 1024->4096 + GELU + Linear 4096->1024, 8.4M parameters each;
12 blocks: 100.7M parameters) with AdamW state (one step taken): 12 blocks hold 1.21 GB of tensors.

* raw save: ``safetensors.torch.save_file`` of the same tensors (model + optimizer state in one dict)
  and ``fsync`` of the file (hasten's save is durable, so the floor must be too).
* raw load: ``safetensors.torch.load_file`` and copying every tensor into the live model
  (``load_state_dict``) and the live optimizer state.
* hasten: ``Accelerator.save_state(folder)`` / ``load_state(folder)``, verification on (xxh3 of every
  file, manifest, atomic rename; every file verified before anything is loaded).
* accelerate, when ``--accelerate-path`` holds it (``pip install --no-deps --target /tmp/accref
  accelerate==1.15.0``): its ``save_state``/``load_state``, run in a worker process that gets that
  folder on its PYTHONPATH (the benchmark's own interpreter never imports it). It does not fsync.

Every round runs each contestant warm (load straight after the save, from the page cache) and cold
(the checkpoint's files synced and dropped from the page cache with ``posix_fadvise(DONTNEED)`` before
the load; ``/proc/sys/vm/drop_caches`` is not used: it would empty the cache of every job on the
machine). Contestants alternate (A B C, then C B A). Before each load the model and optimizer state are
zeroed; after it they are compared with the saved values (untimed). The extra resident memory (peak
private RSS, i.e. RSS less mapped files, during the call minus before it, sampled every 2 ms) is
reported against one shard (the largest file), the bound for a save or load that copies nothing else.

Last, the training-loop stall of an asynchronous save: the time of ``save_state(async_save=True)`` plus the
next 3 training steps, less the time of 3 plain steps, as a fraction of a synchronous ``save_state``; and when
the background write completes, counted from the call, against the synchronous save's time.

``--busy N`` runs N busy processes (``while True: pass``, started by this process, so in its scheduling group,
as a DataLoader's workers are) for the whole run: the machine as a training job with CPU-bound workers sees it.

``--main-only-rounds N``: diffusers' checkpoint pattern (``tests/scripts/eco_diffusers.py``: a UNet trained on 2
processes under DDP, checkpoints saved by the main process alone with save/load hooks, then a resume), launched under
hasten (``hasten launch --as_accelerate``) and under Accelerate (``accelerate launch``, the reference copy first on
PYTHONPATH), alternately, N rounds: the wall time of each launch.

Usage: python bench/bench_checkpoint.py [--rounds 15] [--blocks 12] [--accelerate-path /tmp/accref] [--busy 2]
       [--main-only-rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import BusyProcesses, describe, free_port, paired_ratio_range, ratio_of_medians, round_order  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent / "outputs" / "bench_checkpoint"
WIDTH = 1024
MODES = ("warm", "cold")


def _model(blocks: int) -> torch.nn.Module:
    layers = []
    for _ in range(blocks):
        layers += [
            torch.nn.LayerNorm(WIDTH),
            torch.nn.Linear(WIDTH, 4 * WIDTH),
            torch.nn.GELU(),
            torch.nn.Linear(4 * WIDTH, WIDTH),
        ]
    return torch.nn.Sequential(*layers)


def _step(model, optimizer) -> None:
    model(torch.randn(4, WIDTH)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def _trained(blocks: int):
    torch.manual_seed(0)
    model = _model(blocks)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    _step(model, optimizer)
    return model, optimizer


def _optimizer_tensors(optimizer) -> dict[str, torch.Tensor]:
    """The optimizer's state tensors, keyed ``optimizer.<param index>.<name>``."""
    index = {id(p): i for i, p in enumerate(p for group in optimizer.param_groups for p in group["params"])}
    return {
        f"optimizer.{index[id(p)]}.{name}": value
        for p, state in optimizer.state.items()
        for name, value in state.items()
    }


def _all_tensors(model, optimizer) -> dict[str, torch.Tensor]:
    return {**{f"model.{k}": v for k, v in model.state_dict().items()}, **_optimizer_tensors(optimizer)}


def _evict(folder: Path) -> None:
    """Sync every file of ``folder`` and drop its pages from the page cache."""
    for path in folder.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _private_rss(process) -> int:
    """Resident memory that is not a mapped file (mapped page-cache pages are counted in RSS too)."""
    info = process.memory_info()
    return info.rss - info.shared


class _PeakRss:
    """Peak private resident memory of this process while the block runs, above the level before it."""

    def __init__(self):
        self.process = psutil.Process()
        self.extra = 0

    def __enter__(self):
        self.before = self.peak = _private_rss(self.process)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def _sample(self):
        while not self.stop.wait(0.002):
            self.peak = max(self.peak, _private_rss(self.process))

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()
        self.extra = max(self.peak, _private_rss(self.process)) - self.before


class Raw:
    """``safetensors.torch.save_file`` + fsync; ``load_file`` + copy into the model and optimizer."""

    def __init__(self, model, optimizer):
        self.model, self.optimizer = model, optimizer

    def save(self, folder: Path) -> None:
        from safetensors.torch import save_file

        folder.mkdir(parents=True)
        path = folder / "checkpoint.safetensors"
        save_file(_all_tensors(self.model, self.optimizer), path)
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def load(self, folder: Path) -> None:
        from safetensors.torch import load_file

        loaded = load_file(folder / "checkpoint.safetensors")
        self.model.load_state_dict({k.removeprefix("model."): v for k, v in loaded.items() if k.startswith("model.")})
        with torch.no_grad():
            for name, tensor in _optimizer_tensors(self.optimizer).items():
                tensor.copy_(loaded[name])


class Framework:
    """``Accelerator.save_state`` / ``load_state`` (hasten or accelerate)."""

    def __init__(self, accelerator, model, optimizer):
        self.accelerator, self.model, self.optimizer = accelerator, model, optimizer

    def save(self, folder: Path) -> None:
        self.accelerator.save_state(str(folder))

    def load(self, folder: Path) -> None:
        self.accelerator.load_state(str(folder))


def _framework(module_name: str, blocks: int) -> Framework:
    module = __import__(module_name)
    accelerator = module.Accelerator(cpu=True) if module_name == "accelerate" else module.Accelerator()
    model, optimizer = _trained(blocks)
    model, optimizer = accelerator.prepare(model, optimizer)
    return Framework(accelerator, model, optimizer)


def _scramble(contestant) -> None:
    with torch.no_grad():
        for tensor in _all_tensors(contestant.model, contestant.optimizer).values():
            tensor.zero_()


def _check(contestant, reference: dict[str, torch.Tensor], name: str) -> None:
    current = _all_tensors(contestant.model, contestant.optimizer)
    for key, expected in reference.items():
        if not torch.equal(current[key], expected):
            raise SystemExit(f"{name}: {key} differs from the saved value after load.")


def _measure(contestant, folder: Path, mode: str, reference, name: str) -> dict[str, float]:
    """One save and one load; times in seconds, extra RSS in bytes."""
    shutil.rmtree(folder, ignore_errors=True)
    os.sync()
    with _PeakRss() as save_rss:
        start = time.perf_counter()
        contestant.save(folder)
        save = time.perf_counter() - start
    shard = max(p.stat().st_size for p in folder.rglob("*") if p.is_file())
    if mode == "cold":
        _evict(folder)
    _scramble(contestant)
    with _PeakRss() as load_rss:
        start = time.perf_counter()
        contestant.load(folder)
        load = time.perf_counter() - start
    _check(contestant, reference, name)
    shutil.rmtree(folder)
    return {"save": save, "load": load, "save_rss": save_rss.extra, "load_rss": load_rss.extra, "shard": shard}


class Remote:
    """A contestant in a worker process (accelerate, with its folder on the worker's PYTHONPATH only)."""

    def __init__(self, blocks: int, path: str):
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [path, os.environ.get("PYTHONPATH")]))}
        self.process = subprocess.Popen(
            [sys.executable, __file__, "--worker", "--blocks", str(blocks)],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.version = self._reply()

    def _reply(self):
        line = self.process.stdout.readline()
        if not line:
            raise SystemExit("the accelerate worker ended early")
        return json.loads(line)

    def measure(self, folder: Path, mode: str) -> dict[str, float]:
        self.process.stdin.write(json.dumps([str(folder), mode]) + "\n")
        self.process.stdin.flush()
        return self._reply()

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(timeout=60)


def _worker(blocks: int) -> None:
    torch.set_num_threads(1)
    import accelerate

    contestant = _framework("accelerate", blocks)
    reference = {k: v.clone() for k, v in _all_tensors(contestant.model, contestant.optimizer).items()}
    print(json.dumps(accelerate.__version__), flush=True)
    for line in sys.stdin:
        folder, mode = json.loads(line)
        print(json.dumps(_measure(contestant, Path(folder), mode, reference, "accelerate")), flush=True)


def _async_stall(blocks: int, repeats: int, steps_after: int = 3) -> dict[str, list[float]]:
    """What an asynchronous save costs the training loop (hasten): the save call plus the next ``steps_after``
    training steps, against as many plain steps and against a synchronous save. Each repeat measures the
    plain steps, the synchronous save and the asynchronous one in turn (the background save is waited for,
    untimed, before the next measurement)."""
    import hasten
    from hasten.checkpointing import background, staging_memory, wait_for_pending_save

    times: dict[str, list[float]] = {
        "step": [],
        "sync save": [],
        "async save call": [],
        "async call + next steps": [],
        "plain steps": [],
        "async write done after": [],
    }
    accelerator = hasten.Accelerator()
    model, optimizer = _trained(blocks)
    model, optimizer = accelerator.prepare(model, optimizer)
    batch = torch.randn(16, WIDTH)

    def step():
        start = time.perf_counter()
        accelerator.backward(model(batch).square().mean())
        optimizer.step()
        optimizer.zero_grad()
        return time.perf_counter() - start

    def steps():
        return sum(step() for _ in range(steps_after))

    step()
    folder = ROOT / "stall"
    for _ in range(repeats + 1):  # the first repeat warms up (the staging buffer is allocated there)
        plain = steps()
        start = time.perf_counter()
        accelerator.save_state(str(folder))
        sync = time.perf_counter() - start
        shutil.rmtree(folder)
        start = time.perf_counter()
        accelerator.save_state(str(folder), async_save=True)
        call = time.perf_counter() - start
        pending = background._pending  # its finish time is kept for this measurement
        after = steps()
        wait_for_pending_save()
        done = pending.finished - start
        shutil.rmtree(folder)
        for key, value in (
            ("plain steps", plain),
            ("sync save", sync),
            ("async save call", call),
            ("async call + next steps", call + after),
            ("step", plain / steps_after),
            ("async write done after", done),
        ):
            times[key].append(value)
    for values in times.values():
        del values[0]
    times["staging memory"] = [float(staging_memory())]
    return times


def _report(names, results, nbytes: int) -> None:
    for mode in MODES:
        print(f"\n== page cache {mode} ==")
        for kind in ("save", "load"):
            for name in names:
                print(describe(f"{kind} {name:10s}", [nbytes / r[kind] / 1e9 for r in results[mode][name]], "GB/s"))
        for kind in ("save", "load"):
            raw = [r[kind] for r in results[mode]["raw"]]
            for name in names[1:]:
                times = [r[kind] for r in results[mode][name]]
                median, low, high = paired_ratio_range(times, raw)
                print(
                    f"{kind} time {name}/raw: {ratio_of_medians(times, raw):.3f} (per-round {median:.3f}, min-max "
                    f"{low:.3f}-{high:.3f}; "
                    f"fastest runs {min(times) / min(raw):.3f}); speed {ratio_of_medians(raw, times):.3f}x raw "
                    "(target >= 0.95)"
                )
        for name in names:
            loads = [r["load"] for r in results[mode][name]]
            k = max(len(loads) // 3, 1)
            print(
                f"load rounds {name:10s}: "
                + " ".join(f"{t:.3f}" for t in loads)
                + f"  (last {k} / first {k} median: {statistics.median(loads[-k:]) / statistics.median(loads[:k]):.2f})"
            )
        for name in names:
            rs = results[mode][name]
            shard = max(r["shard"] for r in rs)
            print(
                f"extra RSS {name:10s}: save max {max(r['save_rss'] for r in rs) / 1e6:.0f} MB, load max "
                f"{max(r['load_rss'] for r in rs) / 1e6:.0f} MB "
                f"(largest shard {shard / 1e6:.0f} MB; model + optimizer {nbytes / 1e6:.0f} MB already resident)"
            )


def main() -> None:
    """Run the rounds, then the async-save stall, and print everything with the ratios to raw."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--rounds", type=int, default=15, help="timed rounds (after one untimed warm-up round; 0: only the stall)"
    )
    parser.add_argument(
        "--blocks", type=int, default=12, help="model blocks of 8.4M parameters each (12: 100.7M, 1.21 GB with AdamW)"
    )
    parser.add_argument(
        "--accelerate-path", default="/tmp/accref", help="folder holding accelerate (pip --target); skipped when absent"
    )
    parser.add_argument(
        "--stall-repeats", type=int, default=8, help="repeats of the async-save stall measurement (0: skip it)"
    )
    parser.add_argument(
        "--stall-steps", type=int, default=3, help="training steps after the asynchronous save that count"
    )
    parser.add_argument(
        "--main-only-rounds",
        type=int,
        default=0,
        help="rounds of diffusers' main-only save pattern under hasten and Accelerate (needs diffusers; 0: skip)",
    )
    parser.add_argument(
        "--busy", type=int, default=0, help="busy processes (a CPU-bound loop each) running beside the whole run"
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return _worker(args.blocks)
    with BusyProcesses(args.busy):
        if args.main_only_rounds:
            _main_only_launches(args.main_only_rounds, args.accelerate_path)
        if args.rounds or args.stall_repeats:
            _run(args)


def _run(args) -> None:
    torch.set_num_threads(1)
    raw_model, raw_optimizer = _trained(args.blocks)
    contestants = {"raw": Raw(raw_model, raw_optimizer), "hasten": _framework("hasten", args.blocks)}
    reference = {k: v.clone() for k, v in _all_tensors(raw_model, raw_optimizer).items()}
    remote = Remote(args.blocks, args.accelerate_path) if (Path(args.accelerate_path) / "accelerate").is_dir() else None
    names = list(contestants) + (["accelerate"] if remote else [])
    nbytes = sum(v.numel() * v.element_size() for v in reference.values())
    params = sum(v.numel() for k, v in reference.items() if k.startswith("model."))
    print(
        f"model: {params / 1e6:.1f}M parameters; checkpoint tensors (model + AdamW state): {nbytes / 1e9:.3f} GB; "
        f"torch {torch.__version__}"
        + (f"; accelerate {remote.version}" if remote else "")
        + f"; {args.busy} busy process(es) beside the run"
    )
    results = {mode: {name: [] for name in names} for mode in MODES}
    shutil.rmtree(ROOT, ignore_errors=True)
    try:
        for round_index in range(-1, args.rounds) if args.rounds else ():
            for mode in MODES:
                for name in round_order(names, max(round_index, 0)):
                    folder = ROOT / name
                    result = (
                        remote.measure(folder, mode)
                        if name == "accelerate"
                        else _measure(contestants[name], folder, mode, reference, name)
                    )
                    if round_index >= 0:
                        results[mode][name].append(result)
            if round_index >= 0:
                print(
                    f"round {round_index + 1}: "
                    + "  ".join(
                        f"{m} {n} {results[m][n][-1]['save']:.2f}/{results[m][n][-1]['load']:.2f} s"
                        for m in MODES
                        for n in names
                    ),
                    flush=True,
                )
        if args.rounds:
            _report(names, results, nbytes)
        if args.stall_repeats:
            _report_stall(_async_stall(args.blocks, args.stall_repeats, args.stall_steps), args.stall_steps, args.busy)
    finally:
        if remote:
            remote.close()
        shutil.rmtree(ROOT, ignore_errors=True)


def _report_stall(stall: dict[str, list[float]], steps_after: int, busy: int) -> None:
    print(f"\n== asynchronous save (hasten), {busy} busy process(es) beside it ==")
    staged = stall.pop("staging memory")[0]
    for key, values in stall.items():
        print(describe(f"{key:24s}", values, "s"))
    sync = statistics.median(stall["sync save"])
    losses = [
        (a - p) / s for a, p, s in zip(stall["async call + next steps"], stall["plain steps"], stall["sync save"])
    ]
    loss = (statistics.median(stall["async call + next steps"]) - statistics.median(stall["plain steps"])) / sync
    target = "target <= 0.05" if not busy else "target < 1: a synchronous save loses all of its time"
    print(
        f"stall: the saving step plus the next {steps_after} steps lose {loss:.3f} of a synchronous save ({sync:.3f} "
        f"s; per repeat {min(losses):.3f} to {max(losses):.3f}; {target}); the save call itself "
        f"{statistics.median(stall['async save call']) / sync:.3f}; staging memory {staged / 1e9:.2f} GB"
    )
    done = [d / s for d, s in zip(stall["async write done after"], stall["sync save"])]
    print(
        f"completion: the background write is published {statistics.median(stall['async write done after']) / sync:.2f}"
        f"x a synchronous save's time after the call (per repeat {min(done):.2f}-{max(done):.2f}; target <= 1.5)"
    )


def _main_only_launches(rounds: int, accelerate_path: str) -> None:
    """Wall time of tests/scripts/eco_diffusers.py (main-only saves with hooks, 2 CPU processes) under hasten and
    Accelerate, alternately. Accelerate's runs start from torchrun with ``ACCELERATE_USE_CPU=1``, as
    tests/compat/test_clients.py runs it: ``accelerate launch --cpu --num_processes 2`` starts one process."""
    script = Path(__file__).resolve().parent.parent / "tests" / "scripts" / "eco_diffusers.py"

    def command(name: str, port: str) -> list[str]:
        if name == "hasten":
            launch = ["-m", "hasten.commands.main", "launch", "--as_accelerate", "-q", "--cpu", "--num_processes", "2"]
            return [sys.executable, *launch, "--main_process_port", port]
        return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", port]

    sides = {"hasten": {}, "accelerate": {"PYTHONPATH": accelerate_path, "ACCELERATE_USE_CPU": "1"}}
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HASTEN_", "ACCELERATE_", "MASTER_", "RANK"))}
    times: dict[str, list[float]] = {name: [] for name in sides}
    for round_index in range(rounds):
        for name in round_order(list(sides), round_index):
            with tempfile.TemporaryDirectory() as out:
                start = time.perf_counter()
                subprocess.run(
                    [*command(name, str(free_port())), str(script), out],
                    env={**env, "OMP_NUM_THREADS": "1", **sides[name]},
                    check=True,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
                times[name].append(time.perf_counter() - start)
                result = json.loads((Path(out) / "diffusers_rank0.json").read_text())
                if not result["ok"]:
                    raise SystemExit(f"eco_diffusers.py failed under {name}: {result['error']}")
        print(f"main-only round {round_index + 1}: " + "  ".join(f"{n} {t[-1]:.2f} s" for n, t in times.items()))
    print("\n== diffusers' pattern: main-only saves with hooks, 2 processes (wall time of the launch) ==")
    for name, values in times.items():
        print(describe(f"{name:10s}", values, "s"))
    median, low, high = paired_ratio_range(times["hasten"], times["accelerate"])
    print(
        f"hasten/accelerate: {ratio_of_medians(times['hasten'], times['accelerate']):.3f} (per round {median:.3f}, "
        f"min-max {low:.3f}-{high:.3f}; target <= 1.05)"
    )


if __name__ == "__main__":
    main()
