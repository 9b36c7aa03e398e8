"""Lazy offload policies: the interface (``base``), one module per policy (``fifo``,
``eviction_aware``), and the registry that builds a policy from its configured name
(``registry``). Import each from its own module; this package module exports nothing.
"""
