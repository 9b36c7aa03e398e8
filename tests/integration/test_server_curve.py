"""CURVE authentication with an allow-list: keyed clients are served; a client without an
accepted key gets no reply, changes nothing and is counted; non-loopback binds need keys."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from kvshelf.client import KVShelfClient, ServerUnavailable
from kvshelf.curve import ClientCurve, CurveKeyError, keygen
from kvshelf.platform.shm import SHM_DIR
from kvshelf.protocol import PageLayout, Register, Reserve, Stats, encode
from testbed.server import ServerProcess, free_port, run_kvshelf

LAYOUT = PageLayout(
    model_fingerprint="m", layout_fingerprint="l", page_bytes=4096, world_size=1, rank=0
)


@pytest.fixture
def keys(tmp_path: Path) -> str:
    folder = tmp_path / "keys"
    result = run_kvshelf("keygen", str(folder))
    assert result.returncode == 0, result.stderr
    return str(folder)


@pytest.fixture
def curve_server(keys: str) -> Iterator[ServerProcess]:
    with ServerProcess(curve_keys=keys) as server:
        yield server


def test_keygen_writes_owner_only_key_pairs_and_the_allow_list(keys: str) -> None:
    folder = Path(keys)
    names = sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))
    assert names == [
        "client.key",
        "client.key_secret",
        "clients",
        "clients/client.key",
        "server.key",
        "server.key_secret",
    ]
    for path in [folder, *folder.rglob("*")]:
        mode = stat.S_IMODE(path.stat().st_mode)
        assert mode == (0o700 if path.is_dir() else 0o600), (path, oct(mode))
    # Never overwrites.
    again = run_kvshelf("keygen", keys)
    assert again.returncode == 1 and "exists already" in again.stderr


def test_a_secret_key_others_can_read_is_refused(keys: str) -> None:
    os.chmod(Path(keys) / "client.key_secret", 0o640)
    with pytest.raises(CurveKeyError, match=r"client\.key_secret is readable by other users"):
        ClientCurve.load(keys)


def raw_request(port: int, frame: bytes, curve: ClientCurve | None = None) -> bytes | None:
    """One frame over a plain DEALER socket; the reply, or None after a second of silence."""
    context = zmq.Context.instance()
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    if curve is not None:
        curve.apply(socket)
    socket.connect(f"tcp://127.0.0.1:{port}")
    try:
        socket.send(frame)
        return socket.recv() if socket.poll(1000) else None
    finally:
        socket.close()


def test_an_unkeyed_raw_client_gets_nothing_changes_nothing_and_is_counted(
    curve_server: ServerProcess,
) -> None:
    with curve_server.client() as client:
        before = client.stats()
        frames = [
            encode(Register(request_id=1, layout=LAYOUT)),
            encode(Reserve(request_id=2, pool="p", rank=0, hashes=[b"h"])),
            encode(Stats(request_id=3)),
        ]
        for frame in frames:
            assert raw_request(curve_server.port, frame) is None
        after = client.stats()
    # The keyed stats call itself is the only request the server saw.
    assert after["requests_total"] == before["requests_total"] + 1
    assert after["pools"] == 0 and after["reserved_objects_total"] == 0
    assert after["rejected_handshakes_total"] >= len(frames)


def test_a_client_whose_key_is_not_in_the_allow_list_gets_nothing(
    curve_server: ServerProcess, keys: str, tmp_path: Path
) -> None:
    stranger = ClientCurve.load(keygen(tmp_path / "other")[0].parent)
    # It knows the server's public key, but its own key is not listed.
    impostor = ClientCurve(
        stranger.public_key, stranger.secret_key, ClientCurve.load(keys).server_key
    )
    assert raw_request(curve_server.port, encode(Stats(request_id=1)), impostor) is None
    with (
        KVShelfClient("127.0.0.1", curve_server.port, timeout_s=0.5, curve=impostor) as client,
        pytest.raises(ServerUnavailable, match="refused this client's CURVE key"),
    ):
        client.register(LAYOUT)
    with curve_server.client() as client:
        stats = client.stats()
        assert stats["pools"] == 0 and stats["rejected_handshakes_total"] >= 1
    # A listed key gets an answer over the same raw socket.
    assert raw_request(curve_server.port, encode(Stats(request_id=1)), curve_server.curve)


def test_kvshelf_stats_needs_the_keys(curve_server: ServerProcess, keys: str) -> None:
    port = str(curve_server.port)
    unkeyed = run_kvshelf("stats", "--port", port, "--timeout-s", "0.5")
    assert unkeyed.returncode == 1 and "no answer" in unkeyed.stderr
    keyed = run_kvshelf("stats", "--json", "--port", port, "--curve-keys", keys)
    assert keyed.returncode == 0, keyed.stderr
    assert '"rejected_handshakes_total"' in keyed.stdout
    cleared = run_kvshelf("clear", "--port", port, "--timeout-s", "0.5")
    assert cleared.returncode == 1
    missing = run_kvshelf("stats", "--port", port, "--curve-keys", "/nonexistent")
    assert missing.returncode == 2 and "--curve-keys" in missing.stderr


def test_a_keyed_client_stores_and_hits(curve_server: ServerProcess) -> None:
    with curve_server.client() as client:
        pool = client.register(LAYOUT).pool
        client.commit(client.reserve(pool, 0, [b"a"]).reservation_id)
        assert client.lookup(pool, [b"a"], world_size=1, lock=False).num_hit_blocks == 1
    assert "CURVE authentication on: 1 allowed client keys" in curve_server.log()


def arenas(port: int) -> list[str]:
    return [n for n in os.listdir(SHM_DIR) if n.startswith(f"kvshelf-{port}-")]


def test_a_non_loopback_bind_without_keys_is_refused_naming_curve_and_the_override() -> None:
    port = free_port()
    result = run_kvshelf("server", "--host", "0.0.0.0", "--port", str(port), timeout=30)
    assert result.returncode == 2
    assert "CURVE" in result.stderr and "--curve-keys" in result.stderr
    assert "--allow-unauthenticated" in result.stderr
    assert arenas(port) == []


def test_a_non_loopback_bind_with_keys_needs_no_override(keys: str) -> None:
    server = ServerProcess(extra_args=["--host", "0.0.0.0"], curve_keys=keys)
    with server:
        pass
    assert (
        "WITHOUT AUTHENTICATION" not in server.log() and "CURVE authentication on" in server.log()
    )


def test_a_bad_keys_folder_stops_the_server_naming_the_flag(tmp_path: Path) -> None:
    result = run_kvshelf("server", "--port", str(free_port()), "--curve-keys", str(tmp_path))
    assert result.returncode == 2
    assert "--curve-keys" in result.stderr and "server.key_secret" in result.stderr
