"""A real vLLM ``Scheduler`` without any model: step-by-step tests of scheduling and connectors.

`make_scheduler` builds vLLM's own v1 ``Scheduler`` (with its ``KVCacheManager``, block pool and,
if configured, the scheduler side of a KV connector) from a local model folder, without a model
executor or worker. `step` plays the part of the engine core and the model runner: it calls
``schedule()``, makes up a sampled token for every request whose prompt is complete, and feeds
the result, optionally with a caller-made ``KVConnectorOutput``, to ``update_from_output``.

vLLM is imported here at module level: import this module only where vLLM is installed. It
imports nothing of kvshelf: the connector under test comes in through ``kv_transfer_config``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from vllm.config import KVEventsConfig, KVTransferConfig, VllmConfig
from vllm.engine.arg_utils import EngineArgs
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.attention.backends.utils import record_kv_cache_layout
from vllm.v1.core.kv_cache_utils import (
    get_kv_cache_config_from_groups,
    get_request_block_hasher,
    init_none_hash,
    kv_cache_groups_tp_replicas,
    resolve_cache_hit_alignment_tokens,
    resolve_kv_cache_block_sizes,
)
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreOutputs
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MLAAttentionSpec,
)
from vllm.v1.metrics.stats import PrefillStats
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request

DEFAULT_SAMPLED_TOKEN = 3

MLA_LATENT = 576
"""DeepSeek-V3's MLA cache entry per token: the 512-wide latent and the 64-wide rope key."""
"""The token `step` samples unless told otherwise: the first ordinary id of the bench models."""

KV_CACHE_LAYOUT = "LBHNC"
"""The KV cache layout recorded in the config: the one vLLM's CPU attention backend requires
(per layer ``[num_blocks, kv_heads, block_size, 2 * head_size]``). A real engine resolves it
from its attention backends; a model-less scheduler has none."""

SampledToken = int | Callable[[Request], int]
"""A fixed token id, or a function of the request that returns the next token id."""

ConnectorOutput = KVConnectorOutput | Callable[[SchedulerOutput], KVConnectorOutput | None] | None
"""What the worker side of a connector reports for a step: fixed, or a function of the step's
scheduler output (which carries ``kv_connector_metadata`` and ``finished_req_ids``)."""


@dataclass
class RunResult:
    """What `run_to_completion` observed.

    Attributes:
        token_ids: Output token ids of each finished request.
        prefill_stats: Each request's prefill breakdown (``num_cached_tokens``,
            ``num_local_cached_tokens``, ``num_external_cached_tokens``, ...), as the scheduler
            reports it on the request's first output.
        num_steps: Number of `step` calls made.
    """

    token_ids: dict[str, list[int]] = field(default_factory=dict)
    prefill_stats: dict[str, PrefillStats] = field(default_factory=dict)
    num_steps: int = 0


def make_vllm_config(
    model_path: str | os.PathLike[str],
    *,
    block_size: int = 16,
    num_gpu_blocks: int = 64,
    max_num_batched_tokens: int = 256,
    max_num_seqs: int = 16,
    max_model_len: int = 1024,
    enable_prefix_caching: bool = True,
    kv_transfer_config: Mapping[str, Any] | None = None,
    dtype: str = "float32",
    tensor_parallel_size: int = 1,
    kv_events_config: Mapping[str, Any] | None = None,
) -> VllmConfig:
    """Build the ``VllmConfig`` of an engine on ``model_path``, as ``vllm.LLM`` would.

    Args:
        model_path: A local model folder (see `testbed.models`).
        block_size: Tokens per KV block. A model-less scheduler takes any size vLLM accepts;
            a real CPU engine needs a multiple of 32.
        num_gpu_blocks: Number of KV blocks, the null block (block 0) included.
        max_num_batched_tokens: Token budget of one step (chunked prefill splits longer
            prompts).
        max_num_seqs: Most requests running at once.
        max_model_len: Longest prompt plus output.
        enable_prefix_caching: Whether the local prefix cache is on.
        kv_transfer_config: Keyword arguments of ``KVTransferConfig``, e.g. ``{"kv_connector":
            "MyConnector", "kv_connector_module_path": "my.module", "kv_role": "kv_both",
            "kv_connector_extra_config": {...}}``; None for no connector.
        dtype: Model (and KV cache) dtype; it sets the bytes per KV block.
        tensor_parallel_size: KV ranks the scheduler plans for (no worker is started).
        kv_events_config: Keyword arguments of ``KVEventsConfig`` (vLLM's KV events
            publisher), or None for none.

    Returns:
        The config, with ``cache_config.num_gpu_blocks`` set and the KV cache layout recorded.
    """
    engine_args = EngineArgs(
        model=str(model_path),
        skip_tokenizer_init=True,
        dtype=dtype,
        enforce_eager=True,
        block_size=block_size,
        num_gpu_blocks_override=num_gpu_blocks,
        max_model_len=max_model_len,
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        enable_prefix_caching=enable_prefix_caching,
        tensor_parallel_size=tensor_parallel_size,
        kv_transfer_config=(
            KVTransferConfig(**kv_transfer_config) if kv_transfer_config is not None else None
        ),
        kv_events_config=(
            KVEventsConfig(**kv_events_config) if kv_events_config is not None else None
        ),
    )
    vllm_config = engine_args.create_engine_config()
    vllm_config.cache_config.num_gpu_blocks = num_gpu_blocks
    record_kv_cache_layout(vllm_config.cache_config, KV_CACHE_LAYOUT)
    return vllm_config


