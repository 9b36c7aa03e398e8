"""``kvshelf server --eviction-policy``: a real server evicts by the policy it is given."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvshelf.protocol import PageLayout
from testbed.server import ServerProcess

PAGE = 16 * 1024
NUM_PAGES = 16
LAYOUT = PageLayout(
    model_fingerprint="m", layout_fingerprint="policy", page_bytes=PAGE, world_size=1, rank=0
)


def keys(tag: bytes, n: int) -> list[bytes]:
    return [tag + i.to_bytes(4, "big") * 4 for i in range(n)]


@pytest.mark.parametrize(("policy", "reused_survives"), [("lru", False), ("reuse", True)])
def test_a_reused_chain_survives_one_off_stores_under_reuse_only(
    policy: str, reused_survives: bool
) -> None:
    with (
        ServerProcess(
            l1_size_gb=NUM_PAGES * PAGE / 2**30,
            eviction_watermark=1.0,
            extra_args=["--eviction-policy", policy],
        ) as server,
        server.client() as client,
    ):
        pool = client.register(LAYOUT).pool

        def store(block_hashes: list[bytes]) -> None:
            reservation = client.reserve(pool, 0, block_hashes)
            assert None not in reservation.pages
            client.commit(reservation.reservation_id)

        chain = keys(b"C", 4)
        store(chain)
        assert client.lookup(pool, chain, world_size=1, lock=False).num_hit_blocks == 4
        store(keys(b"B", 12))  # the arena is full; the chain is its least recently used
        store(keys(b"N", 4))  # evicts 4 pages
        hits = client.lookup(pool, chain, world_size=1, lock=False).num_hit_blocks
        assert hits == (4 if reused_survives else 0)
        assert client.stats()["evicted_objects_total"] == 4


@pytest.mark.parametrize(
    ("flags", "disk", "said"),
    [
        ([], False, "eviction reuse)"),
        ([], True, "eviction lru, disk eviction reuse)"),
        (
            ["--eviction-policy", "reuse", "--l2-disk-eviction-policy", "lru"],
            True,
            "eviction reuse, disk eviction lru)",
        ),
    ],
)
def test_the_start_up_line_names_each_tiers_policy_defaults_depending_on_the_disk(
    flags: list[str], disk: bool, said: str, tmp_path: Path
) -> None:
    if disk:
        flags = [*flags, "--l2-disk-path", str(tmp_path), "--l2-disk-size-gb", "0.01"]
    server = ServerProcess(l1_size_gb=NUM_PAGES * PAGE / 2**30, extra_args=flags)
    with server:
        pass
    listening = [line for line in server.log().splitlines() if "listening on" in line]
    assert len(listening) == 1 and listening[0].endswith(said)
