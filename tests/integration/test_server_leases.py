"""A client killed with SIGKILL while holding reservations and locks: its leases run out."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

from kvshelf.protocol import PageLayout
from testbed.server import ServerProcess

PAGE = 16 * 1024
NUM_PAGES = 32
LEASE_S = 2.0

# Registers, stores and locks 10 keys, reserves 12 more, reports, then waits to be killed.
HOLDER = textwrap.dedent(
    """
    import sys, time
    from kvshelf.client import KVShelfClient
    from kvshelf.protocol import PageLayout

    client = KVShelfClient("127.0.0.1", int(sys.argv[1]))
    layout = PageLayout(model_fingerprint="m", layout_fingerprint="lease", page_bytes={page},
                        world_size=1, rank=0)
    pool = client.register(layout).pool
    stored = [b"S" + bytes([i]) * 31 for i in range(10)]
    client.commit(client.reserve(pool, 0, stored).reservation_id)
    lock = client.lookup(pool, stored, world_size=1, lock=True)
    held = client.reserve(pool, 0, [b"H" + bytes([i]) * 31 for i in range(12)])
    print(lock.num_hit_blocks, sum(p is not None for p in held.pages), flush=True)
    time.sleep(600)
    """
).format(page=PAGE)


def test_killed_client_leases_expire() -> None:
    with (
        ServerProcess(l1_size_gb=NUM_PAGES * PAGE / 2**30, lease_timeout_s=LEASE_S) as server,
        server.client() as client,
    ):
        holder = subprocess.Popen(
            [sys.executable, "-c", HOLDER, str(server.port)], stdout=subprocess.PIPE, text=True
        )
        try:
            assert holder.stdout is not None
            assert holder.stdout.readline().split() == ["10", "12"]
        finally:
            holder.kill()
            holder.wait()
        killed_at = time.monotonic()
        stats = client.stats()
        assert stats["locked_objects"] == 10 and stats["reserved_objects"] == 12

        layout = PageLayout(
            model_fingerprint="m", layout_fingerprint="lease", page_bytes=PAGE, world_size=1, rank=0
        )
        pool = client.register(layout).pool
        # While the leases last, only the 10 pages that are neither locked nor reserved remain.
        early = client.reserve(pool, 0, [b"N" + bytes([i]) * 31 for i in range(NUM_PAGES)])
        assert sum(p is not None for p in early.pages) == NUM_PAGES - 22
        client.abort(early.reservation_id)

        deadline = killed_at + LEASE_S + 5.0
        while client.stats()["active_reservations"] or client.stats()["active_locks"]:
            assert time.monotonic() < deadline, "leases of a dead client never expired"
            time.sleep(0.1)
        stats = client.stats()
        assert stats["locked_objects"] == 0 and stats["reserved_objects"] == 0
        assert stats["expired_locks_total"] == 1 and stats["expired_reservations_total"] == 1
        # The dead client's reserved pages are free and its locked pages evictable again.
        late = client.reserve(pool, 0, [b"M" + bytes([i]) * 31 for i in range(NUM_PAGES)])
        assert None not in late.pages
        assert client.stats()["evicted_objects_total"] == 10
