"""A peft LoRA loop as peft's examples write it: adapter dropout on, a shuffled loader, accumulation, 2 epochs."""

import torch
from common import VOCAB, sentences, state, tiny_gpt2


def part_peft(folder):
    from peft import LoraConfig, get_peft_model

    from accelerate import Accelerator
    from accelerate.utils import set_seed

    accelerator = Accelerator(gradient_accumulation_steps=2)
    set_seed(0)
    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1, target_modules=["c_attn"], task_type="CAUSAL_LM")
    model = get_peft_model(tiny_gpt2(), config)
    ids = torch.tensor([[VOCAB[w] for w in text.split()] for text in sentences(24, 7)])
    loader = torch.utils.data.DataLoader([{"input_ids": row, "labels": row} for row in ids], batch_size=4, shuffle=True)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    losses = []
    for _ in range(2):
        model.train()
        for batch in loader:
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            losses.append(accelerator.gather(loss.detach()[None]).tolist())
    unwrapped = accelerator.unwrap_model(model)
    unwrapped.save_pretrained(folder / "adapter", is_main_process=accelerator.is_main_process)
    trained = {k for k, v in unwrapped.named_parameters() if v.requires_grad}
    return {"losses": losses, "trainable": sorted(trained)}, state(unwrapped)


PARTS = {"peft": part_peft}
