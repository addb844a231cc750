"""Test helper: rank 1 writes a hand-made hang report (as the hang watchdog would) and fails; rank 0 ends normally.

The report goes to hang_rank1.json in $HASTEN_HANG_REPORT_DIR, the folder `hasten launch` gives every
multi-process job.
"""

import json
import os
import sys
from pathlib import Path

if __name__ == "__main__":
    if os.environ.get("RANK") == "1":
        report = {
            "rank": 1,
            "restart": 0,
            "operation": "hasten.runtime.operations.reduce",
            "collective": 12,
            "group": "the default process group",
            "waited_s": 12.5,
            "timeout_s": 12.0,
            "ranks": {
                "0": {
                    "role": "exited",
                    "detail": "exited without arriving (its last collective there is #11)",
                    "frames": [],
                },
                "1": {
                    "role": "waiting",
                    "detail": "waited 12.5 s in it, inside `hasten.runtime.operations.reduce`; its hang watchdog ended "
                    "the job",
                    "frames": [
                        ['File "train.py", line 40, in <module>', "main()"],
                        ['File "train.py", line 31, in main', "total = accelerator.reduce(loss)"],
                    ],
                },
            },
        }
        Path(os.environ["HASTEN_HANG_REPORT_DIR"], "hang_rank1.json").write_text(json.dumps(report))
        sys.exit(3)
