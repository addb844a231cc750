"""diffusers' ``train_unconditional.py`` pattern: save/load hooks for the UNet and its EMA, noise and timesteps from
the global generator, a shuffled loader, checkpoints saved by the main process only, and a resume with the scripts'
manual skip. ``diffusers`` runs 8 optimizer steps straight, then 5 steps interrupted; ``diffusers_resume`` (after it,
in the same launch) resumes the interrupted run from its checkpoint at step 3.
"""

import math
from pathlib import Path

import torch
import torch.nn.functional as F

ACCUMULATION, MAX_STEPS, CHECKPOINT_EVERY = 2, 8, 3


def unet():
    from diffusers import UNet2DModel

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


def _register_hooks(accelerator, ema):
    from diffusers import UNet2DModel
    from diffusers.training_utils import EMAModel

    def save_model_hook(models, weights, output_dir):
        if accelerator.is_main_process:
            ema.save_pretrained(Path(output_dir) / "unet_ema")
            for model in models:
                model.save_pretrained(Path(output_dir) / "unet")
                weights.pop()

    def load_model_hook(models, input_dir):
        loaded_ema = EMAModel.from_pretrained(Path(input_dir) / "unet_ema", UNet2DModel)
        ema.load_state_dict(loaded_ema.state_dict())
        ema.to(accelerator.device)
        while models:
            model = models.pop()
            loaded = UNet2DModel.from_pretrained(input_dir, subfolder="unet")
            model.register_to_config(**loaded.config)
            model.load_state_dict(loaded.state_dict())

    accelerator.register_save_state_pre_hook(save_model_hook)
    accelerator.register_load_state_pre_hook(load_model_hook)


def _train(folder: Path, stop_after: int = MAX_STEPS, resume: bool = False) -> dict:
    from diffusers import DDPMScheduler, UNet2DModel
    from diffusers.optimization import get_scheduler
    from diffusers.training_utils import EMAModel

    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration, set_seed

    accelerator = Accelerator(
        gradient_accumulation_steps=ACCUMULATION, project_config=ProjectConfiguration(project_dir=str(folder))
    )
    set_seed(0)
    model = unet()
    ema = EMAModel(model.parameters(), model_cls=UNet2DModel, model_config=model.config)
    _register_hooks(accelerator, ema)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    images = torch.randn(40, 1, 8, 8, generator=torch.Generator().manual_seed(1))
    loader = torch.utils.data.DataLoader(images, batch_size=4, shuffle=True)
    scheduler = get_scheduler(
        "cosine", optimizer, num_warmup_steps=2, num_training_steps=MAX_STEPS * accelerator.num_processes
    )
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    ema.to(accelerator.device)
    noise_scheduler = DDPMScheduler(num_train_timesteps=100)
    updates_per_epoch = math.ceil(len(loader) / ACCUMULATION)
    global_step = first_epoch = resume_step = 0
    if resume:
        accelerator.load_state(str(folder / f"checkpoint-{CHECKPOINT_EVERY}"))
        global_step = CHECKPOINT_EVERY
        first_epoch = global_step // updates_per_epoch
        resume_step = (global_step * ACCUMULATION) % (updates_per_epoch * ACCUMULATION)
    losses = []
    for epoch in range(first_epoch, math.ceil(MAX_STEPS / updates_per_epoch)):
        model.train()
        for step, batch in enumerate(loader):
            if resume and epoch == first_epoch and step < resume_step:
                continue
            noise = torch.randn(batch.shape, device=batch.device)
            timesteps = torch.randint(0, 100, (batch.shape[0],), device=batch.device)
            with accelerator.accumulate(model):
                loss = F.mse_loss(model(noise_scheduler.add_noise(batch, noise, timesteps), timesteps).sample, noise)
                accelerator.backward(loss)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            losses.append(loss.item())
            if accelerator.sync_gradients:
                ema.step(model.parameters())
                global_step += 1
                if accelerator.is_main_process and global_step % CHECKPOINT_EVERY == 0:
                    accelerator.save_state(str(folder / f"checkpoint-{global_step}"))
            if global_step >= stop_after:
                break
        if global_step >= stop_after:
            break
    accelerator.wait_for_everyone()
    weights = {k: v.detach().cpu().clone() for k, v in accelerator.unwrap_model(model).state_dict().items()}
    weights.update({f"ema.{i}": p.detach().cpu().clone() for i, p in enumerate(ema.shadow_params)})
    return {"losses": losses, "global_step": global_step, "weights": weights}


def part_diffusers(folder):
    """8 steps straight, and the same run interrupted after step 5 (its checkpoint at step 3 kept for the next part)."""
    straight = _train(folder / "straight")
    interrupted = _train(folder / "interrupted", stop_after=5)
    numbers = {
        "losses": straight["losses"],
        "interrupted_losses": interrupted["losses"],
        "global_step": straight["global_step"],
        "checkpoint_has_ema": (folder / "interrupted" / f"checkpoint-{CHECKPOINT_EVERY}" / "unet_ema").is_dir(),
    }
    return numbers, straight["weights"]


def part_diffusers_resume(folder):
    """The interrupted run of ``part_diffusers`` resumed from its checkpoint at step 3 and trained to step 8."""
    resumed = _train(folder.parent / "diffusers" / "interrupted", resume=True)
    return {"losses": resumed["losses"], "global_step": resumed["global_step"]}, resumed["weights"]


PARTS = {"diffusers": part_diffusers, "diffusers_resume": part_diffusers_resume}