def make_kv_cache_config(vllm_config: VllmConfig, *, mla: bool = False) -> KVCacheConfig:
    """Build the KV cache config of a model with full attention in every layer.

    One group holds all decoder layers (named ``model.layers.<i>.self_attn.attn`` as in vLLM's
    Llama); the tensors are laid out as a real engine would lay them out.

    Args:
        vllm_config: From `make_vllm_config`; gives the model shape, block size and block count.
        mla: give every layer the cache of DeepSeek-V3's MLA instead of the model's heads: one
            latent of `MLA_LATENT` per token, replicated on every tensor parallel rank (the
            spec vLLM's MLA layers declare).

    Returns:
        A config with ``cache_config.num_gpu_blocks`` blocks, ``hash_block_size``,
        ``cache_hit_alignment_tokens`` and ``kv_tp_replicas`` resolved as the engine core
        resolves them.
    """
    model_config = vllm_config.model_config
    parallel_config = vllm_config.parallel_config
    num_blocks = vllm_config.cache_config.num_gpu_blocks
    assert num_blocks is not None
    spec: FullAttentionSpec
    if mla:
        spec = MLAAttentionSpec(
            block_size=vllm_config.cache_config.block_size,
            num_kv_heads=1,
            max_tp_shards=1,
            head_size=MLA_LATENT,
            dtype=model_config.dtype,
        )
    else:
        spec = FullAttentionSpec(
            block_size=vllm_config.cache_config.block_size,
            num_kv_heads=model_config.get_num_kv_heads(parallel_config),
            head_size=model_config.get_head_size(),
            dtype=model_config.dtype,
        )
    layer_names = [
        f"model.layers.{i}.self_attn.attn"
        for i in range(model_config.get_num_layers(parallel_config))
    ]
    groups = [KVCacheGroupSpec(layer_names=layer_names, kv_cache_spec=spec)]
    bytes_per_block = spec.page_size_bytes * len(layer_names)
    kv_cache_config = get_kv_cache_config_from_groups(
        vllm_config, groups, bytes_per_block * num_blocks
    )
    kv_cache_config.kv_tp_replicas = kv_cache_groups_tp_replicas(
        groups,
        parallel_config.tensor_parallel_size,
        parallel_config.decode_context_parallel_size,
    )
    resolve_block_sizes(kv_cache_config, vllm_config)
    return kv_cache_config


def resolve_block_sizes(kv_cache_config: KVCacheConfig, vllm_config: VllmConfig) -> tuple[int, int]:
    """Set the hash block size and hit alignment vLLM's engine resolves for
    ``kv_cache_config``; returns the scheduler's block size and the hash block size."""
    scheduler_block_size, hash_block_size = resolve_kv_cache_block_sizes(
        kv_cache_config, vllm_config
    )
    kv_cache_config.hash_block_size = hash_block_size
    kv_cache_config.cache_hit_alignment_tokens = resolve_cache_hit_alignment_tokens(
        kv_cache_config, vllm_config, scheduler_block_size, hash_block_size
    )
    return scheduler_block_size, hash_block_size


