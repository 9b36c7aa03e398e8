"""``make bench-chaos``'s hostile clients against a real server with a real Redis tier: every
attack sends what it promises and counts what came back, the pinger keeps measuring, and the
server still answers afterwards. (The targets are the benchmark's; this only shows the
attackers work, in seconds.)"""

from __future__ import annotations

import time
from functools import partial

import pytest

from benchmarks.chaos import analysis
from benchmarks.chaos.attacks import (
    ATTACKS,
    MAX_FRAMES,
    PAUSED_REDIS,
    POOL_RETIRE,
    SHARE_SQUEEZE,
    TENANT_SPRAY,
    WIDE_ABORT,
    AttackRunner,
    max_frame_lookup,
)
from benchmarks.chaos.run import _pause_redis
from benchmarks.chaos.workload import Clock
from kvshelf.protocol import MAX_FRAME_BYTES, encode
from testbed.redis import RedisServer, have_redis
from testbed.server import ServerProcess

pytestmark = pytest.mark.skipif(not have_redis(), reason="redis-server missing: make install")


def test_max_frame_lookup_fills_a_frame() -> None:
    size = len(encode(max_frame_lookup("pool-" + "0" * 32)))
    assert MAX_FRAME_BYTES - 4096 < size <= MAX_FRAME_BYTES


def test_every_attack_runs_and_counts_its_answers() -> None:
    with (
        RedisServer() as redis,
        ServerProcess(l1_size_gb=0.0625, extra_args=["--l3-redis-url", redis.url]) as server,
    ):
        clock = Clock()
        runner = AttackRunner(
            server.host, server.port, clock.now, 1.0, partial(_pause_redis, redis)
        )
        runner.start()
        runner.join()
        assert [r["attack"] for r in runner.results] == list(ATTACKS)
        for result in runner.results:
            assert result["sent"] > 0, result
            assert result["ping"]["pings"] > 0, result
        by_name = {r["attack"]: r for r in runner.results}
        assert by_name[PAUSED_REDIS]["outcomes"] == {"ok": 1}
        assert by_name[MAX_FRAMES]["sent"] >= 4
        # The tenant under its share keeps its pages beside reserved and locked ones (issue 49).
        squeeze = by_name[SHARE_SQUEEZE]["outcomes"]
        assert squeeze.get("victim_kept", 0) > 0 and "victim_lost" not in squeeze, squeeze
        # Nobody retires a pool it does not hold; a reserve over its end's bound is refused.
        retire = by_name[POOL_RETIRE]["outcomes"]
        assert retire.get("victim_kept", 0) > 0 and "victim_lost" not in retire, retire
        assert by_name[WIDE_ABORT]["outcomes"].get("error:INVALID_ARGUMENT", 0) > 0
        # The spray stored pages (a chaos run that sprayed last had its pool refused at the
        # pool limit, so its row measured nothing).
        assert by_name[TENANT_SPRAY]["outcomes"].get("ok", 0) > 0, by_name[TENANT_SPRAY]
        assert runner.quiet["pings"] > 10 and runner.quiet["unanswered"] == 0
        time.sleep(1.0)  # the Redis pause is over
        with server.client(timeout_s=5.0) as client:
            assert client.ping() == server.boot_id
        summary = analysis.attack_windows(
            runner.results,
            [],
            [{"t_s": 0.0, "rss_anon_bytes": 1}, {"t_s": 99.0, "rss_anon_bytes": 2}],
            runner.quiet["at_s"],
        )
        assert summary["rss_anon_before_bytes"] == 1 and summary["rss_anon_peak_bytes"] == 2
        assert all(
            run["engine_a"] == {"requests": 0, "failed": 0, "worst_s": None}
            for run in summary["runs"]
        )
