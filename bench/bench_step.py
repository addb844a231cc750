"""Per-step framework overhead: raw PyTorch vs hasten's four-line loop (vs accelerate when installed).

A model where framework cost is visible (MLP 256-512-256, batch 32 per process, AdamW) trains for
``--warmup`` untimed plus ``--steps`` timed batches per round, on 1 process and on 2 processes over gloo
(both launched by torchrun, so every contestant shares the launch). Three variants:

* ``plain``: forward, backward, step, zero_grad.
* ``accum``: ``gradient_accumulation_steps=4``; raw PyTorch divides the loss and skips DDP's all-reduce
  with ``no_sync`` on the first 3 micro-batches of 4; hasten uses ``accumulate`` + ``backward``.
* ``eval``: an evaluation pass collecting predictions and targets of every sample; raw PyTorch
  all-gathers each batch and trims the ``DistributedSampler`` padding at the end; hasten calls
  ``gather_for_metrics``. The timed part ends with the metric (MSE over exactly N samples).

Rounds alternate the contestants (A B, then B A, ...). Every round starts from the same weights and
data, so the contestants do the same math: the script checks that their final losses (training: the
last batch's loss averaged over processes; eval: the metric) and final weights agree, and prints the
differences. It prints per-step medians with min-max over rounds and the ratios to raw PyTorch last:
of the medians, the spread of the per-round ratios (the noise), and of the fastest rounds (interference
from other jobs only slows a round down). Wall time is what counts; the CPU time of the process (all
its threads) is printed beside it because it varies less on a shared machine. For hasten it also prints
how many of its own collectives (each one a header exchange plus its data, see
``hasten.runtime.collective_check``) a timed step ran: none in training, where only DDP communicates.

With ``--width 4 --hidden 4`` the model costs almost nothing and the per-step difference is the
framework's own cost in microseconds.

Usage: python bench/bench_step.py [--processes 1 2] [--variants plain accum eval] [--rounds 9]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (  # noqa: E402
    describe,
    free_port,
    paired_ratio_range,
    ratio_of_medians,
    real_accelerate,
    round_order,
    worker_environment,
)

BATCH = 32
WIDTH, HIDDEN = 256, 512
ACCUMULATION = 4
EVAL_SHORTFALL = 7  # the eval set is this many samples short of full batches, so the last round is padded
DEVICE = "cpu"  # the worker's device: "cpu", or "cuda:<local rank>" with --device cuda (NCCL)


def _synchronize() -> None:
    import torch

    if DEVICE.startswith("cuda"):
        torch.cuda.synchronize()


# ------------------------------------------------------------------------------------------ worker


def _model():
    import torch

    return torch.nn.Sequential(torch.nn.Linear(WIDTH, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, WIDTH))


def _data(world: int, batches: int, shortfall: int = 0, seed: int = 0):
    import torch

    generator = torch.Generator().manual_seed(seed)
    count = BATCH * world * batches - shortfall
    inputs = torch.randn(count, WIDTH, generator=generator)
    targets = inputs @ (torch.randn(WIDTH, WIDTH, generator=generator) / WIDTH**0.5) + 0.1 * torch.randn(
        count, WIDTH, generator=generator
    )
    return torch.utils.data.TensorDataset(inputs, targets)


def _same_batches_as_distributed_sampler(dataset, world: int):
    """``dataset`` reordered so that hasten's sharding (rank r takes batch r of every round of ``world``
    consecutive batches) gives each rank exactly the samples ``DistributedSampler(shuffle=False)``
    gives it (every ``world``-th sample): then both loops compute the very same numbers."""
    import torch

    batches = len(dataset) // (BATCH * world)
    b = torch.arange(batches).view(-1, 1, 1)
    r = torch.arange(world).view(1, -1, 1)
    j = torch.arange(BATCH).view(1, 1, -1)
    source = ((b * BATCH + j) * world + r).reshape(-1)
    return torch.utils.data.TensorDataset(*(tensor[source] for tensor in dataset.tensors))


class _Round:
    """What one contestant's round returns: timed (wall, CPU) seconds, final loss (or metric), final weights,
    and for hasten the number of its own collectives in the timed steps."""

    def __init__(self, seconds: tuple[float, float], loss: float, weights, collectives: int | None = None):
        self.seconds, self.loss, self.weights, self.collectives = seconds, loss, weights, collectives


class _Clock:
    """Wall and CPU time (all threads of this process) since :meth:`start`, and hasten's collectives meanwhile."""

    def start(self) -> None:
        _synchronize()
        self.wall, self.cpu = time.perf_counter(), time.process_time()
        self.collectives = _hasten_collectives()

    def stop(self) -> tuple[float, float]:
        _synchronize()
        return time.perf_counter() - self.wall, time.process_time() - self.cpu

    def collectives_since_start(self) -> int | None:
        now = _hasten_collectives()
        return None if now is None else now - self.collectives


