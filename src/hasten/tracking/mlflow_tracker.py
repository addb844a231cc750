"""MLflow (needs ``pip install mlflow``); a local file store works with ``MLFLOW_TRACKING_URI=file:/path``."""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping

from ._common import SkipReporter, as_step, is_number
from .base import GeneralTracker, on_main_process
from .values import flatten, sanitize_config, tensors_to_numbers


class MLflowTracker(GeneralTracker):
    """Logs to an MLflow run through MLflow's fluent API (``mlflow.start_run``, ``mlflow.log_metrics``).

    The tracking store is MLflow's own choice (``MLFLOW_TRACKING_URI``, else MLflow's default)
    unless ``tracking_uri`` is given. The experiment is named by ``MLFLOW_EXPERIMENT_NAME`` when that
    variable is set, else ``experiment_name`` (the project name given to ``init_trackers``), and is
    created when it does not exist. ``MLFLOW_RUN_ID`` resumes a run, as in MLflow.

    Args:
        experiment_name: experiment to log into.
        logging_dir: artifact location of a newly created experiment.
        run_id: resume this run instead of starting one.
        tags: tags of the new experiment and run.
        nested_run: start the run nested in the active one.
        run_name: name of the run.
        description: description of the run.
        tracking_uri: tracking store, e.g. ``"file:/tmp/mlruns"`` (hasten addition; sets
            ``mlflow.set_tracking_uri`` for this process).
    """

    name = "mlflow"
    requires_logging_directory = False
    _package = "mlflow"

    def __init__(
        self,
        experiment_name: str | None = None,
        logging_dir: str | os.PathLike | None = None,
        run_id: str | None = None,
        tags: dict | None = None,
        nested_run: bool = False,
        run_name: str | None = None,
        description: str | None = None,
        tracking_uri: str | None = None,
    ):
        super().__init__()
        self.experiment_name = experiment_name
        self.logging_dir = None if logging_dir is None else os.fspath(logging_dir)
        self.run_id = run_id
        self.tags = tags
        self.nested_run = nested_run
        self.run_name = run_name
        self.description = description
        self.tracking_uri = tracking_uri
        self.active_run = None
        self._skips = SkipReporter(self.name, "a number or a dict of numbers (MLflow metrics are numeric)")

    @property
    def tracker(self):
        """The ``mlflow.ActiveRun`` (``None`` before ``start``)."""
        return self.active_run

    def _experiment_id(self, mlflow) -> str | None:
        from mlflow.environment_variables import MLFLOW_EXPERIMENT_NAME

        name = MLFLOW_EXPERIMENT_NAME.get() or self.experiment_name
        if not name:
            return None
        experiment = mlflow.get_experiment_by_name(name)
        if experiment is not None:
            return experiment.experiment_id
        return mlflow.create_experiment(name, artifact_location=self.logging_dir, tags=self.tags)

    @on_main_process
    def start(self) -> None:
        """Find or create the experiment and start (or resume) the run."""
        import mlflow

        if self.tracking_uri is not None:
            mlflow.set_tracking_uri(self.tracking_uri)
        options = {"description": self.description} if self.description is not None else {}
        self.active_run = mlflow.start_run(
            run_id=self.run_id,
            experiment_id=self._experiment_id(mlflow),
            run_name=self.run_name,
            nested=self.nested_run,
            tags=self.tags,
            **options,
        )

    @on_main_process
    def store_init_configuration(self, values: dict) -> None:
        """Log the configuration as run parameters (flattened with ``/``; too-long values are left out with a
        warning)."""
        import mlflow
        from mlflow.utils import validation

        max_length = getattr(validation, "MAX_PARAM_VAL_LENGTH", 500)
        per_batch = getattr(validation, "MAX_PARAMS_TAGS_PER_BATCH", 100)
        params = {key: str(value) for key, value in flatten(sanitize_config(values)).items()}
        too_long = sorted(key for key, value in params.items() if len(value) > max_length)
        if too_long:
            warnings.warn(
                f"MLflow keeps parameter values of at most {max_length} characters; these were left out: "
                f"{', '.join(too_long)}. Log them as an artifact instead (get_tracker('mlflow').log_artifact).",
                UserWarning,
                stacklevel=3,
            )
        items = [(key, value) for key, value in params.items() if key not in too_long]
        for start in range(0, len(items), per_batch):
            mlflow.log_params(dict(items[start : start + per_batch]))

    @on_main_process
    def log(self, values: dict, step: int | None = None, **kwargs) -> None:
        """Log numbers as metrics; a dict of numbers becomes ``name/key`` metrics.

        Args:
            values: name -> number or dict of numbers (one-element tensors are converted).
            step: the step of the metrics.
            **kwargs: passed to ``mlflow.log_metrics``.
        """
        import mlflow

        metrics = {}
        for key, value in tensors_to_numbers(values).items():
            if is_number(value):
                metrics[key] = float(value)
            elif isinstance(value, Mapping) and value and all(is_number(item) for item in value.values()):
                metrics.update({f"{key}/{name}": float(item) for name, item in value.items()})
            else:
                self._skips.skip(key, value)
        if metrics:
            mlflow.log_metrics(metrics, step=as_step(step), **kwargs)

    @on_main_process
    def log_figure(self, figure, artifact_file: str, **save_kwargs) -> None:
        """Save a matplotlib or plotly figure as an artifact of the run (``mlflow.log_figure``)."""
        import mlflow

        mlflow.log_figure(figure=figure, artifact_file=artifact_file, **save_kwargs)

    @on_main_process
    def log_artifacts(self, local_dir: str, artifact_path: str | None = None) -> None:
        """Copy every file of ``local_dir`` into the run's artifacts (``mlflow.log_artifacts``)."""
        import mlflow

        mlflow.log_artifacts(local_dir=local_dir, artifact_path=artifact_path)

    @on_main_process
    def log_artifact(self, local_path: str, artifact_path: str | None = None) -> None:
        """Copy one file into the run's artifacts (``mlflow.log_artifact``)."""
        import mlflow

        mlflow.log_artifact(local_path=local_path, artifact_path=artifact_path)

    @on_main_process
    def finish(self) -> None:
        """End the run."""
        if self.active_run is not None:
            import mlflow

            mlflow.end_run()
            self.active_run = None
