"""The worker-role half of the connector: it moves bytes and reports back.

No vLLM import. The worker maps the server's shared-memory arena, copies loads into vLLM's
blocks layer by layer while the forward pass runs (each attention layer waits for its own
layer only), and copies stores out in a background thread after it. It never decides
anything: every load and store comes from the scheduler's ``StepPlan``. It names no copy
engine: :mod:`kvshelf.transfer`'s factory picks one for the KV cache's device, and the worker
uses it through ``TransferEngine`` and ``LayerwiseLoad`` only.

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

from kvshelf.client import KVShelfClient, Reservation, ServerError, ServerUnavailable
from kvshelf.metrics import WORKER, WORKER_TIMINGS, Counters, Observations
from kvshelf.plan import LoadJob, StoreJob
from kvshelf.platform.affinity import limit_openmp_team, pin_current_thread, worker_spare_cpus
from kvshelf.platform.shm import ArenaAccessError
from kvshelf.protocol import ErrorCode, PageLayout
from kvshelf.roles.attachment import Attachment
from kvshelf.roles.fingerprint import with_epoch
from kvshelf.roles.store_queue import StoreItem, StoreQueue
from kvshelf.transfer import (
    KVCacheLayout,
    LayerwiseLoad,
    TransferEngine,
    UnsupportedKVCache,
    engine_for,
)

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
        self._client_factory = client_factory
        self._client: KVShelfClient | None = None
        self._model_fingerprint = model_fingerprint
        # The identity epoch stores go to (StepPlan.identity_epoch), set by the store thread.
        self._epoch = ""
        self._layout_fingerprint = layout_fingerprint
        self.rank = rank
        self.world_size = world_size
        self._retry_interval_s = retry_interval_s
        # Both set once the KV cache is known to be copyable (else the cache stays off).
        self._layout: KVCacheLayout | None = None
        self._new_engine: Callable[[torch.Tensor], TransferEngine] | None = None
        self._attachment: Attachment | None = None
        self._attach_lock = threading.Lock()
        # Arenas this worker could not open (another user or IPC namespace), logged once each.
        self._inaccessible_arenas: set[str] = set()
        # Attachments of earlier server boots, closed by the step loop (their only reader).
        self._retired: list[Attachment] = []
        # Cumulative counters, exposed through vLLM's connector stats (kvshelf.metrics.WORKER).
        self.counters = Counters(WORKER)
        # Copy times (kvshelf.metrics.WORKER_TIMINGS), taken with each connector stats report.
        self.timings = Observations(WORKER_TIMINGS)

        # Store jobs run in FIFO order on one thread; the lock guards the bookkeeping
        # shared with the step loop. Each job travels with its step's epoch and forward fence.
        self._jobs = StoreQueue()
        self._state_lock = threading.Lock()
        self._outstanding: dict[str, int] = {}
        self._completed: dict[str, int] = {}
        self._awaiting_free: set[str] = set()
        self._load_errors: set[int] = set()
        self._thread: threading.Thread | None = None
        self._helper_cpus: frozenset[int] | None = None
        # This step's loads, from start_loads until finish_loads (both on the step loop), one
        # layer-wise load per engine: two only when a server restart splits a step's loads.
        self._loading: list[tuple[list[LoadJob], LayerwiseLoad]] = []
        self._load_batches: queue.Queue[LayerwiseLoad | None] = queue.Queue()
        self._load_thread: threading.Thread | None = None
        self._layer_index: dict[str, int] = {}

    @property
    def pool(self) -> str:
        from kvshelf.protocol import pool_name

        return pool_name(self._epoch_fingerprint(), self._layout_fingerprint, self.world_size)

    def _epoch_fingerprint(self) -> str:
        return with_epoch(self._model_fingerprint, self._epoch)

    def register_kv_caches(self, kv_caches: Mapping[str, Any], num_blocks: int) -> None:
        """Detect the KV cache layout, connect, and start the store thread.

        A server that is not running is not an error: vLLM serves without the cache and the
        worker registers as soon as the server answers.

        Args:
            kv_caches: layer name -> that layer's KV cache tensor.
            num_blocks: the number of blocks in each tensor.
        """
        self._client = self._client_factory()
        try:
            engine_factory = engine_for(kv_caches)
            self._layout = KVCacheLayout.from_kv_caches(kv_caches, num_blocks)
            self._new_engine = functools.partial(engine_factory, kv_caches, self._layout)
            self._layer_index = {layer.name: i for i, layer in enumerate(self._layout.layers)}
        except ValueError as exc:
            self._disable(exc)
        else:
            logger.info(
                "kvshelf worker rank %d/%d: %d layers, %d bytes per page",
                self.rank,
                self.world_size,
                len(kv_caches),
                self._layout.page_bytes,
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
        if self._attach() is None and self._layout is not None:
            logger.warning(
                "kvshelf server not reachable at startup; serving without the cache and "
                "retrying in the background"
            )
        self._thread = threading.Thread(target=self._store_loop, name="kvshelf-store", daemon=True)
        self._thread.start()
        self._load_thread = threading.Thread(
            target=self._load_loop, name="kvshelf-load", daemon=True
        )
        self._load_thread.start()

    def _disable(self, why: Exception) -> None:
        """Turn the cache off for good, with one ERROR line.

        Never stop vLLM for the cache's sake: every store is dropped and every load is
        reported failed (vLLM recomputes), so outputs stay correct.
        """
        self._layout = None
        self._new_engine = None
        logger.error("kvshelf cannot copy this KV cache (%s); serving without the cache", why)

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
        self._close_retired()
        # The loads by the server boot they read from: each boot's arena has its own engine.
        by_boot: dict[str, tuple[Attachment, list[LoadJob]]] = {}
        for load in loads:
            attachment = self._attachment
            stale = attachment is None or attachment.boot_id != load.boot_id
            if stale and self._layout is not None:
                # The scheduler saw a server boot this worker has not attached to yet (a
                # restart, or a server that came up after this worker started).
                attachment = self._reattach()
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
        if self._release(load, len(load.block_ids) if copied else 0) and copied:
            self.counters.add("blocks_loaded", len(load.block_ids))
            self.counters.add("bytes_loaded", len(load.block_ids) * self._page_bytes())
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
        """Queue this step's stores for the background thread.

        Args:
            stores: the step's stores; their blocks stay valid until the scheduler hears
                that every worker finished them.
            epoch: the model identity's epoch of the step (``StepPlan.identity_epoch``).
        """
        stores = list(stores)
        if not stores:
            return
        # The forward pass that computed these blocks may still run on the device: the copies
        # start after this point of the step loop's stream (a no-op for synchronous engines).
        attachment = self._attachment
        fence = attachment.engine.forward_fence() if attachment is not None else None
        for store in stores:
            with self._state_lock:
                self._outstanding[store.request_id] = self._outstanding.get(store.request_id, 0) + 1
            self._jobs.put(StoreItem(store, epoch, fence))

    def await_delayed_free(self, request_ids: Iterable[str]) -> None:
        """Remember requests whose blocks vLLM keeps until this worker reports them."""
        with self._state_lock:
            self._awaiting_free.update(request_ids)

    def flush_stores(self) -> None:
        """Wait until every queued store has run (blocks of preempted requests may be reused)."""
        self._jobs.join()

    def finished_sending(self) -> set[str]:
        """Delayed-free requests whose stores on this worker are all done."""
        with self._state_lock:
            done = {r for r in self._awaiting_free if self._outstanding.get(r, 0) == 0}
            self._awaiting_free -= done
        return done

    def take_completed(self) -> dict[str, int]:
        """Store jobs finished since the last call: request id -> count."""
        with self._state_lock:
            completed, self._completed = self._completed, {}
        return completed

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
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join(timeout=5.0)
            self._thread = None
        self._close_retired()
        with self._attach_lock:
            if self._attachment is not None:
                self._attachment.close()
                self._attachment = None
        if self._client is not None:
            self._client.close()

    def _close_retired(self) -> None:
        with self._attach_lock:
            retired, self._retired = self._retired, []
        for attachment in retired:
            attachment.close()

    def _page_bytes(self) -> int:
        assert self._layout is not None
        return self._layout.page_bytes

    def _attach(self) -> Attachment | None:
        """Register with the server and map its arena, or return the current attachment.

        A server restart (new boot id) replaces the attachment: page numbers of the old
        boot mean nothing in the new arena.
        """
        assert self._client is not None
        if self._layout is None or self._new_engine is None:
            return None
        with self._attach_lock:
            try:
                registration = self._client.registration
                if registration is None or registration.pool != self.pool:
                    registration = self._client.register(
                        PageLayout(
                            model_fingerprint=self._epoch_fingerprint(),
                            layout_fingerprint=self._layout_fingerprint,
                            page_bytes=self._layout.page_bytes,
                            world_size=self.world_size,
                            rank=self.rank,
                        )
                    )
            except (ServerUnavailable, ServerError) as exc:
                logger.debug("kvshelf registration failed: %s", exc)
                return None
            current = self._attachment
            if current is not None and current.boot_id == registration.boot_id:
                return current
            try:
                attachment = Attachment(registration, self._new_engine, self._helper_cpus)
            except ArenaAccessError as exc:
                # A deployment error, not an outage: say it once, loudly, and serve without
                # the cache (every store dropped, every load recomputed).
                if registration.shm_name not in self._inaccessible_arenas:
                    self._inaccessible_arenas.add(registration.shm_name)
                    logger.error("%s; serving without the cache", exc.strerror)
                return None
            except UnsupportedKVCache as exc:
                # Found only once the arena is mapped (e.g. it cannot be pinned for the GPU).
                self._disable(exc)
                return None
            if current is not None:
                # The step loop may be copying from it right now; it is closed there.
                self._retired.append(current)
                logger.info(
                    "kvshelf server restarted (boot %s): re-registered", registration.boot_id
                )
            else:
                logger.info(
                    "kvshelf worker rank %d registered with the server (arena %s, %d bytes)",
                    self.rank,
                    registration.shm_name,
                    registration.arena_bytes,
                )
            self._attachment = attachment
            return attachment

    def _release(self, load: LoadJob, copied: int) -> bool:
        """Release this rank's share of a load's lock, telling the server how many pages of it
        this rank copied.

        Returns:
            False when the pages may have changed under the copy: the server no longer knew
            the lock although it is still the boot that granted it (the lease ran out, so the
            pages may have been evicted and rewritten). A dead or restarted server cannot
            have touched the pages after it granted the lock.
        """
        assert self._client is not None
        try:
            self._client.release(load.lock_id, self.rank, copied)
        except ServerUnavailable as exc:
            logger.debug("kvshelf release of lock %d failed: %s", load.lock_id, exc)
        except ServerError as exc:
            if exc.code == ErrorCode.UNKNOWN_LOCK and self._client.boot_id == load.boot_id:
                logger.warning("kvshelf lock %d expired during a load: %s", load.lock_id, exc)
                return False
            logger.debug("kvshelf release of lock %d failed: %s", load.lock_id, exc)
        return True

    def _reattach(self) -> Attachment | None:
        """Learn the server's current boot (re-registering if it changed) and map its arena."""
        assert self._client is not None
        try:
            self._client.ping()
        except (ServerUnavailable, ServerError):
            return self._attachment
        return self._attach()

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

    def _store_loop(self) -> None:
        """Run the queued store jobs: every job waiting when the thread wakes up goes into one
        batch (one reserve, one copy, one commit), and a batch's commit is sent without waiting
        for its reply. Its jobs are finished (``flush_stores`` and the reports see them) once a
        later reply on the same connection shows that the server processed the commit: the
        next batch's reserve, or a ping when no job is waiting."""
        self._confine_helper_thread()
        committing: list[StoreItem] = []
        stop = False
        while not stop:
            try:
                item = self._jobs.get(None if committing else self._retry_interval_s)
            except queue.Empty:
                if committing:
                    self._confirm_commits()
                    self._finish_jobs(committing)
                    committing = []
                elif self._attachment is None and self._layout is not None:
                    self._attach()
                continue
            batch, stop = self._jobs.take_batch(
                item, self._layout.page_bytes if self._layout else 0
            )
            committed = False
            try:
                if batch:
                    committed = self._store(batch)
            finally:
                if committing and not batch:
                    self._confirm_commits()
                # Else this batch's reserve came back after the earlier commit was processed
                # (or the server is gone and nothing will come).
                self._finish_jobs(committing)
                committing = batch if committed else []
                if not committed:
                    self._finish_jobs(batch)
                if stop:
                    if committing:
                        # Closing the socket drops what it has not sent yet.
                        self._confirm_commits()
                    self._finish_jobs(committing)
                    self._jobs.task_done()  # the stop sentinel

    def _finish_jobs(self, items: list[StoreItem]) -> None:
        """Count finished store jobs as done (reports, ``flush_stores``)."""
        for job, _, _ in items:
            with self._state_lock:
                left = self._outstanding[job.request_id] - 1
                if left:
                    self._outstanding[job.request_id] = left
                else:
                    del self._outstanding[job.request_id]
                self._completed[job.request_id] = self._completed.get(job.request_id, 0) + 1
            self._jobs.task_done()

    def _confirm_commits(self) -> None:
        """Wait until the server processed the commits sent so far (it answers one
        connection's requests in order); a server that does not answer lost them anyway."""
        assert self._client is not None
        try:
            self._client.ping()
        except (ServerUnavailable, ServerError) as exc:
            logger.debug("kvshelf could not confirm commits: %s", exc)

    def _reserve(
        self, attachment: Attachment, hashes: list[bytes]
    ) -> tuple[Attachment, Reservation]:
        """Reserve pages for ``hashes``, in a restarted server's arena if the server restarted.

        The first call after a restart fails (no pool there yet) but the client learns the new
        boot and registers again: the store goes to the new arena instead of being dropped.

        Returns:
            The attachment the pages are in, and the reservation.
        """
        assert self._client is not None
        try:
            return attachment, self._client.reserve(self.pool, self.rank, hashes)
        except ServerError:
            if self._client.boot_id == attachment.boot_id:
                raise
            fresh = self._attach()
            if fresh is None or fresh.boot_id == attachment.boot_id:
                raise
            return fresh, self._client.reserve(self.pool, self.rank, hashes)

    def _store(self, items: list[StoreItem]) -> bool:
        """Copy a batch of store jobs of one identity epoch into the cache; a failure drops
        them (the cache is optional).

        The copy waits on the last job's forward fence: fences are recorded in step order on
        one stream, so the last covers every earlier job's forward pass. The pages are
        committed only once the copy's handle is done (for an asynchronous engine, once the
        event recorded after the copies has completed); until then the jobs are outstanding,
        so vLLM keeps their blocks.

        Returns:
            Whether a commit was sent (without waiting for its reply).
        """
        assert self._client is not None
        batch = [item.job for item in items]
        fence = items[-1].fence
        names = ", ".join(job.request_id for job in batch)
        # A new epoch (vLLM reset the cache: new weights, say) registers its own pool.
        self._epoch = items[0].epoch
        started = time.perf_counter()
        attachment = self._attach()
        if attachment is None:
            self.counters.add("stores_dropped", len(batch))
            return False
        hashes = [h for job in batch for h in job.block_hashes]
        block_ids = [b for job in batch for b in job.block_ids]
        try:
            attachment, reservation = self._reserve(attachment, hashes)
        except (ServerUnavailable, ServerError) as exc:
            logger.debug("kvshelf store for %s dropped: %s", names, exc)
            self.counters.add("stores_dropped", len(batch))
            return False
        pairs = [
            (block_id, page)
            for block_id, page in zip(block_ids, reservation.pages, strict=True)
            if page is not None
        ]
        self.counters.add("blocks_store_skipped", len(block_ids) - len(pairs))
        try:
            if not pairs or attachment.boot_id != reservation.boot_id:
                self._client.abort(reservation.reservation_id)
                return False
            try:
                attachment.engine.store(
                    [b for b, _ in pairs], [p for _, p in pairs], after=fence
                ).wait()
            except Exception:
                # E.g. the attachment was retired (server restart) during the copy: the pages
                # are incomplete, so they must never be committed.
                logger.exception("kvshelf store for %s failed", names)
                self._client.abort(reservation.reservation_id)
                self.counters.add("stores_dropped", len(batch))
                return False
            # Only now, with every page written: the server never shows a page before this.
            self._client.commit_nowait(reservation.reservation_id)
            self.timings.observe("store_seconds", time.perf_counter() - started)
            self.counters.add("blocks_stored", len(pairs))
            self.counters.add("bytes_stored", len(pairs) * self._page_bytes())
            return True
        except (ServerUnavailable, ServerError) as exc:
            logger.debug("kvshelf store for %s dropped: %s", names, exc)
            self.counters.add("stores_dropped", len(batch))
            return False
