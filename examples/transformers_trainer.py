r"""Causal language modelling with Transformers' ``Trainer``, running on hasten instead of Accelerate.

``Trainer`` builds its own ``accelerate.Accelerator``. This script does not mention hasten at all. Where hasten's
``accelerate`` distribution is installed (the venv ``make`` builds; docs/migration.md), ``import accelerate`` is
hasten in every process and the ``accelerate`` command is hasten's, so the script runs as an Accelerate user runs it:

    accelerate launch --num_processes 2 examples/transformers_trainer.py --output_dir runs/trainer
    accelerate launch --num_processes 2 examples/transformers_trainer.py --output_dir runs/trainer \
        --resume --max_steps 60

Without that distribution, ``hasten launch --as_accelerate --num_processes 2 examples/transformers_trainer.py ...``
makes every process of the job import hasten under Accelerate's name (``torchrun`` works too:
``PYTHONPATH=$(python -m hasten.accelerate_alias) torchrun --nproc_per_node 2 ...``; in a script of your own,
``import hasten; hasten.install_as_accelerate()`` before importing transformers).

Nothing is downloaded: the model is a small GPT-2 built from a ``GPT2Config``, and the text is the
source code of a few Python standard-library modules, read as bytes (256 token ids, no tokenizer).
The run uses gradient accumulation, evaluates every ``--eval_steps``, keeps the last
``--save_total_limit`` checkpoints and continues from the latest one with ``--resume``.
"""

import argparse
import importlib.util
from pathlib import Path

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

import accelerate

CORPUS_MODULES = (
    "textwrap",
    "string",
    "fnmatch",
    "glob",
    "shlex",
    "queue",
    "bisect",
    "heapq",
    "colorsys",
    "contextlib",
)


def parse_args():
    """The command line of the script."""
    parser = argparse.ArgumentParser(description="Train a tiny GPT-2 with Transformers' Trainer.")
    parser.add_argument("--output_dir", type=str, required=True, help="Checkpoints and the final model.")
    parser.add_argument("--max_steps", type=int, default=40)
    parser.add_argument("--block_size", type=int, default=64, help="Tokens per training sequence.")
    parser.add_argument(
        "--corpus_bytes", type=int, default=60_000, help="Bytes of text to use (the last 10%% are held out)."
    )
    parser.add_argument("--per_device_train_batch_size", type=int, default=8)
    parser.add_argument("--gradient_accumulation_steps", type=int, default=2)
    parser.add_argument("--learning_rate", type=float, default=3e-3)
    parser.add_argument("--eval_steps", type=int, default=20)
    parser.add_argument("--save_steps", type=int, default=20)
    parser.add_argument("--save_total_limit", type=int, default=1)
    parser.add_argument("--resume", action="store_true", help="Continue from the latest checkpoint in --output_dir.")
    return parser.parse_args()


class ByteBlocks(torch.utils.data.Dataset):
    """Examples of ``block_size`` byte ids (labels = inputs)."""

    def __init__(self, ids: list[int], block_size: int):
        self.blocks = [ids[start : start + block_size] for start in range(0, len(ids) - block_size + 1, block_size)]

    def __len__(self):
        return len(self.blocks)

    def __getitem__(self, index):
        block = torch.tensor(self.blocks[index])
        return {"input_ids": block, "labels": block}


def load_splits(args):
    """The corpus as training and validation blocks (the last tenth held out)."""
    text = b"\n\n".join(Path(importlib.util.find_spec(name).origin).read_bytes() for name in CORPUS_MODULES)[
        : args.corpus_bytes
    ]
    cut = int(0.9 * len(text))
    return ByteBlocks(list(text[:cut]), args.block_size), ByteBlocks(list(text[cut:]), args.block_size)


class PrintLosses(TrainerCallback):
    """One line per logged loss, on the main process."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs:
            return
        if "loss" in logs:
            print(f"step {state.global_step}: loss {logs['loss']:.4f}", flush=True)
        if "eval_loss" in logs:
            print(f"step {state.global_step}: eval_loss {logs['eval_loss']:.4f}", flush=True)


def main():
    """Build the model and data, train (or resume), save the final model."""
    args = parse_args()
    train_dataset, eval_dataset = load_splits(args)
    config = GPT2Config(
        vocab_size=256, n_positions=args.block_size, n_embd=64, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0
    )
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config)
    training_args = TrainingArguments(
        output_dir=args.output_dir,
        max_steps=args.max_steps,
        per_device_train_batch_size=args.per_device_train_batch_size,
        per_device_eval_batch_size=args.per_device_train_batch_size,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        learning_rate=args.learning_rate,
        warmup_steps=5,
        logging_steps=10,
        eval_strategy="steps",
        eval_steps=args.eval_steps,
        save_strategy="steps",
        save_steps=args.save_steps,
        save_total_limit=args.save_total_limit,
        report_to="none",
        disable_tqdm=True,
        seed=0,
        # Every parameter of GPT-2 gets a gradient: DDP's search for unused ones (Trainer's default without gradient
        # checkpointing) only costs a traversal of the graph per step, and DDP warns about it.
        ddp_find_unused_parameters=False,
        # Pinned memory is for copies to a GPU; without one, torch's DataLoader warns that it is not used.
        dataloader_pin_memory=torch.cuda.is_available(),
    )
    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        callbacks=[PrintLosses()],
    )
    if trainer.is_world_process_zero():
        engine = type(trainer.accelerator).__module__.split(".")[0]
        print(
            f"Trainer runs on {engine} (accelerate {accelerate.__version__}), {trainer.accelerator.num_processes} "
            "process(es)",
            flush=True,
        )
    trainer.train(resume_from_checkpoint=True if args.resume else None)
    if args.resume and trainer.is_world_process_zero():
        print(f"resumed, now at step {trainer.state.global_step}", flush=True)
    trainer.save_model()


if __name__ == "__main__":
    main()
