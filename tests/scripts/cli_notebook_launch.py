"""Test helper: from a plain Python process, run a 2-process function with notebook_launcher and
with debug_launcher; each process all-reduces its rank and writes what it saw to <out_dir>.

Usage: cli_notebook_launch.py <out_dir> <free port>
"""

import json
import os
import sys
from pathlib import Path

from hasten.launchers import debug_launcher, notebook_launcher


def work(out_dir, tag):
    import torch
    import torch.distributed as dist

    from hasten.state import PartialState

    state = PartialState()
    total = torch.tensor([float(state.process_index + 1)])
    dist.all_reduce(total)
    seen = {
        "rank": state.process_index,
        "world": state.num_processes,
        "type": state.distributed_type.value,
        "sum": total.item(),
        "precision": os.environ.get("HASTEN_MIXED_PRECISION"),
        "use_cpu": os.environ.get("HASTEN_USE_CPU"),
        "fork": os.environ.get("FORK_LAUNCHED"),
    }
    Path(out_dir, f"{tag}_rank{state.process_index}.json").write_text(json.dumps(seen))
    state.destroy_process_group()


if __name__ == "__main__":
    out_dir, port = sys.argv[1], sys.argv[2]
    notebook_launcher(work, (out_dir, "notebook"), num_processes=2, mixed_precision="bf16", use_port=port)
    debug_launcher(work, (out_dir, "debug"))
