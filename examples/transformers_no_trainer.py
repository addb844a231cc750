"""Causal language modelling with a Transformers model and a hand-written loop, in the style of
Transformers' ``run_*_no_trainer.py`` example scripts.

This script is written for Accelerate. To run it with hasten, only its import lines changed
(``accelerate`` became ``hasten``) and ``accelerate launch`` becomes ``hasten launch``:

    hasten launch --num_processes 2 examples/transformers_no_trainer.py --output_dir runs/gpt2_tiny \
        --checkpointing_steps 20 --with_tracking

Nothing is downloaded: the model is a small GPT-2 built from a ``GPT2Config``, and the text is the
source code of a few Python standard-library modules, read as bytes (256 token ids, so no tokenizer
is needed). Checkpoints are written every ``--checkpointing_steps`` steps (or every epoch) and the
run resumes from one with ``--resume_from_checkpoint``.
"""

import argparse
import importlib.util
import json
import logging
import math
import os
from pathlib import Path

import torch
import transformers
from torch.utils.data import DataLoader
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, GPT2Config, SchedulerType, default_data_collator, get_scheduler

from hasten import Accelerator
from hasten.logging import get_logger
from hasten.utils import set_seed

logger = get_logger(__name__)

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
    parser = argparse.ArgumentParser(
        description="Train a causal language model from scratch with a custom training loop."
    )
    parser.add_argument("--block_size", type=int, default=64, help="Tokens per training sequence.")
    parser.add_argument(
        "--corpus_bytes", type=int, default=100_000, help="Bytes of text to use (the last 10%% are held out)."
    )
    parser.add_argument("--n_embd", type=int, default=64)
    parser.add_argument("--n_layer", type=int, default=2)
    parser.add_argument("--n_head", type=int, default=4)
    parser.add_argument("--per_device_train_batch_size", type=int, default=16)
    parser.add_argument("--per_device_eval_batch_size", type=int, default=16)
    parser.add_argument("--learning_rate", type=float, default=3e-3)
    parser.add_argument("--weight_decay", type=float, default=0.01)
    parser.add_argument("--num_train_epochs", type=int, default=1)
    parser.add_argument("--max_train_steps", type=int, default=None, help="Overrides --num_train_epochs when set.")
    parser.add_argument("--gradient_accumulation_steps", type=int, default=1)
    parser.add_argument("--lr_scheduler_type", type=SchedulerType, default="linear", choices=list(SchedulerType))
    parser.add_argument("--num_warmup_steps", type=int, default=10)
    parser.add_argument(
        "--output_dir", type=str, default=None, help="Where to store the checkpoints and the final model."
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--checkpointing_steps", type=str, default=None, help="Save every n steps (a number), or 'epoch'."
    )
    parser.add_argument(
        "--resume_from_checkpoint", type=str, default=None, help="A checkpoint folder to continue from."
    )
    parser.add_argument("--with_tracking", action="store_true", help="Log the metrics with the experiment trackers.")
    parser.add_argument(
        "--report_to", type=str, default="tensorboard", help="Tracker(s) to log to ('all' for every installed one)."
    )
    return parser.parse_args()


def load_blocks(block_size, corpus_bytes):
    """The corpus cut into examples of ``block_size`` byte ids; the last tenth is the validation split."""
    text = b"\n\n".join(Path(importlib.util.find_spec(name).origin).read_bytes() for name in CORPUS_MODULES)[
        :corpus_bytes
    ]
    ids = list(text)
    blocks = [ids[start : start + block_size] for start in range(0, len(ids) - block_size + 1, block_size)]
    examples = [{"input_ids": block, "labels": block} for block in blocks]
    cut = int(0.9 * len(examples))
    return examples[:cut], examples[cut:]


