"""The kvshelf cache server process; its command line is :mod:`kvshelf.cli.server`.

- ``config``: :class:`ServerConfig`, built once from the flags, and its checks against the host.
- ``app``: builds the tiers, the index, the handler and the loop from a config; serves.
- ``loop``: the ZMQ socket loop; ``handler``: one request frame in, one reply frame out.
- ``index``: keys, lookups, reservations and locks with leases; ``pool``: its data model.
- ``tiers/``: the storage-tier seam (``base``) and the shared-memory arena, L1 (``arena``,
  ``shared_memory``); ``lower_tiers``: fetches and stores through the tiers below L1, which
  finish on their own threads and hand back through ``completions``.
- ``page_table``: the page table in the arena's trailer; ``adoption``: a starting server adopts
  the arena of a dead one on its port (``tiers/quarantine`` keeps its pages out of use for a
  lease timeout).

Nothing here imports torch or vLLM.
"""
