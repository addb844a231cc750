"""Resuming on another number of processes than the one that saved.

Real processes (``tests/scripts/resume_world_size.py``): loaders saved mid-epoch on N processes and resumed
on M (2->1, 1->2, 2->4, 4->2; even and uneven last rounds, split batches, iterable datasets dispatched or
read by every process) see every sample of the epoch exactly once across both runs; FSDP's sharded model
and optimizer states are resharded (DeepSpeed's: tests/strategies/test_zero_resharding.py). In one process: which
random state each process restores, and the one line the main process prints about it.
"""

import warnings
from pathlib import Path

import pytest
import torch
from helpers import SCRIPTS, torchrun

from hasten.checkpointing.world_change import random_state_for
from hasten.runtime.rng import capture_rng_states, set_seed
from hasten.strategies.deepspeed.checkpoint import check_world_size

SCRIPT = SCRIPTS / "resume_world_size.py"
VARIANTS = ("even", "uneven", "split", "iterable", "iterable-shard")


class FakeReader:
    """The part of a checkpoint reader random states are read through."""

    def __init__(self, states: list[dict], world_size: int | None = None):
        self.directory = Path("/ckpt")
        self.states = states
        self.manifest = {"world_size": world_size if world_size is not None else len(states)}
        self.files = {f"random_states_{r}.json": {} for r in range(len(states))}

    def exists(self, name):
        return name in self.files

    def load_state(self, name):
        return self.states[int(name.rsplit("_", 1)[1])]


def seeded(seed: int) -> dict:
    set_seed(seed)
    meta, tensors = capture_rng_states()
    return {"meta": meta, "tensors": tensors}


def test_processes_with_a_saved_state_restore_their_own():
    states = [seeded(1), seeded(2)]
    assert random_state_for(FakeReader(states), 1, 2) is states[1]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert random_state_for(FakeReader(states), 0, 1) is states[0]
    assert [str(w.message) for w in caught] == [
        (
            "Checkpoint /ckpt was saved by 2 process(es) and is resumed on 1: "
            "process(es) 0 restore their own random states; those of process(es) 1 are not used."
        )
    ]


def test_new_processes_take_the_state_every_saved_process_shared():
    states = [seeded(5), seeded(5)]
    assert random_state_for(FakeReader(states), 3, 4) is states[1]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        random_state_for(FakeReader(states), 0, 4)
        random_state_for(FakeReader(states), 2, 4)
    assert len(caught) == 1, "one line, from the main process"
    assert str(caught[0].message).endswith(
        "process(es) 0, 1 restore their own random states; "
        "process(es) 2, 3 took the random state every saved process shared."
    )


def test_new_processes_are_reseeded_when_the_saved_states_differ():
    states = [seeded(1), seeded(2)]  # set_seed(s, device_specific=True)
    before = torch.get_rng_state()
    got = [random_state_for(FakeReader(states), rank, 4) for rank in (2, 3)]
    assert torch.equal(torch.get_rng_state(), before), "reading changes no live generator"
    assert not torch.equal(got[0]["tensors"]["torch"], got[1]["tensors"]["torch"]), "a different stream per process"
    assert all(not torch.equal(g["tensors"]["torch"], s["tensors"]["torch"]) for g in got for s in states)
    again = random_state_for(FakeReader(states), 2, 4)
    assert torch.equal(again["tensors"]["torch"], got[0]["tensors"]["torch"]), (
        "the same on every resume from this checkpoint"
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        random_state_for(FakeReader(states), 0, 4)
    (line,) = [str(w.message) for w in caught]
    assert (
        "process(es) 2, 3 were seeded with set_seed(" in line
        and "+ rank)" in line
        and "saved process 0's torch state" in line
    ), line


def test_same_number_of_processes_keeps_the_missing_state_missing():
    # A main-only save holds rank 0's state alone: rank 1 keeps its generators, as before (with a warning elsewhere).
    reader = FakeReader([seeded(1)], world_size=2)
    assert random_state_for(reader, 1, 2) is None


def test_deepspeed_checkpoints_of_another_number_of_processes_are_partitioned_again():
    names = [
        "deepspeed/state/mp_rank_00_model_states.pt",
        "deepspeed/state/zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "deepspeed/state/zero_pp_rank_1_mp_rank_00_optim_states.pt",
    ]
    assert check_world_size(names, Path("/ckpt"), 2) is None
    assert check_world_size(["model.safetensors"], Path("/ckpt"), 4) is None
    assert check_world_size(names, Path("/ckpt"), 1) == 2  # partitioned again (strategies/deepspeed/resharding.py)
    assert check_world_size([n.replace("zero_pp", "bf16_zero_pp") for n in names], Path("/ckpt"), 4) == 2


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Checkpoints of every variant saved mid-epoch on 1, 2 and 4 processes."""
    folder = tmp_path_factory.mktemp("world")
    for world in (1, 2, 4):
        torchrun(SCRIPT, "save", str(folder), nproc=world, timeout=600)
    return folder


@pytest.mark.slow
@pytest.mark.parametrize("saved_on, resumed_on", [(2, 1), (1, 2), (2, 4), (4, 2)])
def test_resumed_on_another_number_of_processes_each_sample_once(saved, saved_on, resumed_on):
    out = torchrun(SCRIPT, "resume", str(saved), str(saved_on), nproc=resumed_on, timeout=600).stdout
    for variant in VARIANTS:
        assert f"{variant} {saved_on}->{resumed_on}: " in out, out
    assert out.count("samples, each once") == len(VARIANTS), out
    assert f"fsdp {saved_on}->{resumed_on}: weights and optimizer state resharded" in out, out
    assert out.count(f"was saved by {saved_on} process(es) and is resumed on {resumed_on}") == len(VARIANTS), out
