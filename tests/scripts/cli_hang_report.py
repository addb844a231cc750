"""Test helper: rank 1 writes a hand-made hang report (as the debug-mode runtime would) and fails.

The report goes to hang_rank1.json in $HASTEN_HANG_REPORT_DIR, the folder `hasten launch --debug` exports.
"""

import json
import os
import sys
from pathlib import Path

STACK = """Traceback (most recent call last):
  File "train.py", line 40, in <module>
    main()
  File "train.py", line 31, in main
    total = accelerator.reduce(loss)
  File "hasten/operations.py", line 210, in reduce
    dist.all_reduce(tensor)
"""

if __name__ == "__main__":
    if os.environ.get("RANK") == "1":
        report = {
            "rank": 1,
            "operation": "hasten.runtime.operations.reduce",
            "waited_s": 12.5,
            "stack": STACK,
            "peers": "rank 0 finished the script",
        }
        Path(os.environ["HASTEN_HANG_REPORT_DIR"], "hang_rank1.json").write_text(json.dumps(report))
        sys.exit(3)
