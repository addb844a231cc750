"""``gather_for_metrics``: gather evaluation outputs and drop the samples that were padded in.

Every rank knows the layout of the last round (see :mod:`.sharding`), so no extra collective is
needed: with ``even_batches`` the gathered last batch is cut to its real samples; with uneven last
batches each rank's rows are gathered at their exact sizes.
"""

from __future__ import annotations

from ..operations import _leaves, find_batch_size, gather, gather_object, gather_with_sizes, recursively_apply
from ..state import GradientState, warn_once


def _is_tensor_structure(data) -> bool:
    try:
        recursively_apply(lambda t: t, data, error_on_other_type=True)
    except TypeError:
        return False
    return any(True for _ in _leaves(data))


def _truncate(data, rows: int):
    return recursively_apply(lambda t: t[:rows], data)


def gather_for_metrics(input_data, use_gather_object: bool = False):
    """Gather ``input_data`` from all processes for metric computation, without duplicated samples.

    Over a prepared evaluation loader of N samples, the concatenation of the results of every batch is
    exactly the N predictions, in dataset order. Non-tensor data (or ``use_gather_object=True``) goes
    through ``gather_object``.
    """
    loader = GradientState().active_dataloader
    final = loader.final_round if loader is not None and loader.end_of_dataloader else None
    if use_gather_object or not _is_tensor_structure(input_data):
        data = gather_object(input_data)
        return data[: final.real] if final is not None and final.padded else data
    if final is None:
        return gather(input_data)
    sizes = list(final.sizes)
    from ..state import PartialState

    rank = PartialState().process_index
    local = find_batch_size(input_data) if any(t.ndim for t in _leaves(input_data)) else None
    if local != sizes[rank]:
        warn_once(
            "metrics-layout",
            f"gather_for_metrics got {local} rows on the last batch where the dataloader gave this process "
            f"{sizes[rank]}; the gathered result is returned without dropping padded samples.",
        )
        return gather(input_data) if len(set(sizes)) == 1 else _gather_variable(input_data)
    if final.padded:
        return _truncate(gather(input_data), final.real)
    return gather(input_data) if len(set(sizes)) == 1 else gather_with_sizes(input_data, sizes)


def _gather_variable(data):
    rows = find_batch_size(data)
    sizes = gather_object([rows])
    return gather_with_sizes(data, [int(s) for s in sizes])

