"""A stalled server (SIGSTOP) never locks pages for lookups whose clients gave up: each lookup
carries its client's deadline, and the server answers EXPIRED instead of locking. A client told
the server is silent (by another process that waited a whole timeout) stops waiting for it."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from kvshelf.client import KVShelfClient, ServerError, ServerUnavailable
from kvshelf.client.outages import Outages
from kvshelf.protocol import (
    ErrorCode,
    Lookup,
    PageLayout,
    decode_reply,
    encode,
    lookup_deadline_ms,
)
from testbed.server import ServerProcess

PAGE = 16 * 1024
TIMEOUT_S = 0.5
STALL_S = 2.0
KEYS = [bytes([i]) * 32 for i in range(1, 9)]


def layout() -> PageLayout:
    return PageLayout(
        model_fingerprint="m", layout_fingerprint="stall", page_bytes=PAGE, world_size=1, rank=0
    )


def test_lookups_queued_during_a_stall_lock_nothing_once_it_resumes() -> None:
    import zmq

    # A lease far longer than the test: only the deadlines can keep pages unlocked.
    with ServerProcess(l1_size_gb=1 / 64, lease_timeout_s=60.0) as server:
        with server.client() as writer:
            pool = writer.register(layout()).pool
            writer.commit(writer.reserve(pool, 0, KEYS).reservation_id)
        clients = [
            KVShelfClient(server.host, server.port, timeout_s=TIMEOUT_S, retry_interval_s=0.2)
            for _ in range(4)
        ]
        # A client that gives up without closing its socket (its replies would still arrive).
        silent = zmq.Context.instance().socket(zmq.DEALER)
        silent.connect(f"tcp://{server.host}:{server.port}")
        try:
            os.kill(server.pid, signal.SIGSTOP)
            stopped_at = time.monotonic()
            try:
                # The scheduler's ticketed lookups, given up on (cancelled) by three clients.
                for client in clients[:3]:
                    for _ in range(5):
                        ticket = client.submit_lookup(pool, KEYS, world_size=1, lock=True)
                        assert client.poll_lookup(ticket, wait_s=0.01) is None
                        assert client.cancel_lookup(ticket) is None
                for i in range(5):
                    silent.send(
                        encode(
                            Lookup(
                                request_id=100 + i,
                                pool=pool,
                                hashes=KEYS,
                                world_size=1,
                                lock=True,
                                deadline_ms=lookup_deadline_ms(TIMEOUT_S),
                            )
                        )
                    )
                # A synchronous lookup that times out (its client resets the socket).
                with pytest.raises(ServerUnavailable):
                    clients[3].lookup(pool, KEYS, world_size=1, lock=True)
                assert time.monotonic() - stopped_at < STALL_S
                time.sleep(STALL_S - (time.monotonic() - stopped_at))
            finally:
                os.kill(server.pid, signal.SIGCONT)
            resumed_at = time.monotonic()
            with server.client(timeout_s=5.0) as observer:
                while time.monotonic() - resumed_at < 1.0:
                    stats = observer.stats()
                    assert stats["locked_objects"] == 0 and stats["active_locks"] == 0, stats
                    time.sleep(0.05)
                # Every lookup that reached the server was refused, none locked.
                assert stats["expired_lookups_total"] >= 20, stats
                assert stats["lookup_requests_total"] == 0 and stats["locked_objects_total"] == 0
                # Live clients are served as before.
                result = observer.lookup(pool, KEYS, world_size=1, lock=True)
                assert result.num_hit_blocks == len(KEYS)
                observer.release(result.lock_id, 0)
        finally:
            silent.close(linger=0)
            for client in clients:
                client.close()


def test_a_lookup_past_its_deadline_is_answered_expired(kvshelf_server: ServerProcess) -> None:
    with kvshelf_server.client() as client:
        pool = client.register(layout()).pool
        client.commit(client.reserve(pool, 0, KEYS).reservation_id)
    import zmq

    socket = zmq.Context.instance().socket(zmq.DEALER)
    socket.connect(f"tcp://{kvshelf_server.host}:{kvshelf_server.port}")
    try:
        past = int(time.time() * 1000) - 1
        lookup = Lookup(request_id=7, pool=pool, hashes=KEYS, world_size=1, lock=True)
        socket.send(encode(Lookup(**{**_fields(lookup), "deadline_ms": past})))
        assert socket.poll(5000)
        reply = decode_reply(socket.recv())
        assert getattr(reply, "code", None) is ErrorCode.EXPIRED and reply.request_id == 7
        # No deadline (an older client) is still answered.
        socket.send(encode(lookup))
        assert socket.poll(5000)
        assert decode_reply(socket.recv()).num_hit_blocks == len(KEYS)
    finally:
        socket.close(linger=0)
    with kvshelf_server.client() as client:
        stats = client.stats()
        assert stats["expired_lookups_total"] == 1 and stats["active_locks"] == 1
        with pytest.raises(ServerError):
            client.release(10**9, 0)


def _fields(message: Lookup) -> dict[str, object]:
    return {name: getattr(message, name) for name in message.__struct_fields__}


def test_a_client_told_the_server_is_silent_stops_waiting_for_it() -> None:
    # The worker's view of a stall the scheduler found first (StepPlan.server_outages): a call
    # already waiting gives up, later calls fail at once, and the probe brings it back.
    with (
        ServerProcess(l1_size_gb=1 / 64) as server,
        KVShelfClient(server.host, server.port, timeout_s=5.0, retry_interval_s=0.2) as client,
    ):
        pool = client.register(layout()).pool
        os.kill(server.pid, signal.SIGSTOP)
        try:
            # A reserve sent ahead, as the store thread does, then a wait for it.
            ticket = client.submit_reserve(pool, 0, KEYS[:1])
            threading.Timer(0.3, client.assume_unavailable).start()
            started = time.monotonic()
            with pytest.raises(ServerUnavailable):
                client.take_reserve(ticket)
            assert time.monotonic() - started < 1.0  # not the 5 s timeout
            started = time.monotonic()
            with pytest.raises(ServerUnavailable):
                client.ping()
            assert time.monotonic() - started < 0.1
        finally:
            os.kill(server.pid, signal.SIGCONT)
        deadline = time.monotonic() + 5.0
        while True:
            try:
                assert client.ping() == server.boot_id
                break
            except ServerUnavailable:
                assert time.monotonic() < deadline, "the probe never heard the server"
                time.sleep(0.05)
        # A synchronous call waiting when the word comes gives up too.
        os.kill(server.pid, signal.SIGSTOP)
        try:
            threading.Timer(0.3, client.assume_unavailable).start()
            started = time.monotonic()
            with pytest.raises(ServerUnavailable):
                client.stats()
            assert time.monotonic() - started < 1.0
        finally:
            os.kill(server.pid, signal.SIGCONT)


def test_clients_of_one_process_pay_one_timeout_per_stall() -> None:
    # An engine's store thread (the worker's client) meets the stall first, in a reserve; the
    # scheduler's lookup of the next requests, sent meanwhile on a client of its own, gives up
    # when the worker's ends, not a timeout of its own later; a client outside the group (a
    # benchmark's monitor) still waits its own.
    timeout_s = 2.0
    with ServerProcess(l1_size_gb=1 / 64) as server:
        outages = Outages()
        worker, scheduler = (
            KVShelfClient(
                server.host,
                server.port,
                timeout_s=timeout_s,
                retry_interval_s=0.2,
                outages=outages,
            )
            for _ in range(2)
        )
        outsider = KVShelfClient(server.host, server.port, timeout_s=0.3, retry_interval_s=0.2)
        try:
            pool = worker.register(layout()).pool
            assert scheduler.ping() == outsider.ping() == server.boot_id
            os.kill(server.pid, signal.SIGSTOP)
            try:
                started = time.monotonic()
                failed: list[BaseException] = []
                store = threading.Thread(target=_reserve, args=(worker, pool, failed))
                store.start()
                time.sleep(0.5)
                ticket = scheduler.submit_lookup(pool, KEYS, world_size=1, lock=True)
                with pytest.raises(ServerUnavailable):
                    while scheduler.poll_lookup(ticket, wait_s=0.05) is None:
                        pass
                # Before outages were shared: 0.5 s + a timeout of the scheduler's own.
                assert time.monotonic() - started < timeout_s + 0.3
                store.join()
                assert [type(exc) for exc in failed] == [ServerUnavailable]
                started = time.monotonic()
                with pytest.raises(ServerUnavailable):
                    scheduler.submit_lookup(pool, KEYS, world_size=1, lock=True)
                assert time.monotonic() - started < 0.1
                started = time.monotonic()
                with pytest.raises(ServerUnavailable):
                    outsider.ping()
                assert time.monotonic() - started >= 0.3
            finally:
                os.kill(server.pid, signal.SIGCONT)
            # Each comes back by its own probe.
            deadline = time.monotonic() + 5.0
            for client in (worker, scheduler):
                while True:
                    try:
                        assert client.ping() == server.boot_id
                        break
                    except ServerUnavailable:
                        assert time.monotonic() < deadline, "the probe never heard the server"
                        time.sleep(0.05)
        finally:
            for client in (worker, scheduler, outsider):
                client.close()


def _reserve(client: KVShelfClient, pool: str, failed: list[BaseException]) -> None:
    try:
        client.reserve(pool, 0, KEYS[:1])
    except BaseException as exc:  # checked by the test's thread
        failed.append(exc)
