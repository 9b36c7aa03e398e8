"""A worker's loads, from the step that starts them until their page locks are released.

Owns the load thread, the settle thread and the life of every load: begun on the step loop
(:meth:`StepLoads.begin`), put in place layer by layer while the forward pass runs (the load
thread, and each layer's wait), placed once the forward pass was issued (:meth:`StepLoads.place`:
failures are reported to vLLM in that same step), and settled (its lock released) as soon as
the engine says its copies finished. The step loop never waits for the device: a load whose
copies still run when the step ends (an asynchronous engine's; vLLM's async scheduling overlaps
the next step with them) is settled by the settle thread, which polls it, so that no lock
outlives its copies even when vLLM goes idle. Nor does it wait for the server longer than
:attr:`StepLoads.RELEASE_WAIT_PER_STEP_S`: the settle thread sends every lock release (the step
loop never takes the client's lock, which a store thread's stalled call may hold) and takes its
answer (whether the lock's lease held); the step loop waits for those answers within that
budget only, so a stalled server holds no step for a timeout. Only shutdown waits, a bounded
time.

No vLLM import; it sees the engines through ``LayerwiseLoad`` only.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable

from kvshelf.metric_types import Counters, Observations
from kvshelf.plan import LoadJob
from kvshelf.roles.attachment import Attachment
from kvshelf.roles.server_link import ServerLink
from kvshelf.transfer import LayerwiseLoad, NotReady, UnsupportedKVCache

logger = logging.getLogger(__name__)


class _Release:
    """A load's lock release, from the step that settles the load until the server's answer
    is taken (by the settle thread, which sends it)."""

    def __init__(self, load: LoadJob, copied: bool) -> None:
        self.load = load
        self.copied = copied
        # The ticket of the sent release (None: not sent, or it could not be).
        self.ticket: int | None = None
        self.answered = threading.Event()


class _StepLoad:
    """One engine's share of a step's loads, and which of them failed (reported already)."""

    def __init__(self, jobs: list[LoadJob], copying: LayerwiseLoad) -> None:
        self.jobs = jobs
        self.copying = copying
        self.reported: set[int] = set()


class StepLoads:
    """The loads of one KV rank's worker.

    Args:
        link: the server link (attachments, lock releases).
        rank: this worker's KV rank.
        counters, timings: the worker's counters and copy times.
        confine: called first in the load and settle threads (moves them off vLLM's compute
            cores).
    """

    SETTLE_POLL_S = 0.001
    """How often the settle thread asks whether a load's copies finished (a query, no wait)."""

    RELEASE_WAIT_PER_STEP_S = 0.1
    """How long the step loop waits for the answers to a step's lock releases; the settle
    thread takes those that come later (the server's answer may fail a load, late)."""

    STOP_TIMEOUT_S = 5.0
    """How long shutdown waits for loads whose copies are still running."""

    def __init__(
        self,
        link: ServerLink,
        rank: int,
        counters: Counters,
        timings: Observations,
        confine: Callable[[], None],
    ) -> None:
        self._link = link
        self._rank = rank
        self.counters = counters
        self.timings = timings
        self._confine = confine
        # Layer name -> its layer in a page (the layers vLLM's KV cache groups overlay share
        # one), and the last layer of a page; both set at registration.
        self.layer_index: dict[str, int] = {}
        self.last_layer = -1
        # Guards the blocks to report and the load counters (the step loop and the settle
        # thread both count).
        self._errors_lock = threading.Lock()
        self._errors: set[int] = set()
        # This step's loads, begin .. place: the step loop's only.
        self._loading: list[_StepLoad] = []
        self._batches: queue.Queue[LayerwiseLoad | None] = queue.Queue()
        self._unsettled: queue.Queue[_StepLoad | _Release | None] = queue.Queue()
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        for target, name in ((self._run, "kvshelf-load"), (self._settle, "kvshelf-settle")):
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)

    def begin(self, loads: Iterable[LoadJob], *, layerwise: bool) -> None:
        """Start this step's loads; see ``WorkerConnector.start_loads``."""
        self.place()
        self.start_engine(self._link.attachment)
        # The loads by the server boot they read from: each boot's arena has its own engine.
        by_boot: dict[str, tuple[Attachment, list[LoadJob]]] = {}
        for load in loads:
            attachment = self._link.attachment
            stale = attachment is None or attachment.boot_id != load.boot_id
            if stale and self._link.enabled:
                # The scheduler saw a server boot this worker has not attached to yet (a
                # restart, or a server that came up after this worker started).
                attachment = self._link.reattach()
                self.start_engine(attachment)
            if attachment is not None and attachment.boot_id == load.boot_id:
                by_boot.setdefault(load.boot_id, (attachment, []))[1].append(load)
            else:
                self._unsettled.put(_Release(load, copied=False))
                self._fail(load)
        for attachment, jobs in by_boot.values():
            copying = attachment.engine.begin_loads(
                [(job.pages[self._rank], job.block_ids) for job in jobs]
            )
            self._loading.append(_StepLoad(jobs, copying))
            if layerwise:
                self._batches.put(copying)
            else:
                copying.wait_layer(self.last_layer)

    def start_engine(self, attachment: Attachment | None) -> None:
        """Start ``attachment``'s engine (step loop only: see ``Attachment.start_engine``); an
        engine that cannot work turns the cache off (its loads then fail, its stores drop)."""
        if attachment is None or not self._link.enabled:
            return
        try:
            attachment.start_engine()
        except UnsupportedKVCache as exc:
            self._link.disable(exc)

    def wait_for_layer(self, layer_name: str) -> None:
        """Put layer ``layer_name`` of this step's loads in place for the forward pass."""
        layer = self.layer_index.get(layer_name, self.last_layer)
        for step_load in self._loading:
            step_load.copying.wait_layer(layer)

    def place(self) -> None:
        """Put every layer of this step's loads in place and report the failed ones' blocks
        (vLLM recomputes them); release the locks of those whose copies finished, and leave
        the others to the settle thread."""
        loading, self._loading = self._loading, []
        releases: list[_Release] = []
        for step_load in loading:
            step_load.copying.wait_layer(self.last_layer)
            self._report(step_load)
            if step_load.copying.finished():
                releases += self._settle_one(step_load)
            else:
                self._unsettled.put(step_load)
        self._collect(releases)

    def take_errors(self) -> set[int]:
        """Blocks whose load failed since the last call (this step's loads placed first)."""
        self.place()
        with self._errors_lock:
            errors, self._errors = self._errors, set()
        return errors

    def stop(self) -> None:
        """Settle every load (waiting at most :attr:`STOP_TIMEOUT_S` for running copies) and
        stop the threads."""
        self.place()
        self._batches.put(None)
        self._unsettled.put(None)
        for thread in self._threads:
            thread.join(timeout=self.STOP_TIMEOUT_S + 1.0)
        self._threads = []

    def _settle_one(self, step_load: _StepLoad) -> list[_Release]:
        """The lock releases of a load whose copies finished."""
        self._report(step_load)
        return [
            _Release(job, copied=index not in step_load.reported)
            for index, job in enumerate(step_load.jobs)
        ]

    def _collect(self, releases: list[_Release]) -> None:
        """Have the settle thread send ``releases``, and wait for their answers at most
        :attr:`RELEASE_WAIT_PER_STEP_S` (the settle thread takes later ones)."""
        for release in releases:
            self._unsettled.put(release)
        deadline = time.monotonic() + self.RELEASE_WAIT_PER_STEP_S
        for release in releases:
            if not release.answered.wait(max(0.0, deadline - time.monotonic())):
                return

    def _report(self, step_load: _StepLoad) -> None:
        """Mark the blocks of loads that failed since the last look, once each."""
        for index, error in step_load.copying.failures().items():
            if index in step_load.reported:
                continue
            step_load.reported.add(index)
            job = step_load.jobs[index]
            if isinstance(error, NotReady):
                logger.debug("kvshelf load for request %s missed: %s", job.request_id, error)
            else:
                logger.error("kvshelf load for request %s failed", job.request_id, exc_info=error)
            self._fail(job)

    def _send(self, release: _Release) -> None:
        """Send ``release`` (settle thread only: it may wait for the client's lock)."""
        load = release.load
        release.ticket = self._link.submit_release(load, load.num_pages if release.copied else 0)

    def _released(self, release: _Release, wait_s: float) -> bool:
        """Take the answer to ``release`` if it comes within ``wait_s``, and count the load if
        it was copied; a copied load whose lease ran out (its pages may have changed under the
        copy) fails, late. Whether the answer was taken (or will never come)."""
        load = release.load
        held = self._link.release_outcome(load, release.ticket, wait_s)
        if held is None:
            return False
        if release.copied and held:
            with self._errors_lock:
                self.counters.add("blocks_loaded", len(load.block_ids))
                self.counters.add("bytes_loaded", len(load.block_ids) * self._link.page_bytes)
        elif release.copied:
            self._fail(load)
        release.answered.set()
        return True

    def _fail(self, load: LoadJob) -> None:
        logger.warning(
            "kvshelf could not load %d blocks of request %s; vLLM recomputes them",
            len(load.block_ids),
            load.request_id,
        )
        with self._errors_lock:
            self.counters.add("blocks_load_failed", len(load.block_ids))
            self._errors.update(load.block_ids)

    def _run(self) -> None:
        """The load thread: start every layer-wise load's copies, in order, as soon as it can."""
        self._confine()
        while (batch := self._batches.get()) is not None:
            started = time.perf_counter()
            batch.run()
            # The load thread's copies of the step; a layer the forward pass copied itself
            # may still be finishing (waiting for it here would race the step loop).
            self.timings.observe("load_seconds", time.perf_counter() - started)

    def _settle(self) -> None:
        """The settle thread: send the lock releases of the loads the step loop settled and
        of each placed load once its copies finished, and take the server's answers; it asks
        the engine (``finished``), since a host wait on an event would also make this thread's
        stream wait."""
        self._confine()
        pending: list[_StepLoad | _Release] = []
        deadline: float | None = None
        while True:
            try:
                polling = pending or deadline is not None
                item = self._unsettled.get(timeout=self.SETTLE_POLL_S if polling else None)
            except queue.Empty:
                pass
            else:
                if item is not None:
                    if isinstance(item, _Release):
                        self._send(item)
                    pending.append(item)
                    continue
                deadline = time.monotonic() + self.STOP_TIMEOUT_S
            still: list[_StepLoad | _Release] = []
            for item in pending:
                if isinstance(item, _Release):
                    if not self._released(item, 0.0):
                        still.append(item)
                elif item.copying.finished():
                    for release in self._settle_one(item):
                        self._send(release)
                        if not self._released(release, 0.0):
                            still.append(release)
                else:
                    still.append(item)
            pending = still
            if deadline is not None and (not pending or time.monotonic() > deadline):
                return
