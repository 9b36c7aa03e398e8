"""The disk tier's I/O threads and its fault log.

:class:`IOThreads` runs tasks on a few daemon threads, reads before writes (a lookup waits for
a read; nobody waits for a write), so the socket loop never touches the disk. :class:`FaultLog`
logs a failing directory once per interval, not once per object. Must not import torch or vLLM.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable

logger = logging.getLogger("kvshelf.server.disk")

Task = Callable[[], None]


class IOThreads:
    """A few threads that run queued tasks, reads first.

    Args:
        count: how many threads.
        name: their name prefix.
    """

    def __init__(self, count: int, name: str) -> None:
        self._reads: deque[Task] = deque()
        self._writes: deque[Task] = deque()
        self._ready = threading.Condition()
        self._stopping = False
        self._threads = [
            threading.Thread(target=self._run, name=f"{name}-{i}", daemon=True)
            for i in range(count)
        ]
        for thread in self._threads:
            thread.start()

    @property
    def count(self) -> int:
        """How many threads run the tasks."""
        return len(self._threads)

    def read(self, task: Task) -> None:
        """Queue a read task; from the loop."""
        with self._ready:
            self._reads.append(task)
            self._ready.notify()

    def write(self, task: Task) -> None:
        """Queue a write task; from the loop."""
        with self._ready:
            self._writes.append(task)
            self._ready.notify()

    def stop(self, timeout_s: float) -> list[Task]:
        """Stop the threads once the tasks they run are over, waiting ``timeout_s`` at most
        for all of them: a thread still in its task then is left behind (a daemon) and
        logged. Tasks must end their I/O in time for this (the Redis tier's have deadlines).

        Returns:
            The tasks never started (reads first); the caller finishes their jobs.
        """
        with self._ready:
            self._stopping = True
            left = [*self._reads, *self._writes]
            self._reads.clear()
            self._writes.clear()
            self._ready.notify_all()
        deadline = time.monotonic() + timeout_s
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        running = [thread.name for thread in self._threads if thread.is_alive()]
        if running:
            logger.warning(
                "I/O threads %s still in a task %.1f s after the stop; left behind",
                ", ".join(running),
                timeout_s,
            )
        return left

    def _run(self) -> None:
        while True:
            with self._ready:
                while not (self._reads or self._writes or self._stopping):
                    self._ready.wait()
                if self._stopping:
                    return
                task = self._reads.popleft() if self._reads else self._writes.popleft()
            try:
                task()
            except Exception:
                # A bug in a task: its job would never finish, so make it loud.
                logger.exception("a disk tier task failed")
            # Not held while this thread waits for the next: a task keeps its job, and the
            # job its views of the arena, alive.
            del task


class LogRate:
    """Lets a repeated log line through at most once per ``interval_s``, and counts the ones
    it held back; from any thread.

    Args:
        interval_s: the shortest time between two lines.
        clock: the time source.
    """

    def __init__(self, interval_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._interval_s = interval_s
        self._clock = clock
        self._lock = threading.Lock()
        self._next_at = 0.0
        self._quiet = 0

    def due(self) -> int | None:
        """How many lines were held back since the last one, when this one is due; None when
        it is held back too."""
        with self._lock:
            now = self._clock()
            if now < self._next_at:
                self._quiet += 1
                return None
            quiet, self._quiet = self._quiet, 0
            self._next_at = now + self._interval_s
        return quiet


class FaultLog:
    """Logs disk faults at most once per ``interval_s``, with how many were not logged.

    Args:
        interval_s: the shortest time between two log lines.
        clock: the time source.
    """

    def __init__(self, interval_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._rate = LogRate(interval_s, clock)

    def fault(self, what: str, exc: BaseException) -> None:
        """Note a fault; from any thread."""
        quiet = self._rate.due()
        if quiet is None:
            return
        logger.warning(
            "disk tier degraded: %s failed: %s (%d more faults since the last report; L1 keeps "
            "serving, the disk tier retries by itself)",
            what,
            exc,
            quiet,
        )
