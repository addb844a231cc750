"""Resuming at the first, a middle and the last batch of an epoch, and after it, on 2 processes.

``resume_epochs.py full FOLDER`` trains every variant uninterrupted for 2 epochs of 12 steps (94 samples,
batch 4 per process: the last round is padded) and saves checkpoints inside the loop after steps 1, 6,
12 and 13 and after the loop of epoch 0 (``after``); ``resume FOLDER`` resumes each variant from each
checkpoint (a fresh Accelerator, model and loader each time, in this process) and checks 24 steps in all
and final weights bitwise equal to the uninterrupted run. ``crash FOLDER`` is the report's scenario in
real processes: ``save_state()`` with automatic naming every 4 steps, both processes killed at step 13
in the first attempt; run with ``hasten launch --max_restarts 1``, the restarted group resumes from the
checkpoint of step 12 and must end equal to the ``stateful`` variant's uninterrupted run. ``preempt FOLDER
S1,S2,... NAME`` is one launch of a run preempted again and again: each process sends itself SIGTERM after
step S (when S is past the step it resumed at), so the processes agree to save after step S + 2; run
until it exits 0, it must end equal to the same uninterrupted run.

Variants: ``stateful`` (``use_stateful_dataloader=True``; the loop keeps its epoch in a registered
object, set at the top of each epoch and to the next epoch after the inner loop), ``skip`` (the default
``load_state``; the loop derives epoch and batch from its step count and calls ``skip_first_batches``),
``iterable`` (an ``IterableDataset``: rank 0 reads and dispatches), ``iterable-shard`` (the same,
read by every process, ``dispatch_batches=False``) and ``iterable-skip``.
"""

import os
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from hasten import Accelerator, DataLoaderConfiguration
from hasten.state import reset_state
from hasten.utils import ProjectConfiguration, set_seed

MODE, FOLDER = sys.argv[1], Path(sys.argv[2])
EPOCHS, SAMPLES = 2, 94
SAVES = {1: "ckpt_1", 6: "ckpt_6", 12: "ckpt_12", 13: "ckpt_13"}
VARIANTS = ("stateful", "skip", "iterable", "iterable-shard", "iterable-skip")
X = torch.randn(SAMPLES, 8, generator=torch.Generator().manual_seed(1))
Y = torch.randn(SAMPLES, 1, generator=torch.Generator().manual_seed(2))


class Stream(IterableDataset):
    def __iter__(self):
        return zip(X, Y)

    def __len__(self):
        return SAMPLES


class Progress:
    def __init__(self):
        self.epoch = 0
        self.step = 0

    def state_dict(self):
        return {"epoch": self.epoch, "step": self.step}

    def load_state_dict(self, state):
        self.epoch, self.step = state["epoch"], state["step"]


def setup(variant, project=None):
    iterable = variant.startswith("iterable")
    config = DataLoaderConfiguration(
        use_stateful_dataloader="skip" not in variant, dispatch_batches=False if variant == "iterable-shard" else None
    )
    accelerator = Accelerator(dataloader_config=config, project_config=project)
    set_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(32, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=30)
    # An iterable dataset's loader has no sampler; with its own generator, starting an epoch draws nothing
    # from the global torch generator (which dropout uses), as a map-style prepared loader.
    data = (
        DataLoader(Stream(), batch_size=4, generator=torch.Generator())
        if iterable
        else DataLoader(TensorDataset(X, Y), batch_size=4, shuffle=True)
    )
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, data, scheduler)
    progress = Progress()
    accelerator.register_for_checkpointing(progress)
    return accelerator, model, optimizer, loader, scheduler, progress


def step(accelerator, model, optimizer, scheduler, batch):
    x, y = batch
    accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad()


def train(variant, accelerator, model, optimizer, loader, scheduler, progress, save=None):
    """The user's loop; ``save(label)`` is called after each step and after the loop of each epoch."""
    if "skip" in variant:
        first_epoch, resume_step = divmod(progress.step, len(loader))
    else:
        first_epoch, resume_step = progress.epoch, 0
    for epoch in range(first_epoch, EPOCHS):
        progress.epoch = epoch
        batches = (
            accelerator.skip_first_batches(loader, resume_step) if epoch == first_epoch and resume_step else loader
        )
        for batch in batches:
            step(accelerator, model, optimizer, scheduler, batch)
            progress.step += 1
            if save:
                save(progress.step)
        progress.epoch = epoch + 1
        if save:
            save(f"after{epoch}")


