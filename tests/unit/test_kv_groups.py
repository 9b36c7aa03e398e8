"""kvshelf.roles.groups: keys per KV cache group, and which blocks a store or a load covers."""

from __future__ import annotations

from kvshelf.roles.groups import NULL_BLOCK_ID, ONE_FULL_GROUP, GroupKind, KVGroups, LookupKeys

FULL, WINDOW, STATE = GroupKind.FULL, GroupKind.WINDOW, GroupKind.STATE
HASHES = [bytes([i]) * 32 for i in range(1, 5)]


def test_one_group_keys_are_vllms_block_hashes() -> None:
    assert ONE_FULL_GROUP.lookup_keys(HASHES) == LookupKeys(HASHES, 1, [])
    assert KVGroups((WINDOW,)).lookup_keys(HASHES) == LookupKeys(HASHES, 1, [])
    ids, keys = ONE_FULL_GROUP.store_slots([[7, 8, 9, 10]], HASHES, 1, 3)
    assert ids == (8, 9) and keys == (HASHES[1], HASHES[2])


def test_each_group_keys_a_block_apart_block_by_block() -> None:
    groups = KVGroups((WINDOW, FULL))
    lookup = groups.lookup_keys(HASHES[:2])
    assert lookup.block_keys == 2 and lookup.ends == []
    keys = lookup.hashes
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


def test_state_groups_are_looked_up_at_the_ends_and_stored_from_vllms_checkpoints() -> None:
    groups = KVGroups((STATE, FULL, STATE))
    lookup = groups.lookup_keys(HASHES)
    # The prefix holds the attention group's keys only; each block ends with both states.
    assert lookup.block_keys == 1
    assert lookup.hashes == [groups.key(1, h) for h in HASHES]
    assert lookup.ends == [[groups.key(0, h), groups.key(2, h)] for h in HASHES]
    # A state group's table holds no boundary state to store (vLLM hands them over)...
    block_ids = [[NULL_BLOCK_ID, NULL_BLOCK_ID, 31, 32], [11, 12, 13, 14], [0, 0, 41, 42]]
    assert groups.store_slots(block_ids, HASHES, 0, 4) == (
        (11, 12, 13, 14),
        tuple(groups.key(1, h) for h in HASHES),
    )
    # ...as (group, block id, boundary): stored under the hash of the block ending there; a
    # boundary off a block, past the hashes, of an attention group or a null block is not.
    checkpoints = [(0, 31, 192), (2, 41, 192), (0, 50, 100), (0, 51, 960), (1, 13, 192), (2, 0, 96)]
    assert groups.state_slots(checkpoints, HASHES, 64 + 32) == (
        (31, 41),
        (groups.key(0, HASHES[1]), groups.key(2, HASHES[1])),
    )


def test_a_hits_states_load_into_its_boundary_block_and_the_running_block() -> None:
    groups = KVGroups((STATE, FULL))
    # A hit of 3 blocks, with vLLM's 4th block (the running state) allocated after it.
    block_ids = [[NULL_BLOCK_ID, NULL_BLOCK_ID, 31, 32], [11, 12, 13, 14]]
    # Objects of the lookup: the 3 attention blocks (0..2), then the state at the end (3).
    assert groups.load_slots(block_ids, 1, 3) == [(1, 12), (2, 13), (3, 31), (3, 32)]
