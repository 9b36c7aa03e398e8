"""What an operator runs against a live server: --version, stats' headline figures, the
periodic stats log line and ``kvshelf clear``."""

from __future__ import annotations

import json
import re
import time

import pytest

import kvshelf
from kvshelf.cli import main as kvshelf_main
from kvshelf.protocol import PageLayout
from testbed.server import ServerProcess, run_kvshelf

LAYOUT = PageLayout(
    model_fingerprint="m", layout_fingerprint="l", page_bytes=4096, world_size=1, rank=0
)


def test_version_prints_the_package_version_and_exits_zero() -> None:
    result = run_kvshelf("--version")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"kvshelf {kvshelf.__version__}"


def test_usage_lists_clear_and_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert kvshelf_main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "--version" in out and "clear" in out


def store(client, pool: str, hashes: list[bytes]) -> None:
    client.commit(client.reserve(pool, 0, hashes).reservation_id)


def test_stats_shows_hit_ratio_used_percent_uptime_and_objects_per_pool(
    kvshelf_server: ServerProcess,
) -> None:
    with kvshelf_server.client() as client:
        pool = client.register(LAYOUT).pool
        store(client, pool, [b"a", b"b", b"c"])
        # 2 of 4 asked, then 3 of 3: 5 hits of 7 objects asked for.
        assert (
            client.lookup(pool, [b"a", b"b", b"x", b"c"], world_size=1, lock=False).num_hit_blocks
            == 2
        )
        assert client.lookup(pool, [b"a", b"b", b"c"], world_size=1, lock=False).num_hit_blocks == 3
    time.sleep(1.1)
    args = ("--port", str(kvshelf_server.port))
    result = run_kvshelf("stats", "--json", *args)
    assert result.returncode == 0, result.stderr
    stats = json.loads(result.stdout)
    assert stats["lookup_requested_objects_total"] == 7
    assert stats["lookup_hit_objects_total"] == 5
    assert stats["hit_ratio"] == pytest.approx(5 / 7)
    assert stats["used_percent"] == pytest.approx(100 * 3 * 4096 / stats["capacity_bytes"])
    assert stats["uptime_seconds"] >= 1
    assert stats["pool_objects"] == {pool: 3}

    table = run_kvshelf("stats", *args)
    assert table.returncode == 0, table.stderr
    assert re.search(r"hit ratio\s+71\.4% \(5 of 7 objects", table.stdout)
    assert re.search(r"used\s+\d+\.\d% \(12,288 of", table.stdout)
    assert re.search(r"uptime\s+00:00:0\d", table.stdout)
    assert f"  {pool}  3" in table.stdout


def test_stats_before_any_lookup_has_no_hit_ratio(kvshelf_server: ServerProcess) -> None:
    result = run_kvshelf("stats", "--json", "--port", str(kvshelf_server.port))
    stats = json.loads(result.stdout)
    assert stats["hit_ratio"] is None and stats["pool_objects"] == {}
    assert "no lookups yet" in run_kvshelf("stats", "--port", str(kvshelf_server.port)).stdout


def test_the_server_logs_key_counters_every_stats_log_interval() -> None:
    with ServerProcess(extra_args=["--stats-log-interval-s", "0.3"]) as server:
        with server.client() as client:
            pool = client.register(LAYOUT).pool
            store(client, pool, [b"a", b"b"])
            client.lookup(pool, [b"a", b"z"], world_size=1, lock=False)
        deadline = time.monotonic() + 10
        while "lookups +1 (hit ratio 50.0%" not in server.log():
            assert time.monotonic() < deadline, server.log()
            time.sleep(0.1)
        time.sleep(1.0)
    lines = [line for line in server.log().splitlines() if "INFO kvshelf.server: stats:" in line]
    # Every 0.3 s (the loop wakes at least every 0.1 s): several lines, the later ones quiet.
    assert len(lines) >= 3, server.log()
    assert "committed +2" in "".join(lines) and "lookups +0" in lines[-1]


def test_the_default_stats_log_interval_is_a_minute() -> None:
    from kvshelf.cli.server import build_parser

    assert build_parser().parse_args([]).stats_log_interval_s == 60.0


def test_clear_empties_the_cache_and_stores_work_again(kvshelf_server: ServerProcess) -> None:
    with kvshelf_server.client() as client:
        pool = client.register(LAYOUT).pool
        store(client, pool, [b"a", b"b", b"c"])
        result = run_kvshelf("clear", "--port", str(kvshelf_server.port))
        assert result.returncode == 0, result.stderr
        assert result.stdout.strip() == "cleared 3 objects"
        stats = client.server_stats()
        assert stats.counters["resident_objects"] == 0 == stats.counters["resident_bytes"]
        assert stats.counters["cleared_objects_total"] == 3
        assert stats.pool_objects == {pool: 0}
        assert client.lookup(pool, [b"a"], world_size=1, lock=False).num_hit_blocks == 0
        store(client, pool, [b"a"])
        assert client.lookup(pool, [b"a"], world_size=1, lock=False).num_hit_blocks == 1


def test_clear_keeps_pages_a_load_is_reading(kvshelf_server: ServerProcess) -> None:
    with kvshelf_server.client() as client:
        pool = client.register(LAYOUT).pool
        store(client, pool, [b"a", b"b", b"c"])
        locked = client.lookup(pool, [b"a"], world_size=1, lock=True)
        cleared = client.clear()
        assert (cleared.cleared_objects, cleared.locked_objects) == (2, 1)
        client.release(locked.lock_id, 0)
        assert client.lookup(pool, [b"a", b"b"], world_size=1, lock=False).num_hit_blocks == 1


def test_clear_shared_without_a_redis_tier_fails_and_says_why(
    kvshelf_server: ServerProcess,
) -> None:
    result = run_kvshelf("clear", "--shared", "--port", str(kvshelf_server.port))
    assert result.returncode == 1
    assert "the shared tier was not cleared" in result.stderr and "--l3-redis-url" in result.stderr


def test_clear_without_a_server_fails_naming_it() -> None:
    from testbed.server import free_port

    result = run_kvshelf("clear", "--port", str(free_port()), "--timeout-s", "0.2")
    assert result.returncode == 1 and "no answer from the kvshelf server" in result.stderr
