"""The registration of the DDP engine: several processes, each with the whole model; the device decides the
distributed type (MULTI_CPU over gloo, MULTI_GPU over NCCL, MULTI_XPU). It takes the N-D layout
(``parallelism_config``) for sequence parallelism, and is chosen by a layout that only splits sequences."""

from __future__ import annotations

from ...settings.engines import Argument, Engine
from ...settings.parallelism import PARALLELISM, splits_sequences_only

ENGINE = Engine(
    name="ddp",
    strategy="hasten.strategies.ddp.strategy:DDPStrategy",
    distributed_types=("MULTI_CPU", "MULTI_GPU", "MULTI_XPU"),
    arguments=(
        Argument(
            "parallelism_config",
            "hasten.runtime.parallelism:ParallelismConfig",
            PARALLELISM,
            from_launch=True,
            layout=splits_sequences_only,
        ),
    ),
    fallback="several",
)
