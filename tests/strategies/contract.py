"""The contract every Strategy keeps: what the ``Accelerator`` facade relies on, checked the same way for each engine.

Each engine's test file (``tests/strategies/test_<engine>.py``) subclasses :class:`StrategyContract`, gives its
:class:`Answers` (what its strategy says to the questions the facade asks) and builds its ``Accelerator`` on this one
process (:meth:`StrategyContract.build`); pytest then runs every check below for that engine. The checks use the
public API, so each one follows the facade's path into the strategy: ``prepare`` (``setup_model``/``prepare``),
``backward`` with accumulation, ``no_sync``, ``clip_grad_norm_``, ``unwrap_model``, ``get_state_dict``, the
checkpoint files and the save/load hooks, ``gather_for_metrics``. An engine that does a step's work itself (DeepSpeed
accumulates, synchronises and clips inside its own step) leaves out the checks of that work, setting them to None
with its reason. What needs several processes (gradients reduced or not, samples gathered from every rank) is checked
by the 2-process launches: tests/runtime/test_distributed.py and the differential loops for DDP, test_fsdp.py's and
test_deepspeed.py's own.

``tests/strategies/test_registry.py`` checks that every built-in engine has such a subclass.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from hasten import Accelerator
from hasten.enums import DistributedType


@dataclasses.dataclass(frozen=True)
class Answers:
    """What an engine's strategy answers to the facade's questions (see :class:`hasten.strategies.base.Strategy`)."""

    distributed_type: DistributedType
    replicates_model: bool
    joins_uneven_inputs: bool | None
    handles_optimizer_step: bool
    saves_full_state_dicts: bool
    save_needs_every_process: bool


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def _batches(count: int = 2, size: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    draw = functools.partial(torch.randn, generator=generator)
    return [(draw(size, 4), draw(size, 2)) for _ in range(count)]


def _loader(batches) -> DataLoader:
    inputs = torch.cat([x for x, _ in batches])
    targets = torch.cat([y for _, y in batches])
    return DataLoader(TensorDataset(inputs, targets), batch_size=len(batches[0][0]))


def _loss(model, batch) -> torch.Tensor:
    inputs, targets = batch
    return torch.nn.functional.mse_loss(model(inputs), targets)


def _plain_torch_step(batches, lr: float) -> dict[str, torch.Tensor]:
    """The weights after one SGD step on the mean of ``batches``' losses, in plain torch."""
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    (sum(_loss(model, batch) for batch in batches) / len(batches)).backward()
    optimizer.step()
    return {name: value.detach().clone() for name, value in model.state_dict().items()}


def _weights(accelerator: Accelerator, model) -> dict[str, torch.Tensor]:
    state = accelerator.get_state_dict(model)
    return {name: value.detach().to("cpu", torch.float32, copy=True) for name, value in state.items()}


def _assert_close(actual: dict, expected: dict) -> None:
    assert actual.keys() == expected.keys(), (sorted(actual), sorted(expected))
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], msg=lambda text, name=name: f"{name}: {text}")


