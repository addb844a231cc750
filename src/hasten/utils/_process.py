"""Process helpers exposed under ``hasten.utils``."""

from __future__ import annotations


def wait_for_everyone() -> None:
    """Barrier across all processes of the job (creates the process state if needed)."""
    from ..state import PartialState

    PartialState().wait_for_everyone()
