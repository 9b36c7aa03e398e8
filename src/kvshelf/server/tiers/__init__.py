"""Storage tiers: the interface (:mod:`.base`) and the shared-memory arena, L1 (:mod:`.arena`).

A new tier implements :class:`~kvshelf.server.tiers.base.Tier` in a module of its own here and
is wired in :func:`kvshelf.server.app.build_tiers`.
"""
