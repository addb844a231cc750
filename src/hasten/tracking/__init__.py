"""Experiment trackers behind one interface: TensorBoard, JSON lines, Weights & Biases, MLflow, and your own.

``Accelerator(log_with=...)`` picks them; ``init_trackers``, ``log``, ``get_tracker`` and
``end_training`` drive them through a :class:`TrackerHub`. Tracker packages (tensorboard, wandb,
mlflow) are imported only when a tracker starts, never by ``import hasten``. See ``docs/tracking.md``.
"""

from .base import BlankTracker, GeneralTracker, TrackerDefinitionError, on_main_process
from .hub import TrackerHub
from .jsonl_tracker import JSONLTracker
from .mlflow_tracker import MLflowTracker
from .registry import LOGGER_TYPE_TO_CLASS, filter_trackers, get_available_trackers, register_tracker_class
from .tensorboard_tracker import TensorBoardTracker
from .values import sanitize_config
from .wandb_tracker import WandBTracker

__all__ = [
    "BlankTracker",
    "GeneralTracker",
    "JSONLTracker",
    "LOGGER_TYPE_TO_CLASS",
    "MLflowTracker",
    "TensorBoardTracker",
    "TrackerDefinitionError",
    "TrackerHub",
    "WandBTracker",
    "filter_trackers",
    "get_available_trackers",
    "on_main_process",
    "register_tracker_class",
    "sanitize_config",
]
