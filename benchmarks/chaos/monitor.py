"""What the chaos run samples while it runs: the server's RSS, its arenas in ``/dev/shm`` and its
stats; and the end-of-run readings (leases drained, lazy offload's protected blocks).

Stats are read the way ``kvshelf stats --json`` reads them (`KVShelfClient.stats`); a field this
server does not report yet (e.g. ``l1_quarantined_bytes`` before crash-only adoption) is None,
and so is every field while the server is stopped or restarting.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx

from kvshelf.client import KVShelfClient
from kvshelf.client.errors import KVShelfError
from kvshelf.platform.shm import ARENA_PREFIX, SHM_DIR, shm_path

STAT_FIELDS = (
    "resident_objects",
    "resident_bytes",
    "reserved_objects",
    "locked_objects",
    "l1_reserved_bytes",
    "l1_quarantined_bytes",
    "lookup_requested_objects_total",
    "lookup_hit_objects_total",
    "expired_reservations_total",
    "expired_locks_total",
)
"""Server stats each sample keeps (None when the server does not report one)."""
DRAINED_FIELDS = ("reserved_objects", "locked_objects", "l1_reserved_bytes", "l1_quarantined_bytes")
"""Stats that must be 0 once the engines are idle and the leases ran out."""
PROTECTED_METRIC = "kvshelf_connector_blocks_protected"
"""Lazy offload's protected blocks, as the connector exports them in vLLM's ``/metrics``."""


def process_memory(pid: int) -> dict[str, int | None]:
    """``VmRSS``, ``RssAnon`` and ``RssShmem`` of ``pid`` from ``/proc/<pid>/status``, in bytes.

    Returns:
        The three (``rss_bytes``, ``rss_anon_bytes``, ``rss_shmem_bytes``), None when gone.
    """
    wanted = {"VmRSS:": "rss_bytes", "RssAnon:": "rss_anon_bytes", "RssShmem:": "rss_shmem_bytes"}
    values: dict[str, int | None] = dict.fromkeys(wanted.values())
    with contextlib.suppress(OSError), open(f"/proc/{pid}/status") as f:
        for line in f:
            fields = line.split()
            if fields and fields[0] in wanted:
                values[wanted[fields[0]]] = int(fields[1]) * 1024
    return values


def arena_usage(port: int) -> dict[str, int]:
    """The arenas of servers on ``port`` in ``/dev/shm``: how many, and the bytes they hold.

    Bytes are allocated bytes (``st_blocks``), what the arenas take from RAM; only arenas named
    for ``port`` count, so other servers on the machine do not.
    """
    count = held = 0
    for name in os.listdir(SHM_DIR):
        if name.startswith(f"{ARENA_PREFIX}{port}-"):
            with contextlib.suppress(FileNotFoundError):
                held += os.stat(shm_path(name)).st_blocks * 512
                count += 1
    return {"shm_arenas": count, "shm_bytes": held}


def read_stats(host: str, port: int, timeout_s: float = 0.5) -> dict[str, int | None]:
    """`STAT_FIELDS` of the server on ``host:port``; all None when it does not answer."""
    try:
        with KVShelfClient(host, port, timeout_s=timeout_s, retry_interval_s=0) as client:
            stats = client.stats()
    except KVShelfError:
        return dict.fromkeys(STAT_FIELDS)
    return {name: stats.get(name) for name in STAT_FIELDS}


class Sampler:
    """A thread that samples memory, arenas and stats every ``interval_s`` until stopped.

    Args:
        host: The kvshelf server's host.
        port: Its port (the same across restarts).
        server_pid: Returns the server's current process id (it changes at each restart).
        clock: Returns seconds on the run's clock.
        interval_s: Sampling period.
    """

    def __init__(
        self,
        host: str,
        port: int,
        server_pid: Callable[[], int],
        clock: Callable[[], float],
        interval_s: float,
    ) -> None:
        self.samples: list[dict[str, Any]] = []
        self._args = (host, port, server_pid, clock, interval_s)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="chaos-sampler", daemon=True)

    def _run(self) -> None:
        host, port, server_pid, clock, interval_s = self._args
        while not self._stop.is_set():
            pid = server_pid()
            self.samples.append(
                {
                    "t_s": round(clock(), 3),
                    "server_pid": pid,
                    **process_memory(pid),
                    **arena_usage(port),
                    **read_stats(host, port),
                }
            )
            self._stop.wait(interval_s)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join()


def wait_drained(host: str, port: int, timeout_s: float) -> dict[str, Any]:
    """Wait until `DRAINED_FIELDS` the server reports are 0 (leases ran out), or time out.

    Returns:
        The last stats read, with ``drained`` (bool) and ``waited_s``.
    """
    start = time.monotonic()
    while True:
        stats: dict[str, Any] = read_stats(host, port, timeout_s=2.0)
        present = [stats[name] for name in DRAINED_FIELDS if stats[name] is not None]
        drained = bool(present) and not any(present)
        if drained or time.monotonic() - start > timeout_s:
            return {**stats, "drained": drained, "waited_s": round(time.monotonic() - start, 1)}
        time.sleep(1.0)


def protected_blocks(url: str | None) -> float | None:
    """Lazy offload's protected blocks an engine last reported (summed over its labels).

    Returns:
        The gauge's value; None when the engine is down or does not export it (eager mode).
    """
    if url is None:
        return None
    try:
        text = httpx.get(f"{url}/metrics", timeout=10.0).text
    except httpx.HTTPError:
        return None
    values = [
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith((PROTECTED_METRIC + "{", PROTECTED_METRIC + " "))
    ]
    return sum(values) if values else None
