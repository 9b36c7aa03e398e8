"""kvshelf.roles.groups: keys per KV cache group, and which blocks a store or a load covers."""

from __future__ import annotations

from kvshelf.roles.groups import NULL_BLOCK_ID, ONE_FULL_GROUP, GroupKind, KVGroups

FULL, WINDOW = GroupKind.FULL, GroupKind.WINDOW
HASHES = [bytes([i]) * 32 for i in range(1, 5)]


def test_one_group_keys_are_vllms_block_hashes() -> None:
    assert ONE_FULL_GROUP.lookup_keys(HASHES) == HASHES
    assert KVGroups((WINDOW,)).lookup_keys(HASHES) == HASHES
    ids, keys = ONE_FULL_GROUP.store_slots([[7, 8, 9, 10]], HASHES, 1, 3)
    assert ids == (8, 9) and keys == (HASHES[1], HASHES[2])


def test_each_group_keys_a_block_apart_block_by_block() -> None:
    groups = KVGroups((WINDOW, FULL))
    keys = groups.lookup_keys(HASHES[:2])
    assert len(keys) == 4 == len(set(keys))
    assert keys == [
        groups.key(0, HASHES[0]),
        groups.key(1, HASHES[0]),
        groups.key(0, HASHES[1]),
        groups.key(1, HASHES[1]),
    ]
    assert HASHES[0] not in keys


def test_null_blocks_are_never_stored_nor_loaded() -> None:
    groups = KVGroups((WINDOW, FULL))
    # The window group gave back blocks 0 and 1; the full group holds all four.
    block_ids = [[NULL_BLOCK_ID, NULL_BLOCK_ID, 21, 22], [11, 12, 13, 14]]
    ids, keys = groups.store_slots(block_ids, HASHES, 0, 4)
    assert ids == (11, 12, 21, 13, 22, 14)
    assert keys[2] == groups.key(0, HASHES[2]) and keys[0] == groups.key(1, HASHES[0])
    # Loading blocks 1..3 of a hit: each slot is (object index in the lookup, block id).
    assert groups.load_slots(block_ids, 1, 4) == [(3, 12), (4, 21), (5, 13), (6, 22), (7, 14)]
    assert groups.store_slots([[NULL_BLOCK_ID] * 4, [NULL_BLOCK_ID] * 4], HASHES, 0, 4) == ((), ())
