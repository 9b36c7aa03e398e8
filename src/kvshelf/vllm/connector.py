"""kvshelf's vLLM KV connector: the thin layer between vLLM's connector API and kvshelf.

Load it with::

    {"kv_connector": "KVShelfConnector", "kv_connector_module_path": "kvshelf.vllm",
     "kv_role": "kv_both", "kv_connector_extra_config": {"lmcache.mp.port": 5555}}

``LMCacheMPConnector`` names the same class, so that a launch line written for LMCache's MP
connector works once ``kv_connector_module_path`` points at ``kvshelf.vllm``.

Every decision lives in ``kvshelf.roles.scheduler`` (scheduler role) and every byte moved in
``kvshelf.roles.worker`` (worker role); this class builds the configuration, the clients, the
offload mode (eager, or ``kvshelf.lazy``'s offloader) and the roles, and only adapts vLLM's
calls to them.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvshelf.client import KVShelfClient
from kvshelf.client.outages import shared_outages
from kvshelf.connector_config import LAZY_OFFLOAD, KVShelfConfig
from kvshelf.lazy.block_pool_view import VllmBlockPoolView
from kvshelf.lazy.offloader import LazyOffloader
from kvshelf.plan import StepPlan
from kvshelf.protocol import pool_name
from kvshelf.roles.events import EventTracker
from kvshelf.roles.fingerprint import (
    layout_fingerprint,
    model_fingerprint,
    new_epoch,
    with_epoch,
)
from kvshelf.roles.groups import ONE_FULL_GROUP, KVGroups
from kvshelf.roles.replication import kv_replicas
from kvshelf.roles.scheduler import SchedulerConnector
from kvshelf.roles.support import unsupported_reason
from kvshelf.roles.worker import WorkerConnector
from kvshelf.vllm.events import events_enabled, make_tracker, to_vllm
from kvshelf.vllm.metadata import KVShelfConnectorMetadata, KVShelfWorkerMetadata
from kvshelf.vllm.prometheus import KVShelfPromMetrics
from kvshelf.vllm.stats import CounterDelta, KVShelfConnectorStats

if TYPE_CHECKING:
    from collections.abc import Iterable

    import torch
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)


class KVShelfConnector(KVConnectorBase_V1, SupportsHMA):
    """A vLLM KV connector backed by a kvshelf server (``kvshelf server``).

    It supports vLLM's hybrid KV cache manager (``SupportsHMA``): the KV cache groups kvshelf
    caches are :mod:`kvshelf.roles.groups`'; a model with any other group is refused at
    start-up (:mod:`kvshelf.roles.support`) and vLLM serves it without the cache.

    Args:
        vllm_config: the engine's config; ``kv_transfer_config.kv_connector_extra_config``
            holds the ``lmcache.mp.*`` and ``kvshelf.*`` keys.
        role: scheduler or worker.
        kv_cache_config: the KV cache layout vLLM resolved.
    """

    _cache_hit_source = CacheHitSource.HOST

    @property
    def requires_kv_delivery(self) -> bool:
        # A best-effort cache: a store dropped by a preemption is only a future miss.
        return False

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        if kv_cache_config is None:
            raise ValueError("kvshelf needs vLLM's kv_cache_config (vLLM >= 0.11)")
        self._config = KVShelfConfig.from_extra_config(
            self._kv_transfer_config.kv_connector_extra_config,
            self._kv_transfer_config.kv_role,
        )
        # An attention kvshelf cannot cache correctly: every hook is a no-op and vLLM serves
        # on without the cache (never a wrong output, never a refused start).
        self._disabled = unsupported_reason(kv_cache_config)
        self._scheduler: SchedulerConnector | None = None
        self._worker: WorkerConnector | None = None
        self._lazy_offloader: LazyOffloader | None = None
        # kvshelf's part of vLLM's KV events stream; None unless vLLM publishes events.
        self._events: EventTracker | None = None
        self._stats_delta = CounterDelta()
        self._groups = ONE_FULL_GROUP
        self.kv_replicas = 1
        if self._disabled is not None:
            logger.error("kvshelf disabled: %s; vLLM serves without it", self._disabled)
            return
        self._groups = KVGroups.from_kv_cache_config(kv_cache_config)
        parallel = vllm_config.parallel_config
        self._world_size = parallel.tensor_parallel_size * parallel.pipeline_parallel_size
        # Ranks holding the same KV (MLA, KV heads fewer than ranks) store it once.
        self.kv_replicas = kv_replicas(vllm_config, kv_cache_config)
        # Digests the weights (once per process), unless kvshelf.model_id names them.
        self.model_fingerprint = model_fingerprint(vllm_config, self._config)
        model_fp = self.model_fingerprint
        layout_fp = layout_fingerprint(vllm_config, kv_cache_config)
        self._layout_fp = layout_fp
        self._block_size = kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size
        self._last_stats_log = time.monotonic()
        # The lazy offloader is built when vLLM binds its block pool, which it reads.

        if role == KVConnectorRole.SCHEDULER:
            _recompute_failed_loads(self._kv_transfer_config)
            self._scheduler = SchedulerConnector(
                client=self._make_client(),
                pool=pool_name(model_fp, layout_fp, self._world_size, self.kv_replicas),
                block_size=self._block_size,
                world_size=self._world_size,
                get_block_ids=self._block_ids_of,
                looks_up=self._config.looks_up,
                stores=self._config.stores,
                groups=self._groups,
            )
            if events_enabled(vllm_config) and self._groups != ONE_FULL_GROUP:
                # The server keys a hybrid model's blocks per group, not by vLLM's hashes
                # (roles/groups.py): its log cannot be told in the hashes routers know.
                logger.warning(
                    "kvshelf publishes no KV events for a model with several KV cache groups"
                )
            elif events_enabled(vllm_config):
                self._events = make_tracker(
                    self._make_client,
                    pool_name(model_fp, layout_fp, self._world_size, self.kv_replicas),
                    self._block_size,
                    self._world_size,
                )
                self._scheduler.set_events(self._events)
        else:
            self._worker = WorkerConnector(
                client_factory=self._make_client,
                model_fingerprint=model_fp,
                layout_fingerprint=layout_fp,
                rank=_kv_rank(),
                world_size=self._world_size,
                retry_interval_s=self._config.reconnect_interval_s,
                replicas=self.kv_replicas,
                stop_drain_timeout_s=self._config.stop_drain_timeout_s,
            )
        logger.info(
            "kvshelf connector (%s) for server %s:%d, role %s, %s mode%s",
            role.name.lower(),
            self._config.host,
            self._config.port,
            self._config.role,
            f"lazy ({self._config.lazy.policy})" if self._config.lazy.enabled else "eager",
            ", CURVE" if self._config.curve is not None else "",
        )

    def _make_client(self) -> KVShelfClient:
        # The process's clients of this server (scheduler, worker, events reader) tell each
        # other of an outage: a request waits for one timeout per outage, not one per client.
        return KVShelfClient(
            self._config.host,
            self._config.port,
            timeout_s=self._config.request_timeout_s,
            retry_interval_s=self._config.reconnect_interval_s,
            curve=self._config.curve,
            outages=shared_outages(self._config.host, self._config.port),
        )

    # ---------------------------------------------------------------- worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if self._disabled is not None:
            return
        assert self._worker is not None
        assert self._kv_cache_config is not None
        self._worker.register_kv_caches(kv_caches, self._kv_cache_config.num_blocks)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self._disabled is not None:
            return
        assert self._worker is not None
        plan = self._plan()
        self._worker.note_server_outages(plan.server_outages)
        self._worker.await_delayed_free(plan.delayed_free)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        assert isinstance(kv_connector_metadata, KVShelfConnectorMetadata)
        if self._disabled is not None:
            return
        assert self._worker is not None
        # vLLM calls this first in every step (V1: before it zeroes new blocks and copies
        # into them; V2: just before the loads). This step's new blocks may have been freed
        # under a store still queued (a window slid past them, a preemption): the step is
        # ordered after those stores' copies, and after nothing else.
        plan = kv_connector_metadata.plan
        self._worker.before_reuse(plan.new_blocks, plan.loads)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        if self._disabled is not None:
            return
        assert self._worker is not None
        # vLLM's state-space layers (Mamba2, gated delta net) read their state without calling
        # wait_for_layer_load: every layer must be in place before the forward pass.
        layerwise = _calls_layer_hooks(forward_context) and not self._groups.has_state
        self._worker.start_loads(self._plan().loads, layerwise=layerwise)

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self._disabled is not None:
            return
        assert self._worker is not None
        self._worker.wait_for_layer(layer_name)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return

    def wait_for_save(self) -> None:
        if self._disabled is not None:
            return
        assert self._worker is not None
        self._worker.finish_loads()
        plan = self._plan()
        self._worker.submit_stores(plan.stores, plan.identity_epoch)
        if plan.stores and not self._config.looks_up:
            # A producer's answer is what sends the request on to its consumer (the
            # disaggregated prefill proxy): the step's outputs leave the engine only once
            # its stores are committed, or else the consumer's lookup could come first and
            # recompute the prompt. Bounded by the request timeout, as every store is.
            self._worker.flush_stores()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self._disabled is not None:
            return None, None
        assert self._worker is not None
        return self._worker.finished_sending() or None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        if self._disabled is not None:
            return set()
        assert self._worker is not None
        return self._worker.take_load_errors()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        if self._disabled is not None:
            return None
        assert self._worker is not None
        completed = self._worker.take_completed()
        return KVShelfWorkerMetadata(completed) if completed else None

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        if self._events is not None:
            self._events.close()

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        # kvshelf copies every KVCacheLayout (kvshelf.transfer.layout); a block-compact one
        # (BLNHC/BLHNC) turns a block's copy into one DMA, but nobody has measured what it
        # does to attention speed, so kvshelf leaves the choice to the backends.
        return None

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        # Not needed: a step replayed as a full CUDA graph (a hit's 1-token prefill looks like
        # a decode) skips wait_for_layer_load, so start_load_kv then puts every layer in
        # place before the graph runs (_calls_layer_hooks, under model runners V1 and V2);
        # decode keeps its full graphs.
        return False

    @property
    def lazy_offloader(self) -> LazyOffloader | None:
        """The scheduler role's lazy offloader; None in eager mode, on workers, or before vLLM
        bound its block pool. Read-only access for benchmarks and tests."""
        return self._lazy_offloader

    def _plan(self) -> StepPlan:
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, KVShelfConnectorMetadata)
        return metadata.plan

    # ------------------------------------------------------------- scheduler side

    def bind_gpu_block_pool(self, gpu_block_pool: BlockPool) -> None:
        if self._disabled is not None:
            return
        assert self._scheduler is not None
        lazy = self._config.lazy
        if not lazy.enabled:
            return
        if not self._vllm_config.cache_config.enable_prefix_caching:
            # Without prefix caching vLLM's blocks carry no hash, so no buffered store can be
            # verified and lazy offload would skip every one of them.
            logger.warning(
                "lazy offload needs vLLM's prefix caching to verify block hashes; with "
                "--no-enable-prefix-caching nothing will be stored. Enable prefix caching or "
                "set %s to false.",
                LAZY_OFFLOAD,
            )
        if lazy.eviction_window is None:
            lazy = dataclasses.replace(lazy, eviction_window=self._default_eviction_window())
        self._lazy_offloader = LazyOffloader(
            lazy,
            VllmBlockPoolView(gpu_block_pool),
            frees_early=self._groups.frees_blocks_early,
        )
        self._scheduler.set_mode(self._lazy_offloader)

    def _default_eviction_window(self) -> int:
        """Blocks vLLM may take from its free queue in about two steps."""
        scheduler_config = self._vllm_config.scheduler_config
        per_step = -(-scheduler_config.max_num_batched_tokens // self._block_size)
        return 2 * (per_step + scheduler_config.max_num_seqs)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        if self._disabled is not None:
            return 0, False
        assert self._scheduler is not None
        if self._lazy_offloader is not None:
            # vLLM allocates for this waiting request next: window blocks it freed for the
            # running ones this step are to be free by then, as without lazy offload.
            self._lazy_offloader.settle()
        return self._scheduler.lookup(request, num_computed_tokens), False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        if self._disabled is not None:
            return
        assert self._scheduler is not None
        self._scheduler.after_alloc(request, blocks.get_block_ids(), num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        if self._disabled is not None:
            return KVShelfConnectorMetadata(StepPlan())
        assert self._scheduler is not None
        plan = self._scheduler.build_plan(scheduler_output)
        self._maybe_log_stats()
        return KVShelfConnectorMetadata(plan)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        if self._disabled is not None:
            return
        assert self._scheduler is not None
        if self._lazy_offloader is not None:
            # vLLM freed the requests that finished this step just before.
            self._lazy_offloader.settle()
        worker_meta = connector_output.kv_connector_worker_meta
        if isinstance(worker_meta, KVShelfWorkerMetadata):
            self._scheduler.stores_reported(worker_meta.completed_stores)
            if self._events is not None:
                self._events.stores_confirmed()

    def take_events(self) -> Iterable[KVCacheEvent]:
        if self._events is None:
            return ()
        return to_vllm(self._events.take(), self._block_size)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        # vLLM calls this one when its hybrid manager is off: one group's block ids.
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        if self._disabled is not None:
            return False, None
        assert self._scheduler is not None
        return self._scheduler.request_finished(request, block_ids), None

    def reset_cache(self) -> bool:
        """vLLM's cache reset (after a weight update, say): a new identity epoch.

        Nothing is deleted on the server, which other engines share; this engine only stops
        reading and writing the old pages: from now on its lookups and stores use a pool keyed
        by a fresh random epoch.
        """
        if self._disabled is not None:
            return True
        assert self._scheduler is not None
        epoch = new_epoch()
        self._scheduler.reset_identity(
            pool_name(
                with_epoch(self.model_fingerprint, epoch),
                self._layout_fp,
                self._world_size,
                self.kv_replicas,
            ),
            epoch,
        )
        logger.info("kvshelf cache reset: new identity epoch %s", epoch)
        return True

    def has_pending_push_work(self) -> bool:
        # vLLM stops stepping when it has no request; lazy offload may still have stores to
        # submit (the bounded-delay flush) or to confirm, which free protected blocks.
        if self._events is not None and self._events.pending:
            # Stores confirmed and their Stored events not read yet: a few more steps.
            return True
        return self._scheduler is not None and self._scheduler.has_pending_work()

    def _block_ids_of(self, request_id: str) -> tuple[list[int], ...]:
        assert self._kv_cache_manager is not None
        return self._kv_cache_manager.get_block_ids(request_id)

    # ------------------------------------------------------------------ both sides

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        delta: dict[str, Any] = self._stats_delta.take(self._counters())
        if self._worker is not None:
            delta.update(self._worker.timings.take())
        stats = KVShelfConnectorStats(data=delta)
        return None if stats.is_empty() else stats

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> KVConnectorStats | None:
        return KVShelfConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics | None:
        # vLLM's frontend calls this once, and feeds it every stats report of each engine.
        return KVShelfPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def _counters(self) -> dict[str, int]:
        if self._scheduler is not None:
            return self._scheduler.snapshot()
        if self._disabled is not None:
            return {}
        assert self._worker is not None
        return self._worker.snapshot()

    def _maybe_log_stats(self) -> None:
        now = time.monotonic()
        if now - self._last_stats_log < self._config.stats_log_interval_s:
            return
        self._last_stats_log = now
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("kvshelf scheduler counters: %s", self._counters())


def _recompute_failed_loads(kv_transfer_config: Any) -> None:
    """Make vLLM recompute blocks whose load failed instead of failing their requests.

    vLLM's default policy, "fail", ends a request with an error when a connector reports a
    failed load. For an optional cache that is the wrong trade: a lost hit should cost time,
    never a request. The scheduler reads the policy right after creating this connector.
    """
    if kv_transfer_config.kv_load_failure_policy == "fail":
        kv_transfer_config.kv_load_failure_policy = "recompute"
        logger.info(
            "kvshelf sets kv_load_failure_policy to 'recompute': a failed cache load is "
            "recomputed by vLLM, never a failed request"
        )


def _calls_layer_hooks(forward_context: Any) -> bool:
    """Whether this step's forward pass calls ``wait_for_layer_load`` before each attention.

    Only when ``start_load_kv`` runs inside the step's own forward context (attention metadata
    set: vLLM's attention wrappers call the hook only then) and its mode is not ``FULL`` (a
    full CUDA graph replays the model without the Python wrappers). vLLM 0.32's model runner V2
    starts the loads of a ``FULL`` step outside any forward context, under a stand-in with no
    attention metadata and mode ``NONE``: that is a step without layer hooks too, and the
    compute stream must wait for the whole load before the forward pass.
    """
    from vllm.config import CUDAGraphMode

    if not getattr(forward_context, "attn_metadata", None):
        return False
    mode = getattr(forward_context, "cudagraph_runtime_mode", CUDAGraphMode.NONE)
    return mode != CUDAGraphMode.FULL


def _kv_rank() -> int:
    """This worker's KV rank: its position in the tensor x pipeline parallel grid."""
    from vllm.distributed.parallel_state import get_pp_group, get_tp_group

    tp = get_tp_group()
    return get_pp_group().rank_in_group * tp.world_size + tp.rank_in_group


# The drop-in name: vLLM resolves ``kv_connector`` by attribute in ``kv_connector_module_path``,
# and logs the class's own name, which stays KVShelfConnector.
LMCacheMPConnector = KVShelfConnector
