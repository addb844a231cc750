"""``save_state`` given a different folder on each process (as Accelerate's data-loop test does with a
``tempfile.TemporaryDirectory()`` per process), on 2 processes.

``replicated DIR``: DDP. Each process saves into ``DIR/rank<r>/...`` (sync, async, with a save hook, twice at the
same step): each folder gets a complete checkpoint holding that process's random states (no warning about random
states), each process loads its own folder back exactly. The grace (5 s here) bounds two waits: the main process's
for a process that took part in an earlier save, and a process's for the main process's save into its folder when
it finds only a finished save of another folder that did not see it (the first save, where nobody is waited for).
A save into one folder shared by both processes right after still collects both processes' random states.
``sharded DIR``: FSDP. Different folders fail at once on both processes, naming both folders (the attendance
timeout is 120 s: the other message would be that a process did not call it); the same folder then works.
"""

import sys
import warnings
from pathlib import Path

import torch

from hasten import Accelerator
from hasten.checkpointing import participants, wait_for_pending_save
from hasten.errors import CheckpointError

mode, root = sys.argv[1], Path(sys.argv[2])
participants.JOIN_GRACE_S = 5.0
participants.ATTENDANCE_TIMEOUT_S = 120.0


def build(**kwargs):
    accelerator = Accelerator(**kwargs)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    return accelerator, model, optimizer


def step(accelerator, model, optimizer):
    accelerator.backward(model(torch.randn(2, 4)).square().mean())
    optimizer.step()
    optimizer.zero_grad()


def snapshot(accelerator, model):
    return {k: v.clone() for k, v in accelerator.unwrap_model(model).state_dict().items()}, torch.get_rng_state()


def replicated():
    accelerator, model, optimizer = build()
    rank = accelerator.process_index
    torch.manual_seed(100 + rank)  # a different random stream on each process
    hooked = []
    accelerator.register_save_state_pre_hook(lambda models, weights, output_dir: hooked.append(output_dir))
    saved = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for name, kwargs in (("sync", {}), ("async", {"async_save": True}), ("again", {})):
            step(accelerator, model, optimizer)
            folder = root / f"rank{rank}" / name
            saved[name] = (folder, *snapshot(accelerator, model))
            accelerator.save_state(folder, **kwargs)
            if name == "async":
                step(accelerator, model, optimizer)
                wait_for_pending_save()
        accelerator.save_state(root / f"rank{rank}" / "same_step")  # a second save at the same step, elsewhere again
        shared = root / "shared"
        accelerator.save_state(shared)  # one folder for both: the main process writes both processes' states
    problems = [str(w.message) for w in caught if "random number generator states" in str(w.message)]
    assert not problems, problems
    assert len(hooked) == 5, hooked
    for name, (folder, weights, rng) in saved.items():
        assert sorted(p.name for p in folder.glob("random_states_*.json")) == [f"random_states_{rank}.json"], (
            name,
            list(folder.iterdir()),
        )
        accelerator.load_state(folder)
        now = snapshot(accelerator, model)
        assert all(torch.equal(weights[k], v) for k, v in now[0].items()), f"{name}: weights differ after load"
        assert torch.equal(rng, now[1]), f"{name}: this process's random state was not restored"
    accelerator.wait_for_everyone()
    assert (shared / "random_states_0.json").exists() and (shared / "random_states_1.json").exists()
    print(f"rank {rank}: per-process folders ok", flush=True)


def sharded():
    from hasten.strategies.fsdp.plugin import FullyShardedDataParallelPlugin

    accelerator, model, optimizer = build(fsdp_plugin=FullyShardedDataParallelPlugin())
    rank = accelerator.process_index
    try:
        accelerator.save_state(root / f"rank{rank}")
    except CheckpointError as error:
        message = str(error)
        assert "different folders on different processes" in message, message
        assert f"process 0: {root / 'rank0'}" in message and f"process 1: {root / 'rank1'}" in message, message
    else:
        raise AssertionError("different folders under FSDP must be refused")
    assert not (root / f"rank{rank}").exists()
    accelerator.save_state(root / "fsdp")  # the same folder on every process: works
    print(f"rank {rank}: sharded different folders refused at once", flush=True)


{"replicated": replicated, "sharded": sharded}[mode]()
