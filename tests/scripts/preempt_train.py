"""Training that a preemption signal may interrupt: ``preempt_train.py PROJECT_DIR [--no-project] [--accumulate]``.

Follows docs/checkpointing.md's resume recipe (``use_stateful_dataloader=True``): resumes from the latest
automatic checkpoint when there is one. Rank 0 writes ``step`` (the optimizer steps done) to
``PROJECT_DIR/progress`` after each step and, at the end, the final weights to ``PROJECT_DIR/final.safetensors``.
Each rank prints ``rank R stopped after step S`` however it ends. A short sleep per step leaves time to signal;
``--signal-launcher-at S`` makes rank 0 send SIGTERM to the launcher after step S (8 steps make one epoch).
"""

import os
import signal
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch.utils.data import DataLoader, TensorDataset

from hasten import Accelerator
from hasten.utils import DataLoaderConfiguration, ProjectConfiguration, set_seed

folder = Path(sys.argv[1])
folder.mkdir(parents=True, exist_ok=True)
with_project = "--no-project" not in sys.argv
accumulate = 2 if "--accumulate" in sys.argv else 1
signal_at = int(sys.argv[sys.argv.index("--signal-launcher-at") + 1]) if "--signal-launcher-at" in sys.argv else None


class Progress:
    def __init__(self):
        self.epoch = 0
        self.step = 0

    def state_dict(self):
        return {"epoch": self.epoch, "step": self.step}

    def load_state_dict(self, state):
        self.epoch, self.step = state["epoch"], state["step"]


project = ProjectConfiguration(project_dir=str(folder), automatic_checkpoint_naming=True) if with_project else None
accelerator = Accelerator(
    project_config=project,
    gradient_accumulation_steps=accumulate,
    dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True),
)
rank = accelerator.process_index
set_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(32, 1))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=60)
data = TensorDataset(
    torch.randn(64, 8, generator=torch.Generator().manual_seed(1)),
    torch.randn(64, 1, generator=torch.Generator().manual_seed(2)),
)
model, optimizer, loader, scheduler = accelerator.prepare(
    model, optimizer, DataLoader(data, batch_size=4, shuffle=True), scheduler
)
progress = Progress()
accelerator.register_for_checkpointing(progress)
if with_project and (folder / "checkpoints").is_dir() and any((folder / "checkpoints").iterdir()):
    accelerator.load_state()
    print(f"rank {rank} resumed at step {progress.step}", flush=True)

try:
    for epoch in range(progress.epoch, 3):
        progress.epoch = epoch
        for x, y in loader:
            with accelerator.accumulate(model):
                loss = torch.nn.functional.mse_loss(model(x), y)
                accelerator.backward(loss)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            if accelerator.sync_gradients:
                progress.step += 1
                if rank == 0:
                    (folder / "progress").write_text(str(progress.step))
                    if progress.step == signal_at:
                        os.kill(os.getppid(), signal.SIGTERM)  # as a scheduler would, at a known step
                time.sleep(0.15)
finally:
    print(f"rank {rank} stopped after step {progress.step}", flush=True)

if rank == 0:
    save_file(
        {k: v.contiguous() for k, v in accelerator.unwrap_model(model).state_dict().items()},
        str(folder / "final.safetensors"),
    )
