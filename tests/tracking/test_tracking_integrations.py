"""Comet, Aim, ClearML, DVCLive, Trackio and SwanLab trackers, driven through TrackerHub.

None of these packages is installed here (each pulls a large dependency tree: dvc, gradio, the
ClearML and Comet SDKs...), so each test injects a small fake module into ``sys.modules`` that
records the calls the tracker makes; the calls and their arguments are what each package documents.
"""

from __future__ import annotations

import importlib.machinery
import inspect
import sys
import types

import pytest
import torch

from hasten.errors import MissingDependencyError
from hasten.tracking import (
    LOGGER_TYPE_TO_CLASS,
    AimTracker,
    ClearMLTracker,
    CometMLTracker,
    DVCLiveTracker,
    SwanLabTracker,
    TrackerHub,
    TrackioTracker,
    filter_trackers,
    get_available_trackers,
)


class Recorder:
    """Records every method call (``calls`` is shared) and answers from ``returns``."""

    def __init__(self, calls: list, label: str, returns: dict | None = None):
        self.__dict__.update(_calls=calls, _label=label, _returns=returns or {})

    def __getattr__(self, name):
        def call(*args, **kwargs):
            self._calls.append((f"{self._label}.{name}", args, kwargs))
            return self._returns.get(name)

        return call

    def __setitem__(self, key, value):
        self._calls.append((f"{self._label}[{key!r}]", (value,), {}))


def fake(monkeypatch, name: str, **attributes) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None)
    module.__dict__.update(attributes)
    monkeypatch.setitem(sys.modules, name, module)
    return module


def drive(name: str, tmp_path, init_kwargs=None):
    hub = TrackerHub([name], tmp_path)
    hub.init("proj", config={"lr": 0.1}, init_kwargs={name: init_kwargs or {}})
    hub.log({"loss": torch.tensor(0.5), "note": "hi", "pair": {"a": 1.0}}, step=3)
    tracker = hub.get(name)
    hub.finish()
    return tracker


def test_comet_ml(monkeypatch, tmp_path):
    calls: list = []
    experiment = Recorder(calls, "exp")
    fake(monkeypatch, "comet_ml", start=lambda **kw: calls.append(("comet_ml.start", (), kw)) or experiment)
    tracker = drive("comet_ml", tmp_path, {"workspace": "w"})
    assert tracker.tracker is experiment
    assert calls == [
        ("comet_ml.start", (), {"project_name": "proj", "workspace": "w"}),
        ("exp.log_parameters", ({"lr": 0.1},), {}),
        ("exp.set_step", (3,), {}),
        ("exp.log_metric", ("loss", 0.5), {"step": 3}),
        ("exp.log_other", ("note", "hi"), {}),
        ("exp.log_metrics", ({"a": 1.0},), {"step": 3}),
        ("exp.end", (), {}),
    ]


def test_aim_uses_the_logging_directory_as_repository(monkeypatch, tmp_path):
    calls: list = []

    def run(**kwargs):
        calls.append(("aim.Run", (), kwargs))
        return Recorder(calls, "run")

    fake(monkeypatch, "aim", Run=run)
    tracker = drive("aim", tmp_path)
    assert tracker.tracker.name == "proj"
    assert calls == [
        ("aim.Run", (), {"repo": str(tmp_path)}),
        ("run['hparams']", ({"lr": 0.1},), {}),
        ("run.track", (0.5,), {"name": "loss", "step": 3}),
        ("run.track", ("hi",), {"name": "note", "step": 3}),
        ("run.track", ({"a": 1.0},), {"name": "pair", "step": 3}),
        ("run.close", (), {}),
    ]


