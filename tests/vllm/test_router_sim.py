"""The router simulation benchmark on the tiny model: a router that reads kvshelf's events
sends every request to the node whose kvshelf holds its document, and each of those hits its
whole document; a router on vLLM's GPU events alone cannot do better."""

from __future__ import annotations

import pytest

from benchmarks.router_sim import BLOCK, Workload, run
from testbed.models import TINY

pytestmark = [pytest.mark.vllm, pytest.mark.engine]


def test_kvshelf_events_route_every_request_home(vllm_env: dict[str, str]) -> None:
    workload = Workload(documents=6, passes=2)
    gpu, kvshelf = run(TINY, workload)
    assert (gpu["router"], kvshelf["router"]) == ("gpu", "gpu+kvshelf")
    assert kvshelf["requests"] == gpu["requests"] == 12
    assert kvshelf["to_document_home"] == 12
    # The second pass: every document whole (its question is a block fragment, not cached).
    whole = workload.documents * workload.document_blocks * BLOCK
    assert kvshelf["prefix_hit_tokens"] == whole
    assert gpu["prefix_hit_tokens"] <= whole
