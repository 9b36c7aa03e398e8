"""What bounds the server's memory beyond the arena: page size, pools, leases per pool.

Every object the index keeps is paid for by one of these bounds:

- **pages**: a pool's pages are made per extent of the arena, so there are at most
  ``arena_bytes / min_page_bytes`` of them, whoever asks; a page with its key-table and LRU
  entries costs about :data:`BYTES_PER_PAGE`.
- **pools**: at most ``max_pools`` (a pool is what a ``Register`` creates: one model identity,
  KV layout and world size), retiring ones included (:mod:`kvshelf.server.pool_life`), each
  with its event log for routers, of at most :data:`EVENT_LOG_BYTES_PER_POOL`, and at most
  :data:`MAX_HOLDERS_PER_POOL` holder tokens.
- **tenants**: a pool counts at most :data:`MAX_TENANTS_PER_POOL` named tenants (a request's
  ``tenant``, vLLM's ``cache_salt``: anyone's choice) apart, and ``""``; the pages of the rest
  are counted as one overflow tenant (:mod:`kvshelf.server.tenants`). A tenant costs about
  :data:`BYTES_PER_TENANT` beyond its pages (its name, its policy's lists, its entries).
- **leases**: the unit bounded is the *pool*, not the client. A client has no identity the
  server could trust: its ZeroMQ routing id changes every time it reconnects after a timeout,
  and the scheduler role that takes lookup locks never registers. Each live reservation costs
  1 + its keys, each live lock 1 + its pages (all ranks), in *lease units*; a pool holds at most
  ``max_lease_units_per_pool`` of them, about :data:`BYTES_PER_LEASE_UNIT` each. A client that
  floods leases only starves its own pool (its own model), until the leases expire.

Beyond the index, ZeroMQ buffers at most :data:`CLIENT_BUFFER_BYTES` per connected client
(:data:`RECEIVE_HWM_FRAMES` frames of at most :data:`TRANSPORT_MAX_MESSAGE_BYTES`); what one
request may cost the loop is :mod:`kvshelf.server.request_cost`'s.

A request that would exceed a bound gets a ``LIMIT_EXCEEDED`` (or, for a tiny page,
``INVALID_ARGUMENT``) error and changes nothing. Must not import torch or vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvshelf.protocol import MAX_FRAME_BYTES

# Pages smaller than this make the index's bookkeeping (a Python object per page) the bulk of
# the memory: 4 KiB keeps it under 10 % of the arena. A real KV block of one rank is 10s of KiB
# (a tiny test model) to MiBs.
MIN_PAGE_BYTES = 4096
DEFAULT_MAX_POOLS = 16
# 512 Ki units: e.g. 256 waiting requests, each holding a lock on 256 blocks of 8 ranks.
DEFAULT_MAX_LEASE_UNITS_PER_POOL = 1 << 19
# Measured upper estimates (tests/integration/test_server_bounds.py holds the server to them):
# a page object with its slots, its key-table entry (a 32-36 byte hash) and its LRU entry; a
# reserved key (its hash bytes and list slots) or a locked page reference.
BYTES_PER_PAGE = 400
BYTES_PER_LEASE_UNIT = 160
# Tenants a pool accounts apart (the soft share, kvshelf.server.tenants): the first to hold
# pages; later ones share one overflow tenant until one of those holds nothing.
MAX_TENANTS_PER_POOL = 256
# Measured upper estimate (tests/unit/test_tenants.py holds it; 4,767 B measured, reuse or
# lru): a tenant of a 1,024-character name of 4-byte characters (4,169 B) with its inner
# policy (reuse: two ordered dicts; what it learns is the pool's), its counts and heap entries.
BYTES_PER_TENANT = 6 * 1024
# A pool's event log for KV-aware routers (kvshelf.server.event_log) holds at most this, its
# entries counted as hash bytes + 72 each (about 40,000 entries of 32-byte hashes).
EVENT_LOG_BYTES_PER_POOL = 4 * 1024 * 1024
# Holder tokens a pool counts (kvshelf.server.pool_life): a registrant's rank each (a pool of
# the largest world size registered by one engine), 63-bit ints in a set: 68 B each measured
# (tracemalloc, 4,096 tokens), counted as 80.
MAX_HOLDERS_PER_POOL = 4096
BYTES_PER_HOLDER = 80

# A pool's own objects, its tenants, its holder tokens and its event log.
BYTES_PER_POOL = (
    64 * 1024
    + MAX_TENANTS_PER_POOL * BYTES_PER_TENANT
    + MAX_HOLDERS_PER_POOL * BYTES_PER_HOLDER
    + EVENT_LOG_BYTES_PER_POOL
)
# ZeroMQ drops (and disconnects) a peer whose message exceeds this, so a larger frame never
# reaches memory; the slack lets a frame just over the protocol's limit still get its
# FRAME_TOO_LARGE reply. The server sets it (MAXMSGSIZE) and the receive high-water mark
# (RCVHWM) on its socket.
TRANSPORT_MAX_MESSAGE_BYTES = MAX_FRAME_BYTES + 64 * 1024
RECEIVE_HWM_FRAMES = 16
# What ZeroMQ may buffer per connected client: the queued frames, the one it is reading and one
# more it may read before it sees the mark (measured: 17 to 18 frames' worth of memory).
CLIENT_BUFFER_BYTES = (RECEIVE_HWM_FRAMES + 2) * TRANSPORT_MAX_MESSAGE_BYTES

# The Redis tier (issue 33, D4): the most probes (EXISTS batches asking Redis about keys the
# index does not know, one per lookup) queued or running at once. A probe over it is answered
# "not found" at once (the lookup misses those keys; ``l3_skipped_probes_total``). A healthy
# Redis answers a probe in about a millisecond; 32 queued on 2 I/O threads outlast a lookup's
# 0.25 s fetch deadline only when Redis takes over 15 ms per probe, i.e. is already failing.
MAX_QUEUED_PROBES = 32

# The most L1 pages one Clear drops: a clear of a whole arena (62,259 pages of a 0.25 GiB arena
# of 4 KiB pages held the loop 0.22 s at about 3.5 us a page) takes one request per this many
# pages, so the loop answers others between them; the reply says how many are left and the
# client asks again (``kvshelf clear`` does).
CLEAR_PAGES_PER_REQUEST = 8192


@dataclass(frozen=True)
class IndexLimits:
    """The bounds the index enforces (see the module docstring).

    Attributes:
        min_page_bytes: the smallest page a pool may register.
        max_pools: the most pools at once.
        max_lease_units_per_pool: the most lease units (reservation keys and locked pages,
            plus one per reservation and lock) live in one pool.
    """

    min_page_bytes: int = MIN_PAGE_BYTES
    max_pools: int = DEFAULT_MAX_POOLS
    max_lease_units_per_pool: int = DEFAULT_MAX_LEASE_UNITS_PER_POOL
    # What the eviction policy keeps per page beyond BYTES_PER_PAGE (its key history, say):
    # kvshelf.server.policy's EvictionPolicy.extra_bytes_per_page.
    policy_bytes_per_page: int = 0

    def index_bytes(self, arena_bytes: int) -> int:
        """The most memory the index can hold for ``arena_bytes`` of arena, in bytes."""
        pages = arena_bytes // self.min_page_bytes
        leases = self.max_pools * self.max_lease_units_per_pool
        return (
            pages * (BYTES_PER_PAGE + self.policy_bytes_per_page)
            + leases * BYTES_PER_LEASE_UNIT
            + self.max_pools * BYTES_PER_POOL
        )


# For unit tests of the index alone: nothing but the protocol's own limits.
UNLIMITED = IndexLimits(min_page_bytes=1, max_pools=2**31, max_lease_units_per_pool=2**62)