def test_clearml_reports_series_and_closes_only_its_own_task(monkeypatch, tmp_path):
    calls: list = []
    reporter = Recorder(calls, "logger")
    task = Recorder(calls, "task", {"get_logger": reporter})

    class Task:
        current = None

        @classmethod
        def current_task(cls):
            return cls.current

        @staticmethod
        def init(**kwargs):
            calls.append(("Task.init", (), kwargs))
            return task

    fake(monkeypatch, "clearml", Task=Task)
    monkeypatch.setenv("CLEARML_TASK", "from-env")
    with pytest.warns(UserWarning, match="'clearml' tracker cannot log 'note'"):
        drive("clearml", tmp_path)
    assert calls[0] == ("Task.init", (), {"project_name": "proj", "task_name": "from-env"})
    assert ("logger.report_scalar", (), {"title": "loss", "series": "train", "value": 0.5, "iteration": 3}) in calls
    assert calls[-1] == ("task.close", (), {})
    calls.clear()
    Task.current = task  # started by the user: reused, and left open
    hub = TrackerHub(["clearml"], tmp_path)
    hub.init("proj")
    hub.get("clearml").log({"eval_acc": 0.9})
    hub.finish()
    assert calls == [
        ("task.get_logger", (), {}),
        ("logger.report_single_value", (), {"name": "eval_acc", "value": 0.9}),
    ]


def test_dvclive_logs_a_step_per_call(monkeypatch, tmp_path):
    calls: list = []
    live = Recorder(calls, "live")
    fake(monkeypatch, "dvclive", Live=lambda **kw: calls.append(("Live", (), kw)) or live)
    fake(monkeypatch, "dvclive.plots", Metric=types.SimpleNamespace(could_log=lambda v: isinstance(v, (int, float))))
    with pytest.warns(UserWarning, match="'dvclive' tracker cannot log 'note'"):
        tracker = drive("dvclive", tmp_path, {"dir": "out"})
    assert tracker.tracker is live and live.step == 3
    assert calls == [
        ("Live", (), {"dir": "out"}),
        ("live.log_params", ({"lr": 0.1},), {}),
        ("live.log_metric", ("loss", 0.5), {}),
        ("live.next_step", (), {}),
        ("live.end", (), {}),
    ]


@pytest.mark.parametrize("package", ["trackio", "swanlab"])
def test_trackio_and_swanlab(monkeypatch, tmp_path, package):
    calls: list = []
    run = Recorder(calls, "run")
    config = Recorder(calls, "config")
    fake(monkeypatch, package, init=lambda **kw: calls.append((f"{package}.init", (), kw)) or run, config=config)
    drive(package, tmp_path, {"mode": "offline"})
    assert calls == [
        (f"{package}.init", (), {"project": "proj", "mode": "offline"}),
        ("config.update", ({"lr": 0.1},), {"allow_val_change": True}),
        ("run.log", ({"loss": 0.5, "note": "hi", "pair": {"a": 1.0}},), {"step": 3}),
        ("run.finish", (), {}),
    ]


def test_missing_packages_name_the_pip_command_and_all_skips_them(tmp_path):
    for name in ("aim", "comet_ml", "clearml", "dvclive", "trackio", "swanlab"):
        with pytest.raises(MissingDependencyError, match=rf"The {name!r} tracker .*pip install {name}"):
            filter_trackers(name, tmp_path)
    assert not {"aim", "comet_ml", "clearml", "dvclive", "trackio", "swanlab"} & {
        str(t) for t in get_available_trackers()
    }


def test_constructors_take_accelerates_arguments():
    signatures = {
        cls: str(inspect.signature(cls))
        for cls in (CometMLTracker, AimTracker, ClearMLTracker, DVCLiveTracker, TrackioTracker, SwanLabTracker)
    }
    assert signatures == {
        CometMLTracker: "(run_name: 'str', **kwargs)",
        AimTracker: "(run_name: 'str', logging_dir: 'str | os.PathLike | None' = '.', **kwargs)",
        ClearMLTracker: "(run_name: 'str | None' = None, **kwargs)",
        DVCLiveTracker: "(run_name: 'str | None' = None, live: 'Any | None' = None, **kwargs)",
        TrackioTracker: "(run_name: 'str', **kwargs)",
        SwanLabTracker: "(run_name: 'str', **kwargs)",
    }
    assert all(LOGGER_TYPE_TO_CLASS[cls.name] is cls for cls in signatures)
