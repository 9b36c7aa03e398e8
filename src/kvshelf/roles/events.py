"""The scheduler role's KV events: what this engine can load from kvshelf, told to routers.

KV-aware routers follow vLLM's KV events stream (``--kv-events-config``) to learn which engine
holds a prompt's prefix. kvshelf adds to it what this engine can load from its server:

* ``Stored`` (medium ``CPU``) for a block once the server's event log
  (:mod:`kvshelf.server.event_log`) says it is committed in L1 for every rank, for blocks this
  engine planned to store; a block that a lookup found (a sibling engine stored it) at once.
  Never for a store that failed or was skipped: only the server's log says "stored".
* ``Removed`` when the log says the block left L1 (evicted, dropped), whoever stored it;
  ``Stored``/``Removed`` with medium ``STORAGE`` while only a tier below L1 keeps it.
* ``Cleared`` when this engine can no longer trust what it published: ``kvshelf clear`` or a
  log that dropped entries this engine had not read (the server's log says "overflowed"), a
  restarted server (a new boot id), or a new identity epoch (this engine's pool is retired).
  The blocks still there are then published again, from a probe of the server.

Each event describes its blocks in full (tokens, parent hash, LoRA name, extra keys), from
what the engine knew when it planned the store or found the block; that description is made
by the caller's ``describe`` (vLLM's hashing helpers live in ``kvshelf.vllm.events``), so this
module imports no vLLM. :class:`EventReader` reads the server's log on a thread of its own
every ``READ_INTERVAL_S``; the scheduler's step only takes what it read (no server call).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from kvshelf.client import ServerError, ServerUnavailable
from kvshelf.protocol import EventsReply, max_request_keys

logger = logging.getLogger(__name__)

# How often the reader asks the server for new log entries: a router following the stream is
# this much (plus a step) behind the server's contents.
READ_INTERVAL_S = 0.1
# Block descriptions kept (about 0.3 KiB each with 16-token blocks): the blocks this engine may
# still publish, or publish again after a Cleared.
DEFAULT_KNOWN_BLOCKS = 1 << 17
# After stores were confirmed, vLLM is kept stepping (has_pending_work) until a log read that
# started after the confirmation was taken, so their Stored events are not held back until the
# next request; at most this long, for a server that stopped answering.
SETTLE_LIMIT_S = 2.0

CPU = "CPU"
STORAGE = "STORAGE"

# Log entry kinds (kvshelf.server.event_log.EventKind) and probe answers, as sent.
_STORED, _REMOVED, _DEMOTED = 1, 2, 3
_IN_L1, _BELOW_L1 = 1, 2


@dataclass(frozen=True, slots=True)
class BlockInfo:
    """What a Stored event says about one block besides its hash."""

    parent: bytes | None
    token_ids: tuple[int, ...]
    lora_name: str | None
    # vLLM's per-block extra keys in their published form, or None.
    extra_keys: tuple[Any, ...] | None
    # vLLM's deprecated LoRA adapter id, published beside the name as its GPU events do.
    lora_id: int | None = None


@dataclass(slots=True)
class Stored:
    """Blocks, in chain order: ``hashes[i]``'s parent is ``hashes[i - 1]`` (the first's is
    ``parent``)."""

    hashes: list[bytes]
    parent: bytes | None
    token_ids: list[int]
    lora_name: str | None
    extra_keys: list[Any]
    medium: str
    lora_id: int | None = None


@dataclass(slots=True)
class Removed:
    hashes: list[bytes]
    medium: str


@dataclass(slots=True)
class Cleared:
    """Forget every block this engine published, then take the Stored events after it."""


Event = Stored | Removed | Cleared
Describe = Callable[[Any, int, int], list[BlockInfo]]


class EventsClient(Protocol):
    """The part of ``KVShelfClient`` the reader uses."""

    def events(self, pool: str, after_seq: int = 0, probe: Sequence[bytes] = ()) -> EventsReply: ...

    def close(self) -> None: ...


class EventReader:
    """Reads one pool's server event log on a thread of its own.

    What it read waits in ``items`` for the scheduler's step: ``(read start time, kind,
    payload)`` with kind ``"log"`` (payload: kinds, hashes), ``"restart"`` (a new server boot
    or an overflowed log: start over), or ``"present"`` (payload: probed hashes, where each
    is).

    Args:
        client: a client of its own (its calls block this thread only).
        pool: the pool to read.
        interval_s: the pause between reads that found nothing more to read.
        world_size: the pool's ranks, which bound the hashes one read may probe
            (:func:`kvshelf.protocol.max_request_keys`).
    """

    def __init__(
        self,
        client: EventsClient,
        pool: str,
        interval_s: float = READ_INTERVAL_S,
        world_size: int = 1,
    ):
        self.items: deque[tuple[float, str, Any]] = deque()
        self._client = client
        self._pool = pool
        self._interval_s = interval_s
        self._probe: list[bytes] = []
        self.max_probe = max_request_keys(world_size)
        # Whether the latest read failed (the server is away): nothing is worth waiting for.
        self.failing = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvshelf-events", daemon=True)
        self._thread.start()

    def switch_pool(self, pool: str) -> None:
        """Read ``pool`` from now on (from its beginning, with nothing to start over from)."""
        self._pool = pool
        self._probe = []

    def probe(self, hashes: list[bytes]) -> None:
        """Ask where ``hashes`` are with the next reads (replacing a probe not sent yet)."""
        self._probe = hashes

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)
        self._client.close()

    def _run(self) -> None:
        boot_id: str | None = None
        pool = self._pool
        after_seq = 0
        while not self._stop.is_set():
            if pool != self._pool:
                pool, after_seq, boot_id = self._pool, 0, None
            probe, self._probe = self._probe[: self.max_probe], []
            started = time.monotonic()
            try:
                reply = self._client.events(pool, after_seq, probe)
            except (ServerUnavailable, ServerError) as exc:
                logger.debug("kvshelf events: read failed: %s", exc)
                self.failing = True
                self._probe = probe + self._probe
                self._stop.wait(self._interval_s)
                continue
            self.failing = False
            if pool != self._pool:
                continue
            if boot_id is not None and (reply.boot_id != boot_id or reply.overflowed):
                # A restarted server (the new log's numbers are not the old one's) or entries
                # dropped before this reader saw them: whatever was published may be wrong.
                self.items.append((started, "restart", None))
                if reply.boot_id != boot_id:
                    boot_id, after_seq = reply.boot_id, 0
                    self._probe = probe + self._probe
                    continue
            boot_id = reply.boot_id
            after_seq = reply.next_seq
            if reply.kinds:
                self.items.append((started, "log", (reply.kinds, reply.hashes)))
            if probe:
                self.items.append((started, "present", (probe, reply.present)))
            if not reply.kinds and not self._probe:
                self._stop.wait(self._interval_s)


class EventTracker:
    """Turns what this engine stores and finds, and the server's log, into events.

    Runs on the scheduler's thread; the reader's thread only fills ``reader.items``.

    Args:
        reader: the pool's log reader.
        describe: ``describe(request, start, end)`` describes blocks ``[start, end)`` of a vLLM
            request (``BlockInfo`` each).
        known_blocks: the most block descriptions kept (least recently used dropped first).
    """

    def __init__(
        self, reader: EventReader, describe: Describe, known_blocks: int = DEFAULT_KNOWN_BLOCKS
    ) -> None:
        self._reader = reader
        self._describe = describe
        self._known_blocks = known_blocks
        self._info: OrderedDict[bytes, BlockInfo] = OrderedDict()
        # What the stream says this engine can load from kvshelf: hash -> medium.
        self._published: dict[bytes, str] = {}
        self._events: list[Event] = []
        self._confirmed_at = 0.0
        self._read_at = 0.0
        # When the probe of a start-over was asked for (0.0: none outstanding).
        self._probing_since = 0.0

    def blocks_planned(self, request: Any, start: int, end: int) -> None:
        """Blocks ``[start, end)`` of ``request`` are to be stored: describe them now, publish
        them once the server's log says they are stored."""
        self._learn(request, start, end)

    def blocks_found(self, request: Any, num_blocks: int) -> None:
        """A lookup found the first ``num_blocks`` blocks of ``request`` in L1 for every rank:
        publish the ones not published yet (a sibling engine stored them)."""
        if num_blocks <= 0:
            return
        hashes = request.block_hashes
        if all(self._published.get(hashes[i]) == CPU for i in range(num_blocks)):
            return
        self._learn(request, 0, num_blocks)
        for i in range(num_blocks):
            self._publish(hashes[i], CPU)

    def stores_confirmed(self) -> None:
        """Workers reported stores done: their Stored events come with the next log read."""
        self._confirmed_at = time.monotonic()

    def switch_pool(self, pool: str) -> None:
        """A new identity epoch: this engine's old pool is retired, nothing in it counts."""
        self._reader.switch_pool(pool)
        self._reader.items.clear()
        self._clear()

    @property
    def pending(self) -> bool:
        """Whether Stored events of confirmed stores, or of a start-over's probe, may still
        come (keep vLLM stepping)."""
        if self._reader.failing:
            return False
        now = time.monotonic()
        confirmed = self._confirmed_at
        if self._read_at <= confirmed and now - confirmed < SETTLE_LIMIT_S:
            return True
        return self._probing_since > 0 and now - self._probing_since < SETTLE_LIMIT_S

    def take(self) -> list[Event]:
        """The events since the last call, in order."""
        items = self._reader.items
        while items:
            started, kind, payload = items.popleft()
            self._read_at = max(self._read_at, started)
            if kind == "log":
                self._apply_log(*payload)
            elif kind == "present":
                self._probing_since = 0.0
                self._apply_probe(*payload)
            else:
                self._clear()
                if self._info:
                    # Publish again what is still there, once the server says where it is.
                    self._reader.probe(list(reversed(self._info))[: self._reader.max_probe])
                    self._probing_since = time.monotonic()
        events, self._events = self._events, []
        return events

    def close(self) -> None:
        self._reader.close()

    def _learn(self, request: Any, start: int, end: int) -> None:
        info = self._info
        hashes = request.block_hashes
        first_new = start
        while first_new < end and hashes[first_new] in info:
            info.move_to_end(hashes[first_new])
            first_new += 1
        if first_new == end:
            return
        for i, block in enumerate(self._describe(request, first_new, end), first_new):
            info[bytes(hashes[i])] = block
        while len(info) > self._known_blocks:
            info.popitem(last=False)

    def _apply_log(self, kinds: list[int], hashes: list[bytes]) -> None:
        published = self._published
        for kind, block_hash in zip(kinds, hashes, strict=True):
            medium = published.get(block_hash)
            if kind == _STORED:
                if medium != CPU and block_hash in self._info:
                    self._publish(block_hash, CPU)
            elif medium is None:
                continue
            elif kind == _DEMOTED and medium == CPU:
                self._publish(block_hash, STORAGE)
            elif kind == _REMOVED:
                del published[block_hash]
                self._removed(block_hash, medium)

    def _apply_probe(self, hashes: list[bytes], where: list[int]) -> None:
        for block_hash, place in zip(hashes, where, strict=True):
            if place == _IN_L1:
                self._publish(block_hash, CPU)
            elif place == _BELOW_L1:
                self._publish(block_hash, STORAGE)

    def _publish(self, block_hash: bytes, medium: str) -> None:
        """Publish ``block_hash`` at ``medium`` (withdrawing another medium it was at)."""
        before = self._published.get(block_hash)
        if before == medium:
            return
        info = self._info.get(block_hash)
        if info is None:
            return
        if before is not None:
            self._removed(block_hash, before)
        self._published[block_hash] = medium
        last = self._events[-1] if self._events else None
        if (
            isinstance(last, Stored)
            and last.medium == medium
            and last.hashes[-1] == info.parent
            and last.lora_name == info.lora_name
            and last.lora_id == info.lora_id
        ):
            last.hashes.append(block_hash)
            last.token_ids.extend(info.token_ids)
            last.extra_keys.append(info.extra_keys)
            return
        self._events.append(
            Stored(
                hashes=[block_hash],
                parent=info.parent,
                token_ids=list(info.token_ids),
                lora_name=info.lora_name,
                extra_keys=[info.extra_keys],
                medium=medium,
                lora_id=info.lora_id,
            )
        )

    def _removed(self, block_hash: bytes, medium: str) -> None:
        last = self._events[-1] if self._events else None
        if isinstance(last, Removed) and last.medium == medium:
            last.hashes.append(block_hash)
        else:
            self._events.append(Removed(hashes=[block_hash], medium=medium))

    def _clear(self) -> None:
        if self._published:
            self._published.clear()
        self._events.append(Cleared())
