"""The seam's lookups of keys the index does not know: a tier that ``discovers`` (a shared
store such as Redis) is asked about them, and the keys it has are loaded before the answer."""

from __future__ import annotations

# The seam's test doubles and fixtures (pytest puts this folder on sys.path).
from test_tiers import PAGE, RecordingTier, completions, keys, make_index, memory, register

from kvshelf.server.completions import Completions
from kvshelf.server.lower_tiers import DeferredLookup, IndexHit
from kvshelf.server.tiers.base import TierProbe
from kvshelf.server.tiers.shared_memory import SharedMemoryArena

__all__ = ["completions", "memory"]


class DiscoveringTier(RecordingTier):
    """A recording tier that may hold keys the index never heard of."""

    def __init__(self, reachable: bool = True) -> None:
        super().__init__({})
        self.reachable = reachable
        self.probes: list[TierProbe] = []
        self.completed_probes: list[TierProbe] = []

    def lookup(self, entry: object) -> bool:
        return self.reachable

    def discovers(self) -> bool:
        return self.reachable

    def prepare_probe(self, probe: TierProbe) -> None:
        self.probes.append(probe)

    def complete_probe(self, probe: TierProbe) -> None:
        self.completed_probes.append(probe)


def test_unknown_keys_are_probed_then_loaded_before_the_answer(
    memory: SharedMemoryArena, completions: Completions
) -> None:
    tier = DiscoveringTier()
    index, _ = make_index(memory, completions, tier)
    pool = register(index, world_size=2)
    hashes = keys(1, 2, 3, 4)
    for rank in range(2):
        index.commit(index.reserve(pool, rank, hashes[:1], now=0.0)[0])
    for store in tier.stores:
        store.finish()
    completions.run()

    pending = index.lookup(pool, hashes, 2, lock=True, now=0.0)
    assert isinstance(pending, DeferredLookup)
    answers: list[IndexHit | None] = []
    pending.answer = answers.append
    (probe,) = tier.probes
    # Only the keys after the prefix the index knows, every rank.
    assert probe.keys == [(rank, h) for h in hashes[1:] for rank in range(2)]
    assert tier.loads == []
    # The tier has blocks 2 and 3 for both ranks, and block 4 for rank 0 only.
    found = [f"k{h[-1]}-{rank}" if h != hashes[3] or rank == 0 else None for rank, h in probe.keys]
    probe.finish(found)
    assert completions.run() == 1 and answers == []
    assert tier.completed_probes == [probe]
    index.check_invariants()
    # Block 4 is loadable for rank 0 only: not part of the loadable prefix, so not loaded.
    (load,) = tier.loads
    assert [(e.rank, e.block_hash) for e in load.entries] == [
        (rank, h) for h in hashes[1:3] for rank in range(2)
    ]
    for view in load.views:
        view[:] = b"\x07" * PAGE
    load.finish([True] * len(load.pages))
    completions.run()
    (answer,) = answers
    assert answer is not None and answer[0] == 3 and answer[1] > 0
    index.check_invariants()
    for rank in range(2):
        index.release(answer[1], rank)


def test_a_probe_finding_nothing_answers_the_l1_prefix_and_an_unreachable_tier_is_not_asked(
    memory: SharedMemoryArena, completions: Completions
) -> None:
    tier = DiscoveringTier()
    index, _ = make_index(memory, completions, tier)
    pool = register(index)
    hashes = keys(1, 2)
    pending = index.lookup(pool, hashes, 1, lock=False, now=0.0)
    assert isinstance(pending, DeferredLookup)
    answers: list[IndexHit | None] = []
    pending.answer = answers.append
    (probe,) = tier.probes
    probe.finish([None] * len(probe.keys))
    completions.run()
    assert answers == [(0, 0, [])] and tier.loads == []
    index.check_invariants()

    tier.reachable = False
    assert index.lookup(pool, hashes, 1, lock=False, now=0.0) == (0, 0, [])
    assert len(tier.probes) == 1


def test_a_late_probe_is_answered_pending_and_its_keys_serve_the_next_lookup(
    memory: SharedMemoryArena, completions: Completions
) -> None:
    tier = DiscoveringTier()
    now = 0.0
    index, _ = make_index(memory, completions, tier, clock=lambda: now)
    pool = register(index)
    hashes = keys(5, 6)
    first = index.lookup(pool, hashes, 1, lock=True, now=now)
    assert isinstance(first, DeferredLookup)
    answers: list[IndexHit | None] = []
    first.answer = answers.append
    now = 1.0
    index.expire(now)
    assert answers == [None] and not index.fetching
    (probe,) = tier.probes
    probe.finish(["a", "b"])
    completions.run()
    index.check_invariants()
    # The keys found are the tier's STORED entries now: the next lookup loads them.
    second = index.lookup(pool, hashes, 1, lock=True, now=now)
    assert isinstance(second, DeferredLookup)
    second.answer = answers.append
    (load,) = tier.loads
    assert [e.location for e in load.entries] == ["a", "b"]
    load.finish([True, False])
    completions.run()
    assert answers[-1] is not None and answers[-1][0] == 1
    index.check_invariants()
