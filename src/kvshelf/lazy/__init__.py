"""Lazy offload: buffer store work and submit it in batches after requests finish.

Modules: ``offloader`` (``LazyOffloader``, the scheduler role's lazy ``OffloadMode``),
``pending_store`` (buffered store work with the block hashes it was made against),
``protection`` (the ledger of every GPU block reference lazy offload holds), ``pool`` (the
narrow view of vLLM's block pool) and ``policies/`` (which finished requests to store, when).

No vLLM import anywhere in this package: the connector hands it vLLM's block pool through
``VllmBlockPoolView`` and it is unit-testable alone. Its settings come typed from
``kvshelf.connector_config``. Import each name from its own module; this package module exports
nothing, so that no module here depends on it.
"""
