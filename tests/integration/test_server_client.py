"""The client against real servers: bounded timeouts, fast failure, restarts, stale replies."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import zmq

from kvshelf.client import KVShelfClient, ServerUnavailable
from kvshelf.protocol import PageLayout, Pong, decode_request, encode
from kvshelf.testing import ServerProcess, free_port

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
