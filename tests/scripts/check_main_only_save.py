"""diffusers' checkpoint pattern on 2 processes: the main process saves alone, the resumed loop skips by hand.

``full DIR``: 12 DDP steps; after step 3 every process saves ``DIR/everyone`` (both processes' random
states, no grace waited); after steps 4, 5 and 6 ``if accelerator.is_main_process: accelerator.save_state(...)``
(no collective may be entered while the other process trains on): the first waits the grace, the next
two wait for nobody (the run is marked main-only); the last is ``DIR/main_only``. After step 9 every
process saves ``DIR/late``, process 1 late on purpose: it learns that it was left out (no hang), and the
save after step 10 (``DIR/rejoined``) waits for it again. Records the final weights and prints each save's time.
``resume DIR``: a new launch loads ``DIR/main_only`` and resumes twice: with the manual skip of diffusers'
scripts (``if step < resume_step: continue``) and with ``skip_first_batches``; each must train exactly
the 6 remaining steps and end with the weights of the uninterrupted run.
``sharded DIR``: under FSDP a main-only save is a clear error, not a hang; every process then goes on.
"""

import json
import sys
import time
import warnings
from pathlib import Path

import torch
from torch.utils.data import DataLoader, TensorDataset

from hasten import Accelerator
from hasten.checkpointing import participants
from hasten.errors import CheckpointError
from hasten.state import reset_state
from hasten.utils import set_seed

mode, folder = sys.argv[1], Path(sys.argv[2])
participants.JOIN_GRACE_S = 3.0  # the main process waits this long for processes that never come
participants.ATTENDANCE_TIMEOUT_S = 3.0
STEPS, SAVE_AT, RESUME_STEP = 12, 6, 6
MAIN_ONLY = {4: "main_only_a", 5: "main_only_b", SAVE_AT: "main_only"}


def build(**kwargs):
    accelerator = Accelerator(**kwargs)
    set_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = TensorDataset(
        torch.randn(48, 4, generator=torch.Generator().manual_seed(1)),
        torch.randn(48, 1, generator=torch.Generator().manual_seed(2)),
    )
    loader = DataLoader(data, batch_size=2, shuffle=True)
    return (accelerator, *accelerator.prepare(model, optimizer, loader))


def train_step(accelerator, model, optimizer, x, y):
    loss = torch.nn.functional.mse_loss(model(x), y)
    accelerator.backward(loss)
    optimizer.step()
    optimizer.zero_grad()


def weights(accelerator, model):
    return {k: v.tolist() for k, v in accelerator.unwrap_model(model).state_dict().items()}


def timed_save(accelerator, path) -> float:
    started = time.monotonic()
    accelerator.save_state(path)
    return time.monotonic() - started


def full():
    accelerator, model, optimizer, loader = build()
    assert len(loader) == STEPS
    times = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step, (x, y) in enumerate(loader):
            train_step(accelerator, model, optimizer, x, y)
            if step + 1 == 3:
                times["everyone"] = timed_save(accelerator, folder / "everyone")
                assert not participants.solo_run(), "a save by every process must not mark the run main-only"
            if step + 1 in MAIN_ONLY and accelerator.is_main_process:
                times[MAIN_ONLY[step + 1]] = timed_save(accelerator, folder / MAIN_ONLY[step + 1])
                assert participants.solo_run(), "after a save no other process came to, the run is marked main-only"
            if step + 1 == 9:
                if not accelerator.is_main_process:
                    time.sleep(1.5)  # the main process, in a main-only run, writes without waiting for it
                times["late"] = timed_save(accelerator, folder / "late")
            if step + 1 == 10:
                times["rejoined"] = timed_save(accelerator, folder / "rejoined")
                assert not participants.solo_run(), "a process that came late makes the writer wait for it again"
    print(
        f"rank {accelerator.process_index}: save times "
        + ", ".join(f"{name} {seconds:.3f} s" for name, seconds in times.items())
    )
    main_only_warnings = [str(w.message) for w in caught if "without process(es) [1]" in str(w.message)]
    late_warnings = [str(w.message) for w in caught if "came after the main process" in str(w.message)]
    assert len(late_warnings) == (0 if accelerator.is_main_process else 1), (
        f"the late process must learn it was left out: {late_warnings}"
    )
    if accelerator.is_main_process:
        assert times["everyone"] < participants.JOIN_GRACE_S, (
            f"every process saved: nobody should wait the grace: {times}"
        )
        assert times["main_only_a"] >= participants.JOIN_GRACE_S, f"the first main-only save waits the grace: {times}"
        assert len(main_only_warnings) == 1, f"the main-only save must say once what it left out: {main_only_warnings}"
        assert "random number generator states of process(es) [1]" in main_only_warnings[0], main_only_warnings
        for name in MAIN_ONLY.values():
            assert (
                not (folder / name / "random_states_1.json").exists()
                and (folder / name / "random_states_0.json").exists()
            )
        (folder / "full.json").write_text(json.dumps(weights(accelerator, model)))
    accelerator.wait_for_everyone()
    for name in ("everyone", "rejoined"):
        assert (folder / name / "random_states_1.json").exists(), (
            f"{name}: a save by every process holds every process's random states"
        )
    assert not (folder / "late" / "random_states_1.json").exists()
    print(f"rank {accelerator.process_index}: full run done")


def resume():
    reference = json.loads((folder / "full.json").read_text())
    for how in ("continue", "skip_first_batches"):
        accelerator, model, optimizer, loader = build()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # process 1 has no saved random states: it says so
            accelerator.load_state(folder / "main_only")
        batches = accelerator.skip_first_batches(loader, RESUME_STEP) if how == "skip_first_batches" else loader
        trained = 0
        for step, (x, y) in enumerate(batches):
            if how == "continue" and step < RESUME_STEP:
                continue
            train_step(accelerator, model, optimizer, x, y)
            trained += 1
        assert trained == STEPS - SAVE_AT, (
            f"{how}: trained {trained} steps after the resume, expected {STEPS - SAVE_AT}"
        )
        assert weights(accelerator, model) == reference, f"{how}: final weights differ from the uninterrupted run"
        reset_state()
    print(f"rank {torch.distributed.get_rank()}: resume matches with both skips")


def sharded():
    from hasten.strategies.fsdp.plugin import FullyShardedDataParallelPlugin

    accelerator, model, optimizer, _ = build(fsdp_plugin=FullyShardedDataParallelPlugin())
    if accelerator.is_main_process:
        try:
            accelerator.save_state(folder / "fsdp")
        except CheckpointError as error:
            assert "process(es) [1] did not call it" in str(error) and "call save_state on every process" in str(
                error
            ), error
        else:
            raise AssertionError("a main-only save under FSDP must be refused")
    accelerator.wait_for_everyone()
    assert not (folder / "fsdp").exists()
    accelerator.save_state(folder / "fsdp")  # every process: works
    print(f"rank {accelerator.process_index}: sharded refusal and save done")


{"full": full, "resume": resume, "sharded": sharded}[mode]()
