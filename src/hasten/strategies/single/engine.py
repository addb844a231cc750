"""The registration of the single-device engine: one process, nothing to distribute."""

from __future__ import annotations

from ...settings.engines import Engine

ENGINE = Engine(
    name="single",
    strategy="hasten.strategies.single.strategy:SingleDeviceStrategy",
    distributed_types=("NO",),
    fallback="one",
)
