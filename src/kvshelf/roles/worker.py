"""The worker-role half of the connector: it moves bytes and reports back.

No vLLM import. The worker maps the server's shared-memory arena
(:mod:`kvshelf.roles.server_link`), copies loads into vLLM's blocks layer by layer while the
forward pass runs (each attention layer waits for its own layer only;
:mod:`kvshelf.roles.step_loads`), and copies stores out in a background thread after it
(:mod:`kvshelf.roles.store_thread`). It never decides anything: every load and store comes
from the scheduler's ``StepPlan``. It names no copy engine: :mod:`kvshelf.transfer`'s factory
picks one for the KV cache's device, and the worker uses it through ``TransferEngine`` and
``LayerwiseLoad`` only.

The load, settle, store and prefault threads run on the cores vLLM keeps free of compute
threads, when it keeps any (:mod:`kvshelf.platform.affinity`).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from kvshelf.client import KVShelfClient
from kvshelf.connector_config import KVShelfConfig
from kvshelf.metric_types import Counters, Observations
from kvshelf.metrics import WORKER, WORKER_TIMINGS
from kvshelf.plan import LoadJob, StoreJob
from kvshelf.platform.affinity import limit_openmp_team, pin_current_thread, worker_spare_cpus
from kvshelf.roles.server_link import ServerLink
from kvshelf.roles.step_loads import StepLoads
from kvshelf.roles.store_thread import StoreThread
from kvshelf.transfer import KVCacheLayout, distinct_layers, engine_for

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
        replicas: consecutive ranks holding the same KV bytes (MLA, KV heads fewer than
            ranks), stored once (:mod:`kvshelf.roles.replication`); 1 for sharded KV.
        stop_drain_timeout_s: how long :meth:`shutdown` keeps committing queued stores
            (``kvshelf.stop_drain_timeout_s``) before it aborts the rest.
    """

    def __init__(
        self,
        client_factory: Callable[[], KVShelfClient],
        model_fingerprint: str,
        layout_fingerprint: str,
        rank: int,
        world_size: int,
        retry_interval_s: float = 2.0,
        replicas: int = 1,
        stop_drain_timeout_s: float = KVShelfConfig.stop_drain_timeout_s,
    ) -> None:
        assert 0 <= rank < world_size and world_size % replicas == 0
        self.rank = rank
        self.world_size = world_size
        # Cumulative counters, exposed through vLLM's connector stats (kvshelf.metrics.WORKER).
        self.counters = Counters(WORKER)
        self._link = ServerLink(
            client_factory,
            model_fingerprint,
            layout_fingerprint,
            rank,
            world_size,
            replicas,
            self.counters,
        )
        # Copy times (kvshelf.metrics.WORKER_TIMINGS), taken with each connector stats report.
        self.timings = Observations(WORKER_TIMINGS)
        self._stores = StoreThread(
            self._link,
            self.counters,
            self.timings,
            retry_interval_s,
            self._confine_helper_thread,
            stop_drain_timeout_s,
        )
        self._helper_cpus: frozenset[int] | None = None
        self._loads = StepLoads(
            self._link, rank, self.counters, self.timings, self._confine_helper_thread
        )
        # The scheduler's count of server outages last seen (StepPlan.server_outages).
        self._outages_seen = 0

    @property
    def pool(self) -> str:
        return self._link.pool

    def register_kv_caches(self, kv_caches: Mapping[str, Any], num_blocks: int) -> None:
        """Detect the KV cache layout, connect, and start the store thread.

        A server that is not running is not an error: vLLM serves without the cache and the
        worker registers as soon as the server answers.

        Args:
            kv_caches: layer name -> that layer's KV cache tensor; layers that view the same
                memory (vLLM's KV cache groups overlaid) are one layer of a page.
            num_blocks: the number of blocks in each tensor.
        """
        distinct, aliases = distinct_layers(kv_caches, num_blocks)
        try:
            engine_factory = engine_for(distinct)
            layout = KVCacheLayout.from_kv_caches(distinct, num_blocks)
        except ValueError as exc:
            self._link.disable(exc)
        else:
            self._link.enable(layout, functools.partial(engine_factory, distinct, layout))
            layer_index = {layer.name: i for i, layer in enumerate(layout.layers)}
            # An aliasing layer waits for the loads of the layer it shares memory with.
            for name, first in aliases.items():
                layer_index[name] = layer_index[first]
            self._loads.layer_index = layer_index
            self._loads.last_layer = layout.num_layers - 1
            logger.info(
                "kvshelf worker rank %d/%d: %d layers, %d bytes per page",
                self.rank,
                self.world_size,
                layout.num_layers,
                layout.page_bytes,
            )
        self._helper_cpus = worker_spare_cpus()
        if self._helper_cpus is not None:
            logger.info(
                "kvshelf worker rank %d: load, settle, store and prefault threads on CPUs %s, "
                "which vLLM keeps free of every rank's compute threads",
                self.rank,
                ",".join(map(str, sorted(self._helper_cpus))),
            )
        else:
            # Said at INFO: the copies then compete with this rank's (or another rank's) compute
            # threads, which an operator fixes by reserving CPUs for vLLM's helpers.
            logger.info(
                "kvshelf worker rank %d: vLLM leaves no CPU free of every rank's compute "
                "threads; load, settle, store and prefault threads run where this process "
                "runs (reserve CPUs with VLLM_CPU_NUM_OF_RESERVED_CPU or leave some out of "
                "VLLM_CPU_OMP_THREADS_BIND)",
                self.rank,
            )
        self._link.connect(self._helper_cpus)
        if self._link.attach() is None and self._link.enabled:
            logger.warning(
                "kvshelf server not reachable at startup; serving without the cache and "
                "retrying in the background"
            )
        self._stores.start()
        self._loads.start()

    def start_loads(self, loads: Iterable[LoadJob], *, layerwise: bool = True) -> None:
        """Start copying this step's loads into vLLM's blocks; failures are recorded, never
        raised.

        The copies run in the load thread, layer by layer: ``wait_for_layer`` returns once a
        layer is in place (the engine's ``LayerwiseLoad`` does the copies the load thread has
        not started yet), and ``finish_loads`` places the step's loads.

        Args:
            loads: this step's loads.
            layerwise: False when the forward pass will not call ``wait_for_layer`` (a full
                CUDA graph replays every layer at once): every layer is then put in place
                (for a CUDA engine: the compute stream made to wait for the last layer's copy)
                before this returns.
        """
        self._loads.begin(loads, layerwise=layerwise)

    def wait_for_layer(self, layer_name: str) -> None:
        """Return once this step's loads have filled layer ``layer_name`` of their blocks, for
        the forward pass (a CUDA engine makes the compute stream wait; the host does not).

        Args:
            layer_name: a layer of the registered KV caches; any other name waits for all.
        """
        self._loads.wait_for_layer(layer_name)

    def finish_loads(self) -> None:
        """Put every layer of this step's loads in place and record failed blocks, without
        waiting for the device: a lock is released once its load's copies finished (now, or
        by the settle thread)."""
        self._loads.place()

    def submit_stores(self, stores: Iterable[StoreJob], epoch: str = "") -> None:
        """Queue this step's stores for the store thread.

        Args:
            stores: the step's stores; their blocks stay valid until the scheduler hears
                that every worker finished them.
            epoch: the model identity's epoch of the step (``StepPlan.identity_epoch``).
        """
        # The engine the stores' fence is recorded on starts here if no step started it yet.
        self._loads.start_engine(self._link.attachment)
        self._stores.submit(stores, epoch)

    def await_delayed_free(self, request_ids: Iterable[str]) -> None:
        """Remember requests whose blocks vLLM keeps until this worker reports them."""
        self._stores.await_delayed_free(request_ids)

    def before_reuse(self, new_blocks: Iterable[int], loads: Iterable[LoadJob] = ()) -> bool:
        """Order this step's use of its new blocks and its loads' blocks after the queued
        stores that still read them (vLLM freed them under the store); see
        ``StoreThread.before_reuse``.

        Returns:
            Whether some queued store read one of them.
        """
        blocks = set(new_blocks)
        for load in loads:
            blocks.update(load.block_ids)
        return self._stores.before_reuse(blocks)

    def note_server_outages(self, outages: int) -> None:
        """The scheduler's count of server outages (``StepPlan.server_outages``): when it
        grew, the scheduler waited a whole timeout for the server in vain, so this worker's
        client stops waiting for it now (the store thread drops what it cannot store, a lock
        release waits no more) instead of after a timeout of its own: requests wait for one
        timeout per outage, not one per process. Never waits."""
        if outages <= self._outages_seen:
            return
        self._outages_seen = outages
        self._link.client.assume_unavailable()

    def flush_stores(self) -> None:
        """Wait until every queued store has run and its commit was confirmed: a producer's
        step (its answer must find the blocks committed), tests and benchmarks that look the
        blocks up next; other engines' steps use :meth:`before_reuse`."""
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
        """Blocks whose load failed since the last call (this step's loads placed first)."""
        return self._loads.take_errors()

    def shutdown(self) -> None:
        """Stop the load, settle and store threads and unmap the arena: queued stores are
        committed, or aborted once ``stop_drain_timeout_s`` has passed
        (:meth:`StoreThread.stop`)."""
        self._loads.stop()
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
