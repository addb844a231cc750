"""Restart-and-resume under `hasten launch --max_restarts 1`, following docs/checkpointing.md's recipe.

Usage: fault_resume.py PROJECT_DIR [--kill_at STEP]
Trains 2 epochs of 13 steps on 2 processes (shuffling and dropout on), saving a checkpoint every 4
steps. With ``--kill_at``, rank 1 SIGKILLs itself at that global step in the first attempt; the
restarted group resumes from the latest complete checkpoint. Rank 0 writes the final weights to
PROJECT_DIR/final.safetensors and the attempts' step records to PROJECT_DIR/steps_attempt<N>.txt.
"""

import argparse
import os
import signal
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch.utils.data import DataLoader, TensorDataset

from hasten import Accelerator
from hasten.utils import DataLoaderConfiguration, ProjectConfiguration, set_seed

parser = argparse.ArgumentParser()
parser.add_argument("project")
parser.add_argument("--kill_at", type=int, default=-1)
args = parser.parse_args()
project = Path(args.project)
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


class Progress:
    def __init__(self):
        self.epoch = 0
        self.step = 0

    def state_dict(self):
        return {"epoch": self.epoch, "step": self.step}

    def load_state_dict(self, state):
        self.epoch, self.step = state["epoch"], state["step"]


accelerator = Accelerator(
    project_config=ProjectConfiguration(project_dir=str(project), automatic_checkpoint_naming=True, total_limit=2),
    dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True),
)
set_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(32, 1))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
data = TensorDataset(
    torch.randn(104, 8, generator=torch.Generator().manual_seed(1)),
    torch.randn(104, 1, generator=torch.Generator().manual_seed(2)),
)
model, optimizer, loader = accelerator.prepare(model, optimizer, DataLoader(data, batch_size=4, shuffle=True))
progress = Progress()
accelerator.register_for_checkpointing(progress)
if (project / "checkpoints").is_dir():
    accelerator.load_state()

log = []
for epoch in range(progress.epoch, 2):
    progress.epoch = epoch
    for x, y in loader:
        if accelerator.process_index == 1 and attempt == 0 and progress.step == args.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        loss = torch.nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        progress.step += 1
        log.append(f"{progress.step} {loss.item()!r}")
        if progress.step % 4 == 0:
            accelerator.save_state()
    progress.epoch = epoch + 1

if accelerator.is_main_process:
    (project / f"steps_attempt{attempt}.txt").write_text("\n".join(log))
    weights = {k: v.contiguous() for k, v in accelerator.unwrap_model(model).state_dict().items()}
    save_file(weights, str(project / "final.safetensors"))
accelerator.end_training()
