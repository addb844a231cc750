"""Runs one side of a differential test (tests/differential.py): every case of a scenario, results as JSON.

Usage: ``differential_driver.py CASES_JSON OUT_PREFIX`` (under ``torch.distributed.run`` for several processes).
``CASES_JSON`` holds ``{"scenario": "module:function", "cases": [...]}``; each process writes
``OUT_PREFIX.rank<RANK>.json``: one outcome per case (tests/differential.py's ``describe_outcome``).
"""

import importlib
import json
import os
import sys

from differential import describe_outcome


def main(spec_path: str, out_prefix: str) -> None:
    spec = json.loads(open(spec_path).read())
    module_name, function_name = spec["scenario"].split(":")
    function = getattr(importlib.import_module(module_name), function_name)
    results = [describe_outcome(function, case) for case in spec["cases"]]
    rank = int(os.environ.get("RANK", "0"))
    with open(f"{out_prefix}.rank{rank}.json", "w") as out:
        json.dump(results, out)
    _leave_the_group()


def _leave_the_group() -> None:
    """End the process group the scenario started, as a script should: a process that exits with its gloo group
    alive can abort in the group's teardown ("terminate called without an active exception", seen on 2 processes)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
