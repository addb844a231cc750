"""Libraries built on Accelerate, run on hasten through ``hasten launch --as_accelerate`` (2 processes).

Usage: ``eco_transformers.py OUT_DIR PART...`` with parts ``trainer``, ``device_map``, ``peft``. Each part
runs in turn, and each process writes ``OUT_DIR/<part>_rank<r>.json``: ``{"ok": true, ...numbers}`` or
``{"ok": false, "error": traceback}``, so one part failing does not hide the others' results.
Nothing here imports hasten: the libraries (and this script) import ``accelerate``.
"""

import json
import sys
import traceback
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset

import accelerate
from accelerate import Accelerator, PartialState

OUT = Path(sys.argv[1])
STATE = PartialState()
RANK = STATE.process_index


def tiny_gpt2():
    """A 2-layer GPT-2 built from a config (nothing downloaded), same weights on every process; no dropout."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0
    )
    config.bos_token_id = config.eos_token_id = 0
    torch.manual_seed(0)
    return GPT2LMHeadModel(config)


class Tokens(Dataset):
    """``count`` fixed sequences of 16 tokens, labels = inputs (causal LM): random tokens, or counting
    up from a random start when ``learnable`` (a pattern a LoRA adapter can pick up in a few steps)."""

    def __init__(self, count: int, seed: int, learnable: bool = False):
        generator = torch.Generator().manual_seed(seed)
        if learnable:
            self.ids = (torch.randint(0, 64, (count, 1), generator=generator) + torch.arange(16)) % 64
        else:
            self.ids = torch.randint(0, 64, (count, 16), generator=generator)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, index):
        return {"input_ids": self.ids[index], "labels": self.ids[index]}


def max_abs_diff(first: dict, second: dict) -> float:
    assert first.keys() == second.keys()
    return max(float((first[k].float() - second[k].float()).abs().max()) for k in first)


# ------------------------------------------------------------------------------ transformers Trainer


def _trainer(output_dir: Path, stop_at: int | None = None):
    from transformers import Trainer, TrainerCallback, TrainingArguments

    class StopAt(TrainerCallback):
        """Interrupts the run after ``stop_at`` optimizer steps, as a killed job would (after its save)."""

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == stop_at:
                control.should_training_stop = True

    args = TrainingArguments(
        output_dir=str(output_dir),
        per_device_train_batch_size=2,
        per_device_eval_batch_size=4,
        gradient_accumulation_steps=2,
        max_steps=12,
        learning_rate=1e-3,
        warmup_steps=2,
        logging_steps=1,
        eval_strategy="steps",
        eval_steps=4,
        save_strategy="steps",
        save_steps=4,
        save_total_limit=2,
        seed=0,
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    callbacks = [StopAt()] if stop_at else []
    return Trainer(
        model=tiny_gpt2(), args=args, train_dataset=Tokens(40, 1), eval_dataset=Tokens(12, 2), callbacks=callbacks
    )


def part_trainer(folder: Path) -> dict:
    """Uninterrupted 12 steps vs. 8 steps + resume_from_checkpoint=True; 40 samples = 5 steps per epoch."""
    straight = _trainer(folder / "straight")
    straight.train()
    interrupted = _trainer(folder / "resumed", stop_at=8)
    interrupted.train()
    stopped_at = interrupted.state.global_step
    resumed = _trainer(folder / "resumed")
    resumed.train(resume_from_checkpoint=True)
    evals = {
        name: {e["step"]: e["eval_loss"] for e in t.state.log_history if "eval_loss" in e}
        for name, t in (("straight", straight), ("resumed", resumed))
    }
    losses = {
        name: {e["step"]: e["loss"] for e in t.state.log_history if "loss" in e}
        for name, t in (("straight", straight), ("resumed", resumed))
    }
    straight_weights = {k: v.detach().cpu() for k, v in straight.model.state_dict().items()}
    resumed_weights = {k: v.detach().cpu() for k, v in resumed.model.state_dict().items()}
    return {
        "accelerate_version": accelerate.__version__,
        "accelerator_class": f"{type(straight.accelerator).__module__}.{type(straight.accelerator).__name__}",
        "devices": [str(straight.args.device), str(straight.accelerator.device)],
        "stopped_at": stopped_at,
        "global_step": resumed.state.global_step,
        "straight_global_step": straight.state.global_step,
        "resumed_steps_logged": sorted(step for step in losses["resumed"] if step > stopped_at),
        "eval_steps": {name: sorted(v) for name, v in evals.items()},
        "eval_loss_diff": max(abs(evals["straight"][s] - evals["resumed"][s]) for s in evals["straight"]),
        "loss_diff_after_resume": max(
            abs(losses["straight"][s] - losses["resumed"][s]) for s in range(stopped_at + 1, 13)
        ),
        "checkpoints": sorted(p.name for p in (folder / "resumed").glob("checkpoint-*")),
        "weights_max_abs_diff": max_abs_diff(straight_weights, resumed_weights),
        "weights_equal": all(torch.equal(straight_weights[k], resumed_weights[k]) for k in straight_weights),
    }


# ------------------------------------------------------------------------------ from_pretrained(device_map="auto")


def part_device_map(folder: Path) -> dict:
    """A tiny model saved by the main process, loaded by every process with ``device_map="auto"``."""
    from transformers import AutoModelForCausalLM

    original = tiny_gpt2().eval()
    if STATE.is_main_process:
        original.save_pretrained(folder / "tiny")
    STATE.wait_for_everyone()
    loaded = AutoModelForCausalLM.from_pretrained(folder / "tiny", device_map="auto").eval()
    device = next(loaded.parameters()).device
    ids = Tokens(4, 3).ids.to(device)
    with torch.no_grad():
        diff = float((original.to(device)(ids).logits - loaded(ids).logits).abs().max())
    return {"devices": sorted({str(p.device) for p in loaded.parameters()}), "logits_max_abs_diff": diff}


# ------------------------------------------------------------------------------ peft LoRA


def part_peft(folder: Path) -> dict:
    """A LoRA adapter on the tiny GPT-2, trained on 2 processes; the base weights must not move."""
    from peft import LoraConfig, PeftModel, get_peft_model

    model = get_peft_model(
        tiny_gpt2(), LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["c_attn"], task_type="CAUSAL_LM")
    )
    frozen_before = {k: v.detach().clone() for k, v in model.named_parameters() if not v.requires_grad}
    accelerator = Accelerator()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    loader = DataLoader(Tokens(32, 4, learnable=True), batch_size=4, shuffle=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    probe = Tokens(8, 5, learnable=True).ids.to(accelerator.device)
    with torch.no_grad():
        loss_before = float(model(input_ids=probe, labels=probe).loss)
    for _ in range(3):
        for batch in loader:
            accelerator.backward(model(**batch).loss)
            optimizer.step()
            optimizer.zero_grad()
    unwrapped = accelerator.unwrap_model(model).eval()
    with torch.no_grad():
        loss_after = float(unwrapped(input_ids=probe, labels=probe).loss)
        logits = unwrapped(input_ids=probe).logits
    lora = {k: v.detach() for k, v in unwrapped.named_parameters() if v.requires_grad}
    flat = torch.cat([v.flatten() for v in lora.values()])
    gathered = accelerator.gather(flat[None])
    if accelerator.is_main_process:
        unwrapped.save_pretrained(folder / "adapter")
    accelerator.wait_for_everyone()
    reloaded = PeftModel.from_pretrained(tiny_gpt2(), folder / "adapter").eval()
    with torch.no_grad():
        reload_diff = float((reloaded(input_ids=probe).logits - logits).abs().max())
    frozen_after = dict(unwrapped.named_parameters())
    return {
        "trainable": len(lora),
        "lora_b_norm": float(sum(v.norm() for k, v in lora.items() if "lora_B" in k)),
        "frozen_max_abs_diff": max(float((frozen_after[k] - v).abs().max()) for k, v in frozen_before.items()),
        "ranks_agree": bool(torch.equal(gathered[0], gathered[1])),
        "loss_before": loss_before,
        "loss_after": loss_after,
        "reload_logits_max_abs_diff": reload_diff,
    }


PARTS = {"trainer": part_trainer, "device_map": part_device_map, "peft": part_peft}

for name in sys.argv[2:]:
    folder = OUT / name
    folder.mkdir(parents=True, exist_ok=True)
    try:
        result = {"ok": True, **PARTS[name](folder)}
    except Exception:
        result = {"ok": False, "error": traceback.format_exc()}
    (OUT / f"{name}_rank{RANK}.json").write_text(json.dumps(result, indent=1))
    STATE.wait_for_everyone()
