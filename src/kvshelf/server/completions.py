"""Hand-off from I/O threads to the socket loop: a queue of callbacks and a file descriptor
that becomes readable when the queue is not empty.

Tiers below L1 finish their jobs on threads of their own; everything those jobs change (the
index, the tiers' maps, deferred replies) is changed on the loop's thread only, by callbacks
posted here. The loop polls :meth:`Completions.fileno` next to its socket and calls
:meth:`Completions.run` when it is readable, so a completion wakes it at once.

Must not import torch or vLLM.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
from collections.abc import Callable

logger = logging.getLogger(__name__)


class Completions:
    """A thread-safe queue of callbacks that the socket loop runs."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        # An eventfd counts posts; reading it resets the count, so one read clears any
        # number of wake-ups.
        self._fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)

    def fileno(self) -> int:
        """The descriptor to poll: readable while callbacks may be waiting."""
        return self._fd

    def post(self, callback: Callable[[], None]) -> None:
        """Queue ``callback`` for the loop; from any thread."""
        self._queue.put(callback)
        os.eventfd_write(self._fd, 1)

    def run(self) -> int:
        """Run every queued callback, on the loop's thread; a failing one is logged.

        Returns:
            How many ran.
        """
        # Reset the count first: a callback posted after this read wakes the loop again.
        with contextlib.suppress(BlockingIOError):
            os.eventfd_read(self._fd)
        ran = 0
        while True:
            try:
                callback = self._queue.get_nowait()
            except queue.Empty:
                return ran
            ran += 1
            try:
                callback()
            except Exception:
                # A bug in a tier; the loop keeps serving.
                logger.exception("a completion failed")

    def close(self) -> None:
        """Close the descriptor; posting afterwards fails."""
        os.close(self._fd)