def make_scheduler(
    model_path: str | os.PathLike[str],
    *,
    block_size: int = 16,
    num_gpu_blocks: int = 64,
    max_num_batched_tokens: int = 256,
    max_num_seqs: int = 16,
    max_model_len: int = 1024,
    enable_prefix_caching: bool = True,
    kv_transfer_config: Mapping[str, Any] | None = None,
    dtype: str = "float32",
    tensor_parallel_size: int = 1,
    log_stats: bool = True,
    kv_events_config: Mapping[str, Any] | None = None,
    mla: bool = False,
) -> Scheduler:
    """Build a real vLLM v1 ``Scheduler`` with no model executor behind it.

    The scheduler side of the connector named in ``kv_transfer_config`` is created by the
    scheduler itself (``KVConnectorFactory``, role ``SCHEDULER``) and bound to its KV cache
    manager; it is ``scheduler.connector``.

    Args:
        model_path: A local model folder; only its config is read.
        block_size: Tokens per KV block.
        num_gpu_blocks: KV blocks in the pool, the null block included.
        max_num_batched_tokens: Token budget of one step.
        max_num_seqs: Most requests running at once.
        max_model_len: Longest prompt plus output.
        enable_prefix_caching: Whether the local prefix cache is on.
        kv_transfer_config: ``KVTransferConfig`` keyword arguments, or None for no connector.
        dtype: Model (and KV cache) dtype.
        tensor_parallel_size: KV ranks the scheduler plans for (no worker is started).
        log_stats: Whether the scheduler computes per-step stats (prefix cache hit counters,
            connector stats) into ``EngineCoreOutputs.scheduler_stats``.
        kv_events_config: see `make_vllm_config`; the scheduler publishes its events there.
        mla: an MLA-shaped KV cache (see `make_kv_cache_config`).

    Returns:
        The scheduler. Requests for it come from `make_request` with the same ``block_size``.
    """

    vllm_config = make_vllm_config(
        model_path,
        block_size=block_size,
        num_gpu_blocks=num_gpu_blocks,
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
        enable_prefix_caching=enable_prefix_caching,
        kv_transfer_config=kv_transfer_config,
        dtype=dtype,
        tensor_parallel_size=tensor_parallel_size,
        kv_events_config=kv_events_config,
    )
    return scheduler_for(
        vllm_config, make_kv_cache_config(vllm_config, mla=mla), log_stats=log_stats
    )


def scheduler_for(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, *, log_stats: bool = True
) -> Scheduler:
    """vLLM's ``Scheduler`` for ``kv_cache_config`` (e.g. the groups vLLM's hybrid manager
    makes), with the block sizes and hit alignment vLLM's engine resolves for it."""
    from vllm.v1.structured_output import StructuredOutputManager

    scheduler_block_size, hash_block_size = resolve_block_sizes(kv_cache_config, vllm_config)
    return Scheduler(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=scheduler_block_size,
        hash_block_size=hash_block_size,
        log_stats=log_stats,
    )


def make_request(
    request_id: str,
    prompt_token_ids: Sequence[int],
    *,
    max_tokens: int,
    block_size: int,
    hash_algo: str = "sha256",
    kv_transfer_params: dict[str, Any] | None = None,
) -> Request:
    """Build a ``vllm.v1.request.Request`` with block hashes, as the engine core does.

    Generation ignores eos, so a request finishes after exactly ``max_tokens`` outputs (or at
    ``max_model_len``).

    Args:
        request_id: Unique id.
        prompt_token_ids: The prompt.
        max_tokens: Number of tokens to generate.
        block_size: The scheduler's hash block size (its block size with one KV cache group).
        hash_algo: ``cache_config.prefix_caching_hash_algo``; vLLM's default is ``"sha256"``,
            whose hashes are the same in every process.
        kv_transfer_params: Per-request connector parameters
            (``request.kv_transfer_params``).

    Returns:
        A request in state ``WAITING`` whose ``block_hashes`` cover its full prompt blocks.
    """
    hash_fn = get_hash_fn_by_name(hash_algo)
    init_none_hash(hash_fn)
    extra_args = {"kv_transfer_params": kv_transfer_params} if kv_transfer_params else None
    return Request(
        request_id=request_id,
        prompt_token_ids=list(prompt_token_ids),
        sampling_params=SamplingParams(
            max_tokens=max_tokens, ignore_eos=True, extra_args=extra_args
        ),
        pooling_params=None,
        block_hasher=get_request_block_hasher(block_size, hash_fn),
    )


