"""Kill ``save_state`` with SIGKILL at random moments; after each kill the latest checkpoint must load whole.

Usage: crash_saver.py PROJECT_DIR KILLS [--async] [--shared]. With ``--async`` the child saves with
``save_state(async_save=True)`` and waits for the background writer, so the kills land while the
background thread writes, fsyncs and publishes. With ``--shared`` every save goes to one folder that also
holds the user's files (published file by file beside them): after each kill the folder must load the
previous or the new checkpoint, and the user's files must be as they were. One driver process (one thread of torch,
so forking is safe) forks a child per attempt that fills the weights with the next checkpoint number and saves; the
driver kills it after a random delay within the duration of a save (the first save completes), then loads the
latest checkpoint and checks that every weight holds that checkpoint's number. Attempts go on until
KILLS kills have landed while a save was running (the child reports when its save returned). Prints
one summary line.
"""

import os
import random
import signal
import sys
import time
import warnings

import torch

torch.set_num_threads(1)

from hasten import Accelerator  # noqa: E402
from hasten.checkpointing import complete_checkpoints, wait_for_pending_save  # noqa: E402
from hasten.state import reset_state  # noqa: E402
from hasten.utils import ProjectConfiguration  # noqa: E402

project, wanted_kills = sys.argv[1], int(sys.argv[2])
asynchronous = "--async" in sys.argv[3:]
shared = os.path.join(project, "shared") if "--shared" in sys.argv[3:] else None
USER_FILES = {"train.log": b"epoch 0 loss 1.0\n", "notes/ideas.txt": b"lower the learning rate"}
if shared:
    for name, data in USER_FILES.items():
        os.makedirs(os.path.dirname(os.path.join(shared, name)), exist_ok=True)
        with open(os.path.join(shared, name), "wb") as handle:
            handle.write(data)


def accelerator_and_model():
    reset_state()
    acc = Accelerator(
        project_config=ProjectConfiguration(project_dir=project, automatic_checkpoint_naming=True, total_limit=2)
    )
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(16)])
    model, _ = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    return acc, model


def save_in_child(ready_write, number) -> None:
    acc, model = accelerator_and_model()
    found = complete_checkpoints(project)
    acc.project_configuration.iteration = found[-1][0] + 1 if found else 0
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(number if shared else acc.save_iteration)
    os.write(ready_write, b"s")
    acc.save_state(shared, async_save=asynchronous)
    wait_for_pending_save()
    os.write(ready_write, b"d")
    os._exit(0)


rng = random.Random(0)
loaded = None  # with --shared: the checkpoint number the folder held after the previous attempt
completed = killed_mid_save = 0
save_seconds = 0.0
attempt = 0
while killed_mid_save < wanted_kills and attempt < 4 * wanted_kills:
    attempt += 1
    ready_read, ready_write = os.pipe()
    pid = os.fork()
    if pid == 0:
        save_in_child(ready_write, attempt)
    os.read(ready_read, 1)
    started = time.monotonic()
    if attempt > 1:  # kill at a random moment of the save (the shortest save seen bounds the moment)
        time.sleep(rng.uniform(0, save_seconds))
        os.kill(pid, signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    os.close(ready_write)
    finished = os.read(ready_read, 1) == b"d"
    if finished:
        elapsed = time.monotonic() - started
        save_seconds = elapsed if attempt == 1 else min(save_seconds, elapsed)
    os.close(ready_read)
    if finished:
        completed += 1
    else:
        killed_mid_save += 1
    acc, model = accelerator_and_model()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        path = acc.load_state(shared)
    number = int(model[0].weight.flatten()[0]) if shared else int(path.rsplit("_", 1)[1])
    if not all(bool((p == number).all()) for p in model.parameters()):
        sys.exit(f"attempt {attempt}: checkpoint {path} holds mixed content")
    if shared:
        if number not in (attempt, loaded):
            sys.exit(
                f"attempt {attempt}: {shared} holds checkpoint {number}, neither the previous ({loaded}) nor the new "
                "one"
            )
        loaded = number
        for name, data in USER_FILES.items():
            with open(os.path.join(shared, name), "rb") as handle:
                if handle.read() != data:
                    sys.exit(f"attempt {attempt}: the user's file {name} in {shared} changed")
    # Rotation runs after the new checkpoint is published: a kill in between leaves one extra, which the
    # next completed save removes.
    limit = 2 if finished else 3
    if len(complete_checkpoints(project)) > limit:
        sys.exit(
            f"attempt {attempt}: more than {limit} checkpoints kept with total_limit=2: {complete_checkpoints(project)}"
        )
print(
    f"crash test ({'async' if asynchronous else 'sync'}{', shared folder' if shared else ''}): one save takes "
    f"{save_seconds:.2f} s; {attempt} attempts, {killed_mid_save} killed during the save, {completed} completed, "
    "every load whole"
)