def _hasten_collectives() -> int | None:
    """How many hasten collectives this process ran so far (None when hasten is not loaded)."""
    watchdog = sys.modules.get("hasten.runtime.hang_watchdog")
    return watchdog.sequence() if watchdog is not None else None


def _mean_over_processes(value):
    import torch.distributed as dist

    value = value.detach().clone()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(value)
        value /= dist.get_world_size()
    return float(value)


def _flat_weights(model):
    import torch

    return torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])


class RawTorch:
    """The hand-written loop: DDP + DistributedSampler on several processes, a plain loop on one."""

    name = "raw"

    def __init__(self, world: int):
        self.world = world

    def _loader(self, dataset):
        import torch
        from torch.utils.data.distributed import DistributedSampler

        sampler = DistributedSampler(dataset, shuffle=False) if self.world > 1 else None
        return torch.utils.data.DataLoader(dataset, batch_size=BATCH, shuffle=False, sampler=sampler)

    def _wrap(self, model):
        import torch
        from torch.nn.parallel import DistributedDataParallel

        if self.world == 1:
            return model
        return DistributedDataParallel(model, device_ids=[torch.device(DEVICE).index] if DEVICE != "cpu" else None)

    def train(self, init, dataset, warmup: int, accumulation: int) -> _Round:
        import contextlib

        import torch
        import torch.nn.functional as F

        device = torch.device(DEVICE)
        model = _model()
        model.load_state_dict(init)
        model = self._wrap(model.to(device))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        loader = self._loader(dataset)
        clock = _Clock()
        for index, (inputs, targets) in enumerate(loader):
            if index == warmup:
                clock.start()
            inputs, targets = inputs.to(device), targets.to(device)
            sync = (index + 1) % accumulation == 0
            context = contextlib.nullcontext() if sync or self.world == 1 else model.no_sync()
            with context:
                loss = F.mse_loss(model(inputs), targets)
                (loss / accumulation if accumulation > 1 else loss).backward()
            if sync:
                optimizer.step()
                optimizer.zero_grad()
        seconds = clock.stop()
        return _Round(seconds, _mean_over_processes(loss), _flat_weights(model))

    def evaluate(self, init, dataset, warmup: int) -> _Round:
        import torch
        import torch.distributed as dist
        import torch.nn.functional as F

        device = torch.device(DEVICE)
        model = _model()
        model.load_state_dict(init)
        model = self._wrap(model.to(device))
        model.eval()
        loader = self._loader(dataset)
        predictions, labels = [], []
        clock = _Clock()
        with torch.no_grad():
            for index, (inputs, targets) in enumerate(loader):
                if index == warmup:
                    clock.start()
                inputs, targets = inputs.to(device), targets.to(device)
                outputs = model(inputs)
                if self.world > 1:
                    parts = [torch.empty_like(outputs) for _ in range(self.world)]
                    dist.all_gather(parts, outputs)
                    outputs = torch.cat(parts)
                    parts = [torch.empty_like(targets) for _ in range(self.world)]
                    dist.all_gather(parts, targets)
                    targets = torch.cat(parts)
                predictions.append(outputs)
                labels.append(targets)
            # DistributedSampler repeats samples from the start to fill the last round: drop them.
            metric = F.mse_loss(torch.cat(predictions)[: len(dataset)], torch.cat(labels)[: len(dataset)])
        seconds = clock.stop()
        return _Round(seconds, float(metric), _flat_weights(model))


