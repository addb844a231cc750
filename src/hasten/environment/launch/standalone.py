"""No launcher: a plain ``python script.py`` is the whole job, one process."""

from __future__ import annotations

from .base import LaunchEnvironment, LaunchInfo


class StandaloneEnvironment(LaunchEnvironment):
    """The process runs alone: rank 0 of a world of 1, no rendezvous. It is what remains when no launcher is
    detected, so it is the last of the detection order."""

    name = "none"

    @classmethod
    def detect(cls) -> bool:
        """Always: any process can run alone."""
        return True

    def world_size(self) -> int:
        """1."""
        return 1

    def rank(self) -> int:
        """0."""
        return 0

    def local_rank(self) -> int:
        """0."""
        return 0

    def main_address(self) -> None:
        """None: there is no one to meet."""
        return None

    def main_port(self) -> None:
        """None: there is no one to meet."""
        return None

    def prepare_rendezvous(self, info: LaunchInfo) -> None:
        """Nothing: a process alone meets no one (the group an engine may need is its own, on a local store)."""