def build_optimizer(model, args):
    """AdamW without weight decay on biases and layer-norm weights."""
    no_decay = ["bias", "ln_1.weight", "ln_2.weight", "ln_f.weight"]
    optimizer_grouped_parameters = [
        {
            "params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)],
            "weight_decay": args.weight_decay,
        },
        {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(optimizer_grouped_parameters, lr=args.learning_rate)


def resume_position(accelerator, args, train_dataloader, num_update_steps_per_epoch):
    """Load the checkpoint of ``--resume_from_checkpoint``; return (starting_epoch, completed_steps, resume_step)."""
    checkpoint_path = args.resume_from_checkpoint
    accelerator.print(f"Resumed from checkpoint: {checkpoint_path}")
    accelerator.load_state(checkpoint_path)
    training_difference = os.path.splitext(os.path.basename(checkpoint_path.rstrip("/")))[0]
    if "epoch" in training_difference:
        starting_epoch = int(training_difference.replace("epoch_", "")) + 1
        return starting_epoch, starting_epoch * num_update_steps_per_epoch, None
    # The folder is named after the optimizer steps done; count the batches they used.
    resume_step = int(training_difference.replace("step_", "")) * args.gradient_accumulation_steps
    starting_epoch = resume_step // len(train_dataloader)
    completed_steps = resume_step // args.gradient_accumulation_steps
    return starting_epoch, completed_steps, resume_step - starting_epoch * len(train_dataloader)


def evaluate(accelerator, model, eval_dataloader, args):
    """Mean validation loss and perplexity over the whole validation split."""
    model.eval()
    losses = []
    for batch in eval_dataloader:
        with torch.no_grad():
            outputs = model(**batch)
        loss = outputs.loss
        losses.append(accelerator.gather_for_metrics(loss.repeat(args.per_device_eval_batch_size)))
    losses = torch.cat(losses)
    eval_loss = torch.mean(losses)
    try:
        perplexity = math.exp(eval_loss)
    except OverflowError:
        perplexity = float("inf")
    return eval_loss, perplexity, len(losses)


def save_checkpoint(accelerator, args, name):
    """``save_state`` into ``<output_dir>/<name>``."""
    output_dir = name if args.output_dir is None else os.path.join(args.output_dir, name)
    accelerator.save_state(output_dir)


def main():
    """Build the model, data, optimizer and scheduler, prepare them, and train."""
    args = parse_args()

    accelerator_log_kwargs = {}
    if args.with_tracking:
        accelerator_log_kwargs["log_with"] = args.report_to
        accelerator_log_kwargs["project_dir"] = args.output_dir
    accelerator = Accelerator(gradient_accumulation_steps=args.gradient_accumulation_steps, **accelerator_log_kwargs)

    logging.basicConfig(
        format="%(asctime)s - %(levelname)s - %(name)s - %(message)s", datefmt="%m/%d/%Y %H:%M:%S", level=logging.INFO
    )
    logger.info(accelerator.state, main_process_only=False)
    if accelerator.is_local_main_process:
        transformers.utils.logging.set_verbosity_warning()
    else:
        transformers.utils.logging.set_verbosity_error()

    set_seed(args.seed)
    if accelerator.is_main_process and args.output_dir is not None:
        os.makedirs(args.output_dir, exist_ok=True)
    accelerator.wait_for_everyone()

    config = GPT2Config(
        vocab_size=256,
        n_positions=args.block_size,
        n_embd=args.n_embd,
        n_layer=args.n_layer,
        n_head=args.n_head,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = AutoModelForCausalLM.from_config(config)

    train_dataset, eval_dataset = load_blocks(args.block_size, args.corpus_bytes)
    train_dataloader = DataLoader(
        train_dataset, shuffle=True, collate_fn=default_data_collator, batch_size=args.per_device_train_batch_size
    )
    eval_dataloader = DataLoader(
        eval_dataset, collate_fn=default_data_collator, batch_size=args.per_device_eval_batch_size
    )
    optimizer = build_optimizer(model, args)

    overrode_max_train_steps = False
    num_update_steps_per_epoch = math.ceil(len(train_dataloader) / args.gradient_accumulation_steps)
    if args.max_train_steps is None:
        args.max_train_steps = args.num_train_epochs * num_update_steps_per_epoch
        overrode_max_train_steps = True

    lr_scheduler = get_scheduler(
        name=args.lr_scheduler_type,
        optimizer=optimizer,
        num_warmup_steps=args.num_warmup_steps * accelerator.num_processes,
        num_training_steps=args.max_train_steps
        if overrode_max_train_steps
        else args.max_train_steps * accelerator.num_processes,
    )

    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader, lr_scheduler
    )

    # The dataloader is shorter once sharded: recompute the number of steps.
    num_update_steps_per_epoch = math.ceil(len(train_dataloader) / args.gradient_accumulation_steps)
    if overrode_max_train_steps:
        args.max_train_steps = args.num_train_epochs * num_update_steps_per_epoch
    args.num_train_epochs = math.ceil(args.max_train_steps / num_update_steps_per_epoch)

    if args.with_tracking:
        experiment_config = vars(args).copy()
        experiment_config["lr_scheduler_type"] = experiment_config["lr_scheduler_type"].value
        accelerator.init_trackers("clm_no_trainer", experiment_config)

    total_batch_size = args.per_device_train_batch_size * accelerator.num_processes * args.gradient_accumulation_steps
    logger.info("***** Running training *****")
    logger.info(f"  Num examples = {len(train_dataset)}")
    logger.info(f"  Num Epochs = {args.num_train_epochs}")
    logger.info(f"  Total train batch size (w. parallel, distributed & accumulation) = {total_batch_size}")
    logger.info(f"  Total optimization steps = {args.max_train_steps}")
    train(
        args, accelerator, model, optimizer, lr_scheduler, train_dataloader, eval_dataloader, num_update_steps_per_epoch
    )


def train(
    args, accelerator, model, optimizer, lr_scheduler, train_dataloader, eval_dataloader, num_update_steps_per_epoch
):
    """The training loop, with an evaluation after each epoch; saves the final model in ``--output_dir``."""
    checkpointing_steps = args.checkpointing_steps
    if checkpointing_steps is not None and checkpointing_steps.isdigit():
        checkpointing_steps = int(checkpointing_steps)
    progress_bar = tqdm(range(args.max_train_steps), disable=not accelerator.is_local_main_process)
    starting_epoch, completed_steps, resume_step = 0, 0, None
    if args.resume_from_checkpoint:
        starting_epoch, completed_steps, resume_step = resume_position(
            accelerator, args, train_dataloader, num_update_steps_per_epoch
        )
    progress_bar.update(completed_steps)

    for epoch in range(starting_epoch, args.num_train_epochs):
        model.train()
        total_loss = 0
        if args.resume_from_checkpoint and epoch == starting_epoch and resume_step is not None:
            active_dataloader = accelerator.skip_first_batches(train_dataloader, resume_step)
        else:
            active_dataloader = train_dataloader
        for batch in active_dataloader:
            with accelerator.accumulate(model):
                outputs = model(**batch)
                loss = outputs.loss
                total_loss += loss.detach().float()
                accelerator.backward(loss)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()

            if accelerator.sync_gradients:
                progress_bar.update(1)
                completed_steps += 1
                if completed_steps % 10 == 0:
                    accelerator.print(f"step {completed_steps}: loss {loss.item():.4f}")
                if isinstance(checkpointing_steps, int) and completed_steps % checkpointing_steps == 0:
                    save_checkpoint(accelerator, args, f"step_{completed_steps}")
            if completed_steps >= args.max_train_steps:
                break

        eval_loss, perplexity, count = evaluate(accelerator, model, eval_dataloader, args)
        logger.info(f"epoch {epoch}: perplexity: {perplexity} eval_loss: {eval_loss}")
        accelerator.print(
            f"epoch {epoch}: eval_loss {eval_loss.item():.4f} perplexity {perplexity:.2f} over {count} values"
        )
        if args.with_tracking:
            accelerator.log(
                {
                    "perplexity": perplexity,
                    "eval_loss": eval_loss,
                    "train_loss": total_loss.item() / len(train_dataloader),
                    "epoch": epoch,
                    "step": completed_steps,
                },
                step=completed_steps,
            )
        if args.checkpointing_steps == "epoch":
            save_checkpoint(accelerator, args, f"epoch_{epoch}")

    if args.with_tracking:
        accelerator.end_training()
    if args.output_dir is not None:
        accelerator.wait_for_everyone()
        unwrapped_model = accelerator.unwrap_model(model)
        unwrapped_model.save_pretrained(
            args.output_dir, is_main_process=accelerator.is_main_process, state_dict=accelerator.get_state_dict(model)
        )
        if accelerator.is_main_process:
            with open(os.path.join(args.output_dir, "all_results.json"), "w") as f:
                json.dump({"perplexity": perplexity}, f)


if __name__ == "__main__":
    main()
