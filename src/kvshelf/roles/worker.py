"""The worker-role half of the connector: it moves bytes and reports back.

No vLLM import. The worker maps the server's shared-memory arena (:mod:`kvshelf.roles.server_link`),
copies loads into vLLM's blocks layer by layer while the forward pass runs (each attention
layer waits for its own layer only), and copies stores out in a background thread after it
(:mod:`kvshelf.roles.store_thread`). It never decides anything: every load and store comes
from the scheduler's ``StepPlan``. It names no copy engine: :mod:`kvshelf.transfer`'s factory
picks one for the KV cache's device, and the worker uses it through ``TransferEngine`` and
``LayerwiseLoad`` only.

The load, store and prefault threads run on the cores vLLM keeps free of compute threads, when
it keeps any (:mod:`kvshelf.platform.affinity`).
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from kvshelf.client import KVShelfClient
from kvshelf.metrics import WORKER, WORKER_TIMINGS, Counters, Observations
from kvshelf.plan import LoadJob, StoreJob
from kvshelf.platform.affinity import limit_openmp_team, pin_current_thread, worker_spare_cpus
from kvshelf.roles.attachment import Attachment
from kvshelf.roles.server_link import ServerLink
from kvshelf.roles.store_thread import StoreThread
from kvshelf.transfer import KVCacheLayout, LayerwiseLoad, engine_for

logger = logging.getLogger(__name__)


class WorkerConnector:
    """Worker-side connector logic for one KV rank.

    Args:
        client_factory: makes the server client (called once).
        model_fingerprint: identifies the model weights and dtype.
        layout_fingerprint: identifies the KV cache layout (shared with the scheduler).
        rank: this worker's KV rank.
        world_size: the number of KV ranks.
        retry_interval_s: how often an idle worker tries to reach a missing server.
    """

    def __init__(
        self,
        client_factory: Callable[[], KVShelfClient],
        model_fingerprint: str,
        layout_fingerprint: str,
        rank: int,
        world_size: int,
        retry_interval_s: float = 2.0,
    ) -> None:
        assert 0 <= rank < world_size
        self.rank = rank
        self.world_size = world_size
        self._link = ServerLink(
            client_factory, model_fingerprint, layout_fingerprint, rank, world_size
        )
        # Cumulative counters, exposed through vLLM's connector stats (kvshelf.metrics.WORKER).
        self.counters = Counters(WORKER)
        # Copy times (kvshelf.metrics.WORKER_TIMINGS), taken with each connector stats report.
        self.timings = Observations(WORKER_TIMINGS)
        self._stores = StoreThread(
            self._link, self.counters, self.timings, retry_interval_s, self._confine_helper_thread
        )
        self._state_lock = threading.Lock()
        self._load_errors: set[int] = set()
        self._helper_cpus: frozenset[int] | None = None
        # This step's loads, from start_loads until finish_loads (both on the step loop), one
        # layer-wise load per engine: two only when a server restart splits a step's loads.
        self._loading: list[tuple[list[LoadJob], LayerwiseLoad]] = []
        self._load_batches: queue.Queue[LayerwiseLoad | None] = queue.Queue()
        self._load_thread: threading.Thread | None = None
        self._layer_index: dict[str, int] = {}

    @property
    def pool(self) -> str:
        return self._link.pool

    def register_kv_caches(self, kv_caches: Mapping[str, Any], num_blocks: int) -> None:
        """Detect the KV cache layout, connect, and start the store thread.

        A server that is not running is not an error: vLLM serves without the cache and the
        worker registers as soon as the server answers.

        Args:
            kv_caches: layer name -> that layer's KV cache tensor.
            num_blocks: the number of blocks in each tensor.
        """
        try:
            engine_factory = engine_for(kv_caches)
            layout = KVCacheLayout.from_kv_caches(kv_caches, num_blocks)
        except ValueError as exc:
            self._link.disable(exc)
        else:
            self._link.enable(layout, functools.partial(engine_factory, kv_caches, layout))
            self._layer_index = {layer.name: i for i, layer in enumerate(layout.layers)}
            logger.info(
                "kvshelf worker rank %d/%d: %d layers, %d bytes per page",
                self.rank,
                self.world_size,
                len(kv_caches),
                layout.page_bytes,
            )
        self._helper_cpus = worker_spare_cpus()
        if self._helper_cpus is not None:
            logger.info(
                "kvshelf worker rank %d: load, store and prefault threads on CPUs %s, which vLLM "
                "keeps free of compute threads",
                self.rank,
                ",".join(map(str, sorted(self._helper_cpus))),
            )
        else:
            logger.debug("kvshelf worker rank %d: no CPU free of compute threads", self.rank)
        self._link.connect(self._helper_cpus)
        if self._link.attach() is None and self._link.enabled:
            logger.warning(
                "kvshelf server not reachable at startup; serving without the cache and "
                "retrying in the background"
            )
        self._stores.start()
        self._load_thread = threading.Thread(
            target=self._load_loop, name="kvshelf-load", daemon=True
        )
        self._load_thread.start()

    def start_loads(self, loads: Iterable[LoadJob], *, layerwise: bool = True) -> None:
        """Start copying this step's loads into vLLM's blocks; failures are recorded, never
        raised.

        The copies run in the load thread, layer by layer: ``wait_for_layer`` returns once a
        layer is in place (the engine's ``LayerwiseLoad`` does the copies the load thread has
        not started yet), and ``finish_loads`` settles the step's loads.

        Args:
            loads: this step's loads.
            layerwise: False when the forward pass will not call ``wait_for_layer`` (a full
                CUDA graph replays every layer at once): every layer is then put in place
                (for a CUDA engine: the compute stream made to wait for the last layer's copy)
                before this returns.
        """
        self.finish_loads()
        self._link.close_retired()
        # The loads by the server boot they read from: each boot's arena has its own engine.
        by_boot: dict[str, tuple[Attachment, list[LoadJob]]] = {}
        for load in loads:
            attachment = self._link.attachment
            stale = attachment is None or attachment.boot_id != load.boot_id
            if stale and self._link.enabled:
                # The scheduler saw a server boot this worker has not attached to yet (a
                # restart, or a server that came up after this worker started).
                attachment = self._link.reattach()
            if attachment is not None and attachment.boot_id == load.boot_id:
                by_boot.setdefault(load.boot_id, (attachment, []))[1].append(load)
            else:
                self._settle_load(load, copied=False)
        for attachment, jobs in by_boot.values():
            copying = attachment.engine.begin_loads(
                [(job.pages[self.rank], job.block_ids) for job in jobs]
            )
            self._loading.append((jobs, copying))
            if layerwise:
                self._load_batches.put(copying)
            else:
                copying.wait_layer(len(self._layer_index) - 1)

    def wait_for_layer(self, layer_name: str) -> None:
        """Block until this step's loads have filled layer ``layer_name`` of their blocks.

        Args:
            layer_name: a layer of the registered KV caches; any other name waits for all.
        """
        layer = self._layer_index.get(layer_name)
        for _, copying in self._loading:
            if layer is None:
                copying.wait_all()
            else:
                copying.wait_layer(layer)

    def finish_loads(self) -> None:
        """Wait for this step's loads, release their locks and record failed blocks."""
        loading, self._loading = self._loading, []
        for jobs, copying in loading:
            copying.wait_all()
            failures = copying.failures()
            for index, load in enumerate(jobs):
                error = failures.get(index)
                if error is not None:
                    logger.error(
                        "kvshelf load for request %s failed", load.request_id, exc_info=error
                    )
                self._settle_load(load, copied=error is None)

    def _settle_load(self, load: LoadJob, copied: bool) -> None:
        """Release a load's lock and count it; a load that failed marks its blocks for vLLM."""
        if self._link.release(load, len(load.block_ids) if copied else 0) and copied:
            self.counters.add("blocks_loaded", len(load.block_ids))
            self.counters.add("bytes_loaded", len(load.block_ids) * self._link.page_bytes)
            return
        logger.warning(
            "kvshelf could not load %d blocks of request %s; vLLM recomputes them",
            len(load.block_ids),
            load.request_id,
        )
        self.counters.add("blocks_load_failed", len(load.block_ids))
        with self._state_lock:
            self._load_errors.update(load.block_ids)

    def submit_stores(self, stores: Iterable[StoreJob], epoch: str = "") -> None:
        """Queue this step's stores for the store thread.

        Args:
            stores: the step's stores; their blocks stay valid until the scheduler hears
                that every worker finished them.
            epoch: the model identity's epoch of the step (``StepPlan.identity_epoch``).
        """
        self._stores.submit(stores, epoch)

    def await_delayed_free(self, request_ids: Iterable[str]) -> None:
        """Remember requests whose blocks vLLM keeps until this worker reports them."""
        self._stores.await_delayed_free(request_ids)

    def flush_stores(self) -> None:
        """Wait until every queued store has run (blocks of preempted requests may be reused)."""
        self._stores.flush()

    def finished_sending(self) -> set[str]:
        """Delayed-free requests whose stores on this worker are all done."""
        return self._stores.finished_sending()

    def take_completed(self) -> dict[str, int]:
        """Store jobs finished since the last call: request id -> count."""
        return self._stores.take_completed()

    def snapshot(self) -> dict[str, int]:
        """All counters, by name."""
        return self.counters.snapshot()

    def take_load_errors(self) -> set[int]:
        """Blocks whose load failed since the last call (this step's loads settled first)."""
        self.finish_loads()
        with self._state_lock:
            errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        """Stop the load and store threads and unmap the arena."""
        self.finish_loads()
        if self._load_thread is not None:
            self._load_batches.put(None)
            self._load_thread.join(timeout=5.0)
            self._load_thread = None
        self._stores.stop()
        self._link.close()

    def _confine_helper_thread(self) -> None:
        """Move the calling (load or store) thread off vLLM's compute cores, when vLLM keeps
        any free."""
        if self._helper_cpus is None:
            return
        # ATen sets each thread's OpenMP team size the first time the thread asks for it, which
        # would undo the limit below if it came later.
        torch.get_num_threads()
        if pin_current_thread(self._helper_cpus):
            # A parallel region would rebind this thread to a compute core.
            limit_openmp_team(1)

    def _load_loop(self) -> None:
        self._confine_helper_thread()
        while (batch := self._load_batches.get()) is not None:
            started = time.perf_counter()
            batch.run()
            # The load thread's copies of the step; a layer the forward pass copied itself
            # may still be finishing (waiting for it here would race the step loop).
            self.timings.observe("load_seconds", time.perf_counter() - started)
