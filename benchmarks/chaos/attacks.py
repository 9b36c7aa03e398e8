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
- `TENANT_SPRAY`: a page stored under a new tenant of a 1,024-character name each time (any
  vLLM user picks its ``cache_salt``), and now and then a burst that evicts (issue 49, defects
  2 and 8: tenants cost the loop and memory only up to their cap).
- `SHARE_SQUEEZE`: a tenant reserves batches it never commits, or commits and locks, beside a
  tenant under its share, and counts whether that tenant still finds all its pages (issue 49,
  defect 4).
- `WIDE_ABORT`: in a pool of world size 4,096, reserves as large as one may be made and
  aborted (an end looks each key up in every rank's table), and one over that bound each round
  (issue 49, defect 1: refused).
- `WIDE_UNWHOLE`: blocks committed on every rank of a pool of world size 1,024 but the first,
  whose reserve and abort then drop every other rank's page (issue 49, defect 3: each dropped
  page asked every rank whether its block was whole).
- `POOL_RETIRE`: a pool of its own stored by one client, then another client's registrations
  naming every pool ``Stats`` lists in ``retires`` and junk layouts at the limit of pools,
  counting whether the first still finds its pages (issue 49, defect 5).

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
    MAX_NAME_CHARS,
    Lookup,
    PageLayout,
    encode,
    max_request_keys,
)

ENDS_FLOOD = "ends_flood"
WIDE_POOL = "wide_pool_repeats"
MAX_FRAMES = "max_frames"
POOL_CHURN = "pool_churn"
PAUSED_REDIS = "paused_redis"
TENANT_SPRAY = "tenant_spray"
SHARE_SQUEEZE = "share_squeeze"
WIDE_ABORT = "wide_abort"
WIDE_UNWHOLE = "wide_unwhole"
POOL_RETIRE = "pool_retire"
# SHARE_SQUEEZE, then POOL_RETIRE (whose junk pools count as used, shrinking every pool's fair
# share), before TENANT_SPRAY, WIDE_UNWHOLE and POOL_CHURN: once their pools each hold their
# fair share of the arena, a new pool gets no page until they are idle (docs/safety.md,
# "Reclaim across pools"). Before POOL_CHURN and PAUSED_REDIS: at the pool limit a new pool is
# refused while every pool was used in the last minute (a chaos run with TENANT_SPRAY last had
# its registration refused and measured nothing).
ATTACKS = (
    ENDS_FLOOD,
    WIDE_POOL,
    MAX_FRAMES,
    SHARE_SQUEEZE,
    POOL_RETIRE,
    TENANT_SPRAY,
    WIDE_ABORT,
    WIDE_UNWHOLE,
    POOL_CHURN,
    PAUSED_REDIS,
)
"""Every attack, in the order the run carries them out."""

WIDE_WORLD_SIZE = 256
"""The world size of `WIDE_POOL`'s pool."""
ABORT_WORLD_SIZE = 4096
"""The world size of `WIDE_ABORT`'s pool: the largest a layout may have."""
UNWHOLE_WORLD_SIZE = 1024
"""The world size of `WIDE_UNWHOLE`'s pool."""
UNWHOLE_BLOCKS = 8
"""Blocks `WIDE_UNWHOLE` commits on every rank but the first per round (8,184 pages)."""
RETIRE_KEYS = 64
"""Keys `POOL_RETIRE`'s own pool stores, then looks up after each round."""
MAX_FRAME_CLIENTS = 4
"""How many clients `MAX_FRAMES` runs at once."""
ATTACKER_TIMEOUT_S = 5.0
"""How long an attacker waits for a reply (longer than an engine: it keeps the server busy)."""
PAGE_BYTES = 4096
"""Page size of the attackers' own pools (small: their pages cost the arena little)."""
FRAME_SLACK_BYTES = 1024
"""Room left under `MAX_FRAME_BYTES` for a frame's other fields."""
SPRAY_BURST_EVERY = 64
"""`TENANT_SPRAY`: pages stored one per tenant between two bursts."""
SPRAY_BURST_KEYS = 1024
"""`TENANT_SPRAY`: the new keys of a burst."""
SQUEEZE_BATCH_KEYS = 4096
"""`SHARE_SQUEEZE`: the victim's pages, and the keys of each of the squeezer's batches."""


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


