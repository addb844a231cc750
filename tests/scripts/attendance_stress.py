"""Many sharded-save attendances in a row, with no collective between them (the tightest case of two saves into
one folder at one step): each must see every process, name no false folder mismatch, and never hang; then
main-only saves are refused and the processes still meet at their next save together, and a real mismatch
fails on every process. Run with torchrun on 2 processes; prints one line per process."""

import random
import sys

import torch.distributed as dist

from hasten.checkpointing import participants
from hasten.errors import CheckpointError

ROUNDS = int(sys.argv[1])
participants.ATTENDANCE_TIMEOUT_S = 30.0

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
rng = random.Random(rank)
for _ in range(ROUNDS):
    if rng.random() < 0.3:
        participants.time.sleep(rng.random() * 0.01)  # vary which process arrives first
    participants.check_attendance("/same/folder", rank, world, "FSDPStrategy")
participants.ATTENDANCE_TIMEOUT_S = 1.0
for _ in range(2):  # the main process saves alone, twice: each is refused, and the launch can still save after
    if rank == 0:
        try:
            participants.check_attendance("/same/folder", rank, world, "FSDPStrategy")
        except CheckpointError as error:
            assert "process(es) [1] did not call it" in str(error), error
        else:
            raise AssertionError("a main-only sharded save must be refused")
    dist.barrier()
participants.ATTENDANCE_TIMEOUT_S = 30.0
participants.check_attendance("/same/folder", rank, world, "FSDPStrategy")
try:
    participants.check_attendance(f"/folder/of/{rank}", rank, world, "FSDPStrategy")
except CheckpointError as error:
    assert "different folders" in str(error) and "/folder/of/0" in str(error) and "/folder/of/1" in str(error), error
    print(f"rank {rank}: {ROUNDS} attendances met; the mismatch failed with: {str(error)[:60]}", flush=True)
else:
    raise AssertionError("different folders must fail")
participants.check_attendance("/same/folder", rank, world, "FSDPStrategy")  # and the launch goes on afterwards
dist.destroy_process_group()
