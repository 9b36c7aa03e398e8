"""Operating-system helpers: CPU affinity, page pre-faulting, shared-memory paths and the
arenas' ownership lock.

Linux-specific code lives here and nowhere else. Nothing in this package imports torch, vLLM
or any other kvshelf package, so the server, the transfer engines and the roles can all use it.
"""