def _pool(client: KVShelfClient, name: str, tally: Tally) -> str | None:
    """A pool of the attacker's own (world size 1), or None when its registration failed."""
    layout = PageLayout(
        model_fingerprint=name,
        layout_fingerprint="chaos",
        page_bytes=PAGE_BYTES,
        world_size=1,
        rank=0,
    )
    registration = tally.call(client.register, layout)
    return None if registration is None else registration.pool


def _store(client: KVShelfClient, pool: str, keys: list[bytes], tenant: str, tally: Tally) -> None:
    reservation = tally.call(client.reserve, pool, 0, keys, tenant=tenant)
    if reservation is not None:
        tally.call(client.commit, reservation.reservation_id)


def _store_victim(
    client: KVShelfClient, pool: str, keys: list[bytes], tenant: str, tally: Tally
) -> int:
    """Store a victim's ``keys`` and return how many of them a lookup finds (0, counted as
    ``victim_not_stored``, when a full arena gave it none)."""
    _store(client, pool, keys, tenant, tally)
    stored = tally.call(client.lookup, pool, keys, world_size=1, lock=False)
    if stored is None or not stored.num_hit_blocks:
        tally.count("victim_not_stored")
        return 0
    return stored.num_hit_blocks


def _count_victim(
    client: KVShelfClient, pool: str, keys: list[bytes], stored: int, tally: Tally
) -> None:
    """``victim_kept`` when a lookup still finds ``stored`` of ``keys``, else ``victim_lost``."""
    found = tally.call(client.lookup, pool, keys, world_size=1, lock=False)
    if found is not None:
        tally.count("victim_kept" if found.num_hit_blocks == stored else "victim_lost")


def tenant_spray(host: str, port: int, stop: threading.Event, tally: Tally) -> None:
    """One page per new tenant of the longest name, and every `SPRAY_BURST_EVERY` pages a
    burst of `SPRAY_BURST_KEYS` new keys under one tenant (evictions, once the arena is
    full)."""
    with _client(host, port) as client:
        pool = _pool(client, "chaos-tenants", tally)
        i = 0
        while pool is not None and not stop.is_set():
            tenant = f"spray-{os.getpid()}-{i:012d}".ljust(MAX_NAME_CHARS, "x")
            _store(client, pool, [_key("spray", i)], tenant, tally)
            if i % SPRAY_BURST_EVERY == SPRAY_BURST_EVERY - 1:
                burst = [_key(f"burst{i}", j) for j in range(SPRAY_BURST_KEYS)]
                _store(client, pool, burst, "burst", tally)
            i += 1


def share_squeeze(host: str, port: int, stop: threading.Event, tally: Tally) -> None:
    """Tenant "victim" stores `SQUEEZE_BATCH_KEYS` keys; tenant "squeezer" then reserves
    batches as large, alternately never committed and committed then locked (its leases held
    until they run out). After each batch: ``victim_kept`` when the victim still finds as many
    of its blocks as right after its store, else ``victim_lost`` (``victim_not_stored`` once,
    and nothing more, when a full arena gave it none)."""
    with _client(host, port) as client:
        pool = _pool(client, "chaos-share", tally)
        if pool is None:
            return
        kept = [_key("victim", i) for i in range(SQUEEZE_BATCH_KEYS)]
        stored = _store_victim(client, pool, kept, "victim", tally)
        if not stored:
            return
        batch = 0
        while not stop.is_set():
            keys = [_key(f"squeeze{batch}", i) for i in range(SQUEEZE_BATCH_KEYS)]
            reservation = tally.call(client.reserve, pool, 0, keys, tenant="squeezer")
            if reservation is not None and batch % 2:
                tally.call(client.commit, reservation.reservation_id)
                tally.call(client.lookup, pool, keys, world_size=1, lock=True, tenant="squeezer")
            _count_victim(client, pool, kept, stored, tally)
            batch += 1