class StrategyContract:
    """The checks every engine passes; a subclass per engine sets :attr:`ANSWERS` and overrides :meth:`build`."""

    ANSWERS: Answers

    def build(self, tmp_path, **kwargs) -> Accelerator:
        """An ``Accelerator`` running this engine on this one process, with ``kwargs``."""
        raise NotImplementedError

    @pytest.fixture
    def make(self, tmp_path):
        return lambda **kwargs: self.build(tmp_path, **kwargs)

    def _prepared(self, make, **kwargs):
        """The model and an SGD optimizer (lr 0.1) prepared with a loader of 4-sample batches, in one call (DeepSpeed
        reads its batch size from the loader)."""
        accelerator = make(**kwargs)
        model = _model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        prepared, optimizer, _ = accelerator.prepare(model, optimizer, _loader(_batches(2)))
        return accelerator, model, prepared, optimizer

    def test_answers_the_facades_questions(self, make):
        accelerator = make()
        strategy = accelerator._strategy
        answers = Answers(
            distributed_type=accelerator.distributed_type,
            replicates_model=accelerator.replicates_model,
            joins_uneven_inputs=strategy.joins_uneven_inputs,
            handles_optimizer_step=strategy.handles_optimizer_step,
            saves_full_state_dicts=strategy.saves_full_state_dicts,
            save_needs_every_process=strategy.save_needs_every_process,
        )
        assert answers == self.ANSWERS

    def test_prepare_places_the_model_and_unwrap_gives_it_back(self, make):
        accelerator, model, prepared, _ = self._prepared(make)
        assert accelerator.unwrap_model(prepared) is model
        assert all(p.device.type == accelerator.device.type for p in prepared.parameters())

    def test_the_state_dict_holds_the_models_own_names_and_values(self, make):
        accelerator, model, prepared, _ = self._prepared(make)
        _assert_close(_weights(accelerator, prepared), dict(_model().state_dict()))

    def test_a_step_trains_as_plain_torch_does(self, make):
        (batch,) = _batches(1)
        accelerator, _, prepared, optimizer = self._prepared(make)
        accelerator.backward(_loss(prepared, batch))
        optimizer.step()
        optimizer.zero_grad()
        _assert_close(_weights(accelerator, prepared), _plain_torch_step([batch], lr=0.1))

    def test_accumulated_micro_batches_step_once_on_their_mean(self, make):
        batches = _batches(2)
        accelerator, _, prepared, optimizer = self._prepared(make, gradient_accumulation_steps=2)
        for batch in batches:
            with accelerator.accumulate(prepared):
                accelerator.backward(_loss(prepared, batch))
                optimizer.step()
                optimizer.zero_grad()
        _assert_close(_weights(accelerator, prepared), _plain_torch_step(batches, lr=0.1))

    def test_no_sync_and_sync_in_backward_accumulate_local_gradients(self, make):
        (batch,) = _batches(1)
        accelerator, _, prepared, optimizer = self._prepared(make)
        with accelerator.no_sync(prepared):
            accelerator.backward(_loss(prepared, batch) / 2)
        with accelerator.no_sync(prepared), accelerator.trigger_sync_in_backward(prepared):
            accelerator.backward(_loss(prepared, batch) / 2)
        optimizer.step()
        _assert_close(_weights(accelerator, prepared), _plain_torch_step([batch], lr=0.1))

    def test_clip_grad_norm_returns_the_norm_before_clipping(self, make):
        (batch,) = _batches(1)
        accelerator, _, prepared, _ = self._prepared(make)
        accelerator.backward(_loss(prepared, batch))
        reference = _model()
        _loss(reference, batch).backward()
        expected = torch.nn.utils.get_total_norm([p.grad for p in reference.parameters()])
        norm = accelerator.clip_grad_norm_(prepared.parameters(), max_norm=1e-3)
        torch.testing.assert_close(torch.as_tensor(norm).float().cpu(), expected)
        grads = [p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad for p in prepared.parameters()]
        assert float(torch.nn.utils.get_total_norm(grads)) <= 1e-3 * (1 + 1e-4)

    def test_save_state_and_load_state_restore_the_weights_and_call_the_hooks(self, make, tmp_path):
        (batch,) = _batches(1)
        accelerator, _, prepared, optimizer = self._prepared(make)
        saved_with, loaded_with = [], []
        accelerator.register_save_state_pre_hook(lambda models, weights, folder: saved_with.append(len(models)))
        accelerator.register_load_state_pre_hook(lambda models, folder: loaded_with.append(len(models)))
        accelerator.save_state(str(tmp_path / "checkpoint"))
        before = _weights(accelerator, prepared)
        accelerator.backward(_loss(prepared, batch))
        optimizer.step()
        assert any(not torch.equal(before[name], value) for name, value in _weights(accelerator, prepared).items())
        accelerator.load_state(str(tmp_path / "checkpoint"))
        _assert_close(_weights(accelerator, prepared), before)
        assert (saved_with, loaded_with) == ([1], [1])

    def test_gather_for_metrics_gives_every_sample_once(self, make):
        batches = _batches(3, size=4)
        accelerator, _, _, _ = self._prepared(make)
        loader = accelerator.prepare(_loader(batches))
        gathered = [accelerator.gather_for_metrics(targets) for _, targets in loader]
        torch.testing.assert_close(torch.cat(gathered), torch.cat([y for _, y in batches]))
