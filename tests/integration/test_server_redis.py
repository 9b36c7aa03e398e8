"""The shared Redis tier (L3) behind real server processes and real redis-server processes:
two "nodes" (kvshelf servers with their own arenas and ports) share one Redis or a Redis
Cluster; values are checked and authenticated; Redis going away never fails a request.

Clients write pages into one node's arena as workers do; lookups on the other node must return
exactly those bytes, fetched from Redis.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import redis

from kvshelf.cli.server import main as server_main
from kvshelf.client import KVShelfClient
from kvshelf.protocol import PageLayout, pool_name
from kvshelf.server.tiers.redis_format import object_key
from testbed.redis import RedisServer, have_redis, redis_cluster
from testbed.server import ServerProcess, map_arena_file, run_kvshelf

pytestmark = pytest.mark.skipif(not have_redis(), reason="redis-server missing: make install")

PAGE = 16 * 1024
RANKS = 2
LAYOUT = PageLayout(
    model_fingerprint="m", layout_fingerprint="l3", page_bytes=PAGE, world_size=RANKS, rank=0
)
POOL = pool_name(LAYOUT.model_fingerprint, LAYOUT.layout_fingerprint, RANKS)


def node(url: str, *args: str, env: dict[str, str] | None = None) -> ServerProcess:
    """A kvshelf server using the Redis at ``url`` (256 pages of L1; writes queue 64)."""
    return ServerProcess(
        l1_size_gb=256 * PAGE / 2**30, extra_args=["--l3-redis-url", url, *args], env=env
    )


def block(i: int, tag: str = "b") -> bytes:
    return f"{tag}-{i:06d}".encode().ljust(32, b".")


def content(block_hash: bytes, rank: int) -> bytes:
    unit = block_hash + bytes([rank])
    return (unit * (PAGE // len(unit) + 1))[:PAGE]


def store(client: KVShelfClient, hashes: Sequence[bytes]) -> None:
    """Write and commit ``hashes`` for every rank through the node's arena, as workers do."""
    registration = client.register(LAYOUT)
    arena = map_arena_file(registration.shm_name)
    try:
        for rank in range(RANKS):
            reservation = client.reserve(registration.pool, rank, list(hashes))
            for block_hash, page in zip(hashes, reservation.pages, strict=True):
                if page is not None:
                    arena[page * PAGE : (page + 1) * PAGE] = content(block_hash, rank)
            client.commit(reservation.reservation_id)
    finally:
        arena.close()


def hit(client: KVShelfClient, hashes: Sequence[bytes]) -> int:
    """A locking lookup (asked again while "pending"); every hit page's bytes are checked."""
    registration = client.register(LAYOUT)
    for _ in range(200):
        result = client.lookup(registration.pool, list(hashes), world_size=RANKS, lock=True)
        if not result.pending:
            break
    arena = map_arena_file(registration.shm_name)
    try:
        for rank, pages in enumerate(result.pages):
            for block_hash, page in zip(hashes, pages, strict=False):
                assert arena[page * PAGE : (page + 1) * PAGE] == content(block_hash, rank)
    finally:
        arena.close()
    for rank in range(RANKS if result.lock_id else 0):
        client.release(result.lock_id, rank)
    return result.num_hit_blocks


