"""Progress bars shown once per machine."""

from __future__ import annotations


def tqdm(*args, main_process_only: bool = True, **kwargs):
    """``tqdm.auto.tqdm`` that is shown only on each machine's local main process (unless
    ``main_process_only=False``)."""
    from tqdm.auto import tqdm as _tqdm

    if len(args) > 0 and isinstance(args[0], bool):
        raise TypeError(
            "hasten.utils.tqdm: pass main_process_only as a keyword (main_process_only=True), not as the first "
            "argument."
        )
    if main_process_only:
        from ..state import PartialState

        state = PartialState()
        kwargs["disable"] = kwargs.get("disable", False) or not state.is_local_main_process
    return _tqdm(*args, **kwargs)
