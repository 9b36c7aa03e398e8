"""The tiers below L1 as the index drives them: fetches for lookups, stores behind commits,
and the L1 eviction hook.

- **Fetch**: a lookup whose prefix goes on in entries of tiers below L1 pins the L1 pages of
  that prefix (so that taking pages cannot evict them), takes a FILLING L1 page per missing
  object and hands each tier a :class:`~kvshelf.server.tiers.base.TierLoad`. An entry some
  other lookup is fetching already is not fetched twice: the lookup waits for that load too.
  The tiers copy on their own threads; every ``finish`` is posted to the loop
  (:class:`Completions`), where the pages that landed are committed in place of the lower
  entries. When the last load a lookup waits for is in, its pins go and the index answers it
  (:class:`DeferredLookup`): the hit is whatever prefix is in L1 then, so a late or failed copy
  makes it shorter, never wrong.
- **Fetch deadline**: a lookup is answered by its ``deadline`` at the latest. If its loads are
  not all in by then, the answer is "pending" (``None``): nothing is locked, the loads go on
  and land in L1, and the client asks again (its new lookup joins the loads still running).
  So a slow tier never holds a reply long enough to look like a dead server.
- **Discovery**: a tier that other processes write too (Redis) may hold keys the index has no
  entry for. The keys after the prefix the index can load are asked about from every tier
  whose ``discovers()`` says so (a :class:`~kvshelf.server.tiers.base.TierProbe`, on the
  tier's threads); the keys found become its STORED entries, and the lookup loads them too,
  within the same deadline.
- **Store behind**: every committed page is handed to every tier below in a
  :class:`~kvshelf.server.tiers.base.TierStore` (the commit hook), pinned in L1 until that tier's
  ``finish``, so the bytes it copies cannot be evicted and rewritten meanwhile.
- **Eviction hook**: when L1 evicts a page whose object a tier below keeps
  (:meth:`~kvshelf.server.tiers.base.Tier.holds`), the key stays as that tier's STORED entry.

A tier must finish every job it is given (a copy it gives up on finishes as not landed or not
stored); fetch pins and FILLING pages are not leased. Single-threaded on the socket loop,
except ``finish``, which only posts. Must not import torch or vLLM.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial

from kvshelf.server.completions import Completions
from kvshelf.server.pool import Entry, Page, Pool
from kvshelf.server.tiers.arena import ArenaTier
from kvshelf.server.tiers.base import Tier, TierLoad, TierProbe, TierStore

# (num_hit_blocks, lock_id, pages): what a lookup answers, see CacheIndex.lookup.
IndexHit = tuple[int, int, list[list[int]]]

# The longest a lookup waits for loads from tiers below L1 before it is answered "pending":
# well inside the client's request timeout (1 s by default, kvshelf.request_timeout_s), so a
# slow tier is never mistaken for a dead server. The loop checks deadlines every
# FETCH_POLL_INTERVAL_S while lookups wait.
FETCH_ANSWER_WITHIN_S = 0.25
FETCH_POLL_INTERVAL_S = 0.01


class DeferredLookup:
    """A lookup waiting for tiers below L1 to load blocks into L1 pages.

    Attributes:
        answer: set by whoever made the lookup; called once, on the loop, with the final
            result, or with None when the deadline came first (a "pending" answer: ask again).
        context: set by whoever made the lookup: what it needs to answer it.
        deadline: the loop's clock time by which it is answered either way.
    """

    __slots__ = (
        "answer",
        "context",
        "deadline",
        "hashes",
        "loads",
        "lock",
        "pins",
        "pool",
        "probes",
    )

    def __init__(
        self,
        pool: Pool,
        hashes: Sequence[bytes],
        lock: bool,
        pins: list[TierLoad],
        deadline: float,
    ) -> None:
        self.pool = pool
        self.hashes = hashes
        self.lock = lock
        self.deadline = deadline
        # Loads of the L1 pages already in the prefix, held until the answer.
        self.pins = pins
        # Loads of tiers below it waits for (its own and other lookups').
        self.loads: set[TierLoad] = set()
        # Probes of tiers that discover keys it waits for.
        self.probes: set[TierProbe] = set()
        self.answer: Callable[[IndexHit | None], None] | None = None
        self.context: object = None


class LowerTiers:
    """Fetches into L1 and stores behind commits, over the tiers below the arena.

    Args:
        arena: the L1 tier.
        tiers: the tiers below it, fastest first.
        completions: where tiers' ``finish`` calls are posted for the loop.
        fetched: called on the loop once a fetch is complete and its pins are gone.
    """

    def __init__(
        self,
        arena: ArenaTier,
        tiers: Sequence[Tier],
        completions: Completions,
        fetched: Callable[[DeferredLookup], None],
    ) -> None:
        assert tiers
        self.tiers = list(tiers)
        self._arena = arena
        self._completions = completions
        self._fetched = fetched
        # Lookups waiting for loads, until answered (by their loads or their deadline).
        self._fetches: set[DeferredLookup] = set()
        # Every load handed to a tier below and not taken in yet -> the lookups waiting for it.
        self._loads: dict[TierLoad, set[DeferredLookup]] = {}
        # Entries of tiers below being loaded -> their load.
        self._loading: dict[Entry, TierLoad] = {}
        # Probes not taken in yet -> the lookups waiting for them.
        self._probes: dict[TierProbe, set[DeferredLookup]] = {}
        # Stores handed to tiers below and not finished yet -> the pin on their L1 pages.
        self._stores: dict[TierStore, TierLoad] = {}
        arena.demote = self._demote

    def fetch(
        self, pool: Pool, hashes: Sequence[bytes], start: int, lock: bool, deadline: float
    ) -> DeferredLookup | None:
        """Start loading the blocks after the L1 prefix ``hashes[:start]`` from tiers below.

        Blocks after the prefix the index knows, with no entry, are first asked about from
        every tier that :meth:`~kvshelf.server.tiers.base.Tier.discovers` (a shared store);
        the keys found become its STORED entries and are loaded too.

        Args:
            pool, hashes, lock: the lookup's.
            start: the length of the prefix committed in L1 for every rank.
            deadline: when to answer "pending" if the loads are not all in by then.

        Returns:
            The pending lookup, or None when no tier below can extend the prefix (or L1 has no
            page to load into): answer at once.
        """
        pending = DeferredLookup(pool, hashes, lock, [], deadline)
        end, new_loads = self._start_loads(pending, start)
        if end < len(hashes):
            for tier in self.tiers:
                tier.missed(hashes[end])
        unknown = self._unknown_keys(pool, hashes, end)
        if unknown:
            for tier in self.tiers:
                if tier.discovers():
                    probe = TierProbe(pool, unknown, partial(self._post_probed, tier))
                    self._probes[probe] = {pending}
                    pending.probes.add(probe)
                    new_loads.append((tier, probe))
        if not pending.loads and not pending.probes:
            self._unpin(pending)
            return None
        self._fetches.add(pending)
        self._prepare(new_loads)
        return pending

    def _start_loads(
        self, pending: DeferredLookup, start: int
    ) -> tuple[int, list[tuple[Tier, TierLoad | TierProbe]]]:
        """Pin the prefix ``pending`` can load and take L1 pages for its blocks below L1.

        Returns:
            The end of that prefix, and the new loads (to hand their tiers once registered).
        """
        pool, hashes = pending.pool, pending.hashes
        end = self._loadable_end(pool, hashes, start)
        if end == start:
            return end, []
        # Pin the L1 pages of the prefix first: taking pages below may evict LRU pages.
        pins = self._pin(pool, hashes[:end])
        self._unpin(pending)
        pending.pins = pins
        wanted = self._take_pages(pool, hashes[start:end], pending.loads)
        new_loads: list[tuple[Tier, TierLoad | TierProbe]] = []
        for tier, (entries, pages) in wanted.items():
            views = [self._arena.view(pool, page) for page in pages]
            load = TierLoad(pool, entries, pages, views, partial(self._post_landed, tier))
            self._loads[load] = set()
            self._loading.update(dict.fromkeys(entries, load))
            pending.loads.add(load)
            new_loads.append((tier, load))
        for load in pending.loads:
            self._loads[load].add(pending)
        return end, new_loads

    @staticmethod
    def _prepare(new_loads: list[tuple[Tier, TierLoad | TierProbe]]) -> None:
        for tier, job in new_loads:
            if isinstance(job, TierProbe):
                tier.prepare_probe(job)
            else:
                tier.prepare_load(job)

    def _unknown_keys(
        self, pool: Pool, hashes: Sequence[bytes], end: int
    ) -> list[tuple[int, bytes]]:
        """The keys without an entry in the blocks from ``end`` on, up to the first block with
        an entry that cannot be loaded (a key being written, say)."""
        keys: list[tuple[int, bytes]] = []
        seen: set[bytes] = set()
        for block_hash in hashes[end:]:
            if block_hash in seen:
                continue
            seen.add(block_hash)
            for rank, table in enumerate(pool.tables):
                entry = table.get(block_hash)
                if entry is None:
                    keys.append((rank, block_hash))
                elif not entry.tier.lookup(entry):
                    return keys
        return keys

    def expire(self, now: float) -> None:
        """Answer "pending" every lookup whose deadline passed; their loads go on."""
        for pending in [p for p in self._fetches if p.deadline <= now]:
            for load in pending.loads:
                self._loads[load].discard(pending)
            for probe in pending.probes:
                self._probes[probe].discard(pending)
            pending.loads.clear()
            pending.probes.clear()
            self._fetches.discard(pending)
            self._unpin(pending)
            assert pending.answer is not None, "a pending lookup nobody waits for"
            pending.answer(None)

    @property
    def fetching(self) -> bool:
        """Whether lookups wait for loads (the loop then checks their deadlines often)."""
        return bool(self._fetches)

    def store(self, pool: Pool, rank: int, pages: list[Page], above: Tier | None = None) -> None:
        """The commit hook: hand freshly committed pages to every tier below (or, for pages
        that just landed from ``above``'s tier below, to the tiers faster than it)."""
        arena = self._arena
        hashes = [page.block_hash for page in pages]
        tiers = self.tiers if above is None else self.tiers[: self.tiers.index(above)]
        for tier in tiers:
            # Views of its own per tier: each job's views are released when it finishes.
            views = [arena.view(pool, page).toreadonly() for page in pages]
            pin = TierLoad(pool, pages, pages)
            arena.prepare_load(pin)
            store = TierStore(pool, rank, hashes, pages, views, partial(self._post_stored, tier))
            self._stores[store] = pin
            tier.prepare_store(store)

    def uses(self, pool: Pool) -> bool:
        """Whether a fetch, load, probe or store behind of ``pool`` is in flight."""
        return (
            any(pending.pool is pool for pending in self._fetches)
            or any(load.pool is pool for load in self._loads)
            or any(probe.pool is pool for probe in self._probes)
            or any(store.pool is pool for store in self._stores)
        )

    def drop(self, pool: Pool) -> None:
        """A retired pool (nothing of it in flight): every tier below forgets it."""
        for tier in self.tiers:
            tier.drop_pool(pool)

    def pinned(self) -> list[Sequence[Page]]:
        """The pages of every pin held, once per pin (for the index's invariants)."""
        pins = [pin.pages for pin in self._stores.values()]
        pins.extend(pin.pages for pending in self._fetches for pin in pending.pins)
        return pins

    def filling(self) -> list[Page]:
        """Every FILLING page of a fetch in flight."""
        return [page for load in self._loads for page in load.pages]

    def clear(self, shared: bool) -> tuple[int, bool]:
        """Clear every tier below (``kvshelf clear``); the shared ones only when ``shared``.

        Returns:
            ``(objects dropped from local tiers, whether a shared tier started clearing)``.
        """
        dropped = sum(tier.clear() for tier in self.tiers)
        started = [tier.clear_shared() for tier in self.tiers] if shared else []
        return dropped, any(started)

    def stats(self) -> dict[str, int]:
        """Every tier's stats."""
        stats: dict[str, int] = {}
        for tier in self.tiers:
            stats.update(tier.stats())
        return stats

    def close(self) -> None:
        """Close every tier below, the slowest first; on the loop's thread, after the loop."""
        for tier in reversed(self.tiers):
            tier.close()
        # Take in the jobs they finished while stopping, which releases their arena views.
        self._completions.run()

    # Internals: the loop's side of finish().

    def _post_landed(self, tier: Tier, load: TierLoad) -> None:
        self._completions.post(partial(self._landed, tier, load))

    def _post_stored(self, tier: Tier, store: TierStore) -> None:
        self._completions.post(partial(self._stored, tier, store))

    def _post_probed(self, tier: Tier, probe: TierProbe) -> None:
        self._completions.post(partial(self._probed, tier, probe))

    def _probed(self, tier: Tier, probe: TierProbe) -> None:
        """A probe's answer: the keys found become STORED entries of its tier, and every lookup
        waiting for it loads them."""
        tables = probe.pool.tables
        ranks = probe.pool.ranks
        for (rank, block_hash), location in zip(probe.keys, probe.found, strict=True):
            if location is not None and block_hash not in tables[rank]:
                tables[rank][block_hash] = Entry(tier, location, rank, block_hash)
                if ranks is not None:
                    ranks.on_stored(block_hash)
        tier.complete_probe(probe)
        new_loads: list[tuple[Tier, TierLoad | TierProbe]] = []
        for pending in self._probes.pop(probe):
            pending.probes.remove(probe)
            new_loads.extend(self._start_loads(pending, 0)[1])
            if not pending.loads and not pending.probes:
                self._answer(pending)
        self._prepare(new_loads)

    def _answer(self, pending: DeferredLookup) -> None:
        self._fetches.discard(pending)
        self._unpin(pending)
        self._fetched(pending)

    def _landed(self, tier: Tier, load: TierLoad) -> None:
        pool = load.pool
        arena = self._arena
        by_rank: dict[int, list[Page]] = {}
        for entry, page, landed in zip(load.entries, load.pages, load.landed, strict=True):
            del self._loading[entry]
            table = pool.tables[entry.rank]
            # The entry may have gone meanwhile (its tier dropped it): then this copy is not
            # needed.
            if landed and table.get(entry.block_hash) is entry:
                arena.land(pool, page, entry.rank, entry.block_hash)
                table[entry.block_hash] = page
                by_rank.setdefault(entry.rank, []).append(page)
            else:
                arena.free(pool, page)
        tier.complete_load(load)
        _release(load.views)
        # What came from a slower tier (Redis) is kept by the faster ones (the disk) too.
        if tier is not self.tiers[0]:
            for rank, pages in by_rank.items():
                self.store(pool, rank, pages, above=tier)
        for pending in self._loads.pop(load):
            pending.loads.remove(load)
            if not pending.loads and not pending.probes:
                self._answer(pending)

    def _stored(self, tier: Tier, store: TierStore) -> None:
        self._arena.complete_load(self._stores.pop(store))
        tier.complete_store(store)
        _release(store.views)

    def _loadable_end(self, pool: Pool, hashes: Sequence[bytes], start: int) -> int:
        """The end of the run of blocks from ``start`` on that some tier can load for every
        rank."""
        end = start
        for block_hash in hashes[start:]:
            for table in pool.tables:
                entry = table.get(block_hash)
                if entry is None or not entry.tier.lookup(entry):
                    return end
            end += 1
        return end

    def _pin(self, pool: Pool, hashes: Sequence[bytes]) -> list[TierLoad]:
        """Pin the L1 pages among the entries of ``hashes`` (all present), one load per rank."""
        pins: list[TierLoad] = []
        for table in pool.tables:
            pages = [e for e in map(table.__getitem__, hashes) if e.tier is self._arena]
            pin = TierLoad(pool, pages, pages)
            self._arena.prepare_load(pin)
            pins.append(pin)
        return pins

    def _take_pages(
        self, pool: Pool, hashes: Sequence[bytes], joined: set[TierLoad]
    ) -> dict[Tier, tuple[list[Entry], list[Page]]]:
        """A FILLING L1 page for each entry of ``hashes`` held below L1, grouped by tier.

        Entries already being loaded get no page: their loads join ``joined``. Whole blocks
        only: where L1 runs out of pages, the blocks from there on are left out.
        """
        arena = self._arena
        wanted: dict[Tier, tuple[list[Entry], list[Page]]] = {}
        # A hash may repeat in a lookup; each entry is loaded once.
        taken: set[Entry] = set()
        for block_hash in hashes:
            block: list[tuple[Entry, Page]] = []
            for table in pool.tables:
                entry = table[block_hash]
                if entry.tier is arena or entry in taken:
                    continue
                loading = self._loading.get(entry)
                if loading is not None:
                    joined.add(loading)
                    continue
                page = arena.take_page(pool)
                if page is None:
                    for _, taken in block:
                        arena.free(pool, taken)
                    return wanted
                arena.fill(page)
                block.append((entry, page))
            for entry, page in block:
                taken.add(entry)
                entries, pages = wanted.setdefault(entry.tier, ([], []))
                entries.append(entry)
                pages.append(page)
        return wanted

    def _demote(self, pool: Pool, page: Page) -> Entry | None:
        """The eviction hook: the entry of the fastest tier below keeping the page's object."""
        for tier in self.tiers:
            location = tier.holds(pool, page.rank, page.block_hash)
            if location is not None:
                return Entry(tier, location, page.rank, page.block_hash)
        return None

    def _unpin(self, pending: DeferredLookup) -> None:
        for pin in pending.pins:
            self._arena.complete_load(pin)
        pending.pins = []


def _release(views: Sequence[memoryview]) -> None:
    """Drop a finished job's views of the arena, so that none outlives the arena's mapping."""
    for view in views:
        view.release()
