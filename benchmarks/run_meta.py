"""What every benchmark's result document says of its run: the command that ran it, when, for
how long, on which machine. The rest of a document's ``meta`` is the benchmark's own."""

from __future__ import annotations

import os
import platform
import shlex
import sys
import time


def run_meta(module: str, started: float) -> dict[str, object]:
    """The run's part of a result document's ``meta``.

    Args:
        module: the benchmark's module, as run with ``python -m``.
        started: ``time.time()`` when the run started.
    """
    return {
        "command": shlex.join(["python", "-m", module, *sys.argv[1:]]),
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(started)),
        "wall_s": round(time.time() - started, 1),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
    }
