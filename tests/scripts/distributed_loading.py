"""Two-process checks of load_checkpoint_in_model in a distributed run (gloo, CPU).

Run with ``python -m torch.distributed.run --nproc_per_node 2 distributed_loading.py FOLDER``; rank 0
writes the checkpoint into FOLDER, rank 1 never sees it when the weights are broadcast. Exits non-zero
on the first failed check.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from hasten.big_modeling.serialization import load_checkpoint_in_model, save_model_weights
from hasten.errors import ConfigError


def check(condition: bool, message: str) -> None:
    if not condition:
        print(f"rank {dist.get_rank()}: FAILED: {message}", flush=True)
        sys.exit(1)


def fresh(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 6), nn.ReLU(), nn.Linear(6, 3))


def same(model: nn.Module, reference: nn.Module) -> bool:
    state = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v) for k, v in model.state_dict().items()}
    return all(torch.equal(state[k], v) for k, v in reference.state_dict().items())


def main(folder: Path) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    reference = fresh(0)
    checkpoint = folder / "checkpoint"
    if rank == 0:
        save_model_weights(reference.state_dict(), checkpoint, max_shard_size="100B")
    dist.barrier()
    visible = checkpoint if rank == 0 else folder / "not-on-this-machine"

    plain = fresh(rank + 1)
    load_checkpoint_in_model(plain, visible, broadcast_from_rank0=True)
    check(same(plain, reference), "plain model with broadcast_from_rank0")

    mesh = init_device_mesh("cpu", (2,))
    for broadcast in (False, True):
        sharded = fresh(rank + 1)
        fully_shard(sharded, mesh=mesh)
        load_checkpoint_in_model(sharded, visible if broadcast else checkpoint, broadcast_from_rank0=broadcast)
        check(type(sharded[0].weight).__name__ == "DTensor", "FSDP2 parameters stay DTensors")
        check(same(sharded, reference), f"FSDP2 model, broadcast_from_rank0={broadcast}")

    try:
        load_checkpoint_in_model(fresh(3), checkpoint, broadcast_from_rank0=True, dtype="float16")
        check(False, "dtype with broadcast_from_rank0 must be refused")
    except ConfigError as error:
        check("Cast the model" in str(error), f"unexpected message: {error}")

    bigger = nn.Sequential(nn.Linear(6, 6), nn.ReLU(), nn.Linear(6, 3), nn.Linear(3, 1))
    caught: list = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = caught.append
    logging.getLogger("hasten.big_modeling").addHandler(handler)
    load_checkpoint_in_model(bigger, visible, broadcast_from_rank0=True)
    reported = [record.getMessage() for record in caught if "missing keys" in record.getMessage()]
    check(len(reported) == (1 if rank == 0 else 0), f"missing keys reported once, on rank 0: {reported}")
    check(rank != 0 or "3.weight, 3.bias" in reported[0], f"missing keys named: {reported}")
    dist.barrier()
    dist.destroy_process_group()
    print(f"rank {rank}: all checks passed", flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
