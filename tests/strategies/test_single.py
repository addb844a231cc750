"""The single-device strategy: one process, nothing distributed. The strategy contract (tests/strategies/contract.py)
on the CPU."""

from strategies.contract import Answers, StrategyContract

from hasten import Accelerator
from hasten.enums import DistributedType


class TestSingleDeviceContract(StrategyContract):
    ANSWERS = Answers(
        distributed_type=DistributedType.NO,
        replicates_model=True,
        joins_uneven_inputs=None,
        handles_optimizer_step=False,
        saves_full_state_dicts=True,
        save_needs_every_process=False,
    )

    def build(self, tmp_path, **kwargs) -> Accelerator:
        accelerator = Accelerator(cpu=True, **kwargs)
        assert type(accelerator._strategy).__name__ == "SingleDeviceStrategy"
        return accelerator
