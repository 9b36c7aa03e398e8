"""The worker's store thread: it copies the scheduler's store jobs into the server's arena and
commits them, and keeps the bookkeeping the scheduler's reports need. No vLLM import.

Jobs run in FIFO order on one thread. The step loop queues them (:meth:`StoreThread.submit`)
and reads what finished (:meth:`StoreThread.take_completed`, :meth:`finished_sending`); a lock
guards what both threads touch. A job is finished once its pages are committed (or dropped):
until then vLLM keeps its blocks, unless it frees them without asking (a window slid past them,
a preemption); the step loop then orders the step that reuses such a block after the job's copy
(:meth:`StoreThread.before_reuse`), which is all a reuse needs: the commit does not read it.

A stop drains the queue within a bound (``kvshelf.stop_drain_timeout_s``): batches are copied
and committed until it has passed, the rest aborted (docs/safety.md, "Stopping an engine").
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from kvshelf.client import Reservation, ServerError, ServerUnavailable
from kvshelf.metric_types import Counters, Observations
from kvshelf.plan import StoreJob
from kvshelf.protocol import ErrorCode, max_request_keys
from kvshelf.roles.attachment import Attachment
from kvshelf.roles.replication import own_share
from kvshelf.roles.server_link import ServerLink
from kvshelf.roles.store_queue import StoreItem, StoreQueue
from kvshelf.transfer import NotReady, TransferHandle

logger = logging.getLogger(__name__)

ABORT_GRACE_S = 1.0
"""How much longer than its drain bound a stop waits for the thread: the batches left at the
bound cost a reserve and an abort each (no copy), a few milliseconds on a server that answers.
A server that does not answer makes the stop give up then; their reservations end with their
lease (the server applies the same rule to an expired reservation as to an abort)."""


class StoreThread:
    """Store jobs of one KV rank, run by a background thread.

    Args:
        link: the rank's link to the server.
        counters: the worker's counters (``kvshelf.metrics.WORKER``).
        timings: the worker's copy times (``kvshelf.metrics.WORKER_TIMINGS``).
        retry_interval_s: how often an idle thread tries to reach a missing server.
        confine: called first in the thread (moves it off vLLM's compute cores).
        stop_drain_timeout_s: how long :meth:`stop` keeps copying and committing queued
            batches before it aborts the rest.
    """

    def __init__(
        self,
        link: ServerLink,
        counters: Counters,
        timings: Observations,
        retry_interval_s: float,
        confine: Callable[[], None],
        stop_drain_timeout_s: float,
    ) -> None:
        self._link = link
        self._counters = counters
        self._timings = timings
        self._retry_interval_s = retry_interval_s
        self._confine = confine
        # Each job travels with its step's epoch and forward fence.
        self._jobs = StoreQueue()
        # The most keys one reserve may name for the pool's stored ranks (the server refuses
        # more: it charges a reservation's end, keys x stored ranks, up front).
        self._max_keys = max_request_keys(link.world_size // link.replicas)
        self._lock = threading.Lock()
        self._outstanding: dict[str, int] = {}
        self._completed: dict[str, int] = {}
        self._awaiting_free: set[str] = set()
        # Block id -> queued jobs that read it and whose copies were not issued yet; and the
        # issued copies not known to be finished, with the blocks they read.
        self._reading: dict[int, int] = {}
        self._copying: list[tuple[frozenset[int], TransferHandle]] = []
        self._copied = threading.Condition(self._lock)
        self._thread: threading.Thread | None = None
        # Reserves sent by the thread so far: a reply to the n-th one confirms every commit
        # sent before it (see _finish_committed).
        self._reserves_sent = 0
        self._drain_timeout_s = stop_drain_timeout_s
        # Set by stop(): from then on (monotonic time) the thread aborts the batches it takes.
        self._abort_from: float | None = None
        # Store jobs the thread aborted past the drain bound (read by stop once it joined).
        self._aborted_at_stop = 0

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="kvshelf-store", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Run what is queued, within the drain bound, then stop the thread.

        Batches are copied and committed until ``stop_drain_timeout_s`` after this call; every
        batch left then is reserved and aborted at once, uncopied, so that the server frees
        the other ranks' pages of its blocks (a block is never left committed by some ranks
        only: docs/safety.md). Returns within the bound plus :data:`ABORT_GRACE_S`, and logs
        one line: the queued store jobs committed, aborted and dropped, and how long it took.
        """
        thread, self._thread = self._thread, None
        if thread is None:
            return
        started = time.monotonic()
        with self._lock:
            queued = sum(self._outstanding.values())
        dropped_before = self._counters["stores_dropped"]
        self._abort_from = started + self._drain_timeout_s
        self._jobs.put(None)
        thread.join(timeout=self._drain_timeout_s + ABORT_GRACE_S)
        took = time.monotonic() - started
        with self._lock:
            left = sum(self._outstanding.values())
        aborted = self._aborted_at_stop
        dropped = self._counters["stores_dropped"] - dropped_before
        committed = queued - left - aborted - dropped
        complete = not aborted and not dropped and not left
        logger.log(
            logging.INFO if complete else logging.WARNING,
            "kvshelf worker rank %d stopped in %.2f s: %d queued store jobs committed, "
            "%d aborted past the %g s drain bound (kvshelf.stop_drain_timeout_s), %d dropped "
            "(server errors), %d unfinished (still copying or waiting for the server; their "
            "reservations end with their lease)",
            self._link.rank,
            took,
            committed,
            aborted,
            self._drain_timeout_s,
            dropped,
            left,
        )

    def submit(self, stores: Iterable[StoreJob], epoch: str = "") -> None:
        """Queue this step's stores.

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
        attachment = self._link.attachment
        fence = attachment.engine.forward_fence() if attachment is not None else None
        for job in stores:
            store = own_share(job, self._link.rank, self._link.replicas)
            with self._lock:
                if not store.num_blocks:
                    # Other replicas of this rank write all of its blocks: done here at once.
                    self._completed[job.request_id] = self._completed.get(job.request_id, 0) + 1
                    continue
                self._outstanding[store.request_id] = self._outstanding.get(store.request_id, 0) + 1
                for block_id in store.block_ids:
                    self._reading[block_id] = self._reading.get(block_id, 0) + 1
            self._jobs.put(StoreItem(store, epoch, fence))

    def before_reuse(self, block_ids: Iterable[int]) -> bool:
        """Order what the step loop does next to ``block_ids`` after every queued store that
        reads them: vLLM is about to overwrite them (zero, copy, load or compute into them).

        The step loop waits (on the host) only while such a store's copy is not issued yet
        (its reserve is on its way); an issued copy is waited for by the caller's current
        stream (an asynchronous engine's event; a synchronous engine has copied already).
        Stores of other blocks, and commits, are not waited for.

        Returns:
            Whether some store read one of the blocks (the step was ordered after it).
        """
        blocks = frozenset(block_ids)
        with self._copied:
            copying = [handle for read, handle in self._copying if not read.isdisjoint(blocks)]
            if not copying and self._reading.keys().isdisjoint(blocks):
                return False
            while not self._reading.keys().isdisjoint(blocks):
                self._copied.wait()
            copying = [handle for read, handle in self._copying if not read.isdisjoint(blocks)]
        for handle in copying:
            handle.order_compute()
        self._counters.add("store_reuse_waits")
        return True

    def await_delayed_free(self, request_ids: Iterable[str]) -> None:
        """Remember requests whose blocks vLLM keeps until this worker reports them."""
        with self._lock:
            self._awaiting_free.update(request_ids)

    def flush(self) -> None:
        """Wait until every queued store has run."""
        self._jobs.join()

    def finished_sending(self) -> set[str]:
        """Delayed-free requests whose stores on this worker are all done."""
        with self._lock:
            done = {r for r in self._awaiting_free if self._outstanding.get(r, 0) == 0}
            self._awaiting_free -= done
        return done

    def take_completed(self) -> dict[str, int]:
        """Store jobs finished since the last call: request id -> count."""
        with self._lock:
            completed, self._completed = self._completed, {}
        return completed

    def _run(self) -> None:
        """Run the queued store jobs: every job waiting when the thread wakes up goes into one
        batch (one reserve, one copy, one commit), and a batch's commit is sent without waiting
        for its reply.

        Two batches are in flight at once: while one batch's copy runs, the next batch's
        reserve is already on its way (when its jobs are queued, of the same epoch) and its
        copy is issued before the thread waits for the first copy and commits it, so an
        asynchronous engine always has the next copy queued behind the one it runs, and the
        server makes the next reservation meanwhile. A batch's jobs are finished (``flush``
        and the reports see them) once a later reply on the same connection shows that the
        server processed its commit, since the server answers one connection's requests in
        order: the reply to a reserve sent after the commit (that of a later batch) or a ping
        when no job is waiting. A copy already done when issued (a synchronous engine) is
        committed at once: there is nothing to overlap."""
        self._confine()
        # Committed batches not confirmed yet, with the number of reserves sent before each
        # commit (see _finish_committed).
        committing: list[tuple[int, list[StoreItem]]] = []
        upcoming: _Batch | None = None
        # The batch whose copy was issued last and is not committed yet.
        copying: _Copy | None = None
        stop = False
        while upcoming is not None or copying is not None or not stop:
            if upcoming is None:
                if copying is not None:
                    # Nothing queued behind it: commit it before waiting for more jobs.
                    self._commit_copied(copying, committing)
                    copying = None
                    continue
                try:
                    item = self._jobs.get(None if committing else self._retry_interval_s)
                except queue.Empty:
                    if committing:
                        self._confirm_commits()
                        self._finish_committed(committing, None)
                    elif self._link.attachment is None and self._link.enabled:
                        self._link.attach()
                    continue
                items, stop = self._jobs.take_batch(item, self._page_bytes(), self._max_keys)
                upcoming = _Batch(items)
            current, upcoming = upcoming, None
            issued: _Copy | None = None
            try:
                if current.items:
                    reserved = self._reserve(current, committing)
                    if reserved is not None and self._draining_over():
                        self._abort_at_stop(current, reserved[1])
                    elif reserved is not None:
                        if not stop:
                            upcoming, stop = self._reserve_ahead(current)
                        issued = self._issue_copy(current, *reserved)
            finally:
                self._issued(current, None)
                if issued is None:
                    self._finish_jobs(current.items)
                if copying is not None:
                    self._commit_copied(copying, committing)
                    copying = None
                if issued is not None and issued.done():
                    # Copied already (a synchronous engine): nothing to overlap, commit now.
                    self._commit_copied(issued, committing)
                else:
                    copying = issued
                if stop and upcoming is None:
                    if copying is not None:
                        self._commit_copied(copying, committing)
                        copying = None
                    if committing:
                        # Closing the socket drops what it has not sent yet.
                        self._confirm_commits()
                    self._finish_committed(committing, None)
                    self._jobs.task_done()  # the stop sentinel

    def _draining_over(self) -> bool:
        """Whether a stop's drain bound has passed: batches are aborted from then on."""
        abort_from = self._abort_from
        return abort_from is not None and time.monotonic() >= abort_from

    def _abort_at_stop(self, batch: _Batch, reservation: Reservation) -> None:
        """Abort a reserved batch past the drain bound, uncopied: the server frees its pages,
        and the other ranks' pages of the blocks this rank does not hold."""
        with contextlib.suppress(ServerUnavailable, ServerError):
            self._link.client.abort(reservation.reservation_id)
        self._aborted_at_stop += len(batch.items)

    def _page_bytes(self) -> int:
        return self._link.page_bytes if self._link.enabled else 0

    def _finish_committed(
        self, committing: list[tuple[int, list[StoreItem]]], reserve_number: int | None
    ) -> None:
        """Finish the committed batches a reply confirms: the reply to reserve number
        ``reserve_number`` confirms every commit sent before that reserve was; None (a ping's
        reply, sent after every commit) confirms them all."""
        while committing and (reserve_number is None or committing[0][0] < reserve_number):
            self._finish_jobs(committing.pop(0)[1])

    def _issued(self, batch: _Batch, handle: TransferHandle | None) -> None:
        """Note that a batch's copies were issued (``handle``) or never will be (None, a
        dropped batch): its blocks may be reused once ``handle`` is done. Once per batch."""
        if batch.issued:
            return
        batch.issued = True
        with self._copied:
            for item in batch.items:
                for block_id in item.job.block_ids:
                    left = self._reading[block_id] - 1
                    if left:
                        self._reading[block_id] = left
                    else:
                        del self._reading[block_id]
            if handle is not None and not handle.done():
                read = frozenset(b for item in batch.items for b in item.job.block_ids)
                self._copying.append((read, handle))
            self._copied.notify_all()

    def _copy_done(self, handle: TransferHandle) -> None:
        with self._lock:
            self._copying = [entry for entry in self._copying if entry[1] is not handle]

    def _finish_jobs(self, items: list[StoreItem]) -> None:
        """Count finished store jobs as done (reports, ``flush``)."""
        for job, _, _ in items:
            with self._lock:
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
        try:
            self._link.client.ping()
        except (ServerUnavailable, ServerError) as exc:
            logger.debug("kvshelf could not confirm commits: %s", exc)

    def _reserve(
        self, batch: _Batch, committing: list[tuple[int, list[StoreItem]]]
    ) -> tuple[Attachment, Reservation, float] | None:
        """Attach and reserve a batch's pages (or take its reserve sent ahead); a failure
        drops the batch (the cache is optional). The reply confirms earlier commits.

        Returns:
            The attachment the pages are in, the reservation and when the store began; None
            when the batch is dropped.
        """
        link = self._link
        started = time.perf_counter()
        # A new epoch (vLLM reset the cache: new weights, say) registers its own pool.
        link.epoch = batch.items[0].epoch
        attachment = link.attach()
        hashes = [h for item in batch.items for h in item.job.block_hashes]
        try:
            reservation: Reservation | None = None
            if batch.ticket is not None:
                # A restarted server without this pool yet answers an error: reserved again
                # below, once the attachment has registered there.
                with contextlib.suppress(ServerError):
                    reservation = link.client.take_reserve(batch.ticket)
                    self._finish_committed(committing, batch.number)
            if attachment is None:
                if reservation is not None:
                    link.client.abort(reservation.reservation_id)
                raise ServerUnavailable("no arena attached")
            if reservation is None:
                tenant = batch.items[0].job.tenant
                attachment, reservation = self._send_reserve(attachment, hashes, tenant)
                self._finish_committed(committing, self._reserves_sent)
        except (ServerUnavailable, ServerError) as exc:
            names = ", ".join(item.job.request_id for item in batch.items)
            logger.debug("kvshelf store for %s dropped: %s", names, exc)
            self._counters.add("stores_dropped", len(batch.items))
            return None
        return attachment, reservation, started

    def _send_reserve(
        self, attachment: Attachment, hashes: list[bytes], tenant: str
    ) -> tuple[Attachment, Reservation]:
        """Reserve pages for ``hashes`` now, in a restarted server's arena if the server
        restarted.

        The first call after a restart fails (no pool there yet) but the client learns the new
        boot and registers again: the store goes to the new arena instead of being dropped.
        Likewise when the server retired the pool (UNKNOWN_POOL on the same boot).

        Returns:
            The attachment the pages are in, and the reservation.
        """
        link = self._link
        self._reserves_sent += 1
        try:
            return attachment, link.client.reserve(link.pool, link.rank, hashes, tenant)
        except ServerError as exc:
            # The same boot without the pool retired it (idle, or at the limit of pools,
            # kvshelf.server.pool_life): register it again.
            renew = exc.code == ErrorCode.UNKNOWN_POOL
            if link.client.boot_id == attachment.boot_id and not renew:
                raise
            fresh = link.attach(renew=renew)
            if fresh is None or (fresh.boot_id == attachment.boot_id and not renew):
                raise
            self._reserves_sent += 1
            return fresh, link.client.reserve(link.pool, link.rank, hashes, tenant)

    def _reserve_ahead(self, current: _Batch) -> tuple[_Batch | None, bool]:
        """Take the next batch if its jobs are already queued, and send its reserve now (if
        it is of the current batch's epoch, whose pool is registered).

        Returns:
            The next batch (None when no job is queued), and whether the stop sentinel was
            taken.
        """
        try:
            item = self._jobs.get(None)
        except queue.Empty:
            return None, False
        items, stop = self._jobs.take_batch(item, self._page_bytes(), self._max_keys)
        upcoming = _Batch(items)
        if items and items[0].epoch == current.items[0].epoch:
            link = self._link
            hashes = [h for next_item in items for h in next_item.job.block_hashes]
            try:
                upcoming.ticket = link.client.submit_reserve(
                    link.pool, link.rank, hashes, items[0].job.tenant
                )
            except ServerUnavailable:
                pass  # reserved in its turn, or dropped then if the server is still away
            else:
                self._reserves_sent += 1
                upcoming.number = self._reserves_sent
        return upcoming, stop

    def _issue_copy(
        self, batch: _Batch, attachment: Attachment, reservation: Reservation, started: float
    ) -> _Copy | None:
        """Issue a reserved batch's copy into its pages; a failure drops it (None).

        The copy waits on the last job's forward fence: fences are recorded in step order on
        one stream, so the last covers every earlier job's forward pass.
        """
        link = self._link
        jobs = [item.job for item in batch.items]
        block_ids = [b for job in jobs for b in job.block_ids]
        pairs = [
            (block_id, page)
            for block_id, page in zip(block_ids, reservation.pages, strict=True)
            if page is not None
        ]
        self._counters.add("blocks_store_skipped", len(block_ids) - len(pairs))
        copy = _Copy(batch, reservation, started, len(pairs))
        try:
            if not pairs or attachment.boot_id != reservation.boot_id:
                link.client.abort(reservation.reservation_id)
                return None
            try:
                copy.handle = attachment.engine.store(
                    [b for b, _ in pairs], [p for _, p in pairs], after=batch.items[-1].fence
                )
            except NotReady as exc:
                # Pages the engine cannot reach (a chunk CUDA refused to pin): logged once by
                # the engine; the store is dropped, quietly.
                self._drop(copy, exc, logging.DEBUG)
                return None
            except Exception as exc:
                self._drop(copy, exc, logging.ERROR)
                return None
        except (ServerUnavailable, ServerError) as exc:
            logger.debug("kvshelf store for %s dropped: %s", copy.names, exc)
            self._counters.add("stores_dropped", len(jobs))
            return None
        self._issued(batch, copy.handle)
        return copy

    def _commit_copied(self, copy: _Copy, committing: list[tuple[int, list[StoreItem]]]) -> None:
        """Wait for an issued copy, then commit its pages, or drop the batch if it failed.

        The pages are committed only once the copy's handle is done (for an asynchronous
        engine, once the event recorded after the copies has completed); until then the jobs
        are outstanding, so vLLM keeps their blocks.
        """
        assert copy.handle is not None
        try:
            copy.handle.wait()
        except Exception as exc:
            # E.g. the attachment was retired (server restart) during the copy: the pages
            # are incomplete, so they must never be committed.
            self._copy_done(copy.handle)
            self._drop(copy, exc, logging.ERROR)
            self._finish_jobs(copy.batch.items)
            return
        self._copy_done(copy.handle)
        link = self._link
        try:
            # Only now, with every page written: the server never shows a page before this.
            link.client.commit_nowait(copy.reservation.reservation_id)
        except (ServerUnavailable, ServerError) as exc:
            logger.debug("kvshelf store for %s dropped: %s", copy.names, exc)
            self._counters.add("stores_dropped", len(copy.batch.items))
            self._finish_jobs(copy.batch.items)
            return
        self._timings.observe("store_seconds", time.perf_counter() - copy.started)
        self._counters.add("blocks_stored", copy.pages)
        self._counters.add("bytes_stored", copy.pages * link.page_bytes)
        committing.append((self._reserves_sent, copy.batch.items))

    def _drop(self, copy: _Copy, exc: Exception, level: int) -> None:
        """Drop a batch whose copy could not be made: its reservation is aborted."""
        if level >= logging.ERROR:
            logger.error("kvshelf store for %s failed", copy.names, exc_info=exc)
        else:
            logger.log(level, "kvshelf store for %s dropped: %s", copy.names, exc)
        with contextlib.suppress(ServerUnavailable, ServerError):
            self._link.client.abort(copy.reservation.reservation_id)
        self._counters.add("stores_dropped", len(copy.batch.items))


@dataclass
class _Batch:
    """Store jobs taken from the queue together, and their reserve if it was sent ahead."""

    items: list[StoreItem]
    # The reserve sent ahead (``KVShelfClient.submit_reserve``), None while not sent.
    ticket: int | None = None
    # Which reserve of the thread that was (``StoreThread._reserves_sent`` after sending it).
    number: int = 0
    # Whether its copies were issued or it was dropped (``StoreThread._issued``).
    issued: bool = False


@dataclass
class _Copy:
    """A reserved batch whose copy was issued and that is not committed yet."""

    batch: _Batch
    reservation: Reservation
    # When its store began (its reserve), for ``store_seconds``.
    started: float
    # Pages it writes (its blocks the server did not already hold).
    pages: int
    handle: TransferHandle | None = None

    def done(self) -> bool:
        """Whether its copy has finished (never blocks)."""
        return self.handle is not None and self.handle.done()

    @property
    def names(self) -> str:
        """Its request ids, for the logs."""
        return ", ".join(item.job.request_id for item in self.batch.items)
