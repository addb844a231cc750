"""The checkpoint tests' fixture: no asynchronous save of one test is still writing when the next begins (the
suite's own fixture, tests/conftest.py, gives each test a fresh state and environment)."""

import pytest

from hasten.checkpointing import wait_for_pending_save


@pytest.fixture(autouse=True)
def _no_pending_save():
    yield
    wait_for_pending_save()
