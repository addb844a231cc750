"""Train with DeepSpeed ZeRO from a DeepSpeed JSON config whose values the script fills in ("auto").

Launch it with the config file (``examples/ds_config_zero2.json``: ZeRO-2, the optimizer states and
step offloaded to the CPU, batch sizes, accumulation, clipping, precision, optimizer and scheduler
values left to the script):

    hasten launch --num_processes 2 --use_deepspeed --deepspeed_config_file examples/ds_config_zero2.json \
        examples/deepspeed_config.py

The script itself is the ordinary training loop. When the config defines the optimizer and the
scheduler, ``DummyOptim`` and ``DummyScheduler`` stand for them: their arguments (learning rate, weight
decay, step counts) fill the config's ``"auto"`` values, and ``prepare`` returns DeepSpeed's optimizer
and scheduler. Without DeepSpeed (``hasten launch --num_processes 2 examples/deepspeed_config.py``)
the same script trains with torch's AdamW and a linear schedule.
"""

import argparse
import json
import warnings

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from hasten import Accelerator
from hasten.utils import DummyOptim, DummyScheduler, set_seed

SHOWN_KEYS = ("train_micro_batch_size_per_gpu", "train_batch_size", "gradient_accumulation_steps", "gradient_clipping")

# DeepSpeed's ZeRO-2 step gathers the updated parameters with torch.distributed.all_gather_into_tensor, which torch
# 2.13 deprecates: a FutureWarning at the first step of every process. The call still works, and only a DeepSpeed
# release can change it.
warnings.filterwarnings(
    "ignore", message=r"`torch\.distributed\.all_gather_into_tensor` is deprecated", category=FutureWarning
)


def datasets(seed: int, features: int = 16, classes: int = 4):
    """Points labelled by a random linear teacher: 2,048 for training, 512 held out."""
    generator = torch.Generator().manual_seed(seed)
    teacher = torch.randn(features, classes, generator=generator)
    x = torch.randn(2560, features, generator=generator)
    y = (x @ teacher).argmax(dim=1)
    return TensorDataset(x[:2048], y[:2048]), TensorDataset(x[2048:], y[2048:])


def optimizer_and_scheduler(accelerator, model, args, total_steps: int):
    """DeepSpeed's optimizer and scheduler when the config defines them, torch's otherwise."""
    plugin = accelerator.state.deepspeed_plugin
    config = plugin.deepspeed_config if plugin is not None else {}
    if "optimizer" in config:
        optimizer = DummyOptim(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    # A prepared scheduler steps once per process for each optimizer step, so the total counts every
    # process's steps (for DeepSpeed's scheduler, prepare divides it back; the warm-up is not scaled).
    scheduled_steps = total_steps * accelerator.num_processes
    if "scheduler" in config:
        return optimizer, DummyScheduler(optimizer, total_num_steps=scheduled_steps, warmup_num_steps=args.warmup_steps)
    warmup = args.warmup_steps * accelerator.num_processes
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda step: min((step + 1) / warmup, max(0.0, (scheduled_steps - step) / (scheduled_steps - warmup))),
    )
    return optimizer, scheduler


def main() -> None:
    """Train and evaluate; the engine (DDP or DeepSpeed) is the launcher's choice."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch_size", type=int, default=32, help="per process")
    parser.add_argument("--gradient_accumulation_steps", type=int, default=2)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--weight_decay", type=float, default=0.01)
    parser.add_argument("--warmup_steps", type=int, default=5)
    parser.add_argument("--max_grad_norm", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    accelerator = Accelerator(gradient_accumulation_steps=args.gradient_accumulation_steps)
    set_seed(args.seed)
    train_set, eval_set = datasets(args.seed)
    model = nn.Sequential(nn.Linear(16, 256), nn.GELU(), nn.Linear(256, 4))
    train_loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True)
    eval_loader = DataLoader(eval_set, batch_size=64)
    steps_per_epoch = len(train_loader) // (accelerator.num_processes * args.gradient_accumulation_steps)
    optimizer, scheduler = optimizer_and_scheduler(accelerator, model, args, args.epochs * steps_per_epoch)
    model, optimizer, train_loader, eval_loader, scheduler = accelerator.prepare(
        model, optimizer, train_loader, eval_loader, scheduler
    )

    plugin = accelerator.state.deepspeed_plugin
    if plugin is not None:
        resolved = {key: plugin.deepspeed_config[key] for key in SHOWN_KEYS}
        resolved["optimizer.params.lr"] = plugin.deepspeed_config["optimizer"]["params"]["lr"]
        for key in ("warmup_num_steps", "total_num_steps"):
            resolved[f"scheduler.params.{key}"] = plugin.deepspeed_config["scheduler"]["params"][key]
        accelerator.print(f"DeepSpeed ZeRO-{plugin.zero_stage}, resolved config values: {json.dumps(resolved)}")
    accelerator.print(f"distributed type {accelerator.distributed_type.value}, {accelerator.num_processes} process(es)")

    for epoch in range(args.epochs):
        model.train()
        for inputs, targets in train_loader:
            with accelerator.accumulate(model):
                loss = F.cross_entropy(model(inputs), targets)
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
        model.eval()
        correct = total = 0
        with torch.no_grad():
            for inputs, targets in eval_loader:
                predictions, targets = accelerator.gather_for_metrics((model(inputs).argmax(dim=1), targets))
                correct += (predictions == targets).sum().item()
                total += len(targets)
        accelerator.print(f"epoch {epoch}: accuracy {correct / total:.4f} on {total} held-out samples")
    accelerator.end_training()


if __name__ == "__main__":
    main()
