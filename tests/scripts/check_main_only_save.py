"""diffusers' checkpoint pattern on 2 processes: the main process saves alone, the resumed loop skips by hand.

``full DIR``: 12 DDP steps; after step 3 every process saves ``DIR/everyone`` (both processes' random
states; the first save of the run waits for nobody); after steps 4, 5 and 6 ``if accelerator.is_main_process:
accelerator.save_state(...)`` (no collective may be entered while the other process trains on): the first waits
the grace (the other process took part in the save before), the next two wait for nobody; the last is
``DIR/main_only``. After step 9 every process saves ``DIR/late``, process 1 late on purpose: the main process
does not wait for it (the run saved from the main process alone), and process 1 adds its random states to the
published checkpoint itself (they load back on process 1). After step 10 every process saves ``DIR/rejoined``
(waited for again). Records the final weights and prints each save's time.
``resume DIR``: a new launch loads ``DIR/main_only`` and resumes twice: with the manual skip of diffusers'
scripts (``if step < resume_step: continue``) and with ``skip_first_batches``; each must train exactly
the 6 remaining steps and end with the weights of the uninterrupted run.
``sharded DIR``: under FSDP a main-only save says once that it waits for every process, then is a clear error,
not a hang; every process then goes on.
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
participants.JOIN_GRACE_S = 5.0  # the main process waits this long for processes that took part before
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
                accelerator.wait_for_everyone()
                assert participants.saves_together(), "a save by every process: the next one waits for them"
            if step + 1 in MAIN_ONLY and accelerator.is_main_process:
                times[MAIN_ONLY[step + 1]] = timed_save(accelerator, folder / MAIN_ONLY[step + 1])
                assert not participants.saves_together(), "after a save nobody came to, the next saves wait for nobody"
            if step + 1 == 9:
                if not accelerator.is_main_process:
                    time.sleep(1.5)  # the main process writes without waiting for it
                late_rng = torch.get_rng_state()
                times["late"] = timed_save(accelerator, folder / "late")
            if step + 1 == 10:
                times["rejoined"] = timed_save(accelerator, folder / "rejoined")
                assert participants.saves_together()
    print(
        f"rank {accelerator.process_index}: save times "
        + ", ".join(f"{name} {seconds:.3f} s" for name, seconds in times.items())
    )
    left_out = [str(w.message) for w in caught if "random number generator states" in str(w.message)]
    assert not left_out, f"no process is left out of a save it called: {left_out}"
    waited = {name for name, seconds in times.items() if seconds >= participants.JOIN_GRACE_S}
    expected = {"main_only_a"} if accelerator.is_main_process else set()
    assert waited == expected, f"only the first main-only save after a save together waits the grace: {times}"
    if accelerator.is_main_process:
        for name in MAIN_ONLY.values():
            assert (
                not (folder / name / "random_states_1.json").exists()
                and (folder / name / "random_states_0.json").exists()
            )
        (folder / "full.json").write_text(json.dumps(weights(accelerator, model)))
    accelerator.wait_for_everyone()
    for name in ("everyone", "late", "rejoined"):
        assert (folder / name / "random_states_1.json").exists(), (
            f"{name}: a save by every process holds every process's random states"
        )
    torch.manual_seed(1234)  # anything else than the saved state
    accelerator.load_state(folder / "late")
    assert torch.equal(torch.get_rng_state(), late_rng), "each process gets its own random states back"
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
        participants.SAY_WAITING_AFTER_S = 1.0
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                accelerator.save_state(folder / "fsdp")
            except CheckpointError as error:
                assert "process(es) [1] did not call it" in str(error) and "call save_state on every process" in str(
                    error
                ), error
            else:
                raise AssertionError("a main-only save under FSDP must be refused")
        said = [str(w.message) for w in caught if "waits for process(es) [1] to call it too" in str(w.message)]
        assert len(said) == 1, f"the first wait for every process says so, once: {said}"
    accelerator.wait_for_everyone()
    assert not (folder / "fsdp").exists()
    accelerator.save_state(folder / "fsdp")  # every process: works
    print(f"rank {accelerator.process_index}: sharded refusal and save done")


{"full": full, "resume": resume, "sharded": sharded}[mode]()
