"""The resume matrix: ``resume_matrix.py ROOT LAUNCH`` under torchrun (hasten) runs the steps of launch number LAUNCH
of the plan that tests/strategies/test_resume_matrix.py wrote to ``ROOT/plan.json`` (a list of launches, each
``{"world": processes, "steps": [["run", engine] or ["resume", engine, source layout], ...]}``).

A layout is an engine on this launch's number of processes: ``single`` (one process, no wrapper), ``ddp``, ``fsdp2``
(sharded state dict) or ``zero1``/``zero2``/``zero3``. Every layout trains tests/scripts/zero_resharding.py's tiny
transformer with tied weights, AdamW in two parameter groups (weight decay on the matrices only) and a LambdaLR
schedule in fp32, on the prepared loader (stateful, ``split_batches=True``: one global batch of ``GLOBAL`` shuffled
samples per optimizer step, whatever the number of processes, so that the arithmetic and the schedule are the same
on every layout). An epoch is ``FIRST + NEXT`` steps.

Steps:

* ``run``: the engine trains ``FIRST`` steps, saves its checkpoint to ``ROOT/<engine>_w<processes>`` and, without
  stopping, trains to the end of the epoch: the run every resume on that layout is compared with. Its record
  (``ROOT/records/<layout>.*``: the losses and the sample ids of every step, the learning rate, the weights and Adam's
  state by parameter name at the save and at the end) is written by the main process.
* ``resume``: the engine, built afresh, ``load_state``s the source's checkpoint; right after it the weights and Adam's
  state are the saved ones bit for bit. It trains to the end of the epoch: the samples before and after the resume
  make the epoch once each and are the run's; the losses, the weights and Adam's state at the end match the target
  layout's run within ``RELATIVE`` (bit for bit where the source did the same arithmetic: as many processes, one or
  two), and the learning rate is the run's. A resume under another engine family is said
  in one line (a warning of what did not carry over, or an info line) by the main process alone.

Prints ``rank R: run <layout> passed`` and ``rank R: resume <layout> from <source> passed`` with the time each took
(and a resume's largest relative differences from the run, 0 where bit for bit), or
``... FAILED: <why>`` and exits non-zero at the first failure (a process failing alone would leave the others waiting
in a collective).
"""

import json
import logging
import os
import sys
import time
import warnings
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import torch
from safetensors.torch import load_file, save_file
from torch.utils.data import DataLoader, TensorDataset
from zero_resharding import FIRST, GLOBAL, NEXT, RELATIVE, TOKENS, VOCAB, TinyTransformer, leave_the_group, relative

from hasten import Accelerator, DataLoaderConfiguration, DeepSpeedPlugin
from hasten.state import AcceleratorState, GradientState
from hasten.strategies.fsdp.plugin import FullyShardedDataParallelPlugin

WORLD, RANK = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))  # the tests import build()
SAMPLES = GLOBAL * (FIRST + NEXT)
KEYS = ("exp_avg", "exp_avg_sq", "step")
SAID = "and is resumed under"  # the line of a resume under another engine


def layout(engine: str, world: int = WORLD) -> str:
    """A layout's name (and its checkpoint's folder): ``zero2_w4``."""
    return f"{engine}_w{world}"


def kind(name: str) -> str:
    """The engine of a layout's name, one process without a wrapper counted as DDP."""
    engine = name.rsplit("_w", 1)[0]
    return "ddp" if engine == "single" else engine


def family(name: str) -> str:
    """The engine family of a layout's name: ``torch`` (one process, DDP), ``fsdp2`` or ``zero``."""
    return {"ddp": "torch", "fsdp2": "fsdp2"}.get(kind(name), "zero")


