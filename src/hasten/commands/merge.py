"""Accelerate's ``accelerate.commands.merge`` path: ``merge_command`` and ``merge_command_parser`` of
``hasten merge-weights`` (the code lives in :mod:`hasten.commands.merge_weights`)."""

from .merge_weights import merge_command, merge_command_parser

__all__ = ["merge_command", "merge_command_parser"]
