"""The Accelerator in a single process: prepare, training loop, precision, misuse warnings, state."""

import subprocess
import sys
import warnings

import pytest
import torch
from helpers import clean_env
from torch.utils.data import DataLoader, TensorDataset

from hasten import Accelerator, DistributedDataParallelKwargs, GradScalerKwargs, PartialState
from hasten.errors import ConfigError
from hasten.optimizer import AcceleratedOptimizer
from hasten.scheduler import AcceleratedScheduler
from hasten.state import AcceleratorState, GradientState
from hasten.utils import GradientAccumulationPlugin

_DATA = torch.Generator().manual_seed(0)  # fixed data, whatever ran before: fp16 results depend on it
X, Y = torch.randn(32, 5, generator=_DATA), torch.randn(32, 1, generator=_DATA)


def make_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))


def test_prepare_returns_objects_in_order_with_the_right_types():
    acc = Accelerator()
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    loader = DataLoader(TensorDataset(X, Y), batch_size=4)
    out = acc.prepare(loader, sched, "passthrough", opt, model)
    assert isinstance(out[0], DataLoader) and isinstance(out[1], AcceleratedScheduler) and out[2] == "passthrough"
    assert isinstance(out[3], AcceleratedOptimizer) and out[4] is model
    assert out[1].optimizers == [out[3]]
    assert acc.prepare(out[3]) is out[3], "preparing a prepared object returns it unchanged"
    assert acc.device == torch.device("cpu") and acc.num_processes == 1 and acc.is_main_process and acc.is_last_process


def test_state_is_shared_between_accelerators():
    first = Accelerator(mixed_precision="bf16")
    second = Accelerator()
    assert second.state.mixed_precision == "bf16" and second.state is not first.state
    assert AcceleratorState().device == first.device
    with pytest.raises(ConfigError, match="already exists with mixed_precision='bf16'"):
        Accelerator(mixed_precision="fp16")


def test_state_before_initialisation_is_a_clear_error():
    with pytest.raises(AttributeError, match=r"create an Accelerator\(\) first"):
        AcceleratorState._shared_state.clear() or AcceleratorState.__new__(AcceleratorState).mixed_precision


def test_mixed_precision_from_environment_and_validation(monkeypatch):
    monkeypatch.setenv("HASTEN_MIXED_PRECISION", "bf16")
    assert Accelerator().mixed_precision == "bf16"
    from hasten.state import reset_state

    reset_state()
    with pytest.raises(ConfigError, match="mixed_precision='fp32' is not supported"):
        Accelerator(mixed_precision="fp32")


def test_handler_and_plugin_conflicts():
    with pytest.raises(ConfigError, match="two DistributedDataParallelKwargs"):
        Accelerator(kwargs_handlers=[DistributedDataParallelKwargs(), DistributedDataParallelKwargs()])
    with pytest.raises(ConfigError, match="either gradient_accumulation_steps=2 or a gradient_accumulation_plugin"):
        Accelerator(gradient_accumulation_steps=2, gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=2))


def train(acc, model, batch_size, steps_per_sync=1):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt, loader = acc.prepare(model, opt, DataLoader(TensorDataset(X, Y), batch_size=batch_size))
    for x, y in loader:
        with acc.accumulate(model):
            acc.backward(torch.nn.functional.mse_loss(model(x), y))
            opt.step()
            opt.zero_grad()
    return model


def test_accumulation_equals_large_batch_on_one_process():
    accumulated = train(Accelerator(gradient_accumulation_steps=4), make_model(), 2)
    from hasten.state import reset_state

    reset_state()
    large = train(Accelerator(), make_model(), 8)
    diff = max((a - b).abs().max().item() for a, b in zip(accumulated.parameters(), large.parameters()))
    assert diff < 1e-6


def test_last_batch_forces_sync():
    acc = Accelerator(gradient_accumulation_steps=3)
    model = make_model()
    loader = acc.prepare(DataLoader(TensorDataset(X[:10], Y[:10]), batch_size=2))
    syncs = []
    for _ in loader:
        with acc.accumulate(model):
            syncs.append(acc.sync_gradients)
    assert syncs == [False, False, True, False, True]


