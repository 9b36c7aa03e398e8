"""A slow Redis behind real kvshelf server processes (issue 33, D4): every Redis operation has
one deadline, so a Redis that answers a byte at a time (:class:`DribblingRedis`, a fake: a
real ``redis-server`` cannot do it) or not at all (a real one under ``CLIENT PAUSE``) opens
the breaker within it, lookups answer on time and then miss, probes queued behind a slow Redis
stay bounded, the server stops within its stated bound, a shared clear against a slow Redis
opens the breaker too, and corrupt values are logged with a rate limit while the metric counts
every one.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

import pytest
import redis

from kvshelf.client import KVShelfClient, ServerUnavailable
from kvshelf.client.results import LookupResult
from kvshelf.protocol import PageLayout, pool_name
from kvshelf.server.limits import MAX_QUEUED_PROBES
from kvshelf.server.lower_tiers import FETCH_ANSWER_WITHIN_S
from kvshelf.server.tiers.redis_format import KEY_PATTERN, object_key
from kvshelf.server.tiers.redis_stream import exists_each, get_each, scan_step, unlink_each
from kvshelf.server.tiers.redis_tier import STOP_WITHIN_S
from testbed.dribbling_redis import DribblingRedis
from testbed.redis import RedisServer, have_redis
from testbed.server import ServerProcess, map_arena_file

PAGE = 16 * 1024
RANKS = 2
LAYOUT = PageLayout(
    model_fingerprint="m", layout_fingerprint="slow", page_bytes=PAGE, world_size=RANKS, rank=0
)
POOL = pool_name(LAYOUT.model_fingerprint, LAYOUT.layout_fingerprint, RANKS)
# The Redis tier's deadline for an operation of a few pages (its link's timeout_s).
DEADLINE_S = 1.0
# What a loaded 2-core test machine adds to a reply or a stop.
SLACK_S = 0.5
# The Redis tier's stop bound (STOP_WITHIN_S + 1 s for its monitor) and the process's own
# teardown.
STOP_BOUND_S = STOP_WITHIN_S + 1.0 + 1.0


def node(url: str) -> ServerProcess:
    return ServerProcess(l1_size_gb=256 * PAGE / 2**30, extra_args=["--l3-redis-url", url])


def block(i: int, tag: str) -> bytes:
    return f"{tag}-{i:06d}".encode().ljust(32, b".")


def store(client: KVShelfClient, hashes: Sequence[bytes]) -> None:
    """Write and commit ``hashes`` for every rank, as workers do, and wait until Redis has
    them."""
    registration = client.register(LAYOUT)
    arena = map_arena_file(registration.shm_name)
    try:
        for rank in range(RANKS):
            reservation = client.reserve(registration.pool, rank, list(hashes))
            for page in reservation.pages:
                if page is not None:
                    arena[page * PAGE : (page + 1) * PAGE] = bytes([rank + 1]) * PAGE
            client.commit(reservation.reservation_id)
    finally:
        arena.close()
    wait_for(lambda: client.stats()["l3_stored_objects_total"] >= RANKS * len(hashes))


def timed_lookup(client: KVShelfClient, hashes: Sequence[bytes]) -> tuple[LookupResult, float]:
    """One locking lookup (its lock released) and how long its answer took."""
    started = time.monotonic()
    result = client.lookup(POOL, list(hashes), world_size=RANKS, lock=True)
    took = time.monotonic() - started
    for rank in range(RANKS if result.lock_id else 0):
        client.release(result.lock_id, rank)
    return result, took


def wait_for(condition: Callable[[], bool], timeout_s: float = 20.0) -> float:
    """Poll until ``condition()``; the seconds it took."""
    started = time.monotonic()
    while not condition():
        assert time.monotonic() - started < timeout_s, "timed out"
        time.sleep(0.02)
    return time.monotonic() - started


def lookups_until_a_miss(
    client: KVShelfClient, hashes: Sequence[bytes], within_s: float
) -> list[tuple[float, LookupResult, float]]:
    """Look ``hashes`` up again and again (as a scheduler asks again while "pending") until
    an answer is not pending, then twice more; ``(since the first, result, took)`` each."""
    started = time.monotonic()
    answers = []
    misses = 0
    while misses < 3:
        result, took = timed_lookup(client, hashes)
        answers.append((time.monotonic() - started, result, took))
        misses += not result.pending
        assert time.monotonic() - started < within_s, f"still pending: {answers}"
    return answers


def test_a_dribbled_get_and_exists_give_up_by_their_deadline() -> None:
    with DribblingRedis() as fake:
        client = redis.Redis(port=fake.port, socket_timeout=1.0, protocol=2)
        client.set(b"k", b"v" * 100)
        fake.pace({"GET", "EXISTS"}, byte_interval_s=0.5)
        for call in (
            lambda deadline: get_each(
                client, False, [b"k"], lambda *a: None, lambda *a: None, deadline=deadline
            ),
            lambda deadline: exists_each(client, False, [b"k"], deadline=deadline),
        ):
            started = time.monotonic()
            with pytest.raises(TimeoutError, match="deadline"):
                call(started + DEADLINE_S)
            assert time.monotonic() - started < DEADLINE_S + SLACK_S
        client.close()


def test_a_dribbling_redis_opens_the_breaker_lookups_miss_on_time_and_a_stop_is_bounded() -> None:
    hashes = [block(i, "d") for i in range(4)]
    with DribblingRedis() as fake, node(fake.url) as one, node(fake.url) as two:
        with one.client() as client:
            store(client, hashes)
        # EXISTS answers at once (node two finds the keys), GET, SET and PING a byte per 0.5 s.
        fake.pace({"GET", "PING", "SET"}, byte_interval_s=0.5)
        with two.client() as client:
            client.register(LAYOUT)
            answers = lookups_until_a_miss(client, hashes, within_s=DEADLINE_S + 3 * SLACK_S)
            # Every answer came within the fetch deadline: "pending" while the GET ran, then
            # a miss once it gave up.
            assert all(took < FETCH_ANSWER_WITHIN_S + SLACK_S for _, _, took in answers), answers
            assert all(r.num_hit_blocks == 0 for _, r, _ in answers if not r.pending), answers
            stats = client.stats()
            assert stats["l3_available"] == 0 and stats["l3_errors_total"] >= 1
            # The breaker stays open while Redis dribbles (the monitor's PING is slow too):
            # lookups miss at once.
            time.sleep(1.5)
            for _ in range(3):
                result, took = timed_lookup(client, hashes)
                assert not result.pending and result.num_hit_blocks == 0
                assert took < FETCH_ANSWER_WITHIN_S + SLACK_S
            assert client.stats()["l3_available"] == 0
            assert "GET failed: TimeoutError" in two.log()

            # Redis answers again: the breaker closes by itself. Then a GET is dribbled again
            # while the server is told to stop.
            fake.pace(())
            wait_for(lambda: client.stats()["l3_available"] == 1)
            fake.pace({"GET", "PING", "SET"}, byte_interval_s=0.5)
            result, _ = timed_lookup(client, hashes)
            assert result.pending
        started = time.monotonic()
        assert two.terminate(timeout_s=STOP_BOUND_S + 5) == 0
        took = time.monotonic() - started
        assert took < STOP_BOUND_S, f"the stop took {took:.1f} s"
        assert "kvshelf server stopped" in two.log()


def test_probes_queued_behind_a_slow_redis_stay_bounded() -> None:
    """EXISTS answered after 0.6 s, under the deadline (one rank: a probe of one block is one
    EXISTS): the breaker stays closed, and lookups of unknown keys from 8 clients come faster
    than 2 I/O threads ask. The probes over the bound are answered at once: misses."""
    layout = PageLayout(
        model_fingerprint="m", layout_fingerprint="probes", page_bytes=PAGE, world_size=1, rank=0
    )
    pool = pool_name(layout.model_fingerprint, layout.layout_fingerprint, 1)
    with DribblingRedis() as fake, node(fake.url) as one:
        fake.pace({"EXISTS"}, delay_s=0.6)
        stop = threading.Event()
        queued: list[int] = []
        took: list[float] = []
        unanswered: list[int] = []

        def look_up(worker: int) -> None:
            with one.client() as client:
                client.register(layout)
                i = 0
                while not stop.is_set():
                    started = time.monotonic()
                    try:
                        client.lookup(pool, [block(i, f"u{worker}")], world_size=1, lock=False)
                    except ServerUnavailable:  # no answer within the client's timeout
                        unanswered.append(i)
                    took.append(time.monotonic() - started)
                    i += 1

        def sample() -> None:
            with one.client() as client:
                while not stop.is_set():
                    queued.append(client.stats()["l3_queued_probes"])
                    time.sleep(0.02)

        threads = [threading.Thread(target=look_up, args=(w,)) for w in range(8)]
        threads.append(threading.Thread(target=sample))
        for thread in threads:
            thread.start()
        time.sleep(4.0)
        stop.set()
        for thread in threads:
            thread.join()
        with one.client() as client:
            stats = client.stats()
        assert max(queued) <= MAX_QUEUED_PROBES, max(queued)
        assert max(queued) >= MAX_QUEUED_PROBES // 2, max(queued)
        assert stats["l3_skipped_probes_total"] > 0
        assert stats["l3_available"] == 1 and stats["l3_errors_total"] == 0
        # Every lookup was answered within the client's request timeout.
        assert unanswered == [] and len(took) > 8 * 4


@pytest.mark.skipif(not have_redis(), reason="redis-server missing: make install")
def test_a_paused_redis_server_opens_the_breaker_and_it_recovers_after_the_pause() -> None:
    hashes = [block(i, "p") for i in range(4)]
    with RedisServer() as shared, node(shared.url) as one, node(shared.url) as two:
        with one.client() as client:
            store(client, hashes)
        assert shared.cli("CLIENT", "PAUSE", "3000", "ALL").strip() == "OK"
        paused_at = time.monotonic()
        with two.client() as client:
            client.register(LAYOUT)
            answers = lookups_until_a_miss(client, hashes, within_s=DEADLINE_S + 3 * SLACK_S)
            assert all(took < FETCH_ANSWER_WITHIN_S + SLACK_S for _, _, took in answers), answers
            stats = client.stats()
            assert stats["l3_available"] == 0 and stats["l3_errors_total"] >= 1
            assert time.monotonic() - paused_at < 3.0, "the pause was over before the test"
            # Back after the pause, by itself: the keys are found and loaded again.
            wait_for(lambda: client.stats()["l3_available"] == 1)
            wait_for(lambda: timed_lookup(client, hashes)[0].num_hit_blocks == len(hashes))


@pytest.mark.skipif(not have_redis(), reason="redis-server missing: make install")
def test_corrupt_values_are_all_counted_and_logged_with_a_rate_limit() -> None:
    hashes = [block(i, "c") for i in range(8)]
    with RedisServer() as shared, node(shared.url) as one, node(shared.url) as two:
        with one.client() as client:
            store(client, hashes)
        direct = redis.Redis(port=shared.port)
        for rank in range(RANKS):
            for block_hash in hashes:
                key = object_key(POOL, rank, block_hash)
                value = bytearray(direct.get(key))
                value[-1] ^= 0xFF
                direct.set(key, bytes(value))
        direct.close()
        with two.client() as client:
            client.register(LAYOUT)
            for block_hash in hashes:  # one lookup per block: many loads, many corrupt values
                wait_for(lambda h=block_hash: not timed_lookup(client, [h])[0].pending)
            assert client.stats()["l3_corrupt_objects_total"] == RANKS * len(hashes)
        lines = [line for line in two.log().splitlines() if "not loaded" in line]
        assert len(lines) == 1, lines


def test_a_dribbled_scan_gives_up_by_its_deadline() -> None:
    with DribblingRedis() as fake:
        client = redis.Redis(port=fake.port, socket_timeout=1.0, protocol=2)
        client.set(b"kvshelf:v1:k", b"v")
        assert scan_step(client.connection_pool, 0, KEY_PATTERN, 10, deadline=time.monotonic() + 1)
        assert unlink_each(client, False, [b"kvshelf:v1:k"], deadline=time.monotonic() + 1) == 1
        fake.pace({"SCAN"}, byte_interval_s=0.5)
        started = time.monotonic()
        with pytest.raises(TimeoutError, match="deadline"):
            scan_step(client.connection_pool, 0, KEY_PATTERN, 10, deadline=started + DEADLINE_S)
        assert time.monotonic() - started < DEADLINE_S + SLACK_S
        client.close()


def test_a_dribbled_shared_clear_opens_the_breaker_and_lookups_and_writes_go_on() -> None:
    """Issue 49, defect 6: two ``Clear(shared=True)`` against a Redis that sends SCAN replies
    a byte per 0.5 s. Before, SCAN had only the 1 s per-receive timeout: for 15 s the breaker
    stayed closed, lookups of new keys answered "pending" and writes were queued, never sent.
    Now each SCAN step has the operation's deadline: the breaker opens within 2 s, lookups of
    new keys miss at once, writes are dropped (not queued) until Redis answers again."""
    hashes = [block(i, "s") for i in range(4)]
    with DribblingRedis() as fake, node(fake.url) as one, one.client() as client:
        store(client, hashes)
        # A shared clear against a prompt Redis deletes every kvshelf key.
        assert client.clear(shared=True).clearing_shared
        wait_for(lambda: client.stats()["l3_cleared_objects_total"] == RANKS * len(hashes))
        assert fake.values == {}
        store(client, hashes)

        fake.pace({"SCAN", "PING"}, byte_interval_s=0.5)
        started = time.monotonic()
        assert client.clear(shared=True).clearing_shared
        assert client.clear(shared=True).clearing_shared
        opened = wait_for(lambda: client.stats()["l3_available"] == 0, timeout_s=2.0 + SLACK_S)
        assert opened < 2.0 + SLACK_S
        assert "SCAN/UNLINK failed: TimeoutError" in one.log()
        # Lookups of keys the index does not know ask Redis nothing now: answered at once.
        for i in range(8):
            result, took = timed_lookup(client, [block(i, "new")])
            assert not result.pending and result.num_hit_blocks == 0
            assert took < FETCH_ANSWER_WITHIN_S + SLACK_S
        assert client.stats()["l3_queued_probes"] == 0
        wait_for(lambda: client.stats()["l3_clearing"] == 0, timeout_s=2 * DEADLINE_S + SLACK_S)
        assert time.monotonic() - started < 2 * DEADLINE_S + 2 * SLACK_S

        # Redis is prompt again: the breaker closes and new writes reach it.
        fake.pace(())
        wait_for(lambda: client.stats()["l3_available"] == 1)
        stored = client.stats()["l3_stored_objects_total"]
        fresh = [block(i, "after") for i in range(4)]
        registration = client.register(LAYOUT)
        arena = map_arena_file(registration.shm_name)
        try:
            for rank in range(RANKS):
                reservation = client.reserve(registration.pool, rank, fresh)
                client.commit(reservation.reservation_id)
        finally:
            arena.close()
        wait_for(lambda: client.stats()["l3_stored_objects_total"] == stored + RANKS * 4)
