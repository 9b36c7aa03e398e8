"""Every signal an operator or a supervisor sends ends the server cleanly: a log line, exit 0,
and no ``/dev/shm/kvshelf-*`` left behind, also with pools, stored objects and locks held."""

from __future__ import annotations

import os
import signal

import pytest

from kvshelf.platform.shm import SHM_DIR
from kvshelf.protocol import PageLayout
from testbed.server import ServerProcess

LAYOUT = PageLayout(
    model_fingerprint="m", layout_fingerprint="l", page_bytes=4096, world_size=1, rank=0
)


@pytest.mark.parametrize(
    "signum",
    [signal.SIGHUP, signal.SIGTERM, signal.SIGINT, signal.SIGQUIT],
    ids=lambda s: signal.Signals(s).name,
)
def test_a_stop_signal_ends_the_server_cleanly_and_leaves_no_shared_memory(
    signum: signal.Signals,
) -> None:
    server = ServerProcess()
    with server:
        shm_path = server.shm_path
        with server.client() as client:
            pool = client.register(LAYOUT).pool
            client.commit(client.reserve(pool, 0, [b"a", b"b"]).reservation_id)
            client.reserve(pool, 0, [b"c"])  # left uncommitted
            assert client.lookup(pool, [b"a"], world_size=1, lock=True).num_hit_blocks == 1
        assert os.path.exists(shm_path)
        assert server.send_signal(signum) == 0
    assert not os.path.exists(shm_path)
    assert not [n for n in os.listdir(SHM_DIR) if n.startswith(f"kvshelf-{server.port}-")]
    log = server.log()
    assert f"received {signum.name}, shutting down" in log, log
    assert "kvshelf server stopped" in log and "Traceback" not in log