def weights(accelerator, model):
    return {k: v.detach().clone().contiguous() for k, v in accelerator.unwrap_model(model).state_dict().items()}


def full():
    for variant in VARIANTS:
        objects = setup(variant)
        accelerator = objects[0]

        def save(label, accelerator=accelerator, variant=variant):
            name = SAVES.get(label, "ckpt_after" if label == "after0" else None)
            if name:
                accelerator.save_state(FOLDER / variant / name)

        train(variant, *objects, save=save)
        if accelerator.is_main_process:
            save_file(weights(accelerator, objects[1]), FOLDER / variant / "final.safetensors")
        assert objects[-1].step == EPOCHS * 12, objects[-1].step
        accelerator.wait_for_everyone()
        reset_state()


def resume():
    for variant in VARIANTS:
        expected = load_file(FOLDER / variant / "final.safetensors")
        for name in sorted(set(SAVES.values()) | {"ckpt_after"}):
            objects = setup(variant)
            accelerator, model, progress = objects[0], objects[1], objects[-1]
            accelerator.load_state(FOLDER / variant / name)
            resumed_at = progress.step
            train(variant, *objects)
            got = weights(accelerator, model)
            assert progress.step == EPOCHS * 12, (
                f"{variant} from {name}: {progress.step} steps in all, expected {EPOCHS * 12}"
            )
            different = [k for k in expected if not torch.equal(expected[k], got[k])]
            gap = max(((expected[k] - got[k]).abs().max().item() for k in different), default=0.0)
            assert not different, f"{variant} from {name} (step {resumed_at}): {different} differ by up to {gap:.2e}"
            print(
                f"rank {accelerator.process_index}: {variant} resumed from {name} (step {resumed_at}): bitwise equal",
                flush=True,
            )
            accelerator.wait_for_everyone()
            reset_state()


def crash():
    project = ProjectConfiguration(project_dir=str(FOLDER / "crash"), automatic_checkpoint_naming=True)
    objects = setup("stateful", project)
    accelerator, model, progress = objects[0], objects[1], objects[-1]
    if (FOLDER / "crash" / "checkpoints").is_dir():
        accelerator.load_state()
        print(
            f"rank {accelerator.process_index}: restarted at step {progress.step}, epoch {progress.epoch}", flush=True
        )
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"

    def save(label):
        if isinstance(label, int) and label % 4 == 0:
            accelerator.save_state()
        if label == 13 and first_attempt:
            os._exit(1)  # killed after step 13

    train("stateful", *objects, save=save)
    expected = load_file(FOLDER / "stateful" / "final.safetensors")
    got = weights(accelerator, model)
    assert progress.step == EPOCHS * 12, f"{progress.step} steps in all, expected {EPOCHS * 12}"
    assert all(torch.equal(expected[k], got[k]) for k in expected), "weights differ from the uninterrupted run"
    print(
        f"rank {accelerator.process_index}: crash at step 13, restart: {progress.step} steps, bitwise equal", flush=True
    )


def preempt():
    project = ProjectConfiguration(project_dir=str(FOLDER / sys.argv[4]), automatic_checkpoint_naming=True)
    objects = setup("stateful", project)
    accelerator, model, progress = objects[0], objects[1], objects[-1]
    if (FOLDER / sys.argv[4] / "checkpoints").is_dir():
        accelerator.load_state()
        print(f"rank {accelerator.process_index}: resumed at step {progress.step}", flush=True)
    resumed_at = progress.step
    signal_at = {int(s) for s in sys.argv[3].split(",")}

    def signal_self(label):
        if label in signal_at and label > resumed_at:
            os.kill(os.getpid(), signal.SIGTERM)  # as a scheduler would, at a known step

    train("stateful", *objects, save=signal_self)
    expected = load_file(FOLDER / "stateful" / "final.safetensors")
    got = weights(accelerator, model)
    assert progress.step == EPOCHS * 12, f"{progress.step} steps in all, expected {EPOCHS * 12}"
    assert all(torch.equal(expected[k], got[k]) for k in expected), "weights differ from the uninterrupted run"
    print(
        f"rank {accelerator.process_index}: preempted run resumed at step {resumed_at} ends bitwise equal", flush=True
    )


{"full": full, "resume": resume, "crash": crash, "preempt": preempt}[MODE]()
print(f"rank {dist.get_rank()}: resume_epochs {MODE} done", flush=True)
