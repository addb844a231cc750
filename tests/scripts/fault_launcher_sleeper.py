"""Fault-test helper: start 2 processes with debug_launcher (fork) or notebook_launcher (spawn) that record
their pid in <out_dir> and then sleep; the test kills this process and checks that they die with it.

Usage: fault_launcher_sleeper.py <out_dir> debug|notebook <free port>
"""

import os
import sys
import time
from pathlib import Path

from hasten.launchers import debug_launcher, notebook_launcher


def sleep_forever(out_dir):
    Path(out_dir, f"pid_rank{os.environ['RANK']}").write_text(str(os.getpid()))
    time.sleep(300)


if __name__ == "__main__":
    out, kind, port = sys.argv[1], sys.argv[2], sys.argv[3]
    if kind == "debug":
        debug_launcher(sleep_forever, (out,))
    else:
        notebook_launcher(sleep_forever, (out,), num_processes=2, use_port=port, start_method="spawn")
