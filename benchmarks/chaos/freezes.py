"""Machine freezes: spans in which this machine ran no ordinary process, measured from a process
of its own that only sleeps.

On the 2-core VMs `make bench-chaos` runs on, two engines under load sometimes leave every
normal-priority process unscheduled for seconds: a process that sleeps 0.1 s at a time woke
up to 17 s late, at ``nice 0`` and ``nice -10`` alike, while a ``SCHED_FIFO`` one beside them
never woke more than 0.3 s late; with no connector at all (engines A and B of the `none` mode)
the same happened, and requests in flight took 34 s. A request's latency then counts the
freeze whatever the connector does, so the stall target judges each request's latency less
the freezes it was in flight during (`unfrozen_latency`), and the report says how long the
machine froze.

`FreezeWatch` runs ``python -m benchmarks.chaos.freezes INTERVAL THRESHOLD``, which sleeps
``INTERVAL`` seconds at a time and prints ``<time.monotonic() at the wake-up> <lag> <major
faults>`` for each wake-up later than ``THRESHOLD`` (the major page faults it took itself since
the wake-up before: a sleeper whose code pages the kernel dropped reads them back from disk);
the watch keeps each as a span on the run's clock and counts those with faults. No vLLM, torch
or kvshelf server involved.
"""

from __future__ import annotations

import resource
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from benchmarks.chaos.child import LineChild

SLEEP_S = 0.05
"""How long the watching process sleeps at a time."""
FREEZE_S = 0.25
"""A wake-up this much later than asked for counts as a freeze; shorter delays are left to the
latencies, as the load's own scheduling delays."""


@dataclass
class FreezeWatch:
    """Records the machine's freezes from a child process while in its ``with`` block.

    Args:
        clock: Seconds on the run's clock: ``time.monotonic()`` minus an origin.

    Attributes:
        spans: ``(start_s, end_s)`` per freeze on the run's clock, oldest first.
        faulted: How many of them the watching process took a major page fault in.
    """

    clock: Callable[[], float]
    spans: list[tuple[float, float]] = field(default_factory=list)
    faulted: int = 0

    def __post_init__(self) -> None:
        args = [str(SLEEP_S), str(FREEZE_S)]
        self._child = LineChild(__name__, args, self._line, "chaos-freezes")
        # The child's wake-up times are on time.monotonic(), the run's clock less an origin.
        self._offset = self.clock() - time.monotonic()

    @property
    def pid(self) -> int:
        """The watching process's pid (while in the ``with`` block)."""
        return self._child.pid

    def _line(self, line: str) -> None:
        woke, lag, faults = (float(word) for word in line.split())
        end = woke + self._offset
        self.spans.append((round(end - lag, 3), round(end, 3)))
        self.faulted += faults > 0

    def __enter__(self) -> FreezeWatch:
        self._child.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._child.stop()


def frozen_s(spans: Sequence[tuple[float, float]], start_s: float, end_s: float) -> float:
    """Seconds of ``start_s`` to ``end_s`` the machine spent in the freezes ``spans``."""
    return sum(max(0.0, min(end, end_s) - max(start, start_s)) for start, end in spans)


def unfrozen_latency(
    latency_s: float, start_s: float, spans: Sequence[tuple[float, float]]
) -> float:
    """A request's latency less the freezes it was in flight during."""
    return latency_s - frozen_s(spans, start_s, start_s + latency_s)


def main(sleep_s: float, threshold_s: float) -> None:
    """Sleep until terminated, printing each wake-up later than ``threshold_s``."""
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_majflt
    while True:
        asked = time.monotonic() + sleep_s
        time.sleep(sleep_s)
        woke = time.monotonic()
        before, faults = faults, resource.getrusage(resource.RUSAGE_SELF).ru_majflt
        if woke - asked > threshold_s:
            try:
                print(f"{woke:.6f} {woke - asked:.6f} {faults - before}", flush=True)
            except BrokenPipeError:  # the bench is gone
                return


if __name__ == "__main__":
    main(float(sys.argv[1]), float(sys.argv[2]))
