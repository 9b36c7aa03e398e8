"""Pages adopted from a dead server's arena that stay out of use until its leases are over.

The dead server's workers may still be copying into pages they had reserved, or out of pages
they had locked, for up to a lease timeout after it died. So until ``until`` (the new server's
start plus the lease timeout):

- **held** pages are adopted COMMITTED pages: loadable at once, but pinned (one count of
  ``lock_count``) so that eviction, ``kvshelf clear`` and extent reclaim leave them alone;
- **out** pages were RESERVED or FILLING (or torn): keyless, in no free list, pinned as well,
  so that nothing reuses them.

The arena tier (:meth:`~kvshelf.server.tiers.arena.ArenaTier.end_quarantine`) lets them go.
Must not import torch or vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvshelf.server.pool import Page, Pool


@dataclass
class Quarantine:
    """The quarantined pages and when their quarantine ends (monotonic seconds)."""

    until: float = 0.0
    held: list[tuple[Pool, Page]] = field(default_factory=list)
    out: list[tuple[Pool, Page]] = field(default_factory=list)
    out_bytes: int = 0

    def __len__(self) -> int:
        return len(self.held) + len(self.out)

    def holds(self, pool: Pool) -> bool:
        """Whether pages of ``pool`` are quarantined (it cannot be retired before the end)."""
        return any(owner is pool for owner, _ in (*self.held, *self.out))
