"""Both processes print many long lines at the same moment: ``hasten launch`` must keep every line whole
(never two processes' text on one line). Usage: print_long_lines.py START_TIME (seconds since the epoch)."""

import os
import sys
import time

rank = int(os.environ["RANK"])
time.sleep(max(0.0, float(sys.argv[1]) - time.time()))
for i in range(3000):
    print(f"LINE {rank} {i} " + str(rank) * 300)
