"""Small compatibility helpers of hasten.utils."""

import importlib.util

import torch

import hasten.utils as u
from hasten import Accelerator
from hasten.local_sgd import LocalSGD


def test_availability_and_versions():
    assert u.is_torch_version(">=", "2.6") and u.compare_versions("2.13.0", ">", "2.6")
    assert u.is_deepspeed_available() == (importlib.util.find_spec("deepspeed") is not None)
    assert u.is_tensorboard_available() and not u.is_npu_available()
    assert u.is_bf16_available() and u.is_cuda_available() == torch.cuda.is_available()
    assert u.is_wandb_available.__name__ == "is_wandb_available"


def test_small_helpers(monkeypatch):
    assert u.merge_dicts({"a": {"b": 1}}, {"a": {"c": 2}, "d": 3}) == {"a": {"c": 2, "b": 1}, "d": 3}
    assert u.convert_bytes(3 * 2**30) == "3.0 GB" and u.get_pretty_name(Accelerator) == "Accelerator"
    assert u.recursive_getattr(torch.nn.Sequential(torch.nn.Linear(1, 1)), "0.weight").shape == (1, 1)
    monkeypatch.setenv("MY_FLAG", "yes")
    assert u.parse_flag_from_env("MY_FLAG") and u.get_int_from_env(["NOPE", "ALSO_NOPE"], 7) == 7


def test_local_sgd_on_one_process_is_a_plain_loop():
    acc = Accelerator()
    model = torch.nn.Linear(2, 1)
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with LocalSGD(acc, model, local_sgd_steps=2) as local_sgd:
        for _ in range(3):
            acc.backward(model(torch.ones(1, 2)).sum())
            opt.step()
            opt.zero_grad()
            local_sgd.step()
    assert local_sgd.num_steps == 3 and not local_sgd.enabled