class FrameworkLoop:
    """The four-line loop of hasten (or of accelerate, whose API is the same)."""

    def __init__(self, name: str, module: str):
        self.name = name
        self.module = module
        self._accelerator = None

    def accelerator(self, accumulation: int):
        """The contestant's Accelerator, created once (as a script would), set to ``accumulation`` steps."""
        if self._accelerator is None:
            import importlib

            import torch

            threads = torch.get_num_threads()
            # accelerate runs several CPU processes as one job only when told it is on the CPU; on a GPU machine
            # the CPU bench keeps both frameworks on the CPU
            on_cpu = DEVICE == "cpu" and (self.module == "accelerate" or torch.cuda.is_available())
            cpu = {"cpu": True} if on_cpu else {}
            self._accelerator = importlib.import_module(self.module).Accelerator(**cpu)
            torch.set_num_threads(threads)  # every contestant runs with the same thread count
        self._accelerator.gradient_accumulation_steps = accumulation
        return self._accelerator

    def train(self, init, dataset, warmup: int, accumulation: int) -> _Round:
        """The four-line loop; with accumulation inside ``accumulate`` (without, exactly the README's loop)."""
        import contextlib

        import torch
        import torch.nn.functional as F

        accelerator = self.accelerator(accumulation)
        model = _model()
        model.load_state_dict(init)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        dataset = _same_batches_as_distributed_sampler(dataset, accelerator.num_processes)
        loader = torch.utils.data.DataLoader(dataset, batch_size=BATCH, shuffle=False)
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        clock = _Clock()
        for index, (inputs, targets) in enumerate(loader):
            if index == warmup:
                clock.start()
            with accelerator.accumulate(model) if accumulation > 1 else contextlib.nullcontext():
                loss = F.mse_loss(model(inputs), targets)
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
        seconds = clock.stop()
        result = _Round(seconds, _mean_over_processes(loss), _flat_weights(model), self._collectives(clock))
        accelerator.free_memory()
        return result

    def _collectives(self, clock: _Clock) -> int | None:
        return clock.collectives_since_start() if self.module == "hasten" else None

    def evaluate(self, init, dataset, warmup: int) -> _Round:
        import torch
        import torch.nn.functional as F

        accelerator = self.accelerator(1)
        model = _model()
        model.load_state_dict(init)
        loader = torch.utils.data.DataLoader(dataset, batch_size=BATCH, shuffle=False)
        model, loader = accelerator.prepare(model, loader)
        model.eval()
        predictions, labels = [], []
        clock = _Clock()
        with torch.no_grad():
            for index, (inputs, targets) in enumerate(loader):
                if index == warmup:
                    clock.start()
                outputs, targets = accelerator.gather_for_metrics((model(inputs), targets))
                predictions.append(outputs)
                labels.append(targets)
            metric = F.mse_loss(torch.cat(predictions), torch.cat(labels))
        seconds = clock.stop()
        result = _Round(seconds, float(metric), _flat_weights(model), self._collectives(clock))
        accelerator.free_memory()
        return result


def _contestants(world: int) -> list:
    contestants = [RawTorch(world), FrameworkLoop("hasten", "hasten")]
    if real_accelerate() is not None:  # HuggingFace's Accelerate, not hasten's alias of it
        contestants.append(FrameworkLoop("accelerate", "accelerate"))
    return contestants


def _run_variant(variant: str, contestants: list, args, world: int, rank: int) -> dict:
    import torch

    torch.manual_seed(0)
    init = _model().state_dict()
    batches = args.warmup + args.steps
    dataset = _data(world, batches, EVAL_SHORTFALL if variant == "eval" else 0)
    accumulation = ACCUMULATION if variant == "accum" else 1
    names = [c.name for c in contestants]
    by_name = {c.name: c for c in contestants}
    times: dict[str, list[float]] = {name: [] for name in names}
    cpu_times: dict[str, list[float]] = {name: [] for name in names}
    losses: dict[str, list[float]] = {name: [] for name in names}
    weight_diffs: dict[str, float] = {name: 0.0 for name in names}
    collectives: list[float] = []
    for round_index in range(-1, args.rounds):  # round -1 warms every contestant up, untimed
        reference = None
        for name in round_order(names, max(round_index, 0)):
            contestant = by_name[name]
            if variant == "eval":
                result = contestant.evaluate(init, dataset, args.warmup)
            else:
                result = contestant.train(init, dataset, args.warmup, accumulation)
            if round_index < 0:
                continue
            times[name].append(result.seconds[0] / args.steps)
            cpu_times[name].append(result.seconds[1] / args.steps)
            losses[name].append(result.loss)
            if result.collectives is not None:
                collectives.append(result.collectives / args.steps)
            if name == "raw":
                reference = result.weights
            elif reference is not None:
                weight_diffs[name] = max(weight_diffs[name], float((result.weights - reference).abs().max()))
        if rank == 0 and round_index >= 0:
            line = "  ".join(
                f"{name} {times[name][-1] * 1e6:8.1f} us/step (CPU {cpu_times[name][-1] * 1e6:8.1f})" for name in names
            )
            print(f"[{world}p {variant}] round {round_index + 1}: {line}", flush=True)
    return {"wall": times, "cpu": cpu_times, "losses": losses, "weight_diffs": weight_diffs, "collectives": collectives}


def worker(args) -> None:
    """Run every variant in this process (one of ``world`` under torchrun) and write the results as JSON."""
    import torch
    import torch.distributed as dist

    global WIDTH, HIDDEN
    WIDTH, HIDDEN = args.width, args.hidden
    global DEVICE
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if args.device == "cuda":
        DEVICE = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
        torch.cuda.set_device(torch.device(DEVICE))
    if world > 1:
        dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    rank = dist.get_rank() if world > 1 else 0
    torch.set_num_threads(args.threads)
    contestants = _contestants(world)
    results = {variant: _run_variant(variant, contestants, args, world, rank) for variant in args.variants}
    if rank == 0:
        Path(args.output).write_text(json.dumps(results))
    if world > 1:
        dist.destroy_process_group()


