"""The last stage of ``save_state`` (see ``plan.py`` for the whole pipeline): a staged save written, flushed, its
manifest written last and the folder published (``files.py``, ``publishing.py``), now or by the background writer
of an asynchronous save (``background.py``); then the other processes of the folder are told and, under automatic
naming, the checkpoints beyond ``total_limit`` are deleted."""

from __future__ import annotations

from .background import side_group
from .background import start as start_background_save
from .naming import rotate
from .stage import Staged


def publish(staged: Staged) -> None:
    """Finish ``staged``: synchronously, or in the background for an asynchronous save (its error is raised at the
    next wait point). On a failure every other process of the folder is told, and the error is raised."""
    plan, writer, gathering = staged.plan, staged.writer, staged.gathering
    project = plan.project

    def after_publish() -> None:
        gathering.published()
        if plan.automatic and writer.is_main:
            rotate(project.project_dir, project.total_limit)

    if plan.asynchronous:
        group = side_group(plan.world) if plan.sharded else None
        limit = getattr(project, "async_staging_limit", None)
        optimizers = plan.contents.torch_optimizers()
        start_background_save(writer, staged.info, group, after_publish, optimizers, gathering.failed, limit)
        return
    try:
        writer.finalize(staged.info)
    except BaseException as error:
        gathering.failed(error)
        raise
    after_publish()
