"""The registration of the DDP engine: several processes, each with the whole model; the device decides the
distributed type (MULTI_CPU over gloo, MULTI_GPU over NCCL, MULTI_XPU)."""

from __future__ import annotations

from ...settings.engines import Engine

ENGINE = Engine(
    name="ddp",
    strategy="hasten.strategies.ddp.strategy:DDPStrategy",
    distributed_types=("MULTI_CPU", "MULTI_GPU", "MULTI_XPU"),
    fallback="several",
)