def build(engine: str) -> SimpleNamespace:
    """A fresh Accelerator under ``engine`` with the model, AdamW in two groups, the schedule and the loader."""
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    loaders = DataLoaderConfiguration(split_batches=True, use_stateful_dataloader=True)
    if engine.startswith("zero"):
        plugin = DeepSpeedPlugin(zero_stage=int(engine[4:]), gradient_clipping=1e6)  # no clipping, as elsewhere
        accelerator = Accelerator(dataloader_config=loaders, deepspeed_plugin=plugin)
    elif engine == "fsdp2":
        plugin = FullyShardedDataParallelPlugin(state_dict_type="SHARDED_STATE_DICT")
        accelerator = Accelerator(dataloader_config=loaders, fsdp_plugin=plugin)
    else:
        accelerator = Accelerator(cpu=True, dataloader_config=loaders)
    torch.manual_seed(1)
    raw = TinyTransformer()
    names = [name for name, _ in raw.named_parameters()]  # the tied head is the embedding: named once
    matrices = [p for p in raw.parameters() if p.dim() >= 2]
    others = [p for p in raw.parameters() if p.dim() < 2]
    groups = [{"params": matrices, "weight_decay": 0.01}, {"params": others, "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 / (1 + 0.1 * step))
    data = TensorDataset(torch.arange(SAMPLES), TOKENS)
    loader = DataLoader(data, batch_size=GLOBAL, shuffle=True, generator=torch.Generator().manual_seed(2))
    model, optimizer, loader, scheduler = accelerator.prepare(raw, optimizer, loader, scheduler)
    return SimpleNamespace(
        engine=engine, accelerator=accelerator, model=model, optimizer=optimizer, loader=loader,
        scheduler=scheduler, names=names,
    )  # fmt: skip


def train(run: SimpleNamespace, batches, count: int | None = None) -> tuple[list[float], list[int]]:
    """Train on ``batches`` (an iterator of the prepared loader) for ``count`` steps or to the epoch's end; returns
    the losses of the global batches and the ids of the samples each trained on, in order."""
    losses, ids = [], []
    for index, tokens in batches:
        logits = run.model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        run.accelerator.backward(loss)
        run.optimizer.step()
        run.scheduler.step()
        run.optimizer.zero_grad()
        losses.append(run.accelerator.reduce(loss.detach(), "mean").item())
        ids += run.accelerator.gather(index).tolist()
        if count is not None and len(losses) == count:
            break
    return losses, ids


def _named(names: list[str], weights: dict, moments: dict) -> dict[str, torch.Tensor]:
    state = {}
    for name in names:
        state[name] = weights[name].detach().float().cpu().clone()
        for key in KEYS:
            value = moments[name][key]
            state[f"{name}:{key}"] = (
                torch.tensor(float(value), dtype=torch.float64) if key == "step" else value.detach().cpu().clone()
            )
    return state


def state_of(run: SimpleNamespace, folder: Path) -> dict[str, torch.Tensor]:
    """Every parameter's weight (ZeRO: fp32 master) and Adam state by name, on every process (a collective). Under
    ZeRO they are read from a ``save_state`` into ``folder`` (made now unless it exists): DeepSpeed's
    safe_get_full_optimizer_state fails on 2 processes with two groups."""
    if run.engine.startswith("zero"):
        from hasten.strategies.deepspeed.resharding import read_zero_checkpoint

        if not folder.exists():
            run.accelerator.save_state(str(folder))
        run.accelerator.wait_for_everyone()
        full = read_zero_checkpoint(folder)
        return _named(run.names, full.weights, full.optimizer_state)
    module = run.accelerator.unwrap_model(run.model)
    if run.engine == "fsdp2":
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        options = StateDictOptions(full_state_dict=True)
        weights = get_model_state_dict(module, options=options)
        moments = get_optimizer_state_dict(module, run.optimizer.optimizer, options=options)["state"]
        return _named(run.names, weights, moments)
    params = dict(module.named_parameters())
    return _named(run.names, params, {name: run.optimizer.optimizer.state[p] for name, p in params.items()})


def _record(root: Path, name: str, **values) -> None:
    folder = root / "records"
    folder.mkdir(exist_ok=True)
    for key, value in values.items():
        if isinstance(value, dict):
            save_file(value, folder / f"{name}.{key}.safetensors")
        else:
            (folder / f"{name}.{key}.json").write_text(json.dumps(value))


def _read(root: Path, name: str, key: str):
    path = root / "records" / f"{name}.{key}"
    return (
        load_file(f"{path}.safetensors") if key in ("saved", "final") else json.loads(Path(f"{path}.json").read_text())
    )


def run_through(root: Path, engine: str) -> None:
    """Train ``FIRST`` steps, save, train to the epoch's end; the main process records the run."""
    run, name = build(engine), layout(engine)
    batches = iter(run.loader)
    losses, ids = train(run, batches, FIRST)
    run.accelerator.save_state(str(root / name))
    saved = state_of(run, root / name)
    assert len(ids) == FIRST * GLOBAL, f"{name}: trained on {ids} in {FIRST} steps"
    next_losses, next_ids = train(run, batches)
    final = state_of(run, root / "probes" / f"{name}_final")
    if run.accelerator.is_main_process:
        lr = run.scheduler.get_last_lr()
        _record(root, name, saved=saved, final=final, ids=[ids, next_ids], losses=[losses, next_losses], lr=lr)
    run.accelerator.wait_for_everyone()


class _Lines(logging.Handler):
    """The info lines of hasten's checkpointing logger, kept."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.lines = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def load_saying(run: SimpleNamespace, folder: Path) -> list[str]:
    """``load_state`` of ``folder``; returns the lines (warnings, info) that say it was saved under another engine."""
    logger, lines = logging.getLogger("hasten.checkpointing"), _Lines()
    level = logger.level
    logger.addHandler(lines)
    logger.setLevel(logging.INFO)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            run.accelerator.load_state(str(folder))
    finally:
        logger.removeHandler(lines)
        logger.setLevel(level)
    return [line for line in [str(w.message) for w in caught] + lines.lines if SAID in line]


def _check_said(name: str, source: str, said: list[str]) -> None:
    """A resume under another engine family (one process or DDP, FSDP2, ZeRO) is said in one line, by the main
    process alone."""
    lines = 1 if family(source) != family(name) and RANK == 0 else 0
    assert len(said) == lines, f"{name} from {source}: {lines} line(s) saying the engine changed expected: {said}"


def _check_equal(what: str, state: dict, expected: dict) -> None:
    assert state.keys() == expected.keys(), f"{what}: {sorted(state)} != {sorted(expected)}"
    for key, tensor in expected.items():
        assert torch.equal(state[key], tensor), f"{what}: {key} is not the saved one bit for bit"


def _check_close(what: str, state: dict, expected: dict) -> float:
    """The weights and Adam's moments within ``RELATIVE`` of the run's, its steps equal; returns the largest
    relative difference."""
    worst = 0.0
    for key, tensor in expected.items():
        if key.endswith(":step"):
            assert torch.equal(state[key], tensor), f"{what}: {key} {state[key]} != {tensor}"
            continue
        difference = relative(state[key], tensor)
        assert difference <= RELATIVE, (
            f"{what}: {key} differs by {difference:.3g} (relative) from the uninterrupted run"
        )
        worst = max(worst, difference)
    return worst


def resume(root: Path, engine: str, source: str) -> str:
    """Resume ``source``'s checkpoint under ``engine`` here and check it against this layout's run; returns how
    close the losses and the state at the end came to the run's (relative differences, 0 where equal bit for bit)."""
    name, what = layout(engine), f"{layout(engine)} from {source}"
    expected_losses, expected_ids = _read(root, name, "losses")[1], _read(root, name, "ids")[1]
    run = build(engine)
    said = load_saying(run, root / source)
    _check_equal(f"{what}, right after the load", state_of(run, root / "probes" / f"{name}_from_{source}_loaded"),
                 _read(root, source, "saved"))  # fmt: skip
    _check_said(name, source, said)
    losses, ids = train(run, iter(run.loader))
    before = _read(root, source, "ids")[0]
    both, epoch = Counter(before + ids), Counter(range(SAMPLES))
    assert both == epoch, f"{what}: samples repeated {sorted(both - epoch)}, missing {sorted(epoch - both)}"
    assert ids == expected_ids, (
        f"{what}: trained on {ids} after the resume, the run that never stopped on {expected_ids}"
    )
    for step, (loss, expected) in enumerate(zip(losses, expected_losses)):
        assert abs(loss - expected) <= RELATIVE * abs(expected), (
            f"{what}: step {FIRST + step + 1}'s loss {loss!r} != {expected!r} (losses {losses} != {expected_losses})"
        )
    assert run.scheduler.get_last_lr() == _read(root, name, "lr"), (what, run.scheduler.get_last_lr())
    worst = _check_close(
        what, state_of(run, root / "probes" / f"{name}_from_{source}_final"), _read(root, name, "final")
    )
    losses_off = max(abs(loss - expected) / abs(expected) for loss, expected in zip(losses, expected_losses))
    if same_arithmetic(source):
        assert losses_off == worst == 0, f"{what}: losses {losses_off:.3g}, state {worst:.3g} off, not bit for bit"
    return f"losses {losses_off:.1e}, state {worst:.1e}"


def same_arithmetic(source: str) -> bool:
    """Whether ``source``'s layout computes what this one does, bit for bit: as many processes, one or two (two
    processes' gradients add up alike in either order; four are summed in an order each engine chooses)."""
    return int(source.rsplit("_w", 1)[1]) == WORLD <= 2


def main():
    logging.basicConfig(level=logging.ERROR)
    root = Path(sys.argv[1])
    launch = json.loads((root / "plan.json").read_text())[int(sys.argv[2])]
    assert launch["world"] == WORLD, f"launch {sys.argv[2]} is planned on {launch['world']} processes, not {WORLD}"
    for action, engine, *source in launch["steps"]:
        what = f"{action} {layout(engine)}" + (f" from {source[0]}" if source else "")
        start = time.perf_counter()
        try:
            close = run_through(root, engine) if action == "run" else resume(root, engine, *source)
        except Exception as error:
            # A process that failed alone would leave the others waiting in a collective: the launch ends here.
            message = f"{type(error).__name__}: {error}".replace("\n", " ")
            print(f"rank {RANK}: {what} FAILED: {message}", flush=True)
            raise
        said = f"{close}; " if close else ""
        print(f"rank {RANK}: {what} passed ({said}{time.perf_counter() - start:.1f} s)", flush=True)
    leave_the_group()


if __name__ == "__main__":
    main()
