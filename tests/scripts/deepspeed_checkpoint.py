"""ZeRO-3 on 2 processes: partitioned construction, save_state/load_state resume, merged weights, errors.

Run by tests/strategies/test_deepspeed.py through `hasten launch --use_deepspeed --zero_stage 3 --zero3_init_flag true
--zero3_save_16bit_model true` with a temporary folder as argument; exits non-zero at the first failure.
"""

import sys
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch.utils.data import DataLoader, TensorDataset

from hasten import Accelerator, DataLoaderConfiguration
from hasten.errors import CheckpointError, ConfigError
from hasten.state import reset_state
from hasten.strategies.deepspeed.checkpoint import merge_deepspeed_weights
from hasten.strategies.deepspeed.plugin import DeepSpeedPlugin

torch.manual_seed(0)
X, Y = torch.randn(96, 6), torch.randn(96, 2)
ROOT = Path(sys.argv[1])


def model_factory():
    torch.manual_seed(1)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))


def run(model, optimizer, iterator, accelerator, steps):
    losses = []
    for _ in range(steps):
        x, y = next(iterator)
        loss = torch.nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def check_resume_and_merge():
    accelerator = Accelerator(dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True))
    plugin = accelerator.state.deepspeed_plugin
    assert (plugin.zero_stage, plugin.zero3_init_flag, plugin.zero3_save_16bit_model) == (3, True, True), (
        "the launch flags did not reach the plugin"
    )
    with plugin.zero3_init_context_manager(enable=True):
        raw = model_factory()
    assert all(p.numel() == 0 and hasattr(p, "ds_id") for p in raw.parameters()), (
        "zero3_init_context_manager did not partition the model"
    )
    optimizer = torch.optim.AdamW(raw.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
    loader = DataLoader(TensorDataset(X, Y), batch_size=4)
    model, optimizer, loader, scheduler = accelerator.prepare(raw, optimizer, loader, scheduler)
    batches = iter(loader)
    run(model, optimizer, batches, accelerator, 4)
    checkpoint = accelerator.save_state(str(ROOT / "ckpt"))
    assert any(p.name.endswith("_optim_states.pt") for p in Path(checkpoint, "deepspeed", "state").iterdir())
    lr_at_save = scheduler.get_last_lr()

    gathered = accelerator.get_state_dict(model)
    probe = X[:8]
    engine_out = model(probe).detach()
    if accelerator.is_main_process:
        merge_deepspeed_weights(checkpoint, ROOT / "merged")
        merged = load_file(ROOT / "merged" / "model.safetensors")
        assert merged.keys() == gathered.keys() and all(torch.equal(merged[k], gathered[k]) for k in merged), (
            "merged weights differ from the gathered ones"
        )
        plain = model_factory()
        plain.load_state_dict(merged)
        diff = (plain(probe) - engine_out).abs().max().item()
        assert diff <= 1e-6, f"merged model's outputs differ from the engine's by {diff}"
    else:
        assert gathered == {}, "only the main process gets the gathered ZeRO-3 weights"

    expected = run(model, optimizer, batches, accelerator, 6)
    accelerator.load_state(checkpoint)
    assert scheduler.get_last_lr() == lr_at_save, (scheduler.get_last_lr(), lr_at_save)
    resumed_batches = iter(loader)
    resumed = run(model, optimizer, resumed_batches, accelerator, 6)
    resumed_batches.close()
    assert resumed == expected, f"resumed losses {resumed} != {expected}"
    batches.close()

    corrupt = accelerator.save_state(str(ROOT / "corrupt"))
    for rank in range(2):
        path = Path(corrupt, "deepspeed", "state", f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt")
        if accelerator.is_main_process:
            data = bytearray(path.read_bytes())
            data[-10] ^= 0xFF
            path.write_bytes(bytes(data))
    accelerator.wait_for_everyone()
    try:
        accelerator.load_state(corrupt)
    except CheckpointError as error:
        assert "checksum does not match" in str(error), error
    else:
        raise AssertionError("a corrupt DeepSpeed file was loaded")
    reset_state()


def check_unsaved_zero3_weights_point_to_merge():
    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(zero3_init_flag=False, zero3_save_16bit_model=False))
    raw = model_factory()
    model, _, _ = accelerator.prepare(
        raw, torch.optim.SGD(raw.parameters(), lr=0.1), DataLoader(TensorDataset(X, Y), batch_size=4)
    )
    try:
        accelerator.get_state_dict(model)
    except ConfigError as error:
        assert "hasten merge-weights" in str(error) and "stage3_gather_16bit_weights_on_model_save" in str(error), error
    else:
        raise AssertionError("get_state_dict under ZeRO-3 without gathering should fail")
    reset_state()


def main():
    check_resume_and_merge()
    check_unsaved_zero3_weights_point_to_merge()
    print(f"rank {torch.distributed.get_rank()}: deepspeed checkpoint checks passed")


if __name__ == "__main__":
    main()
