"""The vLLM test bed itself: local model, prompts, real engine runs, model-less real Scheduler."""

from __future__ import annotations

import filecmp
from pathlib import Path

import pytest

from testbed.models import TINY, build_model
from testbed.prompts import (
    FIRST_ORDINARY_ID,
    random_tokens,
    shared_prefix_prompts,
    shared_prefix_workload,
)

pytestmark = pytest.mark.vllm

BLOCK = 32
PREFIX = 8 * BLOCK


def test_prompts_are_deterministic_and_exact() -> None:
    work = shared_prefix_workload(num_prefixes=3, prompts_per_prefix=2, prefix_len=64, suffix_len=5)
    assert len(work.prompts) == 6 and all(len(p) == 69 for p in work.prompts)
    assert work.group_of == [0, 0, 1, 1, 2, 2]
    assert work.prompts[0][:64] == work.prompts[1][:64] == work.prefixes[0]
    assert work.prompts[0][64:] != work.prompts[1][64:]
    assert len({p[0] for p in work.prefixes}) == 3
    assert shared_prefix_prompts(2, 64, 5, seed=1) == shared_prefix_prompts(2, 64, 5, seed=1)
    assert min(random_tokens(1000, seed="x")) >= FIRST_ORDINARY_ID


def test_model_build_is_deterministic_and_idempotent(tiny_model: Path, tmp_path: Path) -> None:
    again = build_model(TINY, tmp_path / "copy")
    names = sorted(p.name for p in tiny_model.iterdir())
    assert "model.safetensors" in names and "tokenizer.json" in names
    _, mismatch, errors = filecmp.cmpfiles(tiny_model, again, names, shallow=False)
    assert (mismatch, errors) == ([], [])
    mtime = (again / "model.safetensors").stat().st_mtime_ns
    assert build_model(TINY, again) == again
    assert (again / "model.safetensors").stat().st_mtime_ns == mtime


@pytest.mark.engine
@pytest.mark.timeout(300)
def test_engine_greedy_outputs_repeat_across_cache_hits_and_processes(
    tiny_model: Path, vllm_env: dict[str, str]
) -> None:
    from testbed.run_engine import EngineSpec, run_engine

    pytest.importorskip("vllm")
    prompts = shared_prefix_prompts(4, PREFIX, 16, seed="harness")
    cached = run_engine(
        EngineSpec(
            model=str(tiny_model),
            rounds=[prompts[:1], prompts],
            max_tokens=12,
            block_size=BLOCK,
            max_model_len=1024,
            num_gpu_blocks_override=64,
            env=vllm_env,
        )
    )
    uncached = run_engine(
        EngineSpec(
            model=str(tiny_model),
            rounds=[prompts],
            max_tokens=12,
            block_size=BLOCK,
            max_model_len=1024,
            num_gpu_blocks_override=64,
            enable_prefix_caching=False,
            env=vllm_env,
        )
    )
    first, second = cached["rounds"]
    reference = [r["token_ids"] for r in uncached["rounds"][0]["requests"]]
    assert all(len(tokens) == 12 for tokens in reference)
    assert len({tuple(tokens) for tokens in reference}) > 1
    assert first["requests"][0]["token_ids"] == reference[0]
    assert [r["token_ids"] for r in second["requests"]] == reference
    assert first["requests"][0]["num_cached_tokens"] == 0
    assert [r["num_cached_tokens"] for r in second["requests"]] == [PREFIX] * 4
    assert second["counters"]["vllm:prefix_cache_hits"] == 4 * PREFIX
    assert all(r["num_cached_tokens"] == 0 for r in uncached["rounds"][0]["requests"])
    assert all(r["ttft_s"] > 0 for r in second["requests"])
    assert cached["num_gpu_blocks"] == 64


def test_scheduler_prefix_cache_hits_and_chunked_prefill(
    tiny_model: Path, vllm_env: dict[str, str]
) -> None:
    pytest.importorskip("vllm")
    from testbed.vllm_scheduler import make_request, make_scheduler, run_to_completion

    block = 16
    scheduler = make_scheduler(
        tiny_model, block_size=block, num_gpu_blocks=64, max_num_batched_tokens=128
    )
    prompts = shared_prefix_prompts(4, 10 * block, 7, seed="sched")
    warm = run_to_completion(
        scheduler, [make_request("warm", prompts[0], max_tokens=3, block_size=block)]
    )
    assert warm.token_ids == {"warm": [FIRST_ORDINARY_ID] * 3}
    assert warm.prefill_stats["warm"].num_cached_tokens == 0
    # 167 prompt tokens at 128 per step: two prefill steps, two decode steps, and a last step
    # with nothing scheduled that tells the workers (scheduler_output.finished_req_ids).
    assert warm.num_steps == 5

    requests = [
        make_request(f"r{i}", prompt, max_tokens=2, block_size=block)
        for i, prompt in enumerate(prompts)
    ]
    hits = run_to_completion(scheduler, requests, sampled_token=lambda request: 100)
    assert hits.token_ids == {f"r{i}": [100, 100] for i in range(4)}
    # r0 repeats "warm": all its full blocks hit. The others share the 10 prefix blocks.
    assert hits.prefill_stats["r0"].num_local_cached_tokens == 10 * block
    for i in range(1, 4):
        stats = hits.prefill_stats[f"r{i}"]
        assert stats.num_local_cached_tokens == 10 * block
        assert stats.num_external_cached_tokens == 0
        assert stats.num_computed_tokens == 7
    assert scheduler.get_num_unfinished_requests() == 0


def test_scheduler_loads_a_kv_connector_and_steps_it(
    tiny_model: Path, vllm_env: dict[str, str], tmp_path: Path
) -> None:
    pytest.importorskip("vllm")
    from vllm.v1.outputs import KVConnectorOutput

    from testbed.vllm_scheduler import make_request, make_scheduler, step

    block = 16
    scheduler = make_scheduler(
        tiny_model,
        block_size=block,
        num_gpu_blocks=32,
        kv_transfer_config={
            "kv_connector": "ExampleConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": str(tmp_path)},
        },
    )
    assert type(scheduler.connector).__name__ == "ExampleConnector"
    scheduler.add_request(
        make_request("a", list(range(3, 3 + 3 * block)), max_tokens=1, block_size=block)
    )
    output, engine_outputs = step(scheduler, kv_connector_output=KVConnectorOutput())
    assert output.num_scheduled_tokens == {"a": 3 * block}
    assert output.kv_connector_metadata is not None
    assert [o.request_id for o in engine_outputs.outputs] == ["a"]
    assert engine_outputs.outputs[0].finish_reason is not None
    assert scheduler.has_requests()
    output, engine_outputs = step(scheduler, kv_connector_output=lambda out: None)
    assert output.total_num_scheduled_tokens == 0
    assert output.finished_req_ids == {"a"}
    assert engine_outputs.outputs == []
    assert not scheduler.has_requests()
