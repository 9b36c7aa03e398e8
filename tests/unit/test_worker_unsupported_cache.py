"""A KV cache the worker cannot copy disables the cache with one ERROR line; it never stops
vLLM: stores are dropped and loads reported failed (vLLM recomputes them).

Each case kvshelf refuses: a device no engine copies (torch's "meta" device stands in for one),
tensors on several devices, a shape with no block dimension, and an engine that refuses once
the arena is mapped (the CUDA engine where CUDA is not usable, or the arena cannot be pinned).
"""

from __future__ import annotations

import contextlib
import logging

import pytest
import torch

from kvshelf.client import KVShelfClient
from kvshelf.plan import LoadJob, StoreJob
from kvshelf.roles.worker import WorkerConnector
from kvshelf.transfer import CudaTransferEngine, UnsupportedKVCache, engine_override
from testbed.server import ServerProcess, free_port

CPU_CACHE = {"layer0": torch.zeros((8, 2, 16, 128))}


def _refuse_pinning(kv_caches, layout, arena):
    raise UnsupportedKVCache("the kvshelf arena cannot be pinned for cuda:0: error 2")


CASES = {
    "meta device": (
        {"layer0": torch.empty((8, 2, 16, 128), device="meta")},
        None,
        "KV caches on meta; copy engines exist for",
    ),
    "two devices": (
        {"a": torch.zeros((8, 4)), "b": torch.empty((8, 4), device="meta")},
        None,
        "KV caches on cpu, meta; one device per worker is needed",
    ),
    "no block dimension": (
        {"layer0": torch.zeros((7, 2, 16, 128))},
        None,
        "KV cache tensor 'layer0' of shape [7, 2, 16, 128] has no block dimension of size 8",
    ),
    "cuda engine without cuda": (
        CPU_CACHE,
        CudaTransferEngine,
        "KV caches on cpu, but CUDA is not usable in this process",
    ),
    "arena cannot be pinned": (
        CPU_CACHE,
        _refuse_pinning,
        "the kvshelf arena cannot be pinned for cuda:0",
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_uncopyable_kv_cache_drops_stores_and_fails_loads(
    case: str, caplog: pytest.LogCaptureFixture
) -> None:
    kv_caches, engine, reason = CASES[case]
    with contextlib.ExitStack() as stack:
        if engine is None:
            port = free_port()
        else:
            # Refused only once the arena is mapped: a server is needed to get that far.
            port = stack.enter_context(ServerProcess(l1_size_gb=1 / 64)).port
            stack.enter_context(engine_override("cpu", engine))
        worker = WorkerConnector(
            client_factory=lambda: KVShelfClient("127.0.0.1", port, timeout_s=2.0),
            model_fingerprint="m",
            layout_fingerprint="l",
            rank=0,
            world_size=1,
            retry_interval_s=0.1,
        )
        with caplog.at_level(logging.WARNING, logger="kvshelf"):
            worker.register_kv_caches(kv_caches, num_blocks=8)
        # One ERROR line, naming what cannot be copied; no warning about the server.
        errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert len(errors) == 1, errors
        assert errors[0].startswith(f"kvshelf cannot copy this KV cache ({reason}"), errors[0]
        assert errors[0].endswith("); serving without the cache")
        assert caplog.records[0].levelno == logging.ERROR
        try:
            worker.submit_stores([StoreJob("r", (1, 2), (b"a", b"b"), 0)])
            worker.flush_stores()
            assert worker.take_completed() == {"r": 1}
            assert worker.counters["stores_dropped"] == 1
            worker.start_loads([LoadJob("s", (3, 4), ((0, 1),), lock_id=7, boot_id="x")])
            assert worker.take_load_errors() == {3, 4}
        finally:
            worker.shutdown()
