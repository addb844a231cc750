"""DeepSpeed on 2 processes: ZeRO 1/2/3 train like DDP (fp32, with and without accumulation), ZeRO-2
with the optimizer offloaded to the CPU, the guide's all-"auto" ZeRO-3 config, and ZeRO-1/2 merged weights.

Usage: deepspeed_training.py TMP_DIR AUTO_CONFIG_JSON. Run by tests/strategies/test_deepspeed.py; exits non-zero at
the first failure.
"""

import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch.utils.data import DataLoader, TensorDataset

from hasten import Accelerator, DeepSpeedPlugin
from hasten.state import reset_state
from hasten.strategies.deepspeed.checkpoint import merge_deepspeed_weights
from hasten.utils import DummyOptim, DummyScheduler

torch.manual_seed(0)
X, Y = torch.randn(160, 6), torch.randn(160, 2)
STEPS = 20
ROOT, AUTO_CONFIG = Path(sys.argv[1]), sys.argv[2]


def model_factory():
    torch.manual_seed(1)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))


def train(accelerator, raw=None, optimizer=None, scheduler=None, steps=STEPS):
    raw = raw if raw is not None else model_factory()
    optimizer = optimizer if optimizer is not None else torch.optim.AdamW(raw.parameters(), lr=0.01)
    loader = DataLoader(TensorDataset(X, Y), batch_size=4)
    prepared = accelerator.prepare(raw, optimizer, loader, *([scheduler] if scheduler is not None else []))
    model, optimizer, loader = prepared[:3]
    losses = []
    for step, (x, y) in enumerate(loader):
        if step == steps:
            break
        with accelerator.accumulate(model):
            loss = torch.nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            if scheduler is not None:
                prepared[3].step()
            optimizer.zero_grad()
        losses.append(loss.item())
    return losses, model, prepared


def check_merged(accelerator, model, name):
    """save_state, then merge-weights on the main process: the merged fp32 weights are the engine's."""
    checkpoint = accelerator.save_state(str(ROOT / name))
    weights = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        merge_deepspeed_weights(checkpoint, ROOT / f"{name}_merged")
        merged = load_file(ROOT / f"{name}_merged" / "model.safetensors")
        assert merged.keys() == weights.keys() and all(torch.equal(merged[k], weights[k]) for k in merged), (
            f"{name}: merged weights differ"
        )
    accelerator.wait_for_everyone()


def check_like_ddp(references, timings):
    for stage in (1, 2, 3):
        for gas in (1, 2):
            start = time.perf_counter()
            # ZeRO-2 takes the accumulation steps from the Accelerator, the others from the plugin.
            plugin = DeepSpeedPlugin(zero_stage=stage, gradient_accumulation_steps=gas if stage != 2 else None)
            accelerator = Accelerator(deepspeed_plugin=plugin, gradient_accumulation_steps=gas if stage == 2 else 1)
            assert accelerator.gradient_accumulation_steps == gas, accelerator.gradient_accumulation_steps
            losses, model, _ = train(accelerator)
            diff = max(abs(a - b) for a, b in zip(losses, references[gas]))
            assert len(losses) == STEPS and diff < 1e-4, f"ZeRO-{stage} gas={gas}: losses differ from DDP by {diff}"
            if stage in (1, 2) and gas == 2:
                check_merged(accelerator, model, f"zero{stage}")
            timings[f"zero{stage}/gas{gas}"] = round(time.perf_counter() - start, 2)
            reset_state()


def check_offload(references, timings):
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    start = time.perf_counter()
    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(zero_stage=2, offload_optimizer_device="cpu"))
    losses, model, (_, optimizer, _) = train(accelerator)
    assert isinstance(optimizer.optimizer.optimizer, DeepSpeedCPUAdam), type(optimizer.optimizer.optimizer)
    assert model.zero_cpu_offload(), "the optimizer states are not offloaded"
    diff = max(abs(a - b) for a, b in zip(losses, references[1]))
    assert diff < 1e-4, f"ZeRO-2 with optimizer offload: losses differ from DDP by {diff}"
    timings["offload"] = round(time.perf_counter() - start, 2)
    reset_state()


def check_auto_config(timings):
    """The guide's ZeRO-3 config, "auto" everywhere, with the optimizer and scheduler of the config."""
    start = time.perf_counter()
    plugin = DeepSpeedPlugin(hf_ds_config=AUTO_CONFIG)
    accelerator = Accelerator(deepspeed_plugin=plugin, gradient_accumulation_steps=2)
    raw = model_factory()
    raw.config = {"hidden_size": 16}
    optimizer = DummyOptim(raw.parameters(), lr=0.01, weight_decay=0.0)
    scheduler = DummyScheduler(optimizer, warmup_num_steps=5)
    losses, model, (_, _, _, prepared_scheduler) = train(accelerator, raw, optimizer, scheduler, steps=12)
    config = plugin.deepspeed_config
    assert (
        config["train_micro_batch_size_per_gpu"],
        config["train_batch_size"],
        config["gradient_accumulation_steps"],
    ) == (4, 16, 2), config
    zero = config["zero_optimization"]
    assert (
        zero["reduce_bucket_size"],
        zero["stage3_prefetch_bucket_size"],
        zero["stage3_param_persistence_threshold"],
    ) == (256, 230, 160), zero
    assert config["optimizer"]["params"] == {"lr": 0.01, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0}, (
        config["optimizer"]
    )
    assert config["scheduler"]["params"] == {"warmup_min_lr": 0, "warmup_max_lr": 0.01, "warmup_num_steps": 5}, config[
        "scheduler"
    ]
    assert config["fp16"]["enabled"] is False and config["gradient_clipping"] == 1.0
    assert model.zero_cpu_offload() and model.optimizer.__class__.__name__ == "DeepSpeedZeroOptimizer_Stage3"
    lr = prepared_scheduler.get_last_lr()[0]
    assert 0 < lr <= 0.01 and model.global_steps == 6, (lr, model.global_steps)
    assert all(torch.isfinite(torch.tensor(losses))), losses
    timings["auto-config"] = round(time.perf_counter() - start, 2)
    reset_state()


def main():
    timings = {}
    references = {}
    for gas in (1, 2):
        references[gas] = train(Accelerator(gradient_accumulation_steps=gas))[0]
        reset_state()
    check_like_ddp(references, timings)
    check_offload(references, timings)
    check_auto_config(timings)
    print(f"rank {torch.distributed.get_rank()}: deepspeed training checks passed {timings}")


if __name__ == "__main__":
    main()
