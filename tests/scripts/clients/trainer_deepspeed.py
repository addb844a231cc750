"""transformers' ``Trainer`` with a DeepSpeed config dict (ZeRO-2, "auto" values the Trainer fills, its AdamW and
WarmupLR) on a tiny GPT-2. Usage: ``trainer_deepspeed.py OUT_DIR``; writes ``OUT_DIR/losses.json`` and the final
weights ``OUT_DIR/weights.safetensors`` (main process). tests/compat/test_trainer_deepspeed.py runs it on hasten and
on Accelerate 1.15 and compares."""

import json
import sys
from pathlib import Path

import torch
from common import state, tiny_gpt2
from hf_trainers import COMMON_ARGS
from safetensors.torch import save_file
from transformers import Trainer, TrainingArguments

DEEPSPEED = {
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "train_batch_size": "auto",
    "gradient_clipping": "auto",
    "zero_optimization": {"stage": 2},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}},
    "scheduler": {
        "type": "WarmupLR",
        "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto"},
    },
}


class Tokens(torch.utils.data.Dataset):
    """16 sequences of 12 tokens from a fixed pattern (the model's vocabulary has 20 tokens)."""

    def __len__(self):
        return 16

    def __getitem__(self, index):
        ids = torch.tensor([(index * 7 + k) % 20 for k in range(12)])
        return {"input_ids": ids, "labels": ids}


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    args = TrainingArguments(
        output_dir=str(out / "trainer"),
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_steps=4,
        warmup_steps=2,
        deepspeed=DEEPSPEED,
        **COMMON_ARGS,
    )
    trainer = Trainer(model=tiny_gpt2(), args=args, train_dataset=Tokens())
    trainer.train()
    if trainer.accelerator.is_main_process:
        losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
        (out / "losses.json").write_text(json.dumps(losses))
        save_file(state(trainer.model), str(out / "weights.safetensors"))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
