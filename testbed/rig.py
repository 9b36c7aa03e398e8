"""A real vLLM scheduler, kvshelf's real connector and a real worker side, without a model.

The rig drives vLLM's own ``Scheduler`` and ``BlockPool`` with kvshelf's scheduler-role
connector, and executes each step's plan with kvshelf's worker-role logic on real (small) CPU
KV cache tensors through a real kvshelf server. Only the model is missing: sampled tokens are
made up, and the KV cache tensors hold a deterministic pattern derived from each block's
content, so that every load can be checked for bit-exactness and every hit is a real hit.

Used by the scheduler-level tests and by the lazy offload replay benchmark. Imports vLLM and
torch; it reaches the connector through public names only.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.engine import EngineCoreOutputs
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request

from kvshelf.client import KVShelfClient
from kvshelf.roles.fingerprint import layout_fingerprint
from kvshelf.roles.worker import WorkerConnector
from kvshelf.vllm.connector import KVShelfConnector
from kvshelf.vllm.metadata import KVShelfConnectorMetadata, KVShelfWorkerMetadata
from testbed.vllm_scheduler import (
    SampledToken,
    make_kv_cache_config,
    make_scheduler,
    sample_tokens,
)

# Wall time of a step that schedules nothing (see `ConnectorRig.step`).
EMPTY_STEP_S = 0.0002

CONNECTOR = {
    "kv_connector": "KVShelfConnector",
    "kv_connector_module_path": "kvshelf.vllm",
    "kv_role": "kv_both",
}


class ConnectorRig:
    """One model-less engine: vLLM's scheduler plus kvshelf's connector, both roles.

    Args:
        model_path: a local model folder (only its config is read).
        host, port: the kvshelf server.
        extra_config: ``kv_connector_extra_config`` (``lmcache.mp.*``); host and port are set.
        block_size: tokens per block.
        num_gpu_blocks: vLLM's KV cache size in blocks (small forces prefix cache eviction).
        max_num_batched_tokens, max_num_seqs: vLLM's step budget.
        tensor_parallel_size: KV ranks; each gets its own worker side and KV cache shard, and
            their outputs are merged by vLLM's own ``KVOutputAggregator``.
        flush_stores: wait for each step's stores before reporting, so that tests see a
            deterministic order; a benchmark leaves them in the background as vLLM does.
        kv_events_config: ``KVEventsConfig`` keyword arguments: vLLM's scheduler publishes its
            KV events (and the connector's) there; None for none.
        mla: give every layer DeepSeek-V3's MLA cache (one latent per token, the same on every
            rank) instead of the model's attention heads.
    """

    def __init__(
        self,
        model_path: str | os.PathLike[str],
        *,
        host: str,
        port: int,
        extra_config: Mapping[str, Any] | None = None,
        block_size: int = 16,
        num_gpu_blocks: int = 64,
        max_num_batched_tokens: int = 256,
        max_num_seqs: int = 16,
        max_model_len: int = 1024,
        tensor_parallel_size: int = 1,
        flush_stores: bool = True,
        kv_events_config: Mapping[str, Any] | None = None,
        mla: bool = False,
    ) -> None:
        extra = {"lmcache.mp.host": host, "lmcache.mp.port": port, **(extra_config or {})}
        self.scheduler = make_scheduler(
            model_path,
            block_size=block_size,
            num_gpu_blocks=num_gpu_blocks,
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
            tensor_parallel_size=tensor_parallel_size,
            kv_transfer_config={**CONNECTOR, "kv_connector_extra_config": extra},
            kv_events_config=kv_events_config,
            mla=mla,
        )
        connector = self.scheduler.connector
        assert isinstance(connector, KVShelfConnector)
        self.connector = connector
        self.block_size = block_size
        self.flush_stores = flush_stores
        vllm_config = self.scheduler.vllm_config
        kv_cache_config = make_kv_cache_config(vllm_config, mla=mla)
        # Ranks that hold the same KV (MLA; KV heads fewer than ranks) as the connector sees it.
        self.kv_replicas = connector.kv_replicas
        self.workers: list[WorkerConnector] = []
        self.worker_kv_caches: list[dict[str, torch.Tensor]] = []
        for rank in range(tensor_parallel_size):
            kv_caches = _make_kv_caches(kv_cache_config)
            worker = WorkerConnector(
                client_factory=lambda: KVShelfClient(
                    host, port, timeout_s=1.0, retry_interval_s=0.5
                ),
                model_fingerprint=connector.model_fingerprint,
                layout_fingerprint=layout_fingerprint(vllm_config, kv_cache_config),
                rank=rank,
                world_size=tensor_parallel_size,
                retry_interval_s=0.5,
                replicas=self.kv_replicas,
            )
            worker.register_kv_caches(kv_caches, kv_cache_config.num_blocks)
            self.workers.append(worker)
            self.worker_kv_caches.append(kv_caches)
        self.worker = self.workers[0]
        self.kv_caches = self.worker_kv_caches[0]
        self._aggregator = KVOutputAggregator(expected_finished_count=tensor_parallel_size)
        self.num_steps = 0
        # While set, the worker's store reports are withheld from the scheduler (as if a
        # slow worker had not answered yet); they are delivered once it is cleared.
        self.hold_reports = False
        self._held: dict[str, int] = {}

    @property
    def block_pool(self) -> Any:
        return self.scheduler.kv_cache_manager.block_pool

    def add(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def step(self, sampled_token: SampledToken = 3) -> tuple[SchedulerOutput, EngineCoreOutputs]:
        """Schedule, run the worker side of the plan, "compute" new KV, and report back.

        Returns:
            The scheduler output and the engine core outputs of client 0.
        """
        scheduler_output = self.scheduler.schedule()
        metadata = scheduler_output.kv_connector_metadata
        assert isinstance(metadata, KVShelfConnectorMetadata)
        plan = metadata.plan
        worker_outputs = [
            self._run_worker(rank, plan, scheduler_output) for rank in range(len(self.workers))
        ]
        connector_output = self._merge(worker_outputs)
        req_ids = list(scheduler_output.num_scheduled_tokens)
        output = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={req_id: i for i, req_id in enumerate(req_ids)},
            sampled_token_ids=sample_tokens(self.scheduler, req_ids, sampled_token),
            kv_connector_output=connector_output,
        )
        outputs = self.scheduler.update_from_output(scheduler_output, output)
        self.num_steps += 1
        if scheduler_output.total_num_scheduled_tokens == 0:
            # vLLM's empty step still goes to the workers and back. A rig spinning through
            # empty steps in pure Python would instead keep the GIL from the worker's store
            # thread (each torch call in it waits a whole switch interval for the GIL back),
            # so stores that vLLM is waiting for, before it can free blocks, would hardly run.
            time.sleep(EMPTY_STEP_S)
        return scheduler_output, outputs.get(0, EngineCoreOutputs())

    def _run_worker(
        self, rank: int, plan: Any, scheduler_output: SchedulerOutput
    ) -> KVConnectorOutput:
        """One worker's side of a step, in the order vLLM's model runner calls the hooks."""
        worker = self.workers[rank]
        worker.before_reuse(plan.new_blocks, plan.loads)
        worker.await_delayed_free(plan.delayed_free)
        worker.start_loads(plan.loads)
        self._write_computed_kv(scheduler_output, rank)
        worker.finish_loads()
        worker.submit_stores(plan.stores, plan.identity_epoch)
        if self.flush_stores:
            worker.flush_stores()
        completed = worker.take_completed()
        return KVConnectorOutput(
            finished_sending=worker.finished_sending() or None,
            invalid_block_ids=worker.take_load_errors(),
            kv_connector_worker_meta=KVShelfWorkerMetadata(completed) if completed else None,
        )

    def _merge(self, outputs: list[KVConnectorOutput]) -> KVConnectorOutput:
        """Merge the workers' outputs with vLLM's aggregator; withhold store reports if asked."""
        merged = self._aggregator.aggregate(
            [
                ModelRunnerOutput(req_ids=[], req_id_to_index={}, kv_connector_output=o)
                for o in outputs
            ]
        )
        assert merged is not None and merged.kv_connector_output is not None
        output = merged.kv_connector_output
        meta = output.kv_connector_worker_meta
        completed = meta.completed_stores if isinstance(meta, KVShelfWorkerMetadata) else {}
        completed = self._merge_held(completed)
        output.kv_connector_worker_meta = KVShelfWorkerMetadata(completed) if completed else None
        return output

    def _merge_held(self, completed: dict[str, int]) -> dict[str, int]:
        for request_id, count in completed.items():
            self._held[request_id] = self._held.get(request_id, 0) + count
        if self.hold_reports:
            return {}
        released, self._held = self._held, {}
        return released

    def step_until_scheduled(
        self, request_id: str, timeout_s: float = 10.0
    ) -> tuple[SchedulerOutput, EngineCoreOutputs]:
        """Step until ``request_id`` is scheduled: a new request waits for its lookup's reply.

        Returns:
            The outputs of the step that scheduled it.

        Raises:
            TimeoutError: it was not scheduled within ``timeout_s``.
        """
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            scheduler_output, outputs = self.step()
            if request_id in scheduler_output.num_scheduled_tokens:
                return scheduler_output, outputs
        raise TimeoutError(f"request {request_id} not scheduled within {timeout_s} s")

    def run(self, max_steps: int = 100_000, sampled_token: SampledToken = 3) -> None:
        """Step until the scheduler has nothing left, in-flight stores included."""
        while self.scheduler.has_requests():
            if self.num_steps >= max_steps:
                raise RuntimeError(f"still busy after {max_steps} steps")
            self.step(sampled_token)

    def block_content_ok(self, request: Request, num_blocks: int) -> bool:
        """Whether the first ``num_blocks`` blocks of ``request`` hold its expected KV, on every
        rank."""
        block_ids = self.scheduler.kv_cache_manager.get_block_ids(request.request_id)[0]
        return all(
            torch.equal(
                layer[block_ids[i]],
                _pattern(request.block_hashes[i], self._shard(rank), layer[0].shape, layer.dtype),
            )
            for rank, kv_caches in enumerate(self.worker_kv_caches)
            for layer in kv_caches.values()
            for i in range(num_blocks)
        )

    def close(self) -> None:
        for worker in self.workers:
            worker.shutdown()
        self.scheduler.shutdown()

    def _write_computed_kv(self, scheduler_output: SchedulerOutput, rank: int) -> None:
        """Play the model: fill each block completed this step with its content's pattern,
        layer by layer, each layer after the connector says its loads are in place (as
        vLLM's attention layers do)."""
        computed: list[tuple[bytes, int]] = []
        for req_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
            request = self.scheduler.requests[req_id]
            # The scheduler advanced num_computed_tokens when it scheduled the step.
            end = request.num_computed_tokens
            start = end - num_tokens
            first = start // self.block_size
            last = min(end // self.block_size, len(request.block_hashes))
            block_ids = self.scheduler.kv_cache_manager.get_block_ids(req_id)[0]
            computed += [(request.block_hashes[i], block_ids[i]) for i in range(first, last)]
        worker = self.workers[rank]
        shard = self._shard(rank)
        for name, layer in self.worker_kv_caches[rank].items():
            worker.wait_for_layer(name)
            for block_hash, block_id in computed:
                layer[block_id] = _pattern(block_hash, shard, layer[0].shape, layer.dtype)

    def _shard(self, rank: int) -> int:
        """Which shard of the KV ``rank`` holds: replicas hold the same one, as in vLLM."""
        return rank // self.kv_replicas


def _pattern(block_hash: bytes, shard: int, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """A block's deterministic stand-in KV: a function of its chained hash and of the shard
    (each rank holds a different shard of the same block, unless the KV is replicated)."""
    seed = (int.from_bytes(bytes(block_hash)[:8], "little") + shard) & 0x7FFF_FFFF_FFFF_FFFF
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=generator).to(dtype)


def _make_kv_caches(kv_cache_config: Any) -> dict[str, torch.Tensor]:
    """Zeroed CPU KV cache tensors in vLLM's CPU layout, one per layer."""
    group = kv_cache_config.kv_cache_groups[0]
    spec = group.kv_cache_spec
    # K||V per token and head (MLA: the latent alone, its head_size_v is 0).
    content = spec.head_size + spec.head_size_v
    shape = (kv_cache_config.num_blocks, spec.num_kv_heads, spec.block_size, content)
    return {name: torch.zeros(shape, dtype=spec.dtype) for name in group.layer_names}
