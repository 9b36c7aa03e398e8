"""Hostile clients: what the chaos run sends the kvshelf server beside the engines' own load.

Each attack runs for a while on threads of its own, through the project's client
(`kvshelf.client.KVShelfClient`) and protocol, and counts what it got back: a reply, an error
(by `kvshelf.protocol.ErrorCode` name: a refusal is what a hardened server should answer), or
no answer within the attacker's timeout. Meanwhile a `~benchmarks.chaos.pinger.Pinger` (a
process of its own) measures the server loop's ping round trip, so that the run can set it
next to the round trip without an attack.

- `ENDS_FLOOD`: lookups of a state-space model's shape whose ``ends`` fill a frame.
- `WIDE_POOL`: one hash committed for every rank of a pool of world size 256, then lookups of
  that hash repeated as often as a request allows.
- `MAX_FRAMES`: several clients sending lookups of the largest frame the protocol allows.
- `POOL_CHURN`: registrations with a new identity epoch each (a new pool each), one page
  committed in each.
- `PAUSED_REDIS`: ``CLIENT PAUSE`` on the server's Redis tier (L3) for the attack's length.

Imports the client and the protocol, never vLLM or torch.
"""

from __future__ import annotations

import collections
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from benchmarks.chaos.pinger import Pinger
from kvshelf.client import KVShelfClient, ServerError, ServerUnavailable
from kvshelf.protocol import (
    MAX_FRAME_BYTES,
    MAX_HASH_BYTES,
    MAX_HASHES_PER_REQUEST,
    Lookup,
    PageLayout,
    encode,
)

ENDS_FLOOD = "ends_flood"
WIDE_POOL = "wide_pool_repeats"
MAX_FRAMES = "max_frames"
POOL_CHURN = "pool_churn"
PAUSED_REDIS = "paused_redis"
ATTACKS = (ENDS_FLOOD, WIDE_POOL, MAX_FRAMES, POOL_CHURN, PAUSED_REDIS)
"""Every attack, in the order the run carries them out."""

WIDE_WORLD_SIZE = 256
"""The world size of `WIDE_POOL`'s pool."""
MAX_FRAME_CLIENTS = 4
"""How many clients `MAX_FRAMES` runs at once."""
ATTACKER_TIMEOUT_S = 5.0
"""How long an attacker waits for a reply (longer than an engine: it keeps the server busy)."""
PAGE_BYTES = 4096
"""Page size of the attackers' own pools (small: their pages cost the arena little)."""
FRAME_SLACK_BYTES = 1024
"""Room left under `MAX_FRAME_BYTES` for a frame's other fields."""


@dataclass
class Tally:
    """What one attack sent and what came back, counted across its threads."""

    sent: int = 0
    outcomes: collections.Counter[str] = field(default_factory=collections.Counter)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def count(self, outcome: str) -> None:
        with self.lock:
            self.sent += 1
            self.outcomes[outcome] += 1

    def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Send one request, ``fn(*args, **kwargs)``, and count its outcome.

        Returns:
            Its result; None unless it was answered without an error.
        """
        try:
            result = fn(*args, **kwargs)
        except ServerError as exc:
            self.count(f"error:{exc.code.name}")
        except ServerUnavailable:
            self.count("no_answer")
        else:
            self.count("ok")
            return result
        return None

    def summary(self) -> dict[str, Any]:
        with self.lock:
            return {"sent": self.sent, "outcomes": dict(sorted(self.outcomes.items()))}


def _key(tag: str, i: int, size: int = 32) -> bytes:
    return f"{tag}-{i:012d}".encode().ljust(size, b".")[:size]


def _client(host: str, port: int) -> KVShelfClient:
    return KVShelfClient(host, port, timeout_s=ATTACKER_TIMEOUT_S, retry_interval_s=0.2)


def _commit_everywhere(client: KVShelfClient, layout: PageLayout, key: bytes, tally: Tally) -> str:
    """Register every rank of ``layout``'s pool and commit ``key`` for each (the pages are not
    written: an attacker's pool holds what it likes). Returns the pool."""
    pool = ""
    for rank in range(layout.world_size):
        rank_layout = PageLayout(
            model_fingerprint=layout.model_fingerprint,
            layout_fingerprint=layout.layout_fingerprint,
            page_bytes=layout.page_bytes,
            world_size=layout.world_size,
            rank=rank,
        )
        registration = tally.call(client.register, rank_layout)
        if registration is None:
            continue
        pool = registration.pool
        reservation = tally.call(client.reserve, pool, rank, [key])
        if reservation is not None:
            tally.call(client.commit, reservation.reservation_id)
    return pool


