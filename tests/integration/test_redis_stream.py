"""Streamed GETs (:func:`kvshelf.server.tiers.redis_stream.get_each`) against real redis-server
processes: values arrive in order and whole, a reader that stops early never leaves a
connection out of step, and in a Redis Cluster a key whose slot moved is still fetched."""

from __future__ import annotations

import pytest
import redis

from kvshelf.server.tiers.redis_stream import get_each
from kvshelf.testbed.redis import RedisServer, have_redis, redis_cluster

pytestmark = pytest.mark.skipif(not have_redis(), reason="redis-server missing: make install")


def value(i: int) -> bytes:
    return f"value-{i}-".encode() * (1000 + i)


def fetch(client: redis.Redis, cluster: bool, keys: list[bytes]) -> list[bytes | None]:
    got: list[bytes | None] = [b"not taken"] * len(keys)

    def take(i: int, data: bytes | None) -> None:
        got[i] = data

    get_each(client, cluster, keys, take)
    return got


def test_values_arrive_whole_in_order_and_a_missing_key_is_none() -> None:
    keys = [f"k{i}".encode() for i in range(20)]
    with RedisServer() as server:
        client = redis.Redis(port=server.port)
        for i, key in enumerate(keys):
            if i != 7:
                client.set(key, value(i))
        got = fetch(client, False, keys)
        assert got == [None if i == 7 else value(i) for i in range(len(keys))]
        assert client.get(keys[3]) == value(3)  # the connection went back in step


def test_a_reader_that_stops_early_leaves_no_connection_out_of_step() -> None:
    keys = [f"k{i}".encode() for i in range(10)]
    with RedisServer() as server:
        client = redis.Redis(port=server.port, max_connections=1)
        for i, key in enumerate(keys):
            client.set(key, value(i))

        def take(i: int, data: bytes | None) -> None:
            if i == 4:
                raise RuntimeError("the reader stops here")

        with pytest.raises(RuntimeError):
            get_each(client, False, keys, take)
        # The one connection of the pool had 5 replies unread: reused as it was, the next
        # command would read one of them.
        assert client.get(b"k9") == value(9)
        assert fetch(client, False, keys) == [value(i) for i in range(len(keys))]


def test_a_cluster_key_whose_slot_moved_is_fetched_from_its_new_master() -> None:
    keys = [f"k{i}".encode() for i in range(30)]
    with redis_cluster(3) as nodes:
        client = redis.RedisCluster(host="127.0.0.1", port=nodes[0].port)
        for i, key in enumerate(keys):
            client.set(key, value(i))
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
        # The client still maps the slot to its old master, which now answers MOVED.
        assert client.get_node_from_key(moved).port == source.port
        assert fetch(client, True, keys) == [value(i) for i in range(len(keys))]
        assert client.get_node_from_key(moved).port == target_port