def sample_tokens(
    scheduler: Scheduler, req_ids: Sequence[str], sampled_token: SampledToken
) -> list[list[int]]:
    """Make up the model runner's sampled tokens for the requests a step scheduled.

    Args:
        scheduler: The scheduler, after ``schedule()`` advanced its requests.
        req_ids: The scheduled requests, in the model runner's order.
        sampled_token: The token each sampling request gets, or a function of the request.

    Returns:
        Per request, one token when its prompt (and earlier outputs) are all computed, else
        none (a non-final prefill chunk samples nothing).
    """
    sampled: list[list[int]] = []
    for req_id in req_ids:
        request = scheduler.requests[req_id]
        if request.num_computed_tokens >= request.num_tokens:
            token = sampled_token(request) if callable(sampled_token) else sampled_token
            sampled.append([token])
        else:
            sampled.append([])
    return sampled


def step(
    scheduler: Scheduler,
    *,
    sampled_token: SampledToken = DEFAULT_SAMPLED_TOKEN,
    kv_connector_output: ConnectorOutput = None,
) -> tuple[SchedulerOutput, EngineCoreOutputs]:
    """Run one engine step: schedule, "execute", and update the scheduler from the output.

    Like the model runner, it samples one token for each scheduled request whose prompt (and
    earlier outputs) are then all computed, and none for a non-final prefill chunk. It calls
    ``update_from_output`` even when nothing was scheduled, as the engine core does, so that
    connector outputs (finished sends and receives) are delivered.

    Args:
        scheduler: From `make_scheduler`.
        sampled_token: The token each sampling request gets, or a function of the request.
        kv_connector_output: What the worker side of a connector reports for this step, or a
            function of the scheduler output that returns it.

    Returns:
        The scheduler output, and the engine core outputs for client 0 (empty when no request
        produced output).
    """
    scheduler_output = scheduler.schedule()
    req_ids = list(scheduler_output.num_scheduled_tokens)
    model_runner_output = ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={req_id: index for index, req_id in enumerate(req_ids)},
        sampled_token_ids=sample_tokens(scheduler, req_ids, sampled_token),
        kv_connector_output=(
            kv_connector_output(scheduler_output)
            if callable(kv_connector_output)
            else kv_connector_output
        ),
    )
    outputs = scheduler.update_from_output(scheduler_output, model_runner_output)
    return scheduler_output, outputs.get(0, EngineCoreOutputs())


def run_to_completion(
    scheduler: Scheduler,
    requests: Iterable[Request] = (),
    *,
    sampled_token: SampledToken = DEFAULT_SAMPLED_TOKEN,
    kv_connector_output: ConnectorOutput = None,
    max_steps: int = 10_000,
) -> RunResult:
    """Add ``requests`` and step until the scheduler has no request left.

    That includes the last, empty step that passes ``finished_req_ids`` to the workers, and,
    with a connector that delays freeing blocks (``request_finished`` returned True), the
    steps until ``kv_connector_output`` reports those requests in ``finished_sending``.

    Args:
        scheduler: From `make_scheduler`.
        requests: Requests to add first (in order); requests added earlier also run.
        sampled_token: As in `step`.
        kv_connector_output: As in `step`, for every step.
        max_steps: Safety limit.

    Returns:
        Outputs and prefill stats of every request that produced output.

    Raises:
        RuntimeError: The requests did not finish within ``max_steps`` steps.
    """
    for request in requests:
        scheduler.add_request(request)
    result = RunResult()
    while scheduler.has_requests():
        if result.num_steps >= max_steps:
            raise RuntimeError(f"requests still unfinished after {max_steps} steps")
        _, outputs = step(
            scheduler, sampled_token=sampled_token, kv_connector_output=kv_connector_output
        )
        result.num_steps += 1
        for output in outputs.outputs:
            result.token_ids.setdefault(output.request_id, []).extend(output.new_token_ids)
            if output.prefill_stats is not None:
                result.prefill_stats[output.request_id] = output.prefill_stats
    return result
