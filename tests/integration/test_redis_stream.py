"""Pages to and from real redis-server processes through the tier's own RESP framing
(:mod:`kvshelf.server.tiers.redis_stream`): values land bit-exact in their pages; a missing,
resized, truncated, damaged or forged value is a miss and the connection stays in step; an
error reply or a Redis killed mid-reply fails the load and closes the connection; in a Redis
Cluster a key whose slot moved is still fetched; over TLS too."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import redis

from kvshelf.server.tiers.redis_format import CorruptValue, ValueCodec, object_key
from kvshelf.server.tiers.redis_resp import FramingError, ReplyReader
from kvshelf.server.tiers.redis_stream import get_each, set_each
from testbed.redis import RedisServer, have_redis, redis_cluster
from testbed.server import free_port

pytestmark = pytest.mark.skipif(not have_redis(), reason="redis-server missing: make install")

POOL = "m-l-1"
SECRET = b"between the nodes"
MISSING, CORRUPT, NOT_READ = "missing", "corrupt", "not read"


def block(i: int) -> bytes:
    return b"%031d!" % i


def page(i: int, size: int) -> bytes:
    return (os.urandom(64) + bytes([i % 256])) * (size // 65) + bytes(size % 65)


def store(
    client: redis.Redis, cluster: bool, codec: ValueCodec, pages: dict[int, bytes]
) -> list[bytes]:
    """Write ``pages`` (block index: bytes) through :func:`set_each`; their keys."""
    items = []
    for i, data in pages.items():
        head, tag = codec.encode(POOL, 0, block(i), memoryview(data))
        items.append((object_key(POOL, 0, block(i)), (head, memoryview(data), tag)))
    set_each(client, cluster, items, None, deadline=time.monotonic() + 30)
    return [key for key, _ in items]


class Load:
    """What one :func:`get_each` did with each key: the page bytes, or why there are none."""

    def __init__(self, codec: ValueCodec, count: int, page_bytes: int) -> None:
        self.codec = codec
        self.pages = [bytearray(page_bytes) for _ in range(count)]
        self.results: list[str | bytes] = [NOT_READ] * count

    def receive(self, i: int, reader: ReplyReader, size: int) -> None:
        try:
            self.codec.receive_into(reader, size, POOL, 0, block(i), memoryview(self.pages[i]))
            self.results[i] = bytes(self.pages[i])
        except CorruptValue:
            self.results[i] = CORRUPT

    def take(self, i: int, value: bytes | None) -> None:
        if value is None:
            self.results[i] = MISSING
            return
        try:
            self.codec.decode_into(value, POOL, 0, block(i), memoryview(self.pages[i]))
            self.results[i] = bytes(self.pages[i])
        except CorruptValue:
            self.results[i] = CORRUPT

    def run(self, client: redis.Redis, cluster: bool, indices: range) -> Load:
        keys = [object_key(POOL, 0, block(i)) for i in indices]
        get_each(client, cluster, keys, self.receive, self.take, deadline=time.monotonic() + 30)
        return self


@pytest.mark.parametrize("secret", [None, SECRET])
@pytest.mark.parametrize("page_bytes", [4096, 3 << 20])
def test_values_land_bit_exact_and_a_missing_key_is_a_miss(
    secret: bytes | None, page_bytes: int
) -> None:
    codec = ValueCodec(secret)
    pages = {i: page(i, page_bytes) for i in range(8) if i != 5}
    with RedisServer() as server:
        client = redis.Redis(port=server.port, max_connections=1)
        store(client, False, codec, pages)
        load = Load(codec, 8, page_bytes).run(client, False, range(8))
        assert load.results == [pages.get(i, MISSING) for i in range(8)]
        assert client.ping()  # the one connection went back in step


def test_values_land_bit_exact_over_tls(tmp_path: Path) -> None:
    if shutil.which("openssl") is None:
        pytest.skip("openssl missing: no certificate for a TLS Redis")
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    openssl = ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1"]
    openssl += ["-keyout", str(key), "-out", str(cert), "-subj", "/CN=127.0.0.1"]
    subprocess.run(openssl, check=True, capture_output=True)
    port = free_port("127.0.0.1")
    tls = ["--tls-port", str(port), "--tls-cert-file", str(cert), "--tls-key-file", str(key)]
    codec = ValueCodec(SECRET)
    pages = {i: page(i, 3 << 20) for i in range(4)}
    with RedisServer(extra_args=[*tls, "--tls-auth-clients", "no"]):
        client = redis.Redis(port=port, ssl=True, ssl_cert_reqs="none", max_connections=1)
        store(client, False, codec, pages)  # TLS sockets have no sendmsg: one sendall a piece
        load = Load(codec, 5, 3 << 20).run(client, False, range(5))
        assert load.results == [*pages.values(), MISSING]
        assert client.ping()


def test_resized_truncated_damaged_or_forged_values_are_misses_in_step() -> None:
    codec = ValueCodec(SECRET)
    size = 256 * 1024
    pages = {i: page(i, size) for i in range(8)}
    with RedisServer() as server:
        client = redis.Redis(port=server.port, max_connections=1)
        keys = store(client, False, codec, pages)
        value = client.get(keys[0])
        assert value is not None
        flipped = bytearray(value)
        flipped[len(value) // 2] ^= 1
        forged_head, forged_tag = ValueCodec(b"a guess").encode(
            POOL, 0, block(5), memoryview(pages[5])
        )
        damage = {
            1: value[:-1000],  # truncated
            2: value + b"more",  # the wrong size
            3: b"",  # empty
            4: bytes(flipped),  # a payload byte flipped (and another key's value)
            5: forged_head + pages[5] + forged_tag,  # forged
            6: os.urandom(len(value)),  # noise of the right size
        }
        for i, data in damage.items():
            client.set(keys[i], data)
        load = Load(codec, 8, size).run(client, False, range(8))
        assert load.results == [pages[0], *[CORRUPT] * 6, pages[7]]
        assert client.get(keys[7]) == client.get(keys[7])  # the connection is in step
        # A node without the secret refuses tagged values: it cannot check them.
        assert Load(ValueCodec(None), 1, size).run(client, False, range(1)).results == [CORRUPT]


def test_an_error_reply_fails_the_load_and_closes_its_connection() -> None:
    codec = ValueCodec(None)
    pages = {i: page(i, 4096) for i in range(6)}
    with RedisServer() as server:
        client = redis.Redis(port=server.port, max_connections=1)
        keys = store(client, False, codec, pages)
        client.delete(keys[2])
        client.rpush(keys[2], b"not a string")  # GET answers -WRONGTYPE
        load = Load(codec, 6, 4096)
        with pytest.raises(FramingError, match="WRONGTYPE"):
            load.run(client, False, range(6))
        assert load.results == [pages[0], pages[1], *[NOT_READ] * 4]
        # The connection had three replies unread: it was closed, not reused out of step.
        assert client.get(keys[5]) == client.get(keys[5]) != b"not a string"
        assert Load(codec, 2, 4096).run(client, False, range(2)).results == [pages[0], pages[1]]


def test_redis_killed_mid_reply_fails_the_load_and_never_lands_a_partial_page() -> None:
    codec = ValueCodec(None)
    size = 32 << 20
    pages = {i: page(i, size) for i in range(3)}
    with RedisServer() as server:
        client = redis.Redis(port=server.port, max_connections=1)
        store(client, False, codec, pages)
        load = Load(codec, 3, size)
        receive = load.receive

        def killing(i: int, reader: ReplyReader, size: int) -> None:
            server.kill()  # Redis has sent at most a socket buffer of this value
            receive(i, reader, size)

        load.receive = killing  # type: ignore[method-assign]
        with pytest.raises(ConnectionError):
            load.run(client, False, range(3))
        assert load.results == [NOT_READ] * 3
        server.start()  # back, empty: the pool's connection was closed, a new one answers
        assert client.ping()


def test_a_cluster_key_whose_slot_moved_is_fetched_from_its_new_master() -> None:
    codec = ValueCodec(SECRET)
    pages = {i: page(i, 8192) for i in range(30)}
    with redis_cluster(3) as nodes:
        client = redis.RedisCluster(host="127.0.0.1", port=nodes[0].port)
        writer = redis.RedisCluster(host="127.0.0.1", port=nodes[0].port)
        keys = store(client, True, codec, pages)
        assert sorted(int(n.cli("DBSIZE")) for n in nodes)[0] > 0  # spread over every master
        moved = keys[0]
        slot = client.keyslot(moved)
        source = client.get_node_from_key(moved)
        ids = {n.port: n.cli("CLUSTER", "MYID").strip() for n in nodes}
        by_port = {n.port: n for n in nodes}
        target_port = next(port for port in by_port if port != source.port)
        source_id, target_id = ids[source.port], ids[target_port]
        by_port[target_port].cli("CLUSTER", "SETSLOT", str(slot), "IMPORTING", source_id)
        by_port[source.port].cli("CLUSTER", "SETSLOT", str(slot), "MIGRATING", target_id)
        for key in by_port[source.port].cli("CLUSTER", "GETKEYSINSLOT", str(slot), "1000").split():
            by_port[source.port].cli("MIGRATE", "127.0.0.1", str(target_port), key, "0", "5000")
        for n in nodes:
            n.cli("CLUSTER", "SETSLOT", str(slot), "NODE", target_id)
        # Both clients still map the slot to its old master, which now answers MOVED.
        assert writer.get_node_from_key(moved).port == source.port
        pages[0] = page(100, 8192)
        store(writer, True, codec, {0: pages[0]})
        assert writer.get_node_from_key(moved).port == target_port
        assert client.get_node_from_key(moved).port == source.port
        load = Load(codec, 30, 8192).run(client, True, range(30))
        assert load.results == [pages[i] for i in range(30)]
        assert client.get_node_from_key(moved).port == target_port
