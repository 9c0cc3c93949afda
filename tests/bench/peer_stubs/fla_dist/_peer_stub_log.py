"""Shared by the stand-ins: one JSON line per process at exit, when DELTAFUSE_TEST_PEER_LOG names a file."""

import atexit
import json
import os
import sys


def register(package: str, calls: dict) -> None:
    path = os.environ.get("DELTAFUSE_TEST_PEER_LOG")
    if not path:
        return

    def write():
        with open(path, "a") as fh:
            fh.write(json.dumps({"package": package, "argv": sys.argv, "pid": os.getpid(), "calls": dict(calls)})
                     + "\n")

    atexit.register(write)
