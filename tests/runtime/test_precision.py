"""The mixed precision forward of prepared models (runtime/precision.py): outputs converted to fp32 as Accelerate
does, or kept in the autocast dtype with ``AutocastKwargs(convert_outputs_to_fp32=False)``; what each costs autograd
and what each means for the loss."""

import sys
from collections import OrderedDict

import pytest
import torch
from helpers import SCRIPTS

from hasten import Accelerator
from hasten.runtime.precision import AutocastForward
from hasten.utils import AutocastKwargs

sys.path.insert(0, str(SCRIPTS))
from fp8_model import TinyLM, batch, lm_loss  # noqa: E402


class Outputs(torch.nn.Module):
    """A model returning a structure: a dict with a tensor, a tuple of tensors and an integer tensor."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x):
        y = self.linear(x)
        return OrderedDict(logits=y, pair=(y * 2, y.argmax(-1)))


def twin_models():
    torch.manual_seed(0)
    model = TinyLM()
    raw = TinyLM()
    raw.load_state_dict(model.state_dict())
    return model, raw


def saved_bytes(function) -> int:
    """Bytes of the tensors autograd saves for backward while ``function`` runs (each storage once)."""
    seen = {}

    def pack(tensor):
        seen[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        function()
    return sum(seen.values())


@pytest.mark.parametrize("convert", [True, False])
def test_outputs_come_back_in_fp32_unless_the_switch_keeps_the_autocast_dtype(convert):
    accelerator = Accelerator(mixed_precision="bf16", kwargs_handlers=[AutocastKwargs(convert_outputs_to_fp32=convert)])
    model = accelerator.prepare(Outputs())
    assert isinstance(model.forward, AutocastForward) and model.forward.to_fp32 is convert
    out = model(torch.randn(2, 8))
    half = torch.float32 if convert else torch.bfloat16
    assert type(out) is OrderedDict and (out["logits"].dtype, out["pair"][0].dtype, out["pair"][1].dtype) == (
        half,
        half,
        torch.int64,
    )
    assert accelerator.unwrap_model(model).forward(torch.randn(2, 8))["logits"].dtype == half


def test_the_fp32_conversion_keeps_nothing_for_backward():
    """Autograd saves the same bytes for the converted forward as for a raw autocast forward: the fp32 copy is the
    caller's alone, and no half-precision copy is kept for it."""
    model, raw = twin_models()
    model = Accelerator(mixed_precision="bf16").prepare(model)
    inputs, _ = batch(4, torch.Generator().manual_seed(0))

    def raw_forward():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return raw(inputs)

    assert saved_bytes(lambda: model(inputs)) == saved_bytes(raw_forward) > 0


def test_the_loss_equals_a_raw_autocast_loops_loss_both_ways_when_computed_under_autocast():
    """Converted outputs give the raw loop's loss; kept bf16 outputs give it under ``accelerator.autocast()`` (torch
    runs the loss in fp32 there) and a bf16 loss outside it: the switch's documented consequence."""
    model, raw = twin_models()
    inputs, targets = batch(4, torch.Generator().manual_seed(0))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = lm_loss(raw(inputs), targets)
    assert torch.equal(lm_loss(Accelerator(mixed_precision="bf16").prepare(model)(inputs), targets), expected)
    from hasten.state import reset_state

    reset_state()
    accelerator = Accelerator(mixed_precision="bf16", kwargs_handlers=[AutocastKwargs(convert_outputs_to_fp32=False)])
    kept = TinyLM()
    kept.load_state_dict(raw.state_dict())
    logits = accelerator.prepare(kept)(inputs)
    with accelerator.autocast():
        assert torch.equal(lm_loss(logits, targets), expected)
    outside = lm_loss(logits, targets)
    assert outside.dtype == torch.bfloat16 and not torch.equal(outside.float(), expected)


def test_the_switch_is_not_an_autocast_argument():
    from hasten.utils import get_mixed_precision_context_manager

    handler = AutocastKwargs(cache_enabled=False, convert_outputs_to_fp32=False)
    assert handler.to_kwargs() == {"cache_enabled": False, "convert_outputs_to_fp32": False}
    assert handler.autocast_kwargs() == {"cache_enabled": False}
    accelerator = Accelerator(mixed_precision="bf16", kwargs_handlers=[handler])
    with get_mixed_precision_context_manager(accelerator.native_amp, handler):
        assert torch.is_autocast_enabled("cpu")
