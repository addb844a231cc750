"""The DDP strategy: the strategy contract (tests/strategies/contract.py) on a one-process gloo group, and its own
checks. Real gradient reduction over two processes is checked by the launches of tests/runtime/test_distributed.py
and tests/compat/test_differential_loop.py."""

import pytest
import torch
import torch.distributed as dist
from strategies.contract import Answers, StrategyContract
from torch.nn.parallel import DistributedDataParallel

from hasten import Accelerator, DistributedDataParallelKwargs, ParallelismConfig
from hasten.enums import DistributedType
from hasten.errors import NotSupportedError


@pytest.fixture(autouse=True)
def _one_process_group():
    """The group :func:`_ddp` starts is the test's, not hasten's: ended after the test."""
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def _ddp(tmp_path, **kwargs) -> Accelerator:
    """An Accelerator training with DDP on this one process, in a gloo group of one (a file rendezvous: no port)."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    return Accelerator(cpu=True, strategy="ddp", **kwargs)


class TestDDPContract(StrategyContract):
    # One process is labelled NO, as in Accelerate, and so has no uneven inputs to join (MULTI_CPU and True on two,
    # checked by test_a_relabelled_job_does_not_join_uneven_inputs's counterpart in the launches).
    ANSWERS = Answers(
        distributed_type=DistributedType.NO,
        replicates_model=True,
        joins_uneven_inputs=False,
        handles_optimizer_step=False,
        saves_full_state_dicts=True,
        save_needs_every_process=False,
    )

    def build(self, tmp_path, **kwargs) -> Accelerator:
        accelerator = _ddp(tmp_path, **kwargs)
        assert type(accelerator._strategy).__name__ == "DDPStrategy"
        return accelerator


def test_models_are_wrapped_in_ddp_with_the_scripts_kwargs(tmp_path):
    accelerator = _ddp(tmp_path, kwargs_handlers=[DistributedDataParallelKwargs(bucket_cap_mb=1)])
    model = torch.nn.Linear(2, 2)
    prepared = accelerator.prepare(model)
    assert isinstance(prepared, DistributedDataParallel) and prepared.module is model
    assert prepared.bucket_bytes_cap == 1024 * 1024


def test_models_without_trainable_parameters_and_evaluated_models_stay_unwrapped(tmp_path):
    accelerator = _ddp(tmp_path)
    frozen = torch.nn.Linear(2, 2).requires_grad_(False)
    assert accelerator.prepare(frozen) is frozen
    evaluated = torch.nn.Linear(2, 2)
    assert accelerator.prepare_model(evaluated, evaluation_mode=True) is evaluated


def test_only_jobs_labelled_ddp_join_uneven_inputs(tmp_path):
    accelerator = _ddp(tmp_path)
    accelerator.state.distributed_type = DistributedType.MULTI_CPU
    assert accelerator._strategy.joins_uneven_inputs is True
    accelerator.state.distributed_type = DistributedType.FSDP
    assert accelerator._strategy.joins_uneven_inputs is False


def test_a_layout_that_shards_is_refused_naming_fsdp(tmp_path):
    with pytest.raises(NotSupportedError, match=r"ParallelismConfig\(tp_size=2\) under DDP: DDP replicates whole"):
        _ddp(tmp_path, parallelism_config=ParallelismConfig(tp_size=2))
