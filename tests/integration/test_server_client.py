"""The client against real servers: bounded timeouts, fast failure, restarts, stale replies."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator

import pytest
import zmq

from kvshelf.client import KVShelfClient, ServerError, ServerUnavailable
from kvshelf.protocol import PageLayout, Pong, decode_request, encode
from testbed.server import ServerProcess, free_port

LAYOUT = PageLayout(
    model_fingerprint="m", layout_fingerprint="l", page_bytes=4096, world_size=1, rank=0
)


def test_no_server_costs_one_timeout_then_fails_fast_until_it_answers() -> None:
    port = free_port()
    with KVShelfClient("127.0.0.1", port, timeout_s=0.2, retry_interval_s=0.1) as client:
        start = time.monotonic()
        with pytest.raises(ServerUnavailable):
            client.lookup("pool", [b"h"], world_size=1, lock=False)
        assert 0.15 < time.monotonic() - start < 0.5
        # However long the outage, callers never wait again: a background probe does.
        start = time.monotonic()
        for _ in range(5):
            with pytest.raises(ServerUnavailable, match="failed recently"):
                client.ping()
            time.sleep(0.1)
        assert time.monotonic() - start < 0.5 + 0.05
        with ServerProcess(port=port) as server:
            deadline = time.monotonic() + 5.0
            while True:
                try:
                    assert client.ping() == server.boot_id
                    break
                except ServerUnavailable:
                    assert time.monotonic() < deadline, "the probe never noticed the server"
                    time.sleep(0.05)


def test_restart_is_detected_and_layout_re_registered(kvshelf_server: ServerProcess) -> None:
    with kvshelf_server.client(timeout_s=1.0, retry_interval_s=0.0) as client:
        first = client.register(LAYOUT)
        assert client.generation == 1 and client.registration == first
        client.commit(client.reserve(first.pool, 0, [b"h"]).reservation_id)

        kvshelf_server.restart()
        assert client.lookup(first.pool, [b"h"], world_size=1, lock=False).num_hit_blocks == 0
        second = client.registration
        assert client.generation == 2 and second is not None
        assert second.boot_id == kvshelf_server.boot_id != first.boot_id
        assert second.shm_name != first.shm_name and second.pool == first.pool
        # The pool exists again, so the worker can store straight away.
        assert client.reserve(second.pool, 0, [b"h"]).pages[0] is not None


def test_killed_server_fails_fast_then_reconnects(kvshelf_server: ServerProcess) -> None:
    with kvshelf_server.client(timeout_s=0.3, retry_interval_s=0.2) as client:
        client.register(LAYOUT)
        kvshelf_server.kill()
        start = time.monotonic()
        with pytest.raises(ServerUnavailable):
            client.stats()
        assert time.monotonic() - start < 0.6
        kvshelf_server.start()
        deadline = time.monotonic() + 5.0
        while True:
            try:
                assert client.ping() == kvshelf_server.boot_id
                break
            except ServerUnavailable:
                assert time.monotonic() < deadline, "the probe never noticed the restart"
                time.sleep(0.05)
        assert client.generation == 2


@pytest.fixture
def scripted_router() -> Iterator[tuple[int, list[str]]]:
    """A bare ROUTER that answers each request first with a stale id, then late, then right."""
    context = zmq.Context.instance()
    router = context.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    log: list[str] = []
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            if not router.poll(50):
                continue
            identity, frame = router.recv_multipart()
            request = decode_request(frame)
            log.append(type(request).__name__)
            stale = Pong(request_id=request.request_id - 1, boot_id="b")
            router.send_multipart([identity, encode(stale)])
            router.send_multipart([identity, b"not msgpack"])
            time.sleep(0.05)
            router.send_multipart(
                [identity, encode(Pong(request_id=request.request_id, boot_id="b"))]
            )

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield port, log
    stop.set()
    thread.join()
    router.close()


def test_stale_and_garbage_replies_are_dropped(scripted_router: tuple[int, list[str]]) -> None:
    port, log = scripted_router
    with KVShelfClient("127.0.0.1", port, timeout_s=2.0) as client:
        for _ in range(3):
            assert client.ping() == "b"
    assert log == ["Ping"] * 3


def test_client_is_thread_safe(kvshelf_server: ServerProcess) -> None:
    with kvshelf_server.client() as client:
        pool = client.register(LAYOUT).pool
        errors: list[BaseException] = []

        def work(tag: int) -> None:
            try:
                for i in range(50):
                    key = bytes([tag, i]) * 16
                    reservation = client.reserve(pool, 0, [key])
                    client.commit(reservation.reservation_id)
                    assert client.lookup(pool, [key], world_size=1, lock=False).num_hit_blocks == 1
            except BaseException as exc:  # surfaced in the main thread below
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert not errors
        assert client.stats()["resident_objects"] == 200


def store_blocks(client: KVShelfClient, pool: str, hashes: list[bytes]) -> None:
    client.commit(client.reserve(pool, 0, hashes).reservation_id)


def poll_until_answered(client: KVShelfClient, ticket: int) -> object:
    deadline = time.monotonic() + 5.0
    while (result := client.poll_lookup(ticket)) is None:
        assert time.monotonic() < deadline, "no reply"
        time.sleep(0.001)
    return result


def test_submitted_lookups_are_answered_without_blocking(kvshelf_server: ServerProcess) -> None:
    with kvshelf_server.client() as client:
        pool = client.register(LAYOUT).pool
        store_blocks(client, pool, [b"a", b"b"])
        first = client.submit_lookup(pool, [b"a", b"b", b"c"], world_size=1, lock=False)
        second = client.submit_lookup(pool, [b"x"], world_size=1, lock=False)
        # A synchronous call in between keeps both replies for their tickets.
        assert client.ping() == kvshelf_server.boot_id
        assert poll_until_answered(client, second).num_hit_blocks == 0
        assert poll_until_answered(client, first).num_hit_blocks == 2


def test_cancelled_lookup_releases_its_lock_whenever_the_reply_comes(
    kvshelf_server: ServerProcess,
) -> None:
    with kvshelf_server.client() as client:
        pool = client.register(LAYOUT).pool
        store_blocks(client, pool, [b"a"])
        # Cancelled before the reply arrives (the server is stopped until after the cancel):
        # the client releases the lock when the reply comes.
        os.kill(kvshelf_server.pid, signal.SIGSTOP)
        try:
            ticket = client.submit_lookup(pool, [b"a"], world_size=1, lock=True)
            assert client.cancel_lookup(ticket) is None
        finally:
            os.kill(kvshelf_server.pid, signal.SIGCONT)
        client.ping()
        deadline = time.monotonic() + 5.0
        while client.stats()["active_locks"] != 0:
            assert time.monotonic() < deadline, "the abandoned lock was never released"
            time.sleep(0.01)
        # Cancelled after the reply arrived: the caller gets the result and owns the lock.
        ticket = client.submit_lookup(pool, [b"a"], world_size=1, lock=True)
        time.sleep(0.05)
        client.ping()
        result = client.cancel_lookup(ticket)
        assert result is not None and result.lock_id != 0
        assert client.stats()["active_locks"] == 1
        client.release(result.lock_id, 0)
        assert client.stats()["active_locks"] == 0


def test_unanswered_lookup_times_out_then_fails_fast() -> None:
    port = free_port()
    with KVShelfClient("127.0.0.1", port, timeout_s=0.2, retry_interval_s=0.1) as client:
        ticket = client.submit_lookup("pool", [b"h"], world_size=1, lock=True)
        assert client.poll_lookup(ticket) is None
        time.sleep(0.25)
        with pytest.raises(ServerUnavailable, match="did not answer"):
            client.poll_lookup(ticket)
        with pytest.raises(ServerUnavailable, match="failed recently"):
            client.submit_lookup("pool", [b"h"], world_size=1, lock=True)


def test_lookup_in_flight_when_the_connection_resets_fails_at_once() -> None:
    port = free_port()
    with KVShelfClient("127.0.0.1", port, timeout_s=0.2, retry_interval_s=10.0) as client:
        ticket = client.submit_lookup("pool", [b"h"], world_size=1, lock=False)
        # A synchronous call times out and resets the socket: the reply can never come.
        with pytest.raises(ServerUnavailable):
            client.ping()
        start = time.monotonic()
        with pytest.raises(ServerUnavailable, match="connection reset"):
            client.poll_lookup(ticket)
        assert time.monotonic() - start < 0.05


def test_commit_nowait_lands_before_the_next_request_and_its_error_is_dropped(
    kvshelf_server: ServerProcess,
) -> None:
    with kvshelf_server.client(timeout_s=2.0) as client:
        pool = client.register(LAYOUT).pool
        reservation = client.reserve(pool, 0, [b"a", b"b"])
        client.commit_nowait(reservation.reservation_id)
        # The server answers one connection in order: the commit is in before this lookup.
        assert client.lookup(pool, [b"a", b"b"], world_size=1, lock=False).num_hit_blocks == 2
        # A second commit of it is rejected; the error reply is dropped, later calls go on.
        bad_before = client.stats()["bad_requests_total"]
        client.commit_nowait(reservation.reservation_id)
        assert client.ping() == kvshelf_server.boot_id
        assert client.stats()["bad_requests_total"] == bad_before + 1


def test_a_reserve_sent_ahead_is_taken_after_other_calls_and_its_error_raised_there(
    kvshelf_server: ServerProcess,
) -> None:
    with kvshelf_server.client(timeout_s=2.0) as client:
        pool = client.register(LAYOUT).pool
        ahead = client.submit_reserve(pool, 0, [b"next-1", b"next-2"])
        # Calls made meanwhile (as the store thread copies and commits the current batch)
        # neither take nor drop its reply.
        current = client.reserve(pool, 0, [b"current"])
        client.commit_nowait(current.reservation_id)
        assert client.ping() == kvshelf_server.boot_id
        reservation = client.take_reserve(ahead)
        assert len(reservation.pages) == 2 and None not in reservation.pages
        assert set(reservation.pages).isdisjoint(current.pages)
        # Not visible before its commit.
        assert client.lookup(pool, [b"next-1"], world_size=1, lock=False).num_hit_blocks == 0
        client.commit_nowait(reservation.reservation_id)
        hit = client.lookup(pool, [b"next-1", b"next-2"], world_size=1, lock=False)
        assert hit.num_hit_blocks == 2
        unknown = client.submit_reserve("no-such-pool", 0, [b"x"])
        with pytest.raises(ServerError):
            client.take_reserve(unknown)
        assert client.ping() == kvshelf_server.boot_id
