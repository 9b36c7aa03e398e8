"""A KV cache the worker cannot copy (here on torch's "meta" device, as a stand-in for a device
this build has no copy engine for) disables the cache; it never stops vLLM."""

from __future__ import annotations

import logging

import pytest
import torch

from kvshelf.client import KVShelfClient
from kvshelf.plan import LoadJob, StoreJob
from kvshelf.roles.worker import WorkerConnector
from kvshelf.testbed.server import free_port


def test_uncopyable_kv_cache_drops_stores_and_fails_loads(caplog: pytest.LogCaptureFixture) -> None:
    port = free_port()
    worker = WorkerConnector(
        client_factory=lambda: KVShelfClient("127.0.0.1", port, timeout_s=0.2),
        model_fingerprint="m",
        layout_fingerprint="l",
        rank=0,
        world_size=1,
        retry_interval_s=0.1,
    )
    kv_caches = {"layer0": torch.empty((8, 2, 16, 128), device="meta")}
    with caplog.at_level(logging.ERROR, logger="kvshelf"):
        worker.register_kv_caches(kv_caches, num_blocks=8)
    # One ERROR line, naming the device the factory has no engine for.
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1, errors
    assert errors[0].startswith("kvshelf cannot copy this KV cache (KV caches on meta;")
    assert errors[0].endswith("); serving without the cache")
    try:
        worker.submit_stores([StoreJob("r", (1, 2), (b"a", b"b"), 0)])
        worker.flush_stores()
        assert worker.take_completed() == {"r": 1}
        assert worker.counters["stores_dropped"] == 1
        worker.start_loads([LoadJob("s", (3, 4), ((0, 1),), lock_id=7, boot_id="x")])
        assert worker.take_load_errors() == {3, 4}
    finally:
        worker.shutdown()