def ends_flood(host: str, port: int, stop: threading.Event, tally: Tally) -> None:
    """Lookups in a pool of the attacker's whose ``ends`` fill a frame."""
    with _client(host, port) as client:
        layout = PageLayout(
            model_fingerprint="chaos-ends",
            layout_fingerprint="chaos",
            page_bytes=PAGE_BYTES,
            world_size=1,
            rank=0,
        )
        first = _key("ends", 0)
        pool = _commit_everywhere(client, layout, first, tally)
        blocks = 4096
        hashes = [first, *(_key("ends", i) for i in range(1, blocks))]
        # As many keys as a request may carry, spread over every block's end.
        per_end = MAX_HASHES_PER_REQUEST // blocks
        ends = [[_key(f"end{i}", j) for j in range(per_end)] for i in range(blocks)]
        while not stop.is_set():
            tally.call(
                client.lookup, pool, hashes, world_size=1, lock=False, fetch=False, ends=ends
            )


def wide_pool(host: str, port: int, stop: threading.Event, tally: Tally) -> None:
    """One hash committed for every rank of a world-size-256 pool, looked up as often as a
    lookup may name it."""
    with _client(host, port) as client:
        layout = PageLayout(
            model_fingerprint="chaos-wide",
            layout_fingerprint="chaos",
            page_bytes=PAGE_BYTES,
            world_size=WIDE_WORLD_SIZE,
            rank=0,
        )
        key = _key("wide", 0)
        pool = _commit_everywhere(client, layout, key, tally)
        repeats = (MAX_FRAME_BYTES - FRAME_SLACK_BYTES) // (len(key) + 2)
        hashes = [key] * min(repeats, MAX_HASHES_PER_REQUEST)
        while not stop.is_set():
            tally.call(
                client.lookup, pool, hashes, world_size=WIDE_WORLD_SIZE, lock=False, fetch=False
            )


def max_frame_lookup(pool: str) -> Lookup:
    """A lookup whose encoded frame is as large as `MAX_FRAME_BYTES` allows (less the slack)."""
    count = (MAX_FRAME_BYTES - FRAME_SLACK_BYTES) // (MAX_HASH_BYTES + 3)
    hashes = [os.urandom(MAX_HASH_BYTES) for _ in range(count)]
    return Lookup(request_id=0, pool=pool, hashes=hashes, world_size=1, lock=False, fetch=False)


