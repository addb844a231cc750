"""Exact resume on 2 processes: ``full DIR`` trains 3 epochs (saving mid-epoch 1), ``resume DIR`` resumes and compares.

The loaders resume at their saved position (``use_stateful_dataloader=True``), so the loop needs no skipping.

Shuffling and dropout are on; the resumed run must reproduce the losses after the save and end with
bitwise-equal weights.
"""

import json
import sys
from pathlib import Path

import torch
from torch.utils.data import DataLoader, TensorDataset

from hasten import Accelerator, DataLoaderConfiguration
from hasten.utils import set_seed

mode, folder = sys.argv[1], Path(sys.argv[2])


class Progress:
    def __init__(self):
        self.epoch = 0

    def state_dict(self):
        return {"epoch": self.epoch}

    def load_state_dict(self, state):
        self.epoch = state["epoch"]


accelerator = Accelerator(dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True))
rank = accelerator.process_index
set_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(32, 1))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=40)
data = TensorDataset(
    torch.randn(52, 8, generator=torch.Generator().manual_seed(1)),
    torch.randn(52, 1, generator=torch.Generator().manual_seed(2)),
)
model, optimizer, loader, scheduler = accelerator.prepare(
    model, optimizer, DataLoader(data, batch_size=4, shuffle=True), scheduler
)
progress = Progress()
accelerator.register_for_checkpointing(progress)
if mode == "resume":
    accelerator.load_state(folder / "ckpt")

losses = []
for epoch in range(progress.epoch, 3):
    progress.epoch = epoch
    for step, (x, y) in enumerate(loader):
        loss = torch.nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        if mode == "full" and (epoch, step) == (1, 2):
            accelerator.save_state(folder / "ckpt")
            losses.clear()

weights = {k: v.tolist() for k, v in accelerator.unwrap_model(model).state_dict().items()}
record = folder / f"full_rank{rank}.json"
if mode == "full":
    record.write_text(json.dumps({"losses": losses, "weights": weights}))
else:
    reference = json.loads(record.read_text())
    assert losses == reference["losses"], f"losses after resume differ:\n{losses}\n{reference['losses']}"
    assert weights == reference["weights"], "final weights differ after resume"
    print(f"rank {rank}: resume matches ({len(losses)} steps after the save)")
