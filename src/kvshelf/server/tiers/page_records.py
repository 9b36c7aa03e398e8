"""The L1 tier's records in the arena's page table: which record each page has, and what the
record says.

:mod:`kvshelf.server.page_table` lays the records out in the arena's trailer and writes them;
this module decides when: a page gets a record with its extent, its key before a reply hands it
out, its state byte at every change, and gives the record back with the extent. Without a
table (unit tests of the index) every call does nothing. Used only by
:class:`~kvshelf.server.tiers.arena.ArenaTier`, on the socket loop. Must not import torch or
vLLM.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvshelf.server.page_table import PageTable, SlotAllocator, SlotState
from kvshelf.server.pool import Page, Pool


class PageRecords:
    """The page table as the arena tier keeps it.

    Args:
        table: the page table in the arena's trailer; None: nothing is recorded.
    """

    def __init__(self, table: PageTable | None) -> None:
        self._table = table
        # Free page records (slots).
        self.slots = SlotAllocator(table.geometry.page_slots if table is not None else 0)
        # Pool records handed out so far, and those retired pools gave back.
        self._pool_slots = 0
        self._free_pool_slots: list[int] = []

    def place(self, pool: Pool, pages: list[Page]) -> None:
        """Give the pages of a new extent their records (and the pool its own, first); pages
        the table has no room for go unrecorded (``slot`` -1)."""
        table = self._table
        if table is None:
            return
        if pool.table_slot < 0:
            if pool.layout is None:
                return
            if self._free_pool_slots:
                pool.table_slot = self._free_pool_slots.pop()
            elif self._pool_slots < table.geometry.pool_slots:
                pool.table_slot = self._pool_slots
                self._pool_slots += 1
            else:
                return  # the table has no room for this pool: its pages go unrecorded
            table.write_pool(pool.table_slot, pool.layout)
        for page in pages:
            page.slot = self.slots.take()
            if page.slot < 0:
                return
            table.place(
                page.slot, pool.table_slot, page.location * pool.page_bytes, pool.page_bytes
            )

    def adopted(self, pool: Pool) -> None:
        """``pool`` came with its record from a dead server's table (adoption)."""
        self._pool_slots = max(self._pool_slots, pool.table_slot + 1)

    def drop_pool(self, pool: Pool) -> None:
        """A retired pool gives its record back (its pages' records are released already)."""
        if self._table is None or pool.table_slot < 0:
            return
        self._table.clear_pool(pool.table_slot)
        self._free_pool_slots.append(pool.table_slot)
        pool.table_slot = -1

    def key(self, pages: Iterable[Page], state: SlotState) -> None:
        """Record each page's key (its ``rank`` and ``block_hash``), then ``state``
        (RESERVED or COMMITTED): a torn key reads as the state before, never as an object."""
        table = self._table
        if table is None:
            return
        for page in pages:
            if page.slot >= 0:
                table.key(page.slot, state, page.rank, page.block_hash)

    def mark(self, pages: Iterable[Page], state: SlotState) -> None:
        """Set the state byte alone of each page's record."""
        if self._table is not None:
            self._table.mark(pages, state)

    def release(self, pages: Iterable[Page]) -> None:
        """The pages' extent goes back to the allocator: their records are unused again."""
        recorded = [page for page in pages if page.slot >= 0]
        self.mark(recorded, SlotState.UNUSED)
        for page in recorded:
            self.slots.give(page.slot)
            page.slot = -1
