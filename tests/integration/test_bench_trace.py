"""bench-trace: the replay through a real server gives the in-process replay's hits exactly,
and vLLM's prefix cache in front takes what it holds out of kvshelf's demand."""

from __future__ import annotations

import pytest

from benchmarks.trace import server_replay, sim, traces

pytestmark = pytest.mark.skipif(
    not traces.trace_path("conversation").exists(), reason="the Mooncake traces are not here"
)


def test_vllm_prefix_cache_in_front_asks_kvshelf_for_the_rest() -> None:
    requests = [((1, 2, 3), 1600), ((1, 2, 4, 5), 2100), ((9,), 700)]
    assert [d.blocks for d in traces.demands(requests, 0)] == [(1, 2, 3), (1, 2, 4, 5), (9,)]
    assert [d.blocks for d in traces.demands(requests, 8)] == [(1, 2, 3), (4, 5), (9,)]
    # Only full blocks are ever asked for: 1600 tokens are 3 full blocks of 512.
    assert traces.load_requests("conversation", 1)[0][0] == tuple(range(13))


@pytest.mark.parametrize("policy", ["lru", "reuse"])
def test_the_real_server_keeps_what_the_simulation_keeps(policy: str) -> None:
    stream = traces.demands(traces.load_requests("conversation", 400), 0)
    in_process = sim.replay(stream, sim.make_cache(policy, 300, stream))
    on_server = server_replay.replay(stream, 300, policy)
    assert on_server["hit_tokens"] == in_process["hit_tokens"] > 0
    assert on_server["tokens"] == in_process["tokens"]


def test_with_a_disk_tier_the_servers_default_is_lru_above_a_reuse_disk() -> None:
    stream = traces.demands(traces.load_requests("conversation", 400), 0)
    default = server_replay.replay(stream, 100, None, 400, None)
    named = server_replay.replay(stream, 100, "lru", 400, "reuse")
    l1_only = server_replay.replay(stream, 100, "lru")
    assert default == named
    assert default["hit_tokens"] > l1_only["hit_tokens"]
