"""A dependency-free tracker writing one JSON object per ``log`` call (JSON Lines)."""

from __future__ import annotations

import json
import os
import time

from ._common import SkipReporter, as_step, write_json_atomically
from .base import GeneralTracker, on_main_process
from .values import sanitize_config, tensors_to_numbers, to_json_compatible

METRICS_FILE = "metrics.jsonl"
CONFIG_FILE = "config.json"


class JSONLTracker(GeneralTracker):
    """Appends ``{"step": ..., "time": ..., "values": {...}}`` lines to ``logging_dir/run_name/metrics.jsonl``.

    Needs no package. ``time`` is the wall-clock time (seconds since the epoch) of the call. The file
    is opened in append mode, so a resumed run continues the same file, and it is flushed after every
    line, so a crash loses nothing that was logged. ``store_init_configuration`` writes
    ``config.json`` beside it (atomically). Values that JSON cannot hold are skipped with one warning
    per name; non-finite floats are written as ``NaN`` / ``Infinity``, which Python's ``json`` and
    pandas read back.

    Read the file with ``[json.loads(line) for line in open(path)]`` or
    ``pandas.json_normalize([json.loads(line) for line in open(path)])``.

    Args:
        run_name: the project name given to ``init_trackers``; the folder of this run.
        logging_dir: the folder that holds the runs (``ProjectConfiguration.logging_dir``).
        fsync: also ``os.fsync`` after every line (survives a machine crash; slower).
    """

    name = "jsonl"
    requires_logging_directory = True

    def __init__(self, run_name: str, logging_dir: str | os.PathLike, fsync: bool = False):
        super().__init__()
        self.run_name = run_name
        self.logging_dir = os.path.join(os.fspath(logging_dir), run_name)
        self.metrics_path = os.path.join(self.logging_dir, METRICS_FILE)
        self.config_path = os.path.join(self.logging_dir, CONFIG_FILE)
        self.fsync = fsync
        self.file = None
        self._skips = SkipReporter(self.name, "JSON-compatible data (numbers, strings, lists, dicts)")

    @property
    def tracker(self):
        """The open metrics file (``None`` before ``start`` and after ``finish``)."""
        return self.file

    @on_main_process
    def start(self) -> None:
        """Create the run folder and open ``metrics.jsonl`` for appending."""
        os.makedirs(self.logging_dir, exist_ok=True)
        self.file = open(self.metrics_path, "a", encoding="utf-8")

    @on_main_process
    def store_init_configuration(self, values: dict) -> None:
        """Write the configuration to ``config.json`` beside the metrics."""
        write_json_atomically(self.config_path, sanitize_config(values))

    @on_main_process
    def log(self, values: dict, step: int | None = None, **kwargs) -> None:
        """Append one line with ``step``, the current time and ``values``, then flush.

        Args:
            values: name -> JSON-compatible value (one-element tensors become numbers).
            step: the step the values belong to (``null`` in the file when not given).
            **kwargs: not used by this tracker.
        """
        record = {}
        for key, value in tensors_to_numbers(values).items():
            converted, dropped = to_json_compatible(value, key)
            if dropped:
                self._skips.skip(key, value)
            else:
                record[str(key)] = converted
        line = json.dumps({"step": as_step(step), "time": time.time(), "values": record})
        self.file.write(line + "\n")
        self.file.flush()
        if self.fsync:
            os.fsync(self.file.fileno())

    @on_main_process
    def finish(self) -> None:
        """Flush, sync to disk and close the metrics file."""
        if self.file is not None:
            self.file.flush()
            os.fsync(self.file.fileno())
            self.file.close()
            self.file = None
