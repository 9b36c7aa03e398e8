"""A real server answering lookups with ``ends``: a hit of a model with state-space layers
ends only at a block boundary whose state the server holds, and covers the prefix before it.
"""

from __future__ import annotations

import os

import pytest

from kvshelf.client import KVShelfClient, ServerError
from kvshelf.protocol import ErrorCode, MissReason, PageLayout
from testbed.server import ServerProcess, map_arena_file

PAGE = 4096
BLOCKS = 6
# Two attention groups' keys per block, one state-space group's key at some boundaries.
BLOCK_KEYS = 2


def layout() -> PageLayout:
    return PageLayout(
        model_fingerprint="hybrid",
        layout_fingerprint="layout",
        page_bytes=PAGE,
        world_size=1,
        rank=0,
    )


def prefix_keys(tag: bytes) -> list[bytes]:
    return [tag + bytes([i, g]) * 8 for i in range(BLOCKS) for g in range(BLOCK_KEYS)]


def state_keys(tag: bytes) -> list[list[bytes]]:
    """``ends[i]``: the state key at the boundary after block ``i``."""
    return [[tag + b"state" + bytes([i]) * 8] for i in range(BLOCKS)]


def store(client: KVShelfClient, pool: str, keys: list[bytes]) -> dict[bytes, bytes]:
    payload = {key: os.urandom(PAGE) for key in keys}
    reservation = client.reserve(pool, 0, keys)
    arena = map_arena_file(client.registration.shm_name)
    try:
        for key, page in zip(keys, reservation.pages, strict=True):
            assert page is not None
            arena[page * PAGE : (page + 1) * PAGE] = payload[key]
    finally:
        arena.close()
    client.commit(reservation.reservation_id)
    return payload


def test_the_hit_ends_at_the_longest_boundary_with_its_prefix_and_state(
    kvshelf_server: ServerProcess,
) -> None:
    with kvshelf_server.client() as client:
        pool = client.register(layout()).pool
        prefix, ends = prefix_keys(b"a"), state_keys(b"a")
        # Every attention block, and states at boundaries 2 and 5 (after blocks 1 and 4)...
        payload = store(client, pool, prefix)
        payload |= store(client, pool, ends[1] + ends[4])
        result = client.lookup(
            pool, prefix, world_size=1, lock=True, block_keys=BLOCK_KEYS, ends=ends
        )
        # ...so a hit ends after block 4, holding blocks 0..4 and the state at that boundary.
        assert result.end_block == 5
        wanted = [*prefix[: 5 * BLOCK_KEYS], *ends[4]]
        assert result.num_hit_blocks == len(wanted) and result.lock_id > 0
        arena = map_arena_file(client.registration.shm_name)
        try:
            for key, page in zip(wanted, result.pages[0], strict=True):
                assert arena[page * PAGE : (page + 1) * PAGE] == payload[key]
        finally:
            arena.close()
        client.release(result.lock_id, 0, copied=len(wanted))


def test_a_missing_prefix_block_moves_the_end_to_an_earlier_state(
    kvshelf_server: ServerProcess,
) -> None:
    with kvshelf_server.client() as client:
        pool = client.register(layout()).pool
        prefix, ends = prefix_keys(b"b"), state_keys(b"b")
        # Block 3's second group is missing: the state after block 4 cannot be used.
        store(client, pool, [key for key in prefix if key != prefix[3 * BLOCK_KEYS + 1]])
        store(client, pool, ends[1] + ends[4])
        result = client.lookup(
            pool, prefix, world_size=1, lock=False, block_keys=BLOCK_KEYS, ends=ends
        )
        assert (result.end_block, result.num_hit_blocks) == (2, 2 * BLOCK_KEYS + 1)


def test_no_state_is_a_miss_counted_under_its_reason(
    kvshelf_server: ServerProcess,
) -> None:
    with kvshelf_server.client() as client:
        pool = client.register(layout()).pool
        prefix, ends = prefix_keys(b"c"), state_keys(b"c")
        store(client, pool, prefix)
        before = client.stats()
        result = client.lookup(
            pool, prefix, world_size=1, lock=True, block_keys=BLOCK_KEYS, ends=ends
        )
        # The lookup aimed at the longest end and its state is missing: short of its keys (the
        # prefix it did find is locked as any partial hit; the client releases it).
        assert result.end_block == BLOCKS
        assert result.num_hit_blocks == BLOCKS * BLOCK_KEYS
        assert result.miss_reason == MissReason.NEVER_STORED
        client.release(result.lock_id, 0)
        after = client.stats()
        assert after["miss_never_stored_total"] == before["miss_never_stored_total"] + 1


@pytest.mark.parametrize(
    ("block_keys", "message"),
    [(3, "not block_keys (3) per block"), (0, "not block_keys (0) per block")],
)
def test_ends_that_do_not_match_the_hashes_are_refused_and_change_nothing(
    kvshelf_server: ServerProcess, block_keys: int, message: str
) -> None:
    with kvshelf_server.client() as client:
        pool = client.register(layout()).pool
        prefix, ends = prefix_keys(b"d"), state_keys(b"d")
        store(client, pool, prefix + ends[0])
        before = client.stats()
        with pytest.raises(ServerError) as info:
            client.lookup(pool, prefix, world_size=1, lock=True, block_keys=block_keys, ends=ends)
        assert info.value.code == ErrorCode.INVALID_ARGUMENT
        assert message in str(info.value)
        after = client.stats()
        assert after["locked_objects_total"] == before["locked_objects_total"]
        assert after["bad_requests_total"] == before["bad_requests_total"] + 1
        # The server serves on: a valid lookup of the same blocks hits.
        result = client.lookup(pool, prefix[:BLOCK_KEYS], world_size=1, lock=False)
        assert result.num_hit_blocks == BLOCK_KEYS
