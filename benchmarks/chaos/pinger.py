"""The server loop's ping round trip, measured from a process of its own.

`make bench-chaos` judges the loop's ping under attack. Pinged from a thread of the bench's own
process, the round trip also counted that process's pauses: the attackers' threads hold its
GIL while they encode 4 MiB frames, and its garbage collector walks the run's records. Here a
child process (``python -m benchmarks.chaos.pinger HOST PORT INTERVAL``) pings and prints one
line per ping, ``<time.monotonic() at the send> <seconds or ->``; `Pinger` reads them on a
thread and keeps them on the run's clock.

Imports the client and the protocol, never vLLM or torch.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from benchmarks.chaos.child import LineChild
from kvshelf.client import KVShelfClient, ServerUnavailable

PING_INTERVAL_S = 0.02
"""How often the `Pinger` pings."""
PING_TIMEOUT_S = 2.0
"""How long one ping waits for its answer (no answer: recorded as None)."""


@dataclass
class Pinger:
    """Pings the server every `PING_INTERVAL_S` from a child process and keeps each round trip.

    Args:
        host: The kvshelf server's host.
        port: Its port.
        clock: Seconds on the run's clock: ``time.monotonic()`` minus an origin.

    Attributes:
        samples: ``(t_s, seconds)`` per ping on the run's clock; seconds None: no answer.
    """

    host: str
    port: int
    clock: Callable[[], float]
    samples: list[tuple[float, float | None]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._child = LineChild(
            __name__, [self.host, str(self.port), str(PING_INTERVAL_S)], self._line, "chaos-pinger"
        )
        # The child's send times are on time.monotonic(), the run's clock less an origin.
        self._offset = self.clock() - time.monotonic()

    def _line(self, line: str) -> None:
        sent, took = line.split()
        self.samples.append(
            (round(float(sent) + self._offset, 3), None if took == "-" else float(took))
        )

    def __enter__(self) -> Pinger:
        self._child.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._child.stop()


def main(host: str, port: int, interval_s: float) -> None:
    """Ping until terminated, one line per ping on stdout."""
    with KVShelfClient(host, port, timeout_s=PING_TIMEOUT_S, retry_interval_s=0.1) as client:
        while True:
            sent = time.monotonic()
            started = time.perf_counter()
            try:
                client.ping()
                took = f"{time.perf_counter() - started:.6f}"
            except ServerUnavailable:
                took = "-"
            try:
                print(f"{sent:.6f} {took}", flush=True)
            except BrokenPipeError:  # the bench is gone
                return
            time.sleep(interval_s)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), float(sys.argv[3]))