def test_fp16_overflow_skips_the_step_and_the_scheduler():
    acc = Accelerator(mixed_precision="fp16", kwargs_handlers=[GradScalerKwargs(init_scale=1024)])
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    model, opt, sched = acc.prepare(model, opt, sched)
    weights = []
    for step in range(3):
        opt.zero_grad()
        acc.backward(torch.nn.functional.mse_loss(model(X[:4]), Y[:4]))
        if step == 1:
            model[0].weight.grad[0, 0] = float("nan")
        before = model[0].weight.detach().clone()
        opt.step()
        weights.append(torch.equal(before, model[0].weight))
        if not acc.optimizer_step_was_skipped:
            sched.step()
    assert weights == [False, True, False]
    assert sched.get_last_lr() == [0.1 * 0.5**2]
    assert acc.scaler.get_scale() == 512


def test_each_accelerator_owns_its_accumulation_steps():
    """The steps settled at Accelerator(...) have one holder, which accumulate/backward read; a later Accelerator in
    the same process (which rewrites the shared GradientState, as in Accelerate) leaves them alone, and the setter
    does not edit the user's plugin. Accelerate 1.15 shares them: there the first Accelerator reports 4 below."""
    plugin = GradientAccumulationPlugin(num_steps=3)
    first = Accelerator(gradient_accumulation_plugin=plugin)
    second = Accelerator(gradient_accumulation_steps=4)
    steps = (first.gradient_accumulation_steps, second.gradient_accumulation_steps, first.gradient_state.num_steps)
    assert steps == (3, 4, 4)
    model, syncs = make_model(), []
    for _ in range(6):
        with first.accumulate(model):
            syncs.append(first.sync_gradients)
    assert syncs == [False, False, True, False, False, True]
    first.gradient_accumulation_steps = 5
    assert (first.gradient_accumulation_steps, first.gradient_state.num_steps, plugin.num_steps) == (5, 5, 3)


def test_join_uneven_inputs_is_a_no_op_in_one_process_and_warns_under_other_engines():
    """As in Accelerate: one process has nothing to join; a non-DDP engine cannot join (the override by
    even_batches on 2 processes is checked by Accelerate's own script, tests/compat/test_accelerate_scripts.py)."""
    acc = Accelerator()
    loader = acc.prepare(DataLoader(TensorDataset(X[:10], Y[:10]), batch_size=2))
    assert loader.even_batches is True and loader.split_batches is False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with acc.join_uneven_inputs([], even_batches=False) as join:
            assert join is None and loader.even_batches is True
    sharded = Accelerator(strategy="fsdp")
    with pytest.warns(UserWarning, match=r"only supported for multi-GPU training \(DDP, here FSDP\)"):
        with sharded.join_uneven_inputs([]) as join:
            assert join is None


def test_backward_calls_are_counted_until_the_optimizer_steps():
    acc = Accelerator()
    model = make_model()
    optimizer = acc.prepare(torch.optim.SGD(model.parameters(), lr=0.1))
    acc.backward(model(X[:2]).sum())
    acc.backward(model(X[:2]).sum())
    assert acc.gradient_state.backward_calls == 2
    optimizer.step()
    assert acc.gradient_state.backward_calls == 0


def test_plain_backward_under_fp16_is_caught():
    acc = Accelerator(mixed_precision="fp16")
    model = make_model()
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    torch.nn.functional.mse_loss(model(X[:4]), Y[:4]).backward()
    with pytest.warns(UserWarning, match="Replace loss.backward"), pytest.raises(ConfigError, match="never scaled"):
        opt.step()
    opt.zero_grad()
    acc.backward(torch.nn.functional.mse_loss(model(X[:4]), Y[:4]))
    opt.step()
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(X[:4]), Y[:4]).backward()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step()  # silently wrong without hasten: the warning was already given once
    assert not [w for w in caught if "Replace loss.backward" in str(w.message)]


def test_plain_backward_with_accumulation_warns():
    acc = Accelerator(gradient_accumulation_steps=2)
    model = make_model()
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    torch.nn.functional.mse_loss(model(X[:4]), Y[:4]).backward()
    with pytest.warns(UserWarning, match="gradient accumulation over 2 steps"):
        opt.step()


