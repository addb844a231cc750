"""Test helper started by `hasten launch`: writes what the process sees to <out_dir>/rank<RANK>.json.

Usage: cli_dump_env.py <out_dir> [args...]. Imports nothing heavy, so launches that use it are quick.
"""

import json
import os
import sys
from pathlib import Path

PREFIXES = (
    "HASTEN_",
    "ACCELERATE_",
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "MASTER_",
    "OMP_NUM_THREADS",
    "CUDA_VISIBLE",
)

if __name__ == "__main__":
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    seen = {
        "argv": sys.argv[1:],
        "env": {k: v for k, v in os.environ.items() if k.startswith(PREFIXES)},
        "cwd": os.getcwd(),
    }
    (out / f"rank{os.environ.get('RANK', 'none')}.json").write_text(json.dumps(seen, indent=1))
