"""A worker's link to the cache server: its client, its pool, its registration and the arena
attachment of the server's current boot. No vLLM import.

The worker's load path (step loop) and its store thread both reach the server through one
:class:`ServerLink`. It owns the registration life cycle: register once the KV cache is known
to be copyable, map the arena, re-register and map the new arena after a server restart (the
old attachment is closed in the background, at once: see :meth:`ServerLink._retire`), and turn
the cache off for good when the KV cache cannot be copied.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import torch

from kvshelf.client import KVShelfClient, ServerError, ServerUnavailable
from kvshelf.metric_types import Counters
from kvshelf.plan import LoadJob
from kvshelf.platform.affinity import pin_current_thread
from kvshelf.platform.shm import ArenaAccessError
from kvshelf.protocol import ErrorCode, PageLayout, pool_name
from kvshelf.roles.attachment import Attachment
from kvshelf.roles.fingerprint import with_epoch
from kvshelf.transfer import KVCacheLayout, TransferEngine, UnsupportedKVCache

logger = logging.getLogger(__name__)


class ServerLink:
    """One KV rank's registration with the server and its mapped arena.

    Args:
        client_factory: makes the server client (called once, by :meth:`connect`), which the
            step loop and the store thread share.
        model_fingerprint: identifies the model weights and dtype.
        layout_fingerprint: identifies the KV cache layout (shared with the scheduler).
        rank: this worker's KV rank.
        world_size: the number of KV ranks.
        replicas: consecutive ranks holding the same KV bytes, stored once
            (:mod:`kvshelf.roles.replication`).
        counters: the worker's counters (``registrations_refused``); None: not counted.
    """

    def __init__(
        self,
        client_factory: Callable[[], KVShelfClient],
        model_fingerprint: str,
        layout_fingerprint: str,
        rank: int,
        world_size: int,
        replicas: int = 1,
        counters: Counters | None = None,
    ) -> None:
        self._client_factory = client_factory
        self._counters = counters
        self._client: KVShelfClient | None = None
        self.rank = rank
        self.world_size = world_size
        self.replicas = replicas
        self._model_fingerprint = model_fingerprint
        self._layout_fingerprint = layout_fingerprint
        self._helper_cpus: frozenset[int] | None = None
        # The identity epoch stores go to (StepPlan.identity_epoch), set by the store thread.
        self.epoch = ""
        # Both set once the KV cache is known to be copyable (else the cache stays off).
        self._layout: KVCacheLayout | None = None
        self._new_engine: Callable[[torch.Tensor], TransferEngine] | None = None
        self._attachment: Attachment | None = None
        self._lock = threading.Lock()
        # Arenas this worker could not open (another user or IPC namespace), logged once each.
        self._inaccessible_arenas: set[str] = set()
        # The threads closing attachments of earlier server boots (joined by close()).
        self._closing: list[threading.Thread] = []
        # (pool, error code) of registrations refused, each logged once.
        self._refusals: set[tuple[str, ErrorCode]] = set()

    def connect(self, helper_cpus: frozenset[int] | None) -> None:
        """Make the client; arenas mapped from now on prefault on ``helper_cpus`` (or None)."""
        self._client = self._client_factory()
        self._helper_cpus = helper_cpus

    @property
    def client(self) -> KVShelfClient:
        assert self._client is not None, "connect() first"
        return self._client

    @property
    def pool(self) -> str:
        return pool_name(
            self._epoch_fingerprint(), self._layout_fingerprint, self.world_size, self.replicas
        )

    @property
    def attachment(self) -> Attachment | None:
        """The attachment of the server boot last registered with, if any."""
        return self._attachment

    @property
    def enabled(self) -> bool:
        """Whether the KV cache is copyable (the cache is on)."""
        return self._layout is not None

    @property
    def page_bytes(self) -> int:
        assert self._layout is not None
        return self._layout.page_bytes

    def enable(
        self, layout: KVCacheLayout, new_engine: Callable[[torch.Tensor], TransferEngine]
    ) -> None:
        """Turn the cache on for a KV cache of ``layout``, copied by ``new_engine``'s engines."""
        self._layout = layout
        self._new_engine = new_engine

    def disable(self, why: Exception) -> None:
        """Turn the cache off for good, with one ERROR line.

        Never stop vLLM for the cache's sake: every store is dropped and every load is
        reported failed (vLLM recomputes), so outputs stay correct.
        """
        self._layout = None
        self._new_engine = None
        logger.error("kvshelf cannot copy this KV cache (%s); serving without the cache", why)

    def _epoch_fingerprint(self) -> str:
        return with_epoch(self._model_fingerprint, self.epoch)

    def attach(self, renew: bool = False) -> Attachment | None:
        """Register with the server and map its arena, or return the current attachment.

        A server restart (new boot id) replaces the attachment: page numbers of the old
        boot mean nothing in the new arena. A new identity epoch registers its own pool and
        retires the one this rank registered before on the same boot (``Register.retires``,
        with the holder token the client sends with every registration: a registration sent
        again after a timeout lets go of it once).

        Args:
            renew: register even if the current registration names this pool (the server
                answered UNKNOWN_POOL: it retired the pool).
        """
        if self._layout is None or self._new_engine is None:
            return None
        with self._lock:
            try:
                registration = self.client.registration
                if renew or registration is None or registration.pool != self.pool:
                    retires = ""
                    if (
                        registration is not None
                        and registration.pool != self.pool
                        and registration.boot_id == self.client.boot_id
                    ):
                        retires = registration.pool
                    registration = self.client.register(
                        PageLayout(
                            model_fingerprint=self._epoch_fingerprint(),
                            layout_fingerprint=self._layout_fingerprint,
                            page_bytes=self._layout.page_bytes,
                            world_size=self.world_size,
                            rank=self.rank,
                            replicas=self.replicas,
                        ),
                        retires,
                    )
            except ServerUnavailable as exc:
                logger.debug("kvshelf registration failed: %s", exc)
                return None
            except ServerError as exc:
                self._refused(exc)
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
                self.disable(exc)
                return None
            if current is not None:
                self._retire(current)
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

    def _refused(self, exc: ServerError) -> None:
        """The server refused this rank's registration: nothing is stored until it accepts
        one (tried again with every store). Said once per pool and cause, counted each time."""
        if self._counters is not None:
            self._counters.add("registrations_refused")
        refusal = (self.pool, exc.code)
        if refusal not in self._refusals:
            self._refusals.add(refusal)
            logger.warning(
                "kvshelf server refused to register pool %s (%s); this worker stores nothing "
                "until it accepts (registration is tried again with each store)",
                self.pool,
                exc,
            )

    def reattach(self) -> Attachment | None:
        """Learn the server's current boot (re-registering if it changed) and map its arena."""
        try:
            self.client.ping()
        except (ServerUnavailable, ServerError):
            return self._attachment
        return self.attach()

    def submit_release(self, load: LoadJob, copied: int) -> int | None:
        """Send the release of this rank's share of a load's lock, telling the server how
        many pages of it this rank copied, without waiting for the server.

        Returns:
            The ticket of its acknowledgement (:meth:`release_outcome`), or None when it
            cannot be sent (the server is away: the lock's lease ends it).
        """
        try:
            return self.client.submit_release(load.lock_id, self.rank, copied)
        except ServerUnavailable as exc:
            logger.debug("kvshelf release of lock %d failed: %s", load.lock_id, exc)
            return None

    def release_outcome(self, load: LoadJob, ticket: int | None, wait_s: float) -> bool | None:
        """What the server answered a :meth:`submit_release` (waiting at most ``wait_s``).

        Returns:
            None while the answer may still come (at most the request timeout after the
            send). False when the pages may have changed under the copy: the server no
            longer knew the lock although it is still the boot that granted it (the lease
            ran out, so the pages may have been evicted and rewritten). True otherwise: a
            dead, stalled or restarted server cannot have touched the pages after it granted
            the lock.
        """
        if ticket is None:
            return True
        try:
            if not self.client.release_done(ticket, wait_s):
                return None
        except ServerUnavailable as exc:
            logger.debug("kvshelf release of lock %d failed: %s", load.lock_id, exc)
        except ServerError as exc:
            if exc.code == ErrorCode.UNKNOWN_LOCK and self.client.boot_id == load.boot_id:
                logger.warning("kvshelf lock %d expired during a load: %s", load.lock_id, exc)
                return False
            if exc.code != ErrorCode.UNKNOWN_LOCK:
                # A release the server refuses keeps its pages locked until the lease ends.
                logger.warning("kvshelf release of lock %d refused: %s", load.lock_id, exc)
            else:
                logger.debug("kvshelf release of lock %d failed: %s", load.lock_id, exc)
        return True

    def _retire(self, attachment: Attachment) -> None:
        """Close an earlier boot's attachment on a thread of its own, starting now.

        Its engine waits for its copies still running and unpins every chunk of its arena
        (seconds for a large arena on a GPU): that holds up neither vLLM's step loop nor the
        store thread, whichever attached the new boot, and happens even while vLLM idles. A
        step still using the old engine is safe: an engine's close waits for the copies it
        issued, and refuses later ones (those loads fail: vLLM recomputes them).
        """
        self._closing = [thread for thread in self._closing if thread.is_alive()]
        thread = threading.Thread(
            target=self._close_retired, args=(attachment,), name="kvshelf-close", daemon=True
        )
        thread.start()
        self._closing.append(thread)

    def _close_retired(self, attachment: Attachment) -> None:
        pin_current_thread(self._helper_cpus)  # off vLLM's compute cores
        try:
            attachment.close()
        except Exception:
            # Unpinned and unmapped all the same (both closes finish in ``finally``).
            logger.exception(
                "kvshelf could not close the arena of server boot %s cleanly", attachment.boot_id
            )

    def close(self) -> None:
        """Unmap every arena (waiting for earlier boots' to close) and close the client."""
        with self._lock:
            closing, self._closing = self._closing, []
        for thread in closing:
            thread.join()
        with self._lock:
            if self._attachment is not None:
                self._attachment.close()
                self._attachment = None
        if self._client is not None:
            self._client.close()
