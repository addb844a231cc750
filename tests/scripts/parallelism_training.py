"""N-D parallelism on real processes: ``parallelism_training.py LAYOUT [save FOLDER | resume FOLDER]``.

LAYOUT is ``fsdp_tp`` (dp_shard=2 x tp=2, 4 processes), ``hsdp`` (dp_replicate=2 x dp_shard=2, 4 processes),
``tp`` (tp=2, 2 processes) or ``launch`` (no ParallelismConfig argument: the ``hasten launch`` flags lay it out).
A small MLP with a ``_tp_plan`` and a tiny transformers LlamaForCausalLM train 8 steps on batches from a prepared
DataLoader; the losses, clipping norms and gathered state dicts must equal a plain one-process model trained on the
same global batches. Run by tests/strategies/test_parallelism.py.
"""

import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

from hasten import Accelerator, ParallelismConfig
from hasten.state import reset_state

LAYOUTS = {
    "fsdp_tp": dict(dp_shard_size=2, tp_size=2),
    "hsdp": dict(dp_replicate_size=2, dp_shard_size=2),
    "tp": dict(tp_size=2),
}
STEPS, LOCAL_BATCH, CLIP = 8, 2, 0.5


class MLP(nn.Module):
    _tp_plan = {"up": "colwise", "down": "rowwise", "head": "colwise_rep"}

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.up, self.down, self.norm, self.head = nn.Linear(8, 32), nn.Linear(32, 8), nn.LayerNorm(8), nn.Linear(8, 4)

    def forward(self, x):
        return self.head(self.norm(x + self.down(F.gelu(self.up(x)))))


def mlp_case():
    generator = torch.Generator().manual_seed(1)
    inputs, targets = torch.randn(64, 8, generator=generator), torch.randn(64, 4, generator=generator)
    return MLP, TensorDataset(inputs, targets), lambda model, x, y: F.mse_loss(model(x), y)


def llama_case():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=16,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )

    def make():
        torch.manual_seed(0)
        return LlamaForCausalLM(config)

    tokens = torch.randint(0, 64, (64, 9), generator=torch.Generator().manual_seed(2))
    return (
        make,
        TensorDataset(tokens[:, :-1], tokens[:, 1:]),
        lambda model, x, y: F.cross_entropy(model(input_ids=x).logits.reshape(-1, 64), y.reshape(-1)),
    )


def local_bytes(model):
    return sum((p.to_local() if isinstance(p, DTensor) else p).numel() * p.element_size() for p in model.parameters())


def reference(make, data, loss_fn, dp):
    model = make()
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    losses, norms = [], []
    for step, (x, y) in enumerate(DataLoader(data, batch_size=LOCAL_BATCH * dp)):
        if step == STEPS:
            break
        loss = loss_fn(model, x, y)
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, norms, model


def train(acc, model, opt, loader, loss_fn, steps):
    losses, norms = [], []
    for step, (x, y) in enumerate(loader):
        if step == steps:
            break
        loss = loss_fn(model, x, y)
        acc.backward(loss)
        norms.append(acc.clip_grad_norm_(model.parameters(), CLIP).item())
        opt.step()
        opt.zero_grad()
        losses.append(acc.reduce(loss.detach(), "mean").item())
    return losses, norms


def check_gather_for_metrics(acc, model, ref_model, inputs):
    """13 evaluation samples over the data-parallel ranks (the last round padded): exactly the 13 predictions come
    back."""
    evaluation = acc.prepare(DataLoader(TensorDataset(inputs), batch_size=LOCAL_BATCH))
    with torch.no_grad():
        predictions = torch.cat([acc.gather_for_metrics(model(x)) for (x,) in evaluation])
        expected = ref_model(inputs)
    assert predictions.shape == expected.shape, (
        f"gather_for_metrics returns each sample once: {tuple(predictions.shape)} vs {tuple(expected.shape)}"
    )
    assert torch.allclose(predictions, expected, atol=1e-5), (
        f"per-sample differences {(predictions - expected).abs().amax(1)}"
    )