def wide_abort(host: str, port: int, stop: threading.Event, tally: Tally) -> None:
    """Reserves of `ABORT_WORLD_SIZE` ranks' pool as large as one may be, aborted, and one
    four times larger each round (``INVALID_ARGUMENT`` from a server that charges an end)."""
    with _client(host, port) as client:
        layout = _wide_layout("chaos-abort", ABORT_WORLD_SIZE)
        registration = tally.call(client.register, layout)
        if registration is None:
            return
        most = max_request_keys(ABORT_WORLD_SIZE)
        round_ = 0
        while not stop.is_set():
            keys = [_key(f"abort{round_}", i) for i in range(most)]
            reservation = tally.call(client.reserve, registration.pool, 0, keys)
            if reservation is not None:
                tally.call(client.abort, reservation.reservation_id)
            over = [_key(f"over{round_}", i) for i in range(4 * most)]
            reservation = tally.call(client.reserve, registration.pool, 0, over)
            if reservation is not None:
                tally.call(client.abort, reservation.reservation_id)
            round_ += 1


def wide_unwhole(host: str, port: int, stop: threading.Event, tally: Tally) -> None:
    """`UNWHOLE_BLOCKS` blocks committed on every rank of `UNWHOLE_WORLD_SIZE` but rank 0,
    then reserved on rank 0 and aborted: the other ranks' pages of blocks that can never be
    whole are dropped, each a removal the event log checks. Round after round."""
    with _client(host, port) as client:
        layout = _wide_layout("chaos-unwhole", UNWHOLE_WORLD_SIZE)
        registration = tally.call(client.register, layout)
        if registration is None:
            return
        pool = registration.pool
        round_ = 0
        while not stop.is_set():
            keys = [_key(f"unwhole{round_}", i) for i in range(UNWHOLE_BLOCKS)]
            for rank in range(1, UNWHOLE_WORLD_SIZE):
                if stop.is_set():
                    break
                reservation = tally.call(client.reserve, pool, rank, keys)
                if reservation is not None:
                    tally.call(client.commit, reservation.reservation_id)
            reservation = tally.call(client.reserve, pool, 0, keys)
            if reservation is not None:
                tally.call(client.abort, reservation.reservation_id)
            round_ += 1


def pool_retire(host: str, port: int, stop: threading.Event, tally: Tally) -> None:
    """A pool stored by one client; another registers its own layout naming every pool the
    server lists in ``retires``, and junk layouts (a new one each) likewise. After each round:
    ``victim_kept`` when the first still finds as many of its `RETIRE_KEYS` blocks as right
    after its store, else ``victim_lost`` (``victim_not_stored`` once, and nothing more, when a
    full arena gave it none)."""
    with _client(host, port) as victim, _client(host, port) as attacker:
        pool = _pool(victim, "chaos-retire-victim", tally)
        if pool is None:
            return
        kept = [_key("retire", i) for i in range(RETIRE_KEYS)]
        stored = _store_victim(victim, pool, kept, "", tally)
        if not stored:
            return
        round_ = 0
        while not stop.is_set():
            listed = tally.call(attacker.server_stats)
            for name in listed.pool_objects if listed is not None else ():
                layout = _wide_layout(f"chaos-retire-{os.getpid()}-{round_}", 1)
                tally.call(attacker.register, layout, retires=name)
            _count_victim(victim, pool, kept, stored, tally)
            round_ += 1


def _wide_layout(model: str, world_size: int) -> PageLayout:
    return PageLayout(
        model_fingerprint=model,
        layout_fingerprint="chaos",
        page_bytes=PAGE_BYTES,
        world_size=world_size,
        rank=0,
    )


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
            TENANT_SPRAY: tenant_spray,
            SHARE_SQUEEZE: share_squeeze,
            WIDE_ABORT: wide_abort,
            WIDE_UNWHOLE: wide_unwhole,
            POOL_RETIRE: pool_retire,
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
