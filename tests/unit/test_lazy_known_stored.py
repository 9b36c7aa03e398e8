"""EVICTION_AWARE's memory of stored blocks yields to the server's answers (issue 15).

The policy skips blocks it believes the server holds; a lookup that finds them missing (the
server restarted empty, evicted them, or their store was dropped) must make them stored again.
"""

from __future__ import annotations

import pytest
from test_lazy_eviction_aware import make
from test_lazy_offloader import MiniScheduler

from kvshelf.lazy.offloader import LazyOffloader
from kvshelf.metric_types import Counters
from kvshelf.metrics import SCHEDULER
from kvshelf.plan import StoreJob
from kvshelf.roles.scheduler_lookups import Lookups

pytest.importorskip("vllm.v1.core.block_pool")


def finish_same(sched: MiniScheduler, offloader: LazyOffloader, request_id: str) -> StoreJob:
    """A request of the same three blocks of content as every other here, finished."""
    sched.start(request_id)
    store = sched.compute(request_id, [f"same:{i}".encode() for i in range(3)])
    offloader.add(store)
    offloader.request_finished(request_id)
    sched.finish(request_id)
    return store


def test_a_block_found_missing_is_stored_again() -> None:
    sched = MiniScheduler(32)
    offloader = make(sched, window=64)
    first = finish_same(sched, offloader, "a")
    offloader.drain(1)
    offloader.store_completed("a")
    # The same content again, believed stored: nothing is buffered.
    finish_same(sched, offloader, "b")
    assert offloader.snapshot()["buffered_requests"] == 0
    # A lookup answers that the server holds only its first block.
    offloader.note_missing(first.block_hashes[1:])
    again = finish_same(sched, offloader, "c")
    (store,) = offloader.drain(1)
    assert store.request_id == "c" and store.first_block == 1
    assert store.block_hashes == again.block_hashes[1:] == first.block_hashes[1:]


class _Request:
    request_id = "r"
    num_tokens = 4 * 16 + 1
    block_hashes = [bytes([i]) for i in range(4)]


class _Reply:
    pending = False
    miss_reason = None
    num_hit_blocks = 1
    lock_id = 0
    boot_id = "boot"
    pages = ()


class _Client:
    def submit_lookup(self, *args: object, **kwargs: object) -> int:
        return 1

    def poll_lookup(self, ticket: int, wait_s: float = 0.0) -> _Reply:
        return _Reply()


def test_lookups_report_the_blocks_asked_beyond_the_hit() -> None:
    replies: list[tuple[int, int]] = []
    lookups = Lookups(
        Counters(SCHEDULER),
        lambda request, hit, asked: replies.append((hit, asked)),
        _Client(),  # type: ignore[arg-type]
        "pool",
        16,
        1,
    )
    assert lookups.lookup(_Request(), 0) == 0
    assert replies == [(1, 4)]
