"""A training loop written the way diffusers' example scripts are, run under ``hasten launch --as_accelerate``.

Usage: ``eco_diffusers.py OUT_DIR``. Three runs in turn, in the same processes: 12 optimizer steps
straight; the same run interrupted after step 7 (its checkpoint at step 5 saved by the main process
only, ``if accelerator.is_main_process: accelerator.save_state(path)``, under DDP); then a run that
resumes from that checkpoint with the scripts' manual skip (``if step < resume_step: continue``).
EMA weights are saved and loaded by the save/load hooks that the scripts register only when
``accelerate.__version__ >= 0.16.0``. The noise of each step is drawn from a generator seeded by
(epoch, step, rank) and the loader does not shuffle, so the resumed run must end with the same weights
as the straight one. The main process writes ``OUT_DIR/diffusers_rank0.json`` (``{"ok": ...}``).
"""

import json
import math
import sys
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F
from diffusers import DDPMScheduler, UNet2DModel
from diffusers.optimization import get_scheduler
from diffusers.training_utils import EMAModel
from packaging import version
from torch.utils.data import DataLoader

import accelerate
from accelerate import Accelerator
from accelerate.utils import ProjectConfiguration

OUT = Path(sys.argv[1])
ACCUMULATION, MAX_STEPS, CHECKPOINT_EVERY = 2, 12, 5


def unet() -> UNet2DModel:
    torch.manual_seed(0)
    return UNet2DModel(
        sample_size=8,
        in_channels=1,
        out_channels=1,
        layers_per_block=1,
        block_out_channels=(8, 16),
        norm_num_groups=4,
        down_block_types=("DownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "UpBlock2D"),
    )


def train(folder: Path, stop_after: int = MAX_STEPS, resume: bool = False) -> dict:
    accelerator = Accelerator(
        gradient_accumulation_steps=ACCUMULATION, project_config=ProjectConfiguration(project_dir=str(folder))
    )
    model = unet()
    ema = EMAModel(model.parameters(), model_cls=UNet2DModel, model_config=model.config)
    if version.parse(accelerate.__version__) >= version.parse("0.16.0"):

        def save_model_hook(models, weights, output_dir):
            if accelerator.is_main_process:
                ema.save_pretrained(Path(output_dir) / "unet_ema")
                for saved in models:
                    accelerator.unwrap_model(saved).save_pretrained(Path(output_dir) / "unet")
                    weights.pop()

        def load_model_hook(models, input_dir):
            loaded_ema = EMAModel.from_pretrained(Path(input_dir) / "unet_ema", UNet2DModel)
            ema.load_state_dict(loaded_ema.state_dict())
            while models:
                target = accelerator.unwrap_model(models.pop())
                loaded = UNet2DModel.from_pretrained(input_dir, subfolder="unet")
                target.register_to_config(**loaded.config)
                target.load_state_dict(loaded.state_dict())

        accelerator.register_save_state_pre_hook(save_model_hook)
        accelerator.register_load_state_pre_hook(load_model_hook)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    images = torch.randn(48, 1, 8, 8, generator=torch.Generator().manual_seed(1))
    loader = DataLoader(images, batch_size=4, shuffle=False)
    scheduler = get_scheduler(
        "cosine",
        optimizer,
        num_warmup_steps=2 * accelerator.num_processes,
        num_training_steps=MAX_STEPS * accelerator.num_processes,
    )
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    ema.to(accelerator.device)
    noise_scheduler = DDPMScheduler(num_train_timesteps=100)
    updates_per_epoch = math.ceil(len(loader) / ACCUMULATION)
    epochs = math.ceil(MAX_STEPS / updates_per_epoch)
    global_step = first_epoch = resume_step = 0
    if resume:
        path = max(folder.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
        accelerator.load_state(str(path))
        global_step = int(path.name.split("-")[1])
        first_epoch = global_step // updates_per_epoch
        resume_step = (global_step * ACCUMULATION) % (updates_per_epoch * ACCUMULATION)
    start_step, trained = global_step, 0
    for epoch in range(first_epoch, epochs):
        model.train()
        for step, batch in enumerate(loader):
            if resume and epoch == first_epoch and step < resume_step:
                continue
            with accelerator.accumulate(model):
                generator = torch.Generator().manual_seed(10_000 * epoch + 10 * step + accelerator.process_index)
                noise = torch.randn(batch.shape, generator=generator).to(batch.device)
                timesteps = torch.randint(0, 100, (batch.shape[0],), generator=generator).to(batch.device)
                prediction = model(noise_scheduler.add_noise(batch, noise, timesteps), timesteps).sample
                accelerator.backward(F.mse_loss(prediction, noise))
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            if accelerator.sync_gradients:
                ema.step(model.parameters())
                global_step += 1
                trained += 1
                if global_step % CHECKPOINT_EVERY == 0 and accelerator.is_main_process:
                    accelerator.save_state(str(folder / f"checkpoint-{global_step}"))
            if global_step >= stop_after:
                break
        if global_step >= stop_after:
            break
    accelerator.wait_for_everyone()
    weights = {k: v.detach().cpu().clone() for k, v in accelerator.unwrap_model(model).state_dict().items()}
    ema_weights = [p.detach().cpu().clone() for p in ema.shadow_params]
    return {"start": start_step, "trained": trained, "global_step": global_step, "weights": weights, "ema": ema_weights}


def main() -> dict:
    straight = train(OUT / "straight")
    interrupted = train(OUT / "resumed", stop_after=7)
    resumed = train(OUT / "resumed", resume=True)
    checkpoint = OUT / "resumed" / "checkpoint-5"
    return {
        "interrupted_steps": interrupted["trained"],
        "resumed_from": resumed["start"],
        "resumed_trained": resumed["trained"],
        "global_step": resumed["global_step"],
        "straight_global_step": straight["global_step"],
        "checkpoint_has_ema": (checkpoint / "unet_ema").is_dir(),
        "weights_max_abs_diff": max(
            float((straight["weights"][k] - v).abs().max()) for k, v in resumed["weights"].items()
        ),
        "weights_equal": all(torch.equal(straight["weights"][k], v) for k, v in resumed["weights"].items()),
        "ema_max_abs_diff": max(float((a - b).abs().max()) for a, b in zip(straight["ema"], resumed["ema"])),
        "moved_from_start": max(
            float((straight["weights"][k] - v).abs().max()) for k, v in unet().state_dict().items()
        ),
    }


try:
    result = {"ok": True, **main()}
except Exception:
    result = {"ok": False, "error": traceback.format_exc()}
rank = accelerate.PartialState().process_index
(OUT / f"diffusers_rank{rank}.json").write_text(json.dumps(result, indent=1))
