"""FIFO offload policy, policy registry and lazy offload configuration."""

from __future__ import annotations

import logging

import pytest

from kvshelf.connector_config import LAZY_OFFLOAD_POLICIES, LazyOffloadConfig
from kvshelf.lazy.policies.base import OffloadPolicy
from kvshelf.lazy.policies.fifo import FIFOOffloadPolicy
from kvshelf.lazy.policies.registry import POLICIES, create_policy
from kvshelf.plan import StoreJob


def store(request_id: str, first_block: int = 0, num_blocks: int = 1) -> StoreJob:
    block_ids = tuple(range(first_block, first_block + num_blocks))
    hashes = tuple(f"{request_id}:{i}".encode() for i in block_ids)
    return StoreJob(request_id, block_ids, hashes, first_block)


def add_request(policy: OffloadPolicy, request_id: str, *, finished: bool) -> None:
    job = store(request_id)
    policy.add(job, [b"h"] * job.num_blocks)
    if finished:
        assert policy.mark_req_finished(request_id)


def popped_ids(policy: OffloadPolicy, count: int) -> list[str]:
    return [item.request_id for item in policy.pop_items_for_offload(count)]


def test_config_defaults_match_spec() -> None:
    config = LazyOffloadConfig()
    assert config.enabled is False
    # LMCache 0.5.6's default; FIFO is the specified policy when named.
    assert config.policy == "EVICTION_AWARE"
    assert config.threshold == 100
    assert config.select_count == 10
    config.validate()


def test_fifo_default_threshold_is_100() -> None:
    assert FIFOOffloadPolicy().threshold == 100


def test_fifo_logs_enabled_line_at_info(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="kvshelf.lazy"):
        FIFOOffloadPolicy(20)
    messages = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert messages == [
        (logging.INFO, "lazy offload enabled with FIFO policy, offload threshold: 20")
    ]


def test_create_policy_matches_name_exactly() -> None:
    assert isinstance(create_policy("FIFO", 5), FIFOOffloadPolicy)
    assert create_policy("FIFO", 5).threshold == 5
    for name in ("fifo", "Fifo", " FIFO", "LRU", ""):
        with pytest.raises(ValueError) as excinfo:
            create_policy(name, 5)
        assert str(excinfo.value) == f"Unknown offload policy: {name}"


def test_every_configurable_policy_name_is_registered() -> None:
    assert tuple(POLICIES) == LAZY_OFFLOAD_POLICIES


def test_create_policy_hands_block_pool_to_policies_that_take_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    class PoolAwarePolicy(FIFOOffloadPolicy):
        @classmethod
        def create(cls, threshold, block_pool):
            policy = cls(threshold)
            policy.block_pool = block_pool
            return policy

    monkeypatch.setitem(POLICIES, "POOL_AWARE", PoolAwarePolicy)
    pool = object()
    policy = create_policy("POOL_AWARE", 3, block_pool=pool)
    assert isinstance(policy, PoolAwarePolicy)
    assert policy.block_pool is pool
    assert policy.threshold == 3


@pytest.mark.parametrize("bad", [0, -1, True, False, 1.5, 10.0, "10", None])
@pytest.mark.parametrize(
    ("field", "key"),
    [
        ("threshold", "lmcache.mp.lazy_offload_threshold"),
        ("select_count", "lmcache.mp.lazy_offload_select_count"),
    ],
)
def test_config_validate_rejects_non_positive_or_non_int(field: str, key: str, bad) -> None:
    config = LazyOffloadConfig(enabled=True, **{field: bad})
    with pytest.raises(ValueError, match=key):
        config.validate()


def test_config_validate_rejects_unknown_policy() -> None:
    with pytest.raises(ValueError) as excinfo:
        LazyOffloadConfig(enabled=True, policy="LIFO").validate()
    assert str(excinfo.value) == "Unknown offload policy: LIFO"


def test_config_validate_rejects_non_bool_enabled() -> None:
    with pytest.raises(ValueError, match=r"lmcache\.mp\.lazy_offload "):
        LazyOffloadConfig(enabled="false").validate()


def test_config_validate_accepts_article_example() -> None:
    LazyOffloadConfig(enabled=True, policy="FIFO", threshold=20, select_count=10).validate()


@pytest.mark.parametrize("bad", [0, -5, True, 2.0])
def test_policy_rejects_bad_threshold_naming_the_key(bad) -> None:
    with pytest.raises(ValueError, match=r"lmcache\.mp\.lazy_offload_threshold"):
        FIFOOffloadPolicy(bad)


