"""The node-local socket against real servers: clients move to it, it answers as ZMQ does, and
garbage, dead clients, strangers and dead servers change nothing."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import struct
import time

import pytest
import zmq

from kvshelf.client import ServerUnavailable
from kvshelf.client.channels import LocalChannel
from kvshelf.protocol import (
    MAX_FRAME_BYTES,
    Error,
    ErrorCode,
    PageLayout,
    Ping,
    Pong,
    Register,
    Registered,
    decode_reply,
    encode,
    local_socket_name,
)
from testbed.server import ServerProcess, free_port

LAYOUT = PageLayout(
    model_fingerprint="m", layout_fingerprint="local", page_bytes=4096, world_size=1, rank=0
)
HEADER = struct.Struct("<I")


def _local_name(server: ServerProcess) -> str:
    """The local socket's name, which only a registration's reply tells."""
    name = _zmq_register(server).local_socket
    assert name, "the server named no local socket"
    return name


def _zmq_register(server: ServerProcess) -> Registered:
    context = zmq.Context.instance()
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(f"tcp://{server.host}:{server.port}")
    try:
        dealer.send(encode(Register(request_id=1, layout=LAYOUT)))
        assert dealer.poll(5000), "no reply over ZMQ"
        reply = decode_reply(dealer.recv())
    finally:
        dealer.close()
    assert isinstance(reply, Registered)
    return reply


def _connect(name: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(5.0)
    sock.connect("\0" + name)
    return sock


def _send(sock: socket.socket, frame: bytes) -> None:
    sock.sendall(HEADER.pack(len(frame)) + frame)


def _recv(sock: socket.socket) -> object:
    header = _recv_exactly(sock, HEADER.size)
    (length,) = HEADER.unpack(header)
    return decode_reply(_recv_exactly(sock, length))


def _recv_exactly(sock: socket.socket, nbytes: int) -> bytes:
    data = b""
    while len(data) < nbytes:
        chunk = sock.recv(nbytes - len(data))
        assert chunk, "the server closed the connection"
        data += chunk
    return data


def test_a_registered_client_moves_to_the_local_socket_and_sees_what_zmq_clients_see(
    kvshelf_server: ServerProcess,
) -> None:
    with (
        kvshelf_server.client(timeout_s=2.0) as local,
        kvshelf_server.client(timeout_s=2.0, local=False) as remote,
    ):
        assert local.transport == remote.transport == "zmq"  # until a registration names it
        pool = local.register(LAYOUT).pool
        remote.register(LAYOUT)
        # The move happens at the next request.
        assert local.transport == "zmq"
        local.ping()
        assert (local.transport, remote.transport) == ("local", "zmq")
        assert local.ping() == remote.ping() == kvshelf_server.boot_id

        reservation = local.reserve(pool, 0, [b"a", b"b"])
        local.commit(reservation.reservation_id)
        hit = remote.lookup(pool, [b"a", b"b"], world_size=1, lock=True)
        assert hit.num_hit_blocks == 2 and hit.pages[0] == list(reservation.pages)
        remote.release(hit.lock_id, 0)

        reservation = remote.reserve(pool, 0, [b"c"])
        remote.commit(reservation.reservation_id)
        assert local.lookup(pool, [b"a", b"b", b"c"], world_size=1, lock=False).num_hit_blocks == 3
        ticket = local.submit_lookup(pool, [b"c"], world_size=1, lock=False)
        result = local.poll_lookup(ticket, wait_s=2.0)
        assert result is not None and result.num_hit_blocks == 1
        assert local.stats()["local_socket_clients"] == 1


def test_a_client_that_never_registers_moves_once_no_reply_is_awaited(
    kvshelf_server: ServerProcess,
) -> None:
    with kvshelf_server.client(timeout_s=2.0) as writer:
        pool = writer.register(LAYOUT).pool
        writer.commit(writer.reserve(pool, 0, [b"a"]).reservation_id)
    with kvshelf_server.client(timeout_s=2.0, local=False) as observer:
        before = observer.stats()["requests_total"]
        # Like the scheduler's client: lookups only, several in flight at once.
        with kvshelf_server.client(timeout_s=2.0) as client:
            tickets = [
                client.submit_lookup(pool, [b"a"], world_size=1, lock=True) for _ in range(3)
            ]
            for ticket in tickets:
                result = client.poll_lookup(ticket, wait_s=2.0)
                # Nothing in flight was lost to the move.
                assert result is not None and result.num_hit_blocks == 1
                client.release(result.lock_id, 0)
            # The first reply told the boot, and so the local socket's name.
            assert client.transport == "local"
            assert client.lookup(pool, [b"a"], world_size=1, lock=False).num_hit_blocks == 1
            assert observer.stats()["local_socket_clients"] == 1
        # No request of its own: 3 lookups, 3 releases, 1 lookup, and the observer's 2 stats.
        assert observer.stats()["requests_total"] - before == 3 + 3 + 1 + 2


def test_no_local_socket_keeps_every_client_on_zmq() -> None:
    with ServerProcess(extra_args=["--no-local-socket"]) as server:
        assert _zmq_register(server).local_socket == ""
        with server.client(timeout_s=2.0) as client:
            pool = client.register(LAYOUT).pool
            assert client.transport == "zmq"
            client.commit(client.reserve(pool, 0, [b"a"]).reservation_id)
            assert client.lookup(pool, [b"a"], world_size=1, lock=False).num_hit_blocks == 1
            assert client.stats()["local_socket_clients"] == 0
        with server.client(timeout_s=2.0) as client:
            # A client that never registers tries the name the boot would have, once.
            for _ in range(3):
                assert client.lookup(pool, [b"a"], world_size=1, lock=False).num_hit_blocks == 1
            assert client.transport == "zmq"


def test_garbage_on_the_local_socket_gets_errors_and_changes_nothing(
    kvshelf_server: ServerProcess,
) -> None:
    name = _local_name(kvshelf_server)
    rng = random.Random(7)
    with kvshelf_server.client(timeout_s=2.0) as client:
        pool = client.register(LAYOUT).pool
        client.commit(client.reserve(pool, 0, [b"kept"]).reservation_id)
        before = client.stats()

        with _connect(name) as sock:
            # Frames that are not messages: each gets an error, and the stream stays usable.
            for frame in [b"", b"\xc1", rng.randbytes(300), encode(Ping(request_id=5))[:-1]]:
                _send(sock, frame)
                reply = _recv(sock)
                assert isinstance(reply, Error) and reply.code == ErrorCode.MALFORMED, reply
            _send(sock, encode(Ping(request_id=9)))
            reply = _recv(sock)
            assert isinstance(reply, Pong) and reply.request_id == 9

        with _connect(name) as sock:
            # A length over the limit: a clear error, then the connection is closed.
            sock.sendall(HEADER.pack(MAX_FRAME_BYTES + 1) + b"x" * 100)
            reply = _recv(sock)
            assert isinstance(reply, Error) and reply.code == ErrorCode.FRAME_TOO_LARGE
            assert sock.recv(1) == b""

        for cut in (2, HEADER.size + 3):
            # Clients that die mid-frame.
            sock = _connect(name)
            sock.sendall((HEADER.pack(50) + b"y" * 50)[:cut])
            sock.close()

        assert client.transport == "local"
        hit = client.lookup(pool, [b"kept"], world_size=1, lock=False)
        assert hit.num_hit_blocks == 1
        after = client.stats()
        assert after["bad_requests_total"] - before["bad_requests_total"] == 5
        assert after["resident_objects"] == before["resident_objects"] == 1


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user")
def test_a_peer_of_another_user_is_refused_and_counted(kvshelf_server: ServerProcess) -> None:
    name = _local_name(kvshelf_server)
    with kvshelf_server.client(timeout_s=2.0) as client:
        client.register(LAYOUT)
        before = client.stats()["rejected_handshakes_total"]
        child = os.fork()
        if child == 0:  # pragma: no cover - the child reports through its exit status
            status = 1
            try:
                os.setuid(65534)
                with _connect(name) as sock:
                    try:
                        _send(sock, encode(Ping(request_id=1)))
                        status = 0 if sock.recv(64) == b"" else 2
                    except (BrokenPipeError, ConnectionResetError):
                        status = 0  # closed before the ping was even sent
            finally:
                os._exit(status)
        _, status = os.waitpid(child, 0)
        assert os.waitstatus_to_exitcode(status) == 0, "the stranger was answered"
        assert client.stats()["rejected_handshakes_total"] == before + 1
        assert client.transport == "local"


def test_a_restarted_server_costs_no_failed_call_and_is_reached_locally_again(
    kvshelf_server: ServerProcess,
) -> None:
    with kvshelf_server.client(timeout_s=1.0, retry_interval_s=0.05) as client:
        first = client.register(LAYOUT)
        client.ping()
        assert client.transport == "local"
        kvshelf_server.kill()
        kvshelf_server.start()
        # The local socket died with its server; the call goes over ZMQ to the new one,
        # which the reply's boot id reveals: the layout is registered again, locally.
        client.lookup(first.pool, [b"h"], world_size=1, lock=False)
        assert client.registration is not None
        assert client.registration.boot_id == kvshelf_server.boot_id != first.boot_id
        assert client.ping() == kvshelf_server.boot_id
        assert client.transport == "local"


def test_a_dead_server_costs_one_timeout_then_fails_fast(kvshelf_server: ServerProcess) -> None:
    with kvshelf_server.client(timeout_s=0.5, retry_interval_s=10.0) as client:
        client.register(LAYOUT)
        client.ping()
        assert client.transport == "local"
        kvshelf_server.kill()
        start = time.monotonic()
        with pytest.raises(ServerUnavailable):
            client.ping()
        assert time.monotonic() - start < 0.5 + 0.3
        start = time.monotonic()
        with pytest.raises(ServerUnavailable, match="failed recently"):
            client.ping()
        assert time.monotonic() - start < 0.05


def test_a_stalled_server_times_out_on_the_local_socket_and_is_used_again(
    kvshelf_server: ServerProcess,
) -> None:
    with kvshelf_server.client(timeout_s=0.3, retry_interval_s=0.05) as client:
        pool = client.register(LAYOUT).pool
        os.kill(kvshelf_server.pid, signal.SIGSTOP)
        try:
            start = time.monotonic()
            with pytest.raises(ServerUnavailable):
                client.lookup(pool, [b"h"], world_size=1, lock=False)
            assert 0.25 < time.monotonic() - start < 1.0
        finally:
            os.kill(kvshelf_server.pid, signal.SIGCONT)
        deadline = time.monotonic() + 10.0
        while True:
            try:
                assert client.ping() == kvshelf_server.boot_id
                break
            except ServerUnavailable:
                assert time.monotonic() < deadline, "the client never came back"
                time.sleep(0.05)
        # The same boot: the reopened channel is the local socket again.
        assert client.transport == "local"


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user")
def test_a_client_never_trusts_a_local_socket_of_another_user() -> None:
    name = local_socket_name(free_port(), "impostor")
    ready_read, ready_write = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - an impostor listening until the parent is done
        try:
            os.setuid(65534)
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            listener.bind("\0" + name)
            listener.listen()
            os.write(ready_write, b"x")
            listener.settimeout(10)
            with contextlib.suppress(OSError):
                listener.accept()[0].recv(1)
        finally:
            os._exit(0)
    try:
        assert os.read(ready_read, 1) == b"x"
        with pytest.raises(PermissionError, match="uid 65534"):
            LocalChannel(name, 1.0)
    finally:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)
        os.close(ready_read)
        os.close(ready_write)