def test_scheduler_before_optimizer_warns():
    acc = Accelerator()
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt, sched = acc.prepare(opt, torch.optim.lr_scheduler.StepLR(opt, 1))
    with pytest.warns(UserWarning, match="before any optimizer.step"):
        sched.step()


def test_clip_grad_norm_matches_torch_and_unscales_fp16():
    """On data whose scaled fp16 gradients do not overflow (with some data the first step's scale 65536
    overflows: the norm is inf and the scaler skips that step, as torch's GradScaler does)."""
    for precision in ("no", "fp16"):
        from hasten.state import reset_state

        reset_state()
        acc = Accelerator(mixed_precision=precision)
        model = make_model()
        reference = make_model()
        model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        acc.backward(torch.nn.functional.mse_loss(model(X), Y))
        torch.nn.functional.mse_loss(reference(X), Y).backward()
        expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.1)
        norm = acc.clip_grad_norm_(model.parameters(), 0.1)
        assert torch.allclose(norm, expected, rtol=1e-3), (precision, norm, expected)


def test_unwrap_model_restores_the_original_forward():
    acc = Accelerator(mixed_precision="bf16")
    model = acc.prepare(make_model())
    assert acc.unwrap_model(model)(X).dtype == torch.float32
    plain = acc.unwrap_model(model, keep_fp32_wrapper=False)
    assert "forward" not in plain.__dict__


def test_device_placement_false_keeps_batches_where_they_are():
    acc = Accelerator(device_placement=False)
    loader = acc.prepare(DataLoader(TensorDataset(X, Y), batch_size=4))
    assert loader.device is None


def test_process_helpers_on_one_process():
    acc = Accelerator()
    with acc.split_between_processes([1, 2, 3]) as part:
        assert part == [1, 2, 3]
    with acc.main_process_first():
        pass
    assert acc.on_local_main_process(lambda: 5)() == 5
    assert not acc.check_trigger()
    acc.set_trigger()
    assert acc.check_trigger() and not acc.check_trigger()
    assert repr(PartialState()).startswith("Distributed environment: DistributedType.NO\n"), (
        "Accelerate's repr prints the enum member"
    )


def test_free_memory_drops_references():
    acc = Accelerator()
    model = acc.prepare(make_model())
    assert acc.free_memory(model) == [None] and acc._models == []


def test_gradient_state_keeps_only_the_plugin_fields_that_differ_from_the_defaults():
    """As Accelerate keeps them (transformers reads plugin_kwargs): the default adjust_scheduler=True reads back as
    False."""
    Accelerator(gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=2))
    state = GradientState()
    assert state.plugin_kwargs == {"num_steps": 2}
    assert state.num_steps == 2 and state.adjust_scheduler is False and state.sync_with_dataloader is True


def test_no_warnings_in_a_clean_loop():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        train(Accelerator(gradient_accumulation_steps=2), make_model(), 4)


def test_compatibility_members_of_a_data_parallel_job():
    from hasten.errors import NotSupportedError

    acc = Accelerator()
    assert acc.should_save_model and acc.deepspeed_plugin is None and acc.fp8_backend == "NO"
    assert (
        acc.data_parallel_rank,
        acc.tensor_parallel_rank,
        acc.pipeline_parallel_rank,
        acc.context_parallel_rank,
    ) == (0, 0, 0, 0)
    assert not acc.is_composable_parallelism_enabled and acc.torch_device_mesh is None
    with acc.maybe_context_parallel():
        pass
    with pytest.raises(NotSupportedError, match="LOMO"):
        acc.lomo_backward(torch.tensor(1.0), 0.1)
    from hasten.state import reset_state

    reset_state()
    with pytest.raises(NotSupportedError, match="megatron_lm_plugin"):
        Accelerator(megatron_lm_plugin=object())


_EXIT_PROBE = """
import atexit, sys, time, torch.distributed as dist
atexit.register(
    lambda: print("group alive at exit:", dist.is_initialized(), "handed over for", time.monotonic() - end, flush=True)
)
from hasten import Accelerator
state = Accelerator(cpu=True).state
state.ensure_process_group()
if sys.argv[1] == "destroyed":
    state.destroy_process_group()
end = time.monotonic()
if sys.argv[1] == "crash":
    raise RuntimeError("user code failed")
"""