def check(layout, name, case):
    make, data, loss_fn = case()
    acc = Accelerator(parallelism_config=ParallelismConfig(**LAYOUTS[layout]) if layout in LAYOUTS else None)
    mesh = acc.torch_device_mesh
    dp = acc.parallelism_config.data_parallel_size
    raw = make()
    full = local_bytes(raw)
    opt = torch.optim.SGD(raw.parameters(), lr=0.2)
    loader = acc.prepare(DataLoader(data, batch_size=LOCAL_BATCH))
    model, opt = acc.prepare(raw, opt)
    x, _ = next(iter(loader))
    rows = x.shape[0]
    assert torch.equal(x, data.tensors[0][acc.data_parallel_rank * rows : (acc.data_parallel_rank + 1) * rows]), (
        "batches are split over the data-parallel ranks only"
    )
    losses, norms = train(acc, model, opt, loader, loss_fn, STEPS)
    state = acc.get_state_dict(model)
    mine = local_bytes(model)
    ref_losses, ref_norms, ref_model = reference(make, data, loss_fn, dp)
    ref_state = ref_model.state_dict()
    if name == "mlp":
        check_gather_for_metrics(acc, model, ref_model, data.tensors[0][:13])
    worst_loss = max(abs(a - b) for a, b in zip(losses, ref_losses))
    worst_norm = max(abs(a - b) / max(1.0, b) for a, b in zip(norms, ref_norms))
    assert worst_loss < 1e-5 and worst_norm < 1e-5, (
        f"{name}: losses/norms differ from the reference by "
        f"{worst_loss:.2g}/{worst_norm:.2g}\n{losses}\n{ref_losses}\n{norms}\n{ref_norms}"
    )
    if acc.is_main_process:
        assert state.keys() == ref_state.keys(), (sorted(state), sorted(ref_state))
        worst_param = max((state[k] - ref_state[k]).abs().max().item() for k in ref_state)
        assert worst_param < 1e-5, f"{name}: parameters differ from the reference by {worst_param:.2g}"
        print(
            f"RESULT {layout} {name}: mesh {dict(zip(mesh.mesh_dim_names, mesh.shape))}, max loss diff "
            f"{worst_loss:.2g}, "
            f"max norm diff {worst_norm:.2g}, max parameter diff {worst_param:.2g}, rank 0 holds {mine}/{full} "
            f"parameter bytes ({mine / full:.4f}) |"
        )
    reset_state()


def check_prepare_orders(layout):
    """Optimizer and model in one call, the optimizer built from the prepared model, or built before: identical
    losses."""
    make, data, loss_fn = mlp_case()
    config = ParallelismConfig(**LAYOUTS[layout]) if layout in LAYOUTS else None

    def one_call(acc):
        raw = make()
        return acc.prepare(raw, torch.optim.AdamW(raw.parameters(), lr=1e-2))

    def from_prepared(acc):
        model = acc.prepare(make())
        return model, acc.prepare(torch.optim.AdamW(model.parameters(), lr=1e-2))

    def built_before(acc):
        raw = make()
        opt = torch.optim.AdamW(raw.parameters(), lr=1e-2)
        model = acc.prepare(raw)
        return model, acc.prepare(opt)

    runs = []
    for order in (one_call, from_prepared, built_before):
        acc = Accelerator(parallelism_config=config)
        model, opt = order(acc)
        runs.append(train(acc, model, opt, acc.prepare(DataLoader(data, batch_size=LOCAL_BATCH)), loss_fn, STEPS)[0])
        reset_state()
    assert runs[0] == runs[1] == runs[2], f"the prepare orders train differently under {layout}: {runs}"
    if dist.get_rank() == 0:
        print(
            f"RESULT {layout} orders: three prepare orders, identical losses over {STEPS} steps ({runs[0][0]:.4f} -> "
            f"{runs[0][-1]:.4f}) |"
        )


if __name__ == "__main__":
    layout = sys.argv[1]
    check_prepare_orders(layout)
    for name, case in (("mlp", mlp_case), ("llama", llama_case)):
        check(layout, name, case)
    print(f"rank {dist.get_rank()}: parallelism {layout} checks passed")
