"""The three orders users prepare an FSDP model and its optimizer in, on 2 real processes: all train identically.

1. model and optimizer in one ``prepare`` call;
2. the model first, then an optimizer built from the prepared model's (sharded) parameters, in a second call;
3. an optimizer built on the unsharded model, prepared in a call after the model's.

Run by tests/strategies/test_fsdp.py; exits non-zero at the first failure.
"""

import torch
import torch.distributed as dist
from fsdp_model import batches, loss_fn, make_model

from hasten import Accelerator
from hasten.state import reset_state
from hasten.strategies.fsdp.plugin import FullyShardedDataParallelPlugin as Plugin

STEPS = 20


def one_call(acc):
    raw = make_model()
    return acc.prepare(raw, torch.optim.AdamW(raw.parameters(), lr=1e-2))


def optimizer_from_prepared_model(acc):
    model = acc.prepare(make_model())
    return model, acc.prepare(torch.optim.AdamW(model.parameters(), lr=1e-2))


def optimizer_built_before(acc):
    raw = make_model()
    opt = torch.optim.AdamW(raw.parameters(), lr=1e-2)
    model = acc.prepare(raw)
    return model, acc.prepare(opt)


def losses(order):
    acc = Accelerator(fsdp_plugin=Plugin(auto_wrap_policy="TRANSFORMER_BASED_WRAP"))
    model, opt = order(acc)
    result = []
    for tokens in batches(STEPS, rank=acc.process_index):
        loss = loss_fn(model, tokens)
        acc.backward(loss)
        acc.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
        result.append(loss.item())
    reset_state()
    return result


reference = losses(one_call)
for order in (optimizer_from_prepared_model, optimizer_built_before):
    other = losses(order)
    assert other == reference, f"{order.__name__} trains differently from one prepare call:\n{other}\n{reference}"
assert reference[-1] < reference[0] - 0.1, f"the model learns: {reference[0]:.4f} -> {reference[-1]:.4f}"
print(
    f"rank {dist.get_rank()}: fsdp prepare orders give identical losses over {STEPS} steps ({reference[0]:.4f} -> "
    f"{reference[-1]:.4f})"
)
