"""The scheduler role's asynchronous lookups against a real server (no vLLM involved)."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace

import pytest

from kvshelf.client import KVShelfClient
from kvshelf.protocol import PageLayout
from kvshelf.roles import scheduler_lookups as lookups_module
from kvshelf.roles.lookup_answers import ANSWER_REFRESH_S
from kvshelf.roles.scheduler import SchedulerConnector
from testbed.server import ServerProcess, free_port

BLOCK = 4
LAYOUT = PageLayout(
    model_fingerprint="m", layout_fingerprint="l", page_bytes=4096, world_size=1, rank=0
)
HASHES = [bytes([i]) * 8 for i in range(1, 6)]


@pytest.fixture
def stored(kvshelf_server: ServerProcess) -> Iterator[tuple[ServerProcess, str]]:
    """A server holding the first 3 blocks of ``HASHES``, and the pool's name."""
    with kvshelf_server.client() as client:
        pool = client.register(LAYOUT).pool
        client.commit(client.reserve(pool, 0, HASHES[:3]).reservation_id)
    yield kvshelf_server, pool


def make_request(request_id: str, num_blocks: int = 5) -> SimpleNamespace:
    return SimpleNamespace(
        request_id=request_id,
        block_hashes=HASHES[:num_blocks],
        num_tokens=num_blocks * BLOCK + 1,
        num_computed_tokens=0,
    )


def step_output(total_num_scheduled_tokens: int) -> SimpleNamespace:
    """The fields of vLLM's ``SchedulerOutput`` the scheduler role reads, for a step that
    schedules no request of these tests."""
    return SimpleNamespace(
        num_scheduled_tokens={},
        total_num_scheduled_tokens=total_num_scheduled_tokens,
        preempted_req_ids=None,
        scheduled_new_reqs=[],
        scheduled_cached_reqs=SimpleNamespace(new_block_ids=[]),
    )


def ask_until_answered(scheduler: SchedulerConnector, request: SimpleNamespace) -> int:
    deadline = time.monotonic() + 5.0
    while (hit := scheduler.lookup(request, 0)) is None:
        assert time.monotonic() < deadline, "the lookup was never answered"
        time.sleep(0.001)
    return hit


def active_locks(server: ServerProcess) -> int:
    with server.client() as client:
        return client.stats()["active_locks"]


def make_scheduler(client: KVShelfClient, pool: str) -> SchedulerConnector:
    return SchedulerConnector(
        client, pool, block_size=BLOCK, world_size=1, get_block_ids=lambda _: []
    )


def wait_for_locks(server: ServerProcess, count: int) -> None:
    deadline = time.monotonic() + 5.0
    while active_locks(server) != count:
        assert time.monotonic() < deadline, f"never {count} active locks"
        time.sleep(0.01)


def test_re_asks_answer_at_once_and_refresh_in_the_background(
    stored: tuple[ServerProcess, str],
) -> None:
    server, pool = stored
    with server.client() as client:
        scheduler = make_scheduler(client, pool)
        request = make_request("r")
        assert ask_until_answered(scheduler, request) == 3 * BLOCK
        assert active_locks(server) == 1
        # The server gets the 4th block; vLLM, which could not allocate, asks again: the kept
        # answer comes at once while a refresh is sent, and once its reply is in, it replaces
        # the answer (and its lock).
        client.commit(client.reserve(pool, 0, HASHES[3:4]).reservation_id)
        assert scheduler.lookup(request, BLOCK) == 2 * BLOCK
        time.sleep(ANSWER_REFRESH_S)
        deadline = time.monotonic() + 5.0
        while (hit := scheduler.lookup(request, 0)) != 4 * BLOCK:
            assert hit == 3 * BLOCK
            assert time.monotonic() < deadline, "the refresh never replaced the answer"
            time.sleep(0.001)
        wait_for_locks(server, 1)
        # Allocated without the hit: the lock goes; a later ask is a new lookup.
        scheduler.after_alloc(request, (list(range(6)),), 0)
        wait_for_locks(server, 0)
        lookups = scheduler.counters["lookups"]
        assert ask_until_answered(scheduler, request) == 4 * BLOCK
        assert scheduler.counters["lookups"] == lookups + 1


