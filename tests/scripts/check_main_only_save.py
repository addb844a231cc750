"""diffusers' checkpoint pattern on 2 processes: the main process saves alone, the resumed loop skips by hand.

``full DIR``: 12 DDP steps; after step 6 ``if accelerator.is_main_process: accelerator.save_state(DIR/main_only)``
(no collective may be entered while the other process trains on), after step 9 every process saves
``DIR/everyone``; records the final weights.
``resume DIR``: a new launch loads ``DIR/main_only`` and resumes twice: with the manual skip of diffusers'
scripts (``if step < resume_step: continue``) and with ``skip_first_batches``; each must train exactly
the 6 remaining steps and end with the weights of the uninterrupted run.
``sharded DIR``: under FSDP a main-only save is a clear error, not a hang; every process then goes on.
"""

import json
import sys
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


def build(**kwargs):
    accelerator = Accelerator(**kwargs)
    set_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = TensorDataset(torch.randn(48, 4, generator=torch.Generator().manual_seed(1)), torch.randn(48, 1, generator=torch.Generator().manual_seed(2)))
    loader = DataLoader(data, batch_size=2, shuffle=True)
    return (accelerator, *accelerator.prepare(model, optimizer, loader))


def train_step(accelerator, model, optimizer, x, y):
    loss = torch.nn.functional.mse_loss(model(x), y)
    accelerator.backward(loss)
    optimizer.step()
    optimizer.zero_grad()


def weights(accelerator, model):
    return {k: v.tolist() for k, v in accelerator.unwrap_model(model).state_dict().items()}


def full():
    accelerator, model, optimizer, loader = build()
    assert len(loader) == STEPS
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step, (x, y) in enumerate(loader):
            train_step(accelerator, model, optimizer, x, y)
            if step + 1 == SAVE_AT and accelerator.is_main_process:
                accelerator.save_state(folder / "main_only")
            if step + 1 == 9:
                accelerator.save_state(folder / "everyone")
    main_only_warnings = [str(w.message) for w in caught if "without process(es) [1]" in str(w.message)]
    if accelerator.is_main_process:
        assert len(main_only_warnings) == 1, f"the main-only save must say once what it left out: {main_only_warnings}"
        assert "random number generator states of process(es) [1]" in main_only_warnings[0], main_only_warnings
        assert not (folder / "main_only" / "random_states_1.json").exists() and (folder / "main_only" / "random_states_0.json").exists()
        (folder / "full.json").write_text(json.dumps(weights(accelerator, model)))
    accelerator.wait_for_everyone()
    assert (folder / "everyone" / "random_states_1.json").exists(), "a save by every process holds every process's random states"
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
        assert trained == STEPS - SAVE_AT, f"{how}: trained {trained} steps after the resume, expected {STEPS - SAVE_AT}"
        assert weights(accelerator, model) == reference, f"{how}: final weights differ from the uninterrupted run"
        reset_state()
    print(f"rank {torch.distributed.get_rank()}: resume matches with both skips")


def sharded():
    from hasten.plugins.fsdp import FullyShardedDataParallelPlugin

    accelerator, model, optimizer, _ = build(fsdp_plugin=FullyShardedDataParallelPlugin())
    if accelerator.is_main_process:
        try:
            accelerator.save_state(folder / "fsdp")
        except CheckpointError as error:
            assert "process(es) [1] did not call it" in str(error) and "call save_state on every process" in str(error), error
        else:
            raise AssertionError("a main-only save under FSDP must be refused")
    accelerator.wait_for_everyone()
    assert not (folder / "fsdp").exists()
    accelerator.save_state(folder / "fsdp")  # every process: works
    print(f"rank {accelerator.process_index}: sharded refusal and save done")


{"full": full, "resume": resume, "sharded": sharded}[mode]()