def test_steps_of_one_request_aggregate_into_one_item_in_arrival_order() -> None:
    policy = FIFOOffloadPolicy(1)
    steps = [store("a", 0, 2), store("a", 2, 3), store("a", 5, 1)]
    policy.add(steps[0], [b"0", b"1"])
    policy.add(store("b"), [b"b"])
    policy.add(steps[1], [b"2", b"3", None])
    policy.add(steps[2], [b"5"])
    assert policy.num_pending == 2
    policy.mark_req_finished("a")
    (item,) = policy.pop_items_for_offload(1)
    assert item.request_id == "a"
    assert item.finished
    assert [job for job, _ in item.entries] == steps
    assert [hashes for _, hashes in item.entries] == [(b"0", b"1"), (b"2", b"3", None), (b"5",)]
    assert item.num_blocks == 6


def test_finish_counts_once_per_request() -> None:
    policy = FIFOOffloadPolicy(2)
    policy.add(store("a"), [b"h"])
    policy.add(store("a", 1), [b"h"])
    assert policy.mark_req_finished("a") is True
    assert policy.mark_req_finished("a") is False
    assert policy.num_ready == 1
    assert policy.pop_items_for_offload(10) == []


def test_mark_finished_of_unknown_request_is_a_noop() -> None:
    policy = FIFOOffloadPolicy(1)
    assert policy.mark_req_finished("never-stored") is False
    assert policy.num_ready == 0
    assert policy.num_pending == 0
    # It must not count towards a later trigger either.
    add_request(policy, "a", finished=False)
    assert policy.pop_items_for_offload(10) == []


def test_nothing_pops_below_threshold() -> None:
    policy = FIFOOffloadPolicy(3)
    add_request(policy, "a", finished=True)
    add_request(policy, "b", finished=True)
    add_request(policy, "c", finished=False)
    assert policy.pop_items_for_offload(10) == []
    assert (policy.num_pending, policy.num_ready) == (3, 2)
    policy.mark_req_finished("c")
    assert popped_ids(policy, 10) == ["a", "b", "c"]


@pytest.mark.parametrize("count", [0, -1, -100])
def test_non_positive_count_pops_nothing(count: int) -> None:
    policy = FIFOOffloadPolicy(1)
    add_request(policy, "a", finished=True)
    assert policy.pop_items_for_offload(count) == []
    assert (policy.num_pending, policy.num_ready) == (1, 1)


def test_threshold_20_select_10_leaves_10_ready_until_10_more_finish() -> None:
    policy = FIFOOffloadPolicy(20)
    for i in range(20):
        add_request(policy, f"r{i}", finished=True)
    assert popped_ids(policy, 10) == [f"r{i}" for i in range(10)]
    assert (policy.num_pending, policy.num_ready) == (10, 10)
    # The other 10 are still ready, but below the threshold: no trigger.
    assert policy.pop_items_for_offload(10) == []
    for i in range(20, 29):
        add_request(policy, f"r{i}", finished=True)
    assert policy.pop_items_for_offload(10) == []
    add_request(policy, "r29", finished=True)
    assert popped_ids(policy, 10) == [f"r{i}" for i in range(10, 20)]
    assert (policy.num_pending, policy.num_ready) == (10, 10)


def test_threshold_1_select_2_six_finished_pop_as_three_batches() -> None:
    policy = FIFOOffloadPolicy(1)
    for i in range(6):
        add_request(policy, f"r{i}", finished=True)
    batches = [popped_ids(policy, 2) for _ in range(4)]
    assert batches == [["r0", "r1"], ["r2", "r3"], ["r4", "r5"], []]
    assert (policy.num_pending, policy.num_ready) == (0, 0)


def test_unfinished_items_are_skipped_and_keep_their_place() -> None:
    policy = FIFOOffloadPolicy(1)
    add_request(policy, "a", finished=False)
    add_request(policy, "b", finished=True)
    add_request(policy, "c", finished=False)
    add_request(policy, "d", finished=True)
    assert popped_ids(policy, 10) == ["b", "d"]
    assert (policy.num_pending, policy.num_ready) == (2, 0)
    # Insertion order, not finishing order, decides.
    policy.mark_req_finished("c")
    policy.mark_req_finished("a")
    assert popped_ids(policy, 10) == ["a", "c"]


def test_popped_items_leave_queue_and_ready_count() -> None:
    policy = FIFOOffloadPolicy(1)
    for name in "abc":
        add_request(policy, name, finished=True)
    assert popped_ids(policy, 2) == ["a", "b"]
    assert (policy.num_pending, policy.num_ready) == (1, 1)
    # A popped request is gone: finishing it again changes nothing.
    assert policy.mark_req_finished("a") is False
    assert policy.num_ready == 1
    assert popped_ids(policy, 2) == ["c"]
