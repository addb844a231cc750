"""Experiment trackers: TensorBoard and JSON-lines files read back, config conversion, errors, custom trackers,
2 processes."""

from __future__ import annotations

import dataclasses
import enum
import glob
import json
import os
import pathlib
import struct
import subprocess
import sys
from collections import Counter

import numpy as np
import pytest
import torch
from helpers import SCRIPTS, free_port, read_scalars, requires

from hasten.enums import LoggerType
from hasten.errors import ConfigError, HastenError, MissingDependencyError
from hasten.tracking import (
    LOGGER_TYPE_TO_CLASS,
    BlankTracker,
    GeneralTracker,
    JSONLTracker,
    TensorBoardTracker,
    TrackerDefinitionError,
    TrackerHub,
    WandBTracker,
    filter_trackers,
    get_available_trackers,
    on_main_process,
    register_tracker_class,
    sanitize_config,
)
from hasten.tracking.values import tensors_to_numbers

# ----------------------------------------------------------------------------------- helpers


def read_tagged(run_dir, plugin: str) -> list:
    """(tag, step, value proto) of every summary of ``plugin`` in the run's own event files."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    found = []
    for path in glob.glob(os.path.join(run_dir, "events.out.tfevents.*")):
        for event in EventFileLoader(path).Load():
            found += [
                (v.tag, event.step, v) for v in event.summary.value if v.metadata.plugin_data.plugin_name == plugin
            ]
    return found


def read_jsonl(path) -> list[dict]:
    with open(path, encoding="utf-8") as handle:
        return [json.loads(line) for line in handle]


def f32(value: float) -> float:
    """What TensorBoard stores for ``value`` (a float32)."""
    return float(np.float32(value))


class Color(enum.Enum):
    RED = "red"


@dataclasses.dataclass
class OptimizerConfig:
    lr: float = 0.5
    betas: tuple = (0.9, 0.99)


class RecordingTracker(GeneralTracker):
    """Remembers every call, for checking what the hub sends."""

    name = "recording"
    requires_logging_directory = False

    def __init__(self, run_name: str = "direct", **kwargs):
        super().__init__()
        self.run_name, self.init_kwargs = run_name, kwargs
        self.calls: list = []

    @property
    def tracker(self):
        return self.calls

    def start(self):
        self.calls.append(("start",))

    def store_init_configuration(self, values):
        self.calls.append(("config", values))

    def log(self, values, step=None, **kwargs):
        self.calls.append(("log", values, step, kwargs))

    def finish(self):
        self.calls.append(("finish",))


@pytest.fixture
def no_optional_trackers(monkeypatch):
    """Make wandb and mlflow look absent, whether or not they are installed."""
    monkeypatch.setitem(sys.modules, "wandb", None)
    monkeypatch.setitem(sys.modules, "mlflow", None)


@pytest.fixture
def restore_registry():
    saved = dict(LOGGER_TYPE_TO_CLASS)
    yield
    LOGGER_TYPE_TO_CLASS.clear()
    LOGGER_TYPE_TO_CLASS.update(saved)


# ----------------------------------------------------------------------------------- built-in trackers


def test_tensorboard_writes_each_scalar_once_with_its_step(tmp_path):
    hub = TrackerHub("tensorboard", tmp_path)
    hub.init("run", config={"lr": torch.tensor(0.125), "layers": [2, 3], "optim": {"name": "adam"}})
    for step in range(4):
        hub.log(
            {
                "loss": torch.tensor(1.0 / (step + 1)),
                "epoch": step // 2,
                "note": f"s{step}",
                "lr": {"a": 0.1 * step, "b": step},
            },
            step=step,
        )
    hub.finish()

    scalars = read_scalars(tmp_path / "run")
    counts = Counter((tag, step) for tag, step, _ in scalars)
    assert set(counts.values()) == {1}
    expected = {}
    for step in range(4):
        expected[("loss", step)] = f32(1.0 / (step + 1))
        expected[("epoch", step)] = float(step // 2)
        expected[("lr_a:lr", step)] = f32(0.1 * step)
        expected[("lr_b:lr", step)] = float(step)
    assert {(tag, step): value for tag, step, value in scalars} == expected
    texts = sorted((tag, step) for tag, step, _ in read_tagged(tmp_path / "run", "text"))
    assert texts == [("note/text_summary", step) for step in range(4)]


def test_tensorboard_config_goes_to_hparams_and_yaml(tmp_path):
    from tensorboard.plugins.hparams import plugin_data_pb2

    hub = TrackerHub("tensorboard", tmp_path)
    hub.init("run", config={"lr": torch.tensor(0.125), "layers": [2, 3], "optim": {"name": "adam"}, "none": None})
    hub.finish()
    (start,) = [v for tag, _, v in read_tagged(tmp_path / "run", "hparams") if tag == "_hparams_/session_start_info"]
    hparams = plugin_data_pb2.HParamsPluginData.FromString(
        start.metadata.plugin_data.content
    ).session_start_info.hparams
    assert hparams["lr"].number_value == 0.125
    assert hparams["layers"].string_value == "[2, 3]"
    assert hparams["optim/name"].string_value == "adam"
    assert "none" not in hparams
    import yaml

    with open(tmp_path / "run" / "hparams.yml", encoding="utf-8") as handle:
        assert yaml.safe_load(handle) == {"lr": 0.125, "layers": [2, 3], "optim": {"name": "adam"}, "none": None}


def test_tensorboard_skips_unloggable_values_with_one_warning(tmp_path):
    hub = TrackerHub("tensorboard", tmp_path)
    hub.init("run")
    with pytest.warns(
        UserWarning, match=r"The 'tensorboard' tracker cannot log 'weights' of type Tensor: it expects a number"
    ):
        hub.log({"weights": torch.zeros(3), "loss": 1.0}, step=0)
    hub.log({"weights": torch.zeros(3), "loss": 2.0}, step=1)  # the same key is not reported again
    hub.finish()
    assert [(tag, step) for tag, step, _ in read_scalars(tmp_path / "run")] == [("loss", 0), ("loss", 1)]


def test_tensorboard_tracker_used_directly(tmp_path):
    tracker = TensorBoardTracker("direct", tmp_path, flush_secs=1)
    assert tracker.tracker is None and tracker.logging_dir == os.path.join(str(tmp_path), "direct")
    tracker.start()
    tracker.log_images({"samples": np.zeros((2, 3, 4, 4), dtype=np.float32)}, step=7)
    tracker.log({"loss": np.float32(0.5)}, step=np.int64(8))
    assert type(tracker.tracker).__name__ == "SummaryWriter"
    tracker.finish()
    assert [(tag, step) for tag, step, _ in read_tagged(tmp_path / "direct", "images")] == [("samples", 7)]
    assert read_scalars(tmp_path / "direct") == [("loss", 8, 0.5)]


def test_jsonl_lines_config_and_append_on_resume(tmp_path):
    hub = TrackerHub("jsonl", tmp_path)
    hub.init("run", config={"lr": 0.5, "path": pathlib.Path("/data")})
    hub.log({"loss": torch.tensor(0.5), "tag": "a", "group": {"x": torch.tensor(2)}}, step=1)
    metrics = tmp_path / "run" / "metrics.jsonl"
    assert [line["values"] for line in read_jsonl(metrics)] == [{"loss": 0.5, "tag": "a", "group": {"x": 2}}]  # flushed
    hub.log({"loss": 0.25}, step=torch.tensor(2))
    hub.finish()
    assert json.loads((tmp_path / "run" / "config.json").read_text()) == {"lr": 0.5, "path": "/data"}

    resumed = TrackerHub(JSONLTracker("run", tmp_path), None)
    resumed.init("ignored-for-instances")
    resumed.log({"loss": 0.125}, step=3)
    resumed.finish()
    lines = read_jsonl(metrics)
    assert [(line["step"], line["values"]["loss"]) for line in lines] == [(1, 0.5), (2, 0.25), (3, 0.125)]
    assert all(isinstance(line["time"], float) for line in lines)
    assert lines[0]["time"] <= lines[1]["time"] <= lines[2]["time"]


def test_jsonl_step_none_and_unserialisable_value(tmp_path):
    tracker = JSONLTracker("run", tmp_path, fsync=True)
    tracker.start()
    with pytest.warns(UserWarning, match=r"The 'jsonl' tracker cannot log 'model' of type Linear"):
        tracker.log({"model": torch.nn.Linear(1, 1), "ok": Color.RED})
    tracker.finish()
    assert tracker.tracker is None
    (line,) = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert (line["step"], line["values"]) == (None, {"ok": "red"})


# ----------------------------------------------------------------------------------- value conversion


def test_sanitize_config_converts_and_reports_in_one_warning():
    config = {
        "scalar": torch.tensor(3),
        "small": torch.tensor([1.5, 2.5]),
        "array": np.arange(3),
        "np_float": np.float32(0.5),
        "path": pathlib.Path("/tmp/x"),
        "color": Color.RED,
        "logger": LoggerType.WANDB,
        "optim": OptimizerConfig(),
        "activation": json.dumps,
        "cls": torch.nn.Linear,
        "dtype": torch.bfloat16,
        "nested": {"deep": {"value": 1, "bad": object()}, 3: "int key"},
        "items": ["a", pathlib.Path("b"), {"c": 1}],
        "handle": object(),
        "big": torch.zeros(2000),
    }
    config["self"] = config
    with pytest.warns(UserWarning) as record:
        out = sanitize_config(config)
    assert len(record) == 1
    assert str(record[0].message) == (
        "These configuration values cannot be stored by the trackers and were left out: nested.deep.bad (object), "
        "handle (object), big (Tensor with 2000 elements; at most 1024 are stored), self (refers to itself). "
        "Convert them to numbers, strings, lists or dicts to record them."
    )
    assert out == {
        "scalar": 3,
        "small": [1.5, 2.5],
        "array": [0, 1, 2],
        "np_float": 0.5,
        "path": "/tmp/x",
        "color": "red",
        "logger": "wandb",
        "optim": {"lr": 0.5, "betas": [0.9, 0.99]},
        "activation": "json.dumps",
        "cls": "torch.nn.modules.linear.Linear",
        "dtype": "torch.bfloat16",
        "nested": {"deep": {"value": 1}, "3": "int key"},
        "items": ["a", "b", {"c": 1}],
    }
    assert type(out["np_float"]) is float and type(out["scalar"]) is int
    json.dumps(out)


def test_sanitize_config_rejects_non_mapping():
    with pytest.raises(
        ConfigError,
        match=r"init_trackers\(config=...\) must be a dict \(or a dataclass / argparse.Namespace\), got list",
    ):
        sanitize_config([1, 2])
    import argparse

    assert sanitize_config(argparse.Namespace(lr=0.1, out=pathlib.Path("o"))) == {"lr": 0.1, "out": "o"}


def test_tensors_to_numbers_copies_and_groups():
    values = {
        "a": torch.tensor(1.5),
        "b": torch.tensor([2.5]),
        "c": torch.tensor(3),
        "d": {"e": torch.tensor(0.25)},
        "v": torch.ones(2),
        "s": "x",
    }
    out = tensors_to_numbers(values)
    assert out["a"] == 1.5 and out["b"] == 2.5 and out["c"] == 3 and out["d"] == {"e": 0.25} and out["s"] == "x"
    assert type(out["c"]) is int and out["v"] is values["v"]
    assert isinstance(values["a"], torch.Tensor) and isinstance(values["d"]["e"], torch.Tensor)  # input untouched


# ----------------------------------------------------------------------------------- choosing trackers


def test_missing_package_is_an_error_with_the_pip_command(tmp_path, no_optional_trackers, monkeypatch):
    with pytest.raises(MissingDependencyError) as raised:
        filter_trackers(["jsonl", "wandb"], tmp_path)
    assert str(raised.value) == (
        "The 'wandb' tracker (log_with='wandb') needs the package 'wandb', which is not installed. "
        "Install it with: pip install wandb"
    )
    with pytest.raises(MissingDependencyError, match=r"pip install mlflow"):
        TrackerHub(LoggerType.MLFLOW)
    with pytest.raises(MissingDependencyError, match=r"The 'wandb' tracker needs the package 'wandb'"):
        WandBTracker("direct")
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    with pytest.raises(MissingDependencyError, match=r"Install it with: pip install 'hasten\[tracking\]'"):
        filter_trackers("tensorboard", tmp_path)


def test_all_means_every_installed_tracker(tmp_path, no_optional_trackers):
    # As in Accelerate: only its own trackers, so neither hasten's jsonl nor a registered custom tracker.
    assert get_available_trackers() == [LoggerType.TENSORBOARD]
    custom = RecordingTracker()
    assert filter_trackers([custom, "all"], tmp_path) == [custom, LoggerType.TENSORBOARD]
    assert filter_trackers([custom, "all", "jsonl"], tmp_path) == [custom, LoggerType.TENSORBOARD, LoggerType.JSONL]
    with pytest.raises(
        ConfigError, match=r"Logging with `tensorboard` requires a `logging_dir` to be passed in \(log_with='all'\)"
    ):
        filter_trackers("all")


def test_log_with_errors():
    assert filter_trackers(None) == []
    with pytest.raises(ConfigError, match=r"no logging directory is set. Pass Accelerator\(project_dir=...\)"):
        filter_trackers("jsonl")
    with pytest.raises(
        ConfigError, match=r"log_with='tensorbord' is not a known tracker; .* Did you mean 'tensorboard'\?"
    ):
        filter_trackers("tensorbord")
    with pytest.raises(
        MissingDependencyError,
        match=r"The 'comet_ml' tracker \(log_with='comet_ml'\) needs the package 'comet_ml'.*pip install comet_ml",
    ):
        filter_trackers(["comet_ml"])
    with pytest.raises(ConfigError, match=r"log_with got the class RecordingTracker; pass an instance"):
        filter_trackers(RecordingTracker)
    with pytest.raises(ConfigError, match=r"log_with entries must be tracker names or GeneralTracker instances, got 3"):
        filter_trackers([3])
    assert filter_trackers(["TensorBoard", "tensorboard"], "d") == [LoggerType.TENSORBOARD]


# ----------------------------------------------------------------------------------- custom trackers


def test_general_tracker_names_missing_attributes():
    class NoTracker(GeneralTracker):
        name = "x"
        requires_logging_directory = False

    class Nothing(GeneralTracker):
        pass

    with pytest.raises(
        TrackerDefinitionError, match=r"The tracker class NoTracker is missing `tracker`\. Every GeneralTracker"
    ):
        NoTracker()
    with pytest.raises(
        NotImplementedError, match=r"Nothing is missing `name`, `requires_logging_directory`, `tracker`"
    ):
        Nothing()
    assert isinstance(GeneralTracker(_blank=True), GeneralTracker)


def test_custom_tracker_instance_and_registration(tmp_path, restore_registry):
    instance = RecordingTracker()
    hub = TrackerHub([instance], tmp_path)
    hub.init("proj", config={"p": pathlib.Path("q")})
    hub.log({"loss": torch.tensor(2.0)}, step=5, log_kwargs={"recording": {"commit": False}})
    assert hub.get("recording") is instance and hub.get("recording", unwrap=True) is instance.calls
    hub.finish()
    assert instance.calls == [
        ("start",),
        ("config", {"p": "q"}),
        ("log", {"loss": 2.0}, 5, {"commit": False}),
        ("finish",),
    ]

    class Registered(RecordingTracker):
        name = "registered"

    assert register_tracker_class(Registered) is Registered
    assert "registered" not in get_available_trackers() and "registered" not in filter_trackers("all", tmp_path)
    hub = TrackerHub(["registered"], tmp_path)
    hub.init("proj", init_kwargs={"registered": {"color": "blue"}})
    made = hub.get("registered")
    assert type(made) is Registered and (made.run_name, made.init_kwargs) == ("proj", {"color": "blue"})
    hub.finish()

    class Clash(RecordingTracker):
        name = "jsonl"

    from hasten.tracking.registry import LOGGER_TYPE_TO_CLASS

    jsonl = LOGGER_TYPE_TO_CLASS["jsonl"]
    try:
        with pytest.warns(
            UserWarning,
            match=r"A tracker named 'jsonl' is already registered \(hasten.tracking.jsonl_tracker.JSONLTracker\)",
        ):
            register_tracker_class(Clash)
        assert LOGGER_TYPE_TO_CLASS["jsonl"] is Clash, "as in Accelerate, the later registration wins"
    finally:
        LOGGER_TYPE_TO_CLASS["jsonl"] = jsonl

    class NoFlag(GeneralTracker):
        name = "no_flag"

    with pytest.raises(ConfigError, match="needs a class attribute `requires_logging_directory`"):
        register_tracker_class(NoFlag)
    with pytest.raises(
        ConfigError, match=r"register_tracker_class expects a subclass of hasten.tracking.GeneralTracker"
    ):
        register_tracker_class(dict)


def test_on_main_process_decorator(monkeypatch):
    class Tracker(RecordingTracker):
        @on_main_process
        def log(self, values, step=None, **kwargs):
            self.calls.append(step)

    class EveryRank(Tracker):
        main_process_only = False

    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    main_only, everywhere = Tracker(), EveryRank()
    assert main_only.log({}, step=1) is None and main_only.calls == []
    everywhere.log({}, step=1)
    assert everywhere.calls == [1]
    monkeypatch.setenv("RANK", "0")
    main_only.log({}, step=2)
    assert main_only.calls == [2]


# ----------------------------------------------------------------------------------- the hub


def test_hub_on_a_non_main_process_writes_nothing(tmp_path):
    everywhere = RecordingTracker()
    everywhere.main_process_only = False
    hub = TrackerHub(["tensorboard", "jsonl", everywhere], tmp_path, is_main_process=False)
    hub.log({"before": 1})  # before init: no error on non-main ranks (scripts often init on rank 0 only)
    hub.init("run", config={"a": 1})
    hub.log({"loss": torch.tensor(1.0)}, step=0)
    assert hub.trackers == [everywhere] and everywhere.calls[-1] == ("log", {"loss": 1.0}, 0, {})
    blank = hub.get("tensorboard", unwrap=True)
    assert isinstance(blank, BlankTracker) and blank.add_scalar("x", 1.0, 0) is None
    assert blank.writer.add_histogram("h", torch.ones(2)) is None
    assert isinstance(hub.get("jsonl"), BlankTracker)
    with pytest.raises(
        ConfigError,
        match=r"get_tracker\('wandb'\): no tracker of that name; this run logs with tensorboard, jsonl, recording",
    ):
        hub.get("wandb")
    hub.finish()
    assert list(tmp_path.iterdir()) == []


def test_hub_misuse_is_reported(tmp_path):
    hub = TrackerHub("jsonl", tmp_path)
    with pytest.raises(
        ConfigError, match=r"log\(\) was called before init_trackers\(\), so nothing would be recorded for jsonl"
    ):
        hub.log({"loss": 1.0})
    with pytest.raises(ConfigError, match=r"get_tracker\('jsonl'\) was called before init_trackers\(\)"):
        hub.get("jsonl")
    with pytest.raises(ConfigError, match=r"init_trackers\(project_name=...\) must be a non-empty string, got ''"):
        hub.init("")
    with pytest.raises(
        ConfigError, match=r"init_kwargs\['jsonl'\]=\{'colour': 1\} does not fit JSONLTracker: .*colour"
    ):
        hub.init("run", init_kwargs={"jsonl": {"colour": 1}})
    with pytest.warns(
        UserWarning,
        match=(
            r"init_trackers\(init_kwargs=...\) has an entry for 'jsnl', which is not a tracker; it is ignored\..* "
            r"Did you mean 'jsonl'\?"
        ),
    ):
        hub.init("run", init_kwargs={"jsnl": {}, "wandb": {"entity": "unused here"}})
    with pytest.raises(ConfigError, match=r"init_trackers\(\) was already called for this run; call end_training\(\)"):
        hub.init("run")
    with pytest.raises(ConfigError, match=r"log\(values=...\) must be a dict of metric name -> value, got list"):
        hub.log([1.0])
    with pytest.raises(ConfigError, match=r"log\(step=...\) must be an integer \(or None\), got 'one'"):
        hub.log({"loss": 1.0}, step="one")
    hub.finish()
    assert TrackerHub(None).get("wandb").log({"x": 1}) is None  # tracking off: a blank tracker, as in Accelerate


def test_hub_finishes_every_tracker_even_if_one_fails(tmp_path):
    class Broken(RecordingTracker):
        name = "broken"

        def finish(self):
            raise OSError("disk full")

    hub = TrackerHub([Broken(), "jsonl"], tmp_path)
    hub.init("run")
    jsonl = hub.get("jsonl")
    with pytest.raises(
        HastenError,
        match=r"Some trackers failed to finish, their last values may be missing: broken: OSError: disk full",
    ):
        hub.finish()
    assert jsonl.file is None and hub.trackers == []


def test_import_does_not_load_tracker_packages():
    code = (
        "import sys, hasten.tracking; print(sorted(m for m in ('tensorboard', 'wandb', 'mlflow', "
        "'torch.utils.tensorboard') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "[]"


# ----------------------------------------------------------------------------------- wandb / mlflow (when installed)


def read_wandb_records(path) -> list:
    """The protobuf records of a ``.wandb`` run file (LevelDB log framing: 32 KiB blocks, 7-byte chunk headers)."""
    from wandb.proto import wandb_internal_pb2

    data, block, position = pathlib.Path(path).read_bytes(), 32768, 7  # 7: the ':W&B' file header
    records, pending = [], b""
    while position + 7 <= len(data):
        left = block - position % block
        _, length, kind = struct.unpack("<IHB", data[position : position + 7])
        if left < 7 or (kind == 0 and length == 0):  # block padding
            position += left
            continue
        pending += data[position + 7 : position + 7 + length]
        position += 7 + length
        if kind in (1, 4):  # a full record, or the last chunk of one
            records.append(wandb_internal_pb2.Record.FromString(pending))
            pending = b""
    return records


@requires("wandb")
def test_wandb_offline_run_holds_each_metric_once(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    hub = TrackerHub("wandb")
    hub.init("hasten-test", config={"lr": torch.tensor(0.5), "path": pathlib.Path("/p")})
    for step in range(3):
        hub.log({"loss": torch.tensor(step + 0.5), "acc": step / 4}, step=step)
    run = hub.get("wandb", unwrap=True)
    assert run.settings.mode == "offline" and dict(run.config) == {"lr": 0.5, "path": "/p"}
    hub.finish()
    (store,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    history = []
    for record in read_wandb_records(store):
        if record.WhichOneof("record_type") == "history":
            items = {"/".join(item.nested_key) or item.key: json.loads(item.value_json) for item in record.history.item}
            history.append((record.history.step.num, items["loss"], items["acc"]))
    assert history == [(0, 0.5, 0.0), (1, 1.5, 0.25), (2, 2.5, 0.5)]


@requires("mlflow")
def test_mlflow_file_store_holds_each_metric_once(tmp_path, monkeypatch):
    import mlflow

    uri = (tmp_path / "mlruns").as_uri()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # recent MLflow refuses file stores without it
    hub = TrackerHub("mlflow")
    hub.init("hasten-test", config={"lr": torch.tensor(0.5), "optim": {"name": "adam"}})
    for step in range(3):
        hub.log({"loss": torch.tensor(step + 0.5), "group": {"a": step}}, step=step)
    run_id = hub.get("mlflow", unwrap=True).info.run_id
    hub.finish()
    client = mlflow.MlflowClient(tracking_uri=uri)
    history = client.get_metric_history(run_id, "loss")
    assert sorted((m.step, m.value) for m in history) == [(0, 0.5), (1, 1.5), (2, 2.5)]
    assert sorted(m.step for m in client.get_metric_history(run_id, "group/a")) == [0, 1, 2]
    params = client.get_run(run_id).data.params
    assert (params["lr"], params["optim/name"]) == ("0.5", "adam")
    assert client.get_experiment(client.get_run(run_id).info.experiment_id).name == "hasten-test"


# ----------------------------------------------------------------------------------- two processes


@pytest.mark.slow
def test_two_processes_only_rank0_writes(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
        "--master_port", str(free_port()), str(SCRIPTS / "tracking_two_procs.py"), str(tmp_path),
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("tracking checks passed") == 2

    steps = range(5)
    scalars = read_scalars(tmp_path / "two_procs")
    assert sorted(scalars) == sorted(
        [("loss", s, f32(s + 0.25)) for s in steps] + [("acc", s, f32(s / 10)) for s in steps]
    )
    lines = read_jsonl(tmp_path / "two_procs" / "metrics.jsonl")
    assert [(line["step"], line["values"]) for line in lines] == [
        (s, {"loss": s + 0.25, "acc": s / 10, "phase": "rank0"}) for s in steps
    ]
    assert json.loads((tmp_path / "two_procs" / "config.json").read_text()) == {"lr": 0.125, "world_size": 2}
    for rank in (0, 1):
        seen = json.loads((tmp_path / f"everyrank_{rank}.json").read_text())
        assert [(r["step"], r["values"]["loss"]) for r in seen] == [(s, s + 0.25 + 100 * rank) for s in steps]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["everyrank_0.json", "everyrank_1.json", "two_procs"]
