"""ProtectedBlocks: the one ledger of the references lazy offload holds on GPU blocks."""

from __future__ import annotations

from collections import Counter

import pytest

from kvshelf.lazy.protection import ProtectedBlocks


class RecordingPool:
    """A block pool view that counts the references taken and dropped on each block."""

    def __init__(self) -> None:
        self.refs: Counter[int] = Counter()
        self.freed: list[list[int]] = []

    def block_hash(self, block_id: int) -> object | None:
        raise AssertionError("the ledger never reads hashes")

    def touch(self, block_ids) -> None:
        self.refs.update(block_ids)

    def free(self, block_ids) -> None:
        self.freed.append(list(block_ids))
        self.refs.subtract(block_ids)
        assert min(self.refs.values(), default=0) >= 0


def storing(ledger: ProtectedBlocks, request_id: str, block_ids: list[int]) -> None:
    ledger.hold(request_id, block_ids)
    ledger.mark_storing(request_id, len(block_ids))


def test_protected_blocks_accumulate_per_request_and_pop_once() -> None:
    pool = RecordingPool()
    ledger = ProtectedBlocks(pool)
    storing(ledger, "a", [1, 2])
    storing(ledger, "b", [2])
    storing(ledger, "a", [3])
    assert ledger.num_blocks == 4
    assert ledger.request_ids == ["a", "b"]
    assert pool.refs == Counter({2: 2, 1: 1, 3: 1})
    assert ledger.drop_storing("a") == 3
    # Freed tail first, as vLLM frees a request's blocks.
    assert pool.freed == [[3, 2, 1]]
    assert ledger.drop_storing("a") == 0
    assert ledger.drop_storing("unknown") == 0
    assert ledger.num_blocks == 1
    assert ledger.request_ids == ["b"]
    ledger.check()


def test_waiting_blocks_move_to_storing_or_go_back_in_block_order() -> None:
    pool = RecordingPool()
    ledger = ProtectedBlocks(pool)
    ledger.hold("r", [4, 5, 6, 7])
    assert ledger.waiting("r") == [4, 5, 6, 7]
    ledger.mark_storing("r", 2)
    assert ledger.waiting("r") == [6, 7]
    assert ledger.num_blocks == 4 and pool.freed == []
    assert ledger.drop_waiting("r", 1) == 1
    assert pool.freed == [[6]]
    assert ledger.drop_waiting("r") == 1
    assert ledger.waiting("r") == [] and ledger.drop_waiting("r") == 0
    assert ledger.num_blocks == 2
    ledger.check()
    assert ledger.drop_storing("r") == 2
    assert pool.freed[-1] == [5, 4]
    assert ledger.num_blocks == 0 and ledger.request_ids == []
    assert +pool.refs == Counter()


def test_nothing_held_for_an_empty_list() -> None:
    ledger = ProtectedBlocks(RecordingPool())
    ledger.hold("r", [])
    assert ledger.request_ids == [] and ledger.num_blocks == 0
    ledger.check()


def test_moving_more_than_is_waiting_is_a_bug() -> None:
    ledger = ProtectedBlocks(RecordingPool())
    ledger.hold("r", [1])
    with pytest.raises(AssertionError):
        ledger.mark_storing("r", 2)