def wait_for(condition: Callable[[], bool], timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def wait_sent(client: KVShelfClient) -> dict[str, int]:
    """Wait until every committed object was written to Redis or dropped; the stats then."""

    def done() -> bool:
        stats = client.stats()
        sent = stats["l3_stored_objects_total"] + stats["l3_dropped_writes_total"]
        return sent >= stats["committed_objects_total"]

    wait_for(done)
    return client.stats()


def test_flags_are_checked_and_name_the_bad_one(capsys: pytest.CaptureFixture[str]) -> None:
    assert server_main(["--l3-secret-file", "/nonexistent"]) == 2
    assert "--l3-secret-file: needs --l3-redis-url" in capsys.readouterr().err
    assert server_main(["--l3-redis-url", "http://127.0.0.1:6379"]) == 2
    assert "--l3-redis-url" in capsys.readouterr().err
    assert server_main(["--l3-redis-url", "redis://h:1", "--l3-secret-file", "/none"]) == 2
    assert "cannot read /none" in capsys.readouterr().err


def test_node_two_hits_what_node_one_stored() -> None:
    hashes = [block(i) for i in range(12)]
    with RedisServer() as shared, node(shared.url) as one, node(shared.url) as two:
        with one.client() as client:
            store(client, hashes)
            stats = wait_sent(client)
        assert stats["l3_stored_objects_total"] == RANKS * len(hashes)
        assert stats["l3_available"] == 1
        with two.client() as client:
            assert client.stats()["resident_objects"] == 0
            assert hit(client, [*hashes, block(99)]) == len(hashes)
            stats = client.stats()
            # Now in node two's L1: a second lookup needs no Redis.
            assert hit(client, hashes) == len(hashes)
        assert stats["l3_hit_objects_total"] == RANKS * len(hashes)
        assert stats["l3_corrupt_objects_total"] == stats["l3_errors_total"] == 0


def test_fetched_objects_land_on_the_disk_tier_too(tmp_path: Path) -> None:
    hashes = [block(i, "l2") for i in range(5)]
    disk = ["--l2-disk-path", str(tmp_path / "l2"), "--l2-disk-size-gb", "0.01"]
    with RedisServer() as shared, node(shared.url) as one, node(shared.url, *disk) as two:
        with one.client() as client:
            store(client, hashes)
            wait_sent(client)
        with two.client() as client:
            assert hit(client, hashes) == len(hashes)
            wait_for(lambda: client.stats()["l2_stored_objects_total"] == RANKS * len(hashes))
            stats = client.stats()
        # Nothing was committed on node two: the disk got what came from Redis, and Redis
        # was not written again.
        assert stats["committed_objects_total"] == stats["l3_stored_objects_total"] == 0
        assert stats["l3_hit_objects_total"] == RANKS * len(hashes)


def test_clear_leaves_the_shared_tier_alone_unless_asked_and_then_only_kvshelf_keys(
    tmp_path: Path,
) -> None:
    hashes = [block(i, "x") for i in range(4)]
    disk = ["--l2-disk-path", str(tmp_path / "l2"), "--l2-disk-size-gb", "0.01"]
    with RedisServer() as shared, node(shared.url, *disk) as one, node(shared.url) as two:
        shared.cli("SET", "someone-else:key", "kept")
        with one.client() as client:
            store(client, hashes)
            wait_sent(client)
            wait_for(lambda: client.stats()["l2_stored_objects_total"] == RANKS * len(hashes))
            result = run_kvshelf("clear", "--port", str(one.port))
            assert result.returncode == 0, result.stderr
            assert result.stdout.strip() == (
                f"cleared {RANKS * len(hashes)} objects; {RANKS * len(hashes)} from the disk tier"
            )
            stats = client.stats()
            assert stats["resident_objects"] == stats["l2_resident_objects"] == 0
            assert int(shared.cli("DBSIZE").strip()) == RANKS * len(hashes) + 1
            # Node one's own tiers are empty, Redis still serves it.
            assert hit(client, hashes) == len(hashes)

            result = run_kvshelf("clear", "--shared", "--port", str(one.port))
            assert result.returncode == 0, result.stderr
            assert f"deleted {RANKS * len(hashes)} kvshelf keys" in result.stdout
            stats = client.stats()
            assert stats["l3_cleared_objects_total"] == RANKS * len(hashes)
            assert stats["l3_clearing"] == 0
        assert shared.cli("KEYS", "*").split() == ["someone-else:key"]
        with two.client() as client:
            assert hit(client, hashes) == 0


def test_keys_get_the_time_to_live_asked_for() -> None:
    with RedisServer() as shared, node(shared.url, "--l3-ttl-s", "30") as one:
        with one.client() as client:
            store(client, [block(0, "t")])
            wait_sent(client)
        ttl_ms = int(shared.cli("PTTL", object_key(POOL, 0, block(0, "t")).decode()).strip())
        assert 20_000 < ttl_ms <= 30_000


def test_a_cluster_spreads_keys_over_every_master() -> None:
    hashes = [block(i, "c") for i in range(24)]
    with redis_cluster(3) as nodes, node(nodes[0].url) as one, node(nodes[1].url) as two:
        with one.client() as client:
            store(client, hashes)
            assert wait_sent(client)["l3_stored_objects_total"] == RANKS * len(hashes)
        counts = [int(n.cli("DBSIZE").strip()) for n in nodes]
        assert sum(counts) == RANKS * len(hashes) and min(counts) > 0, counts
        assert "Redis Cluster" in one.log()
        with two.client() as client:
            assert hit(client, hashes) == len(hashes)
            assert client.stats()["l3_hit_objects_total"] == RANKS * len(hashes)
        result = run_kvshelf("clear", "--shared", "--port", str(one.port))
        assert result.returncode == 0, result.stderr
        assert f"deleted {RANKS * len(hashes)} kvshelf keys" in result.stdout
        assert [int(n.cli("DBSIZE").strip()) for n in nodes] == [0, 0, 0]


def test_a_damaged_or_forged_value_is_a_counted_miss(tmp_path: Path) -> None:
    hashes = [block(i, "d") for i in range(6)]
    secret = tmp_path / "secret"
    secret.write_bytes(b"shared between the nodes\n")
    other = tmp_path / "other"
    other.write_bytes(b"another secret")
    with RedisServer() as shared, node(shared.url, "--l3-secret-file", str(secret)) as one:
        with one.client() as client:
            store(client, hashes)
            wait_sent(client)
        direct = redis.Redis(port=shared.port)
        damaged = object_key(POOL, 1, hashes[3])
        value = bytearray(direct.get(damaged))
        value[len(value) // 2] ^= 0xFF
        direct.set(damaged, bytes(value))
        with node(shared.url, "--l3-secret-file", str(secret)) as two, two.client() as client:
            assert hit(client, hashes) == 3
            stats = client.stats()
            assert stats["l3_corrupt_objects_total"] == 1
            # Fetched in one go: every object but the damaged one landed in L1.
            assert stats["l3_hit_objects_total"] == RANKS * len(hashes) - 1
        # Another secret (or none where one is required): nothing authenticates, nothing loads.
        with node(shared.url, "--l3-secret-file", str(other)) as three, three.client() as client:
            assert hit(client, hashes[:3]) == 0
            assert client.stats()["l3_corrupt_objects_total"] == RANKS * 3
        # A value forged without the secret: a valid checksum, but no tag.
        with node(shared.url) as forger, forger.client() as client:
            store(client, [block(0, "f")])
            wait_sent(client)
        with node(shared.url, "--l3-secret-file", str(secret)) as four, four.client() as client:
            assert hit(client, [block(0, "f")]) == 0
            assert client.stats()["l3_corrupt_objects_total"] == RANKS
        direct.close()


def test_an_error_reply_fails_only_that_load_and_the_tier_stays_available() -> None:
    hashes = [block(i, "e") for i in range(6)]
    later = [block(i, "l") for i in range(6)]
    with RedisServer() as shared, node(shared.url) as one, node(shared.url) as two:
        with one.client() as client:
            store(client, hashes)
            wait_sent(client)
        direct = redis.Redis(port=shared.port)
        wrong = object_key(POOL, 1, hashes[3])
        direct.delete(wrong)
        direct.rpush(wrong, b"not a value")  # GET answers -WRONGTYPE
        with two.client() as client:
            assert hit(client, hashes) <= 3
            stats = client.stats()
            assert stats["l3_available"] == 1 and stats["l3_errors_total"] == 1
        with one.client() as client:
            store(client, later)
            wait_sent(client)
        with two.client() as client:
            # The failed load's connection was closed: the next load's replies are its own.
            assert hit(client, later) == len(later)
            assert client.stats()["l3_errors_total"] == 1
        assert "WRONGTYPE" in two.log() and "unavailable" not in two.log()
        direct.close()


def test_redis_down_then_back_never_fails_a_request() -> None:
    first = [block(i, "k") for i in range(4)]
    later = [block(i, "r") for i in range(4)]
    with RedisServer() as shared, node(shared.url) as one, node(shared.url) as two:
        with one.client() as a, two.client() as b:
            store(a, first)
            wait_sent(a)
            shared.kill()
            # Writes are dropped and counted, lookups answer from L1 (node one) or miss.
            store(a, later)
            stats = wait_sent(a)
            assert stats["l3_dropped_writes_total"] >= 1
            assert stats["l3_available"] == 0
            assert hit(a, later) == len(later)
            assert hit(b, first) == 0
            stats = b.stats()
            assert stats["l3_available"] == 0 and stats["l3_errors_total"] >= 1
            # Back, empty (no persistence): writes and hits resume by themselves.
            shared.start()
            wait_for(lambda: a.stats()["l3_available"] == 1 and b.stats()["l3_available"] == 1)
            again = [block(i, "n") for i in range(4)]
            before = a.stats()["l3_stored_objects_total"]
            store(a, again)
            wait_for(lambda: a.stats()["l3_stored_objects_total"] == before + RANKS * 4)
            assert hit(b, again) == len(again)
        assert one.returncode is None and two.returncode is None
        assert one.log().count("unavailable") <= 2


def test_a_password_protected_redis(tmp_path: Path) -> None:
    hashes = [block(i, "p") for i in range(4)]
    with RedisServer(password="s3cret-pw") as shared:
        with_url = f"redis://:s3cret-pw@127.0.0.1:{shared.port}"
        env = {**os.environ, "KVSHELF_REDIS_PASSWORD": "s3cret-pw"}
        with node(with_url) as one, node(shared.url, env=env) as two, node(shared.url) as three:
            with one.client() as client:
                store(client, hashes)
                assert wait_sent(client)["l3_stored_objects_total"] == RANKS * len(hashes)
            with two.client() as client:
                assert hit(client, hashes) == len(hashes)
            with three.client() as client:
                # No password: L1 only, and one clear line in the log.
                assert client.stats()["l3_available"] == 0
                assert hit(client, hashes) == 0
                store(client, hashes[:2])
                assert hit(client, hashes) == 2
                time.sleep(1.5)
            log = three.log()
            assert log.count("unavailable") == 1, log
            assert "KVSHELF_REDIS_PASSWORD" in log
            assert "s3cret-pw" not in one.log() + two.log() + log