@pytest.mark.parametrize("how, alive", [("clean", False), ("destroyed", False), ("crash", True)])
def test_process_group_is_torn_down_at_exit_unless_the_script_crashed(how, alive):
    # Left alive into interpreter shutdown, a collective's worker thread can abort a successful run. hasten
    # destroys its group at exit (not after a crash: other ranks could be stuck in a collective the teardown
    # would wait on) and, in every case, sleeps so that such a thread gets the GIL before shutdown begins.
    proc = subprocess.run(
        [sys.executable, "-c", _EXIT_PROBE, how], capture_output=True, text=True, env=clean_env(), timeout=120
    )
    assert f"group alive at exit: {alive}" in proc.stdout, proc.stdout + proc.stderr
    assert float(proc.stdout.split("handed over for")[1]) >= 0.1
    assert (proc.returncode != 0) == (how == "crash")


def test_optimizer_state_that_exists_before_prepare_is_kept_exactly():
    # prepare re-homes existing optimizer state onto the parameters' devices; nothing may change on the way.
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.nn.functional.mse_loss(model(X), Y).backward()
    opt.step()
    before = {i: {k: v.clone() for k, v in state.items()} for i, state in enumerate(opt.state.values())}
    model, opt = Accelerator().prepare(model, opt)
    after = list(opt.state.values())
    assert [set(s) for s in after] == [set(s) for s in before.values()]
    assert all(torch.equal(after[i][k], v) for i, state in before.items() for k, v in state.items())
    assert all(p in opt.state for p in model.parameters())


def test_profile_writes_accelerates_trace_file_name(tmp_path):
    from hasten import ProfileKwargs

    accelerator = Accelerator(cpu=True)
    with accelerator.profile(ProfileKwargs(activities=["cpu"], output_trace_dir=str(tmp_path))):
        torch.ones(4).sum()
    assert [p.name for p in tmp_path.iterdir()] == ["profile_0.json"]


def test_prepared_objects_carry_accelerates_flag_and_are_not_prepared_twice():
    accelerator = Accelerator(cpu=True)
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
    loader = DataLoader(TensorDataset(torch.arange(8.0)), batch_size=2)
    prepared = accelerator.prepare(model, optimizer, scheduler, loader)
    assert all(getattr(obj, "_is_accelerate_prepared", False) for obj in prepared)
    again = accelerator.prepare(*prepared)
    assert all(a is b for a, b in zip(again, prepared))
    assert [
        len(x)
        for x in (accelerator._models, accelerator._optimizers, accelerator._schedulers, accelerator._dataloaders)
    ] == [1, 1, 1, 1]
    accelerator.free_memory()
    # As in Accelerate, an object prepared before is tracked again, not wrapped a second time.
    assert (
        accelerator.prepare_data_loader(prepared[3]) is prepared[3]
        and accelerator.prepare_optimizer(prepared[1]) is prepared[1]
    )
    assert accelerator.prepare(prepared[0], prepared[2]) == (prepared[0], prepared[2])
    assert (accelerator._models, accelerator._optimizers, accelerator._schedulers, accelerator._dataloaders) == (
        [prepared[0]],
        [prepared[1]],
        [prepared[2]],
        [prepared[3]],
    )


def test_a_missing_state_attribute_is_a_plain_attribute_error_and_a_reset_state_says_why():
    from hasten.state import AcceleratorState

    accelerator = Accelerator(cpu=True)
    for state, name in ((PartialState(), "PartialState"), (accelerator.state, "AcceleratorState")):
        with pytest.raises(AttributeError, match=f"^'{name}' object has no attribute 'someotherthing'$"):
            _ = state.someotherthing
    AcceleratorState._reset_state()
    with pytest.raises(
        AttributeError,
        match=(
            r"`AcceleratorState` object has no attribute `num_processes`.*This happens if "
            r"`AcceleratorState._reset_state\(\)`"
        ),
    ):
        _ = accelerator.state.num_processes
    PartialState._reset_state()
    with pytest.raises(
        AttributeError,
        match=(
            r"`PartialState` object has no attribute `num_processes`.*This happens if `PartialState._reset_state\(\)`"
        ),
    ):
        _ = PartialState.__new__(PartialState).num_processes
