import os

import pytest

import hasten.state


@pytest.fixture(autouse=True)
def _fresh_state(monkeypatch):
    """Every test starts with no hasten state and no launcher variables, and leaves none behind."""
    for key in list(os.environ):
        if key.startswith(("HASTEN_", "ACCELERATE_", "OMPI_COMM_WORLD", "PMI_", "PMIX_", "SLURM_", "MV2_")) or key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            monkeypatch.delenv(key, raising=False)
    hasten.state.reset_state(destroy_process_group=True)
    yield
    hasten.state.reset_state(destroy_process_group=True)