# ------------------------------------------------------------------------------------------ driver


def _launch(processes: int, args, output: Path) -> dict:
    script = [
        str(Path(__file__).resolve()),
        "--worker",
        "--output",
        str(output),
        "--rounds",
        str(args.rounds),
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--threads",
        str(args.threads),
        "--width",
        str(args.width),
        "--hidden",
        str(args.hidden),
        "--device",
        args.device,
        "--variants",
        *args.variants,
    ]
    launcher = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(processes),
        "--master_port",
        str(free_port()),
    ]
    env = worker_environment(args.accelerate_path, OMP_NUM_THREADS=str(args.threads))
    subprocess.run([*launcher, *script], check=True, env=env)
    return json.loads(output.read_text())


def _check_agreement(processes: int, variant: str, name: str, data: dict) -> str:
    losses = data["losses"]
    loss_diff = max(abs(a - b) for a, b in zip(losses[name], losses["raw"]))
    if loss_diff > 1e-4 * max(1.0, abs(losses["raw"][-1])):
        raise SystemExit(
            f"{name} and raw PyTorch disagree on {processes}p {variant}: the loops do not do the same math."
        )
    return (
        f"{processes}p {variant:5s} {name:10s} agrees with raw: final {'metric' if variant == 'eval' else 'loss'} "
        f"{losses[name][-1]:.6f} vs {losses['raw'][-1]:.6f} (max |diff| {loss_diff:.2e}), "
        f"max |weight diff| {data['weight_diffs'][name]:.2e}"
    )


def _report(results: dict[int, dict]) -> list[str]:
    """Per-contestant medians (wall and CPU), agreement with raw, then the ratios to raw PyTorch."""
    lines, ratios = [], []
    for processes, variants in results.items():
        for variant, data in variants.items():
            for name in data["wall"]:
                lines.append(
                    describe(f"{processes}p {variant:5s} {name:10s} wall", data["wall"][name], "us/step", 1e6, 1)
                )
                lines.append(
                    describe(f"{processes}p {variant:5s} {name:10s} CPU ", data["cpu"][name], "us/step", 1e6, 1)
                )
            if data.get("collectives"):
                per_step = max(data["collectives"])
                lines.append(f"{processes}p {variant:5s} hasten collectives per timed step: {per_step:.2f}")
            for name in data["wall"]:
                if name == "raw":
                    continue
                lines.append(_check_agreement(processes, variant, name, data))
                for clock in ("wall", "cpu"):
                    median, low, high = paired_ratio_range(data[clock][name], data[clock]["raw"])
                    fastest = min(data[clock][name]) / min(data[clock]["raw"])
                    ratios.append(
                        f"ratio {name}/raw {processes}p {variant:5s} {clock:4s}: "
                        f"{ratio_of_medians(data[clock][name], data[clock]['raw']):.3f} "
                        f"(per-round ratios median {median:.3f}, min-max {low:.3f}-{high:.3f}; fastest rounds "
                        f"{fastest:.3f})"
                    )
    return lines + ratios


def main() -> None:
    """Parse arguments; in the driver launch the workers and print the summary, ratios last."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--processes", type=int, nargs="+", default=[1, 2], help="process counts to run (default: 1 2)")
    parser.add_argument("--variants", nargs="+", default=["plain", "accum", "eval"], choices=["plain", "accum", "eval"])
    parser.add_argument("--rounds", type=int, default=9, help="timed rounds per contestant (after one warm-up round)")
    parser.add_argument("--steps", type=int, default=300, help="timed batches per round")
    parser.add_argument("--warmup", type=int, default=20, help="untimed batches at the start of each round")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process (same for every contestant)")
    parser.add_argument(
        "--width",
        type=int,
        default=WIDTH,
        help="MLP input/output width (a tiny model, e.g. 4, shows the framework cost alone)",
    )
    parser.add_argument("--hidden", type=int, default=HIDDEN, help="MLP hidden width")
    parser.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="cuda: one GPU per process, NCCL (bench/device_check.sh on a machine with 2 GPUs)",
    )
    parser.add_argument(
        "--accelerate-path",
        help="folder holding HuggingFace's accelerate package (default: the repository's .reference copy, else the "
        "installed one when it is not hasten's alias)",
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--output", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    results = {}
    with tempfile.TemporaryDirectory() as folder:
        for processes in args.processes:
            results[processes] = _launch(processes, args, Path(folder) / f"step_{processes}.json")
    print()
    print("\n".join(_report(results)))


if __name__ == "__main__":
    main()
