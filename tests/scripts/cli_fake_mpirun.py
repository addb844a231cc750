"""Test helper standing in for `mpirun`: `--version` says Open MPI; otherwise it records its command
line and the variables it was asked to export (-x NAME) in $FAKE_MPIRUN_OUT, and exits 0."""

import json
import os
import sys

if __name__ == "__main__":
    args = sys.argv[1:]
    if args == ["--version"]:
        print("mpirun (Open MPI) 4.1.6")
        sys.exit(0)
    exported = {args[i + 1]: os.environ.get(args[i + 1]) for i, arg in enumerate(args) if arg == "-x"}
    with open(os.environ["FAKE_MPIRUN_OUT"], "w") as out:
        json.dump({"argv": args, "exported": exported}, out)
