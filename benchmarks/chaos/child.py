"""A measuring child process of the chaos bench: ``python -m MODULE ARGS...`` printing one line
per observation, read on a thread of the bench.

The bench measures from processes of its own what its own process would distort (its threads
hold the GIL, its garbage collector walks the run's records): the server's ping round trip
(:mod:`benchmarks.chaos.pinger`) and the machine's freezes
(:mod:`benchmarks.chaos.freezes`). Both print ``time.monotonic()`` values, which every process
shares on Linux. Imports nothing of kvshelf.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Callable, Sequence


class LineChild:
    """Runs ``python -m module *args`` and hands each line it prints to ``on_line``, on a
    thread, from :meth:`start` until :meth:`stop` terminates it.

    Args:
        module: The child's module.
        args: Its arguments.
        on_line: Called with each line (thread ``name``).
        name: The reading thread's name.
    """

    def __init__(
        self, module: str, args: Sequence[str], on_line: Callable[[str], None], name: str
    ) -> None:
        self._argv = [sys.executable, "-m", module, *args]
        self._on_line = on_line
        self._proc: subprocess.Popen[str] | None = None
        self._reader = threading.Thread(target=self._read, name=name, daemon=True)

    @property
    def pid(self) -> int:
        """The child's pid (between :meth:`start` and :meth:`stop`)."""
        assert self._proc is not None
        return self._proc.pid

    def start(self) -> None:
        self._proc = subprocess.Popen(
            self._argv, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True
        )
        self._reader.start()

    def stop(self) -> None:
        """Terminate the child and wait for it and for its last lines to be read."""
        assert self._proc is not None
        self._proc.terminate()
        self._proc.wait(timeout=10)
        self._reader.join()

    def _read(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        for line in self._proc.stdout:
            self._on_line(line)