def max_frames(host: str, port: int, stop: threading.Event, tally: Tally) -> None:
    """`MAX_FRAME_CLIENTS` clients sending the largest lookups the protocol allows."""
    request = max_frame_lookup("pool-" + "0" * 32)
    assert len(encode(request)) <= MAX_FRAME_BYTES

    def one() -> None:
        with _client(host, port) as client:
            while not stop.is_set():
                tally.call(
                    client.lookup,
                    request.pool,
                    request.hashes,
                    world_size=1,
                    lock=False,
                    fetch=False,
                )

    threads = [threading.Thread(target=one, daemon=True) for _ in range(MAX_FRAME_CLIENTS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def pool_churn(host: str, port: int, stop: threading.Event, tally: Tally) -> None:
    """A new identity epoch per registration (a new pool each), one page committed in each."""
    with _client(host, port) as client:
        epoch = 0
        while not stop.is_set():
            layout = PageLayout(
                model_fingerprint=f"chaos-churn@{os.getpid()}-{epoch:08d}",
                layout_fingerprint="chaos",
                page_bytes=PAGE_BYTES,
                world_size=1,
                rank=0,
            )
            _commit_everywhere(client, layout, _key("churn", epoch), tally)
            epoch += 1


def paused_redis(
    pause: Callable[[int], None], duration_s: float, stop: threading.Event, tally: Tally
) -> None:
    """Pause every client of the server's Redis tier for ``duration_s`` (``CLIENT PAUSE``)."""
    try:
        pause(int(duration_s * 1000))
    except (OSError, RuntimeError) as exc:
        tally.count(f"error:{exc}"[:80])
    else:
        tally.count("ok")
    stop.wait(duration_s)


def ping_summary(samples: list[tuple[float, float | None]], start_s: float, end_s: float) -> dict:
    """The pings sent in ``[start_s, end_s)``: how many, how many got no answer, and the
    median, 99th percentile and worst round trip in milliseconds (None without answers)."""
    inside = [took for at, took in samples if start_s <= at < end_s]
    answered = sorted(took for took in inside if took is not None)

    def ms(value: float) -> float:
        return round(value * 1000, 3)

    return {
        "pings": len(inside),
        "unanswered": len(inside) - len(answered),
        "p50_ms": ms(answered[len(answered) // 2]) if answered else None,
        "p99_ms": ms(answered[min(len(answered) - 1, int(len(answered) * 0.99))])
        if answered
        else None,
        "worst_ms": ms(answered[-1]) if answered else None,
    }


class AttackRunner:
    """A thread that carries out every attack in turn, each for ``duration_s``, after a window
    of the same length without one, while a `Pinger` runs throughout.

    Args:
        host: The kvshelf server's host.
        port: Its port.
        clock: Seconds on the run's clock.
        duration_s: Length of each attack and of the quiet window before them.
        pause_redis: Pauses the server's Redis tier for the given milliseconds; None without
            a Redis tier (`PAUSED_REDIS` is then skipped).
    """

    def __init__(
        self,
        host: str,
        port: int,
        clock: Callable[[], float],
        duration_s: float,
        pause_redis: Callable[[int], None] | None,
    ) -> None:
        self.quiet: dict[str, Any] = {}
        self.results: list[dict[str, Any]] = []
        self.error: BaseException | None = None
        self._args = (host, port, clock, duration_s, pause_redis)
        self._thread = threading.Thread(target=self._run, name="chaos-attacks", daemon=True)

    def _attack(self, name: str, stop: threading.Event, tally: Tally) -> Callable[[], None]:
        host, port, _, duration_s, pause_redis = self._args
        if name == PAUSED_REDIS:
            assert pause_redis is not None
            return lambda: paused_redis(pause_redis, duration_s, stop, tally)
        attack = {
            ENDS_FLOOD: ends_flood,
            WIDE_POOL: wide_pool,
            MAX_FRAMES: max_frames,
            POOL_CHURN: pool_churn,
        }[name]
        return lambda: attack(host, port, stop, tally)

    def _run(self) -> None:
        host, port, clock, duration_s, pause_redis = self._args
        try:
            with Pinger(host, port, clock) as pinger:
                start = clock()
                time.sleep(duration_s)
                windows = [("quiet", start, clock())]
                for name in ATTACKS:
                    if name == PAUSED_REDIS and pause_redis is None:
                        self.results.append({"attack": name, "skipped": "no Redis tier"})
                        continue
                    stop, tally = threading.Event(), Tally()
                    at_s = clock()
                    thread = threading.Thread(target=self._attack(name, stop, tally), daemon=True)
                    thread.start()
                    stop.wait(duration_s)
                    stop.set()
                    # An attacker waits for its last reply at most its timeout.
                    thread.join(ATTACKER_TIMEOUT_S * 2)
                    done_s = clock()
                    print(f"[chaos] attack {name}: {tally.summary()}", flush=True)
                    self.results.append(
                        {"attack": name, "at_s": round(at_s, 3), "done_s": round(done_s, 3)}
                        | tally.summary()
                    )
                    windows.append((name, at_s, done_s))
            summaries = {name: ping_summary(pinger.samples, a, b) for name, a, b in windows}
            self.quiet = {"at_s": round(start, 3), **summaries["quiet"]}
            for result in self.results:
                if "at_s" in result:
                    result["ping"] = summaries[result["attack"]]
        except BaseException as exc:  # reported by join()
            self.error = exc

    def start(self) -> None:
        """Start the quiet window, then the attacks."""
        self._thread.start()

    def finished(self) -> bool:
        """True once the last attack is over (or the runner failed)."""
        return not self._thread.is_alive()

    def join(self) -> None:
        """Wait for the last attack; re-raise what stopped the runner, if anything did."""
        self._thread.join()
        if self.error is not None:
            raise RuntimeError("the attacks failed") from self.error
