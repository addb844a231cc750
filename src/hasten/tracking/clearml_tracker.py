"""ClearML (needs ``pip install clearml``): scalars, images and tables reported to a ClearML task."""

from __future__ import annotations

from .. import environment
from ._common import SkipReporter, as_step, is_number
from .base import GeneralTracker, on_main_process
from .values import tensors_to_numbers


def _title_series(name: str) -> tuple[str, str]:
    """``"eval_loss"`` -> ``("loss", "eval")``; names without an eval/test/train prefix go to the ``train`` series."""
    for prefix in ("eval", "test", "train"):
        if name.startswith(prefix + "_"):
            return name[len(prefix) + 1 :], prefix
    return name, "train"


class ClearMLTracker(GeneralTracker):
    """Reports to a ClearML task: the one already running (``Task.current_task()``), or one made by ``Task.init``.

    The new task's project and name are ``CLEARML_PROJECT`` / ``CLEARML_TASK`` when set, else ``run_name``.
    A task started outside (by your own ``Task.init``) is left open by ``finish``.

    Args:
        run_name: the project name given to ``init_trackers``.
        **kwargs: passed to ``Task.init``.
    """

    name = "clearml"
    requires_logging_directory = False
    _package = "clearml"

    def __init__(self, run_name: str | None = None, **kwargs):
        super().__init__()
        self.user_provided_run_name = run_name
        self._initialized_externally = False
        self.init_kwargs = kwargs
        self.task = None
        self._skips = SkipReporter("clearml", "a number")

    @property
    def tracker(self):
        """The ClearML ``Task`` (``None`` before ``start``)."""
        return self.task

    @on_main_process
    def start(self) -> None:
        """Use the running task, or create one."""
        from clearml import Task

        current = Task.current_task()
        if current:
            self._initialized_externally, self.task = True, current
            return
        options = dict(self.init_kwargs)
        options.setdefault(
            "project_name", environment.parse_choice_from_env("CLEARML_PROJECT", "") or self.user_provided_run_name
        )
        options.setdefault(
            "task_name", environment.parse_choice_from_env("CLEARML_TASK", "") or self.user_provided_run_name
        )
        self.task = Task.init(**options)

    @on_main_process
    def store_init_configuration(self, values: dict):
        """Connect ``values`` to the task as its configuration."""
        return self.task.connect_configuration(values)

    @on_main_process
    def log(self, values: dict, step: int | None = None, **kwargs) -> None:
        """Report numbers: as scalars of the ``eval``/``test``/``train`` series at ``step``, or as single values
        without one.

        Other values are skipped with a warning (once per name).
        """
        reporter = self.task.get_logger()
        step = as_step(step)
        for key, value in tensors_to_numbers(values).items():
            if not is_number(value):
                self._skips.skip(key, value)
            elif step is None:
                reporter.report_single_value(name=key, value=value, **kwargs)
            else:
                title, series = _title_series(key)
                reporter.report_scalar(title=title, series=series, value=value, iteration=step, **kwargs)

    @on_main_process
    def log_images(self, values: dict, step: int | None = None, **kwargs) -> None:
        """Report images: name -> array / PIL image (the name's eval/test/train prefix picks the series)."""
        reporter = self.task.get_logger()
        for key, image in values.items():
            title, series = _title_series(key)
            reporter.report_image(title=title, series=series, iteration=as_step(step), image=image, **kwargs)

    @on_main_process
    def log_table(
        self, table_name: str, columns=None, data=None, dataframe=None, step: int | None = None, **kwargs
    ) -> None:
        """Report a table given as ``columns`` + ``data`` (list of rows) or a pandas ``dataframe``."""
        table = dataframe
        if table is None:
            if data is None:
                raise ValueError("ClearMLTracker.log_table needs `data` (a list of rows) when no `dataframe` is given.")
            table = [columns, *data] if columns else data
        title, series = _title_series(table_name)
        self.task.get_logger().report_table(
            title=title, series=series, table_plot=table, iteration=as_step(step), **kwargs
        )

    @on_main_process
    def finish(self) -> None:
        """Close the task, unless it was started outside the tracker."""
        if self.task is not None and not self._initialized_externally:
            self.task.close()
