"""Experiment trackers behind one interface: TensorBoard, JSON lines, Weights & Biases, MLflow, Comet, Aim,
ClearML, DVCLive, Trackio, SwanLab, and your own.

``Accelerator(log_with=...)`` picks them; ``init_trackers``, ``log``, ``get_tracker`` and
``end_training`` drive them through a :class:`TrackerHub`. Tracker packages are imported only when a
tracker starts, never by ``import hasten``. See ``docs/tracking.md``.
"""

from .aim_tracker import AimTracker
from .base import BlankTracker, GeneralTracker, TrackerDefinitionError, on_main_process
from .clearml_tracker import ClearMLTracker
from .comet_tracker import CometMLTracker
from .dvclive_tracker import DVCLiveTracker
from .hub import TrackerHub
from .jsonl_tracker import JSONLTracker
from .mlflow_tracker import MLflowTracker
from .registry import LOGGER_TYPE_TO_CLASS, filter_trackers, get_available_trackers, register_tracker_class
from .swanlab_tracker import SwanLabTracker
from .tensorboard_tracker import TensorBoardTracker
from .trackio_tracker import TrackioTracker
from .values import sanitize_config
from .wandb_tracker import WandBTracker

__all__ = [
    "AimTracker",
    "BlankTracker",
    "ClearMLTracker",
    "CometMLTracker",
    "DVCLiveTracker",
    "GeneralTracker",
    "JSONLTracker",
    "LOGGER_TYPE_TO_CLASS",
    "MLflowTracker",
    "SwanLabTracker",
    "TensorBoardTracker",
    "TrackerDefinitionError",
    "TrackerHub",
    "TrackioTracker",
    "WandBTracker",
    "filter_trackers",
    "get_available_trackers",
    "on_main_process",
    "register_tracker_class",
    "sanitize_config",
]
