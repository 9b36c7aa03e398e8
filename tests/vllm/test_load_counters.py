"""The server's load counters tell the truth: ``loaded_objects_total`` counts the pages workers
copied, ``locked_objects_total`` the pages lookups locked (vLLM's real Scheduler, a real worker
side and server; no model)."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvshelf.testbed.rig import ConnectorRig
from kvshelf.testbed.scheduler import make_request
from kvshelf.testbed.server import ServerProcess

BLOCK = 16


@pytest.fixture
def server() -> Iterator[ServerProcess]:
    with ServerProcess(l1_size_gb=1 / 16, lease_timeout_s=5.0) as process:
        yield process


def tokens(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1000) for _ in range(length)]


def test_loaded_counts_copied_pages_locked_counts_locked_pages(
    tiny_model: Path, server: ServerProcess
) -> None:
    prompt = tokens(1, 8 * BLOCK + 5)
    writer = ConnectorRig(tiny_model, host=server.host, port=server.port, block_size=BLOCK)
    try:
        writer.add(make_request("first", prompt, max_tokens=2, block_size=BLOCK))
        writer.run()
    finally:
        writer.close()
    before = server.client().stats()

    reader = ConnectorRig(tiny_model, host=server.host, port=server.port, block_size=BLOCK)
    try:
        # 3 full blocks and one token: the lookup locks 3 blocks, vLLM loads all 3.
        reader.add(make_request("short", prompt[: 3 * BLOCK + 1], max_tokens=1, block_size=BLOCK))
        reader.run()
        # The whole prompt: 3 blocks are in vLLM's own prefix cache now; the lookup locks the
        # 8 stored blocks, vLLM loads the 5 it lacks.
        again = make_request("again", prompt, max_tokens=1, block_size=BLOCK)
        reader.add(again)
        reader.run()
        assert reader.worker.counters["blocks_loaded"] == 3 + 5
    finally:
        reader.close()
    after = server.client().stats()
    assert after["loaded_objects_total"] - before["loaded_objects_total"] == 3 + 5
    assert after["locked_objects_total"] - before["locked_objects_total"] == 3 + 8
    assert after["locked_objects"] == 0