def test_request_ending_before_its_reply_leaves_no_lock(
    stored: tuple[ServerProcess, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    server, pool = stored
    # Steps that may not wait at all: every first ask is answered later.
    monkeypatch.setattr(lookups_module, "LOOKUP_WAIT_PER_STEP_S", 0.0)
    with server.client() as client:
        scheduler = make_scheduler(client, pool)
        request = make_request("aborted")
        # The server is stopped until the request has ended, so no reply can beat the end.
        os.kill(server.pid, signal.SIGSTOP)
        try:
            assert scheduler.lookup(request, 0) is None
            assert scheduler.request_finished(request, []) is False
        finally:
            os.kill(server.pid, signal.SIGCONT)
        # The reply is collected on later steps and its lock released.
        empty_step = step_output(0)
        deadline = time.monotonic() + 5.0
        while True:
            scheduler.build_plan(empty_step)
            if active_locks(server) == 0 and not scheduler._lookups.has_abandoned_replies:
                break
            assert time.monotonic() < deadline, "the aborted request's lock was never released"
            time.sleep(0.01)


def test_dead_server_means_a_miss_and_never_a_wait() -> None:
    port = free_port()
    with KVShelfClient("127.0.0.1", port, timeout_s=0.2, retry_interval_s=5.0) as client:
        scheduler = make_scheduler(client, "pool")
        first = make_request("first")
        start = time.monotonic()
        # No reply within the step's wait: asked again later.
        assert scheduler.lookup(first, 0) is None
        assert time.monotonic() - start < 0.05
        # The request waits at most the client's timeout, then is computed.
        assert ask_until_answered(scheduler, first) == 0
        assert time.monotonic() - start < 0.5
        assert scheduler.counters["lookup_failures"] == 1
        # While the server is away, later requests do not wait at all.
        start = time.monotonic()
        assert scheduler.lookup(make_request("second"), 0) == 0
        assert time.monotonic() - start < 0.05


@pytest.mark.parametrize("idle", [True, False])
def test_after_a_step_that_ran_nothing_a_lookup_waits_longer_for_its_reply(
    stored: tuple[ServerProcess, str], monkeypatch: pytest.MonkeyPatch, idle: bool
) -> None:
    # Margins of seconds, not milliseconds: the server answers 0.3 s late; a busy step may not
    # wait at all, a step after an idle one may wait up to 2 s.
    monkeypatch.setattr(lookups_module, "LOOKUP_WAIT_PER_STEP_S", 0.0)
    monkeypatch.setattr(lookups_module, "IDLE_LOOKUP_WAIT_PER_STEP_S", 2.0)
    server, pool = stored
    with server.client(timeout_s=5.0) as client:
        scheduler = make_scheduler(client, pool)
        step = step_output(0 if idle else 16)
        scheduler.build_plan(step)
        os.kill(server.pid, signal.SIGSTOP)
        resume = threading.Timer(0.3, os.kill, args=(server.pid, signal.SIGCONT))
        resume.start()
        try:
            hit = scheduler.lookup(make_request("r"), 0)
        finally:
            resume.join()
            os.kill(server.pid, signal.SIGCONT)
        if idle:
            assert hit == 3 * BLOCK
        else:
            assert hit is None
            assert ask_until_answered(scheduler, make_request("r")) == 3 * BLOCK


def test_the_plan_counts_each_outage_once_for_the_workers(
    stored: tuple[ServerProcess, str],
) -> None:
    server, pool = stored
    step = step_output(0)
    with server.client(timeout_s=0.3, retry_interval_s=0.1) as client:
        scheduler = make_scheduler(client, pool)
        assert ask_until_answered(scheduler, make_request("before")) == 3 * BLOCK
        assert scheduler.build_plan(step).server_outages == 0
        for outage in (1, 2):
            os.kill(server.pid, signal.SIGSTOP)
            try:
                # A lookup waits the whole timeout in vain: the workers are told, once.
                assert ask_until_answered(scheduler, make_request(f"stalled-{outage}")) == 0
                assert scheduler.lookup(make_request(f"fast-{outage}"), 0) == 0
                assert scheduler.build_plan(step).server_outages == outage
            finally:
                os.kill(server.pid, signal.SIGCONT)
            # Answered again (once the probe heard the server): the next timeout is news.
            deadline = time.monotonic() + 5.0
            while ask_until_answered(scheduler, make_request(f"after-{outage}")) == 0:
                assert time.monotonic() < deadline, "the server never answered again"
                time.sleep(0.05)
            assert scheduler.build_plan(step).server_outages == outage
