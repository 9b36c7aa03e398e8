"""A KV events subscriber built from vLLM's own types, as a KV-aware router would run one.

It subscribes to an engine's ZMQ publisher (``--kv-events-config`` with ``publisher: zmq``),
decodes every message with msgspec into vLLM's ``KVEventBatch``, and fills the gaps a late
subscription leaves with a replay request to the publisher's replay socket. Tests and the
router simulation benchmark read what an engine published from it. Imports vLLM and pyzmq.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass

import msgspec
import zmq
from vllm.distributed.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)

from testbed.server import free_port

# The publisher's end-of-replay marker: sequence number -1.
_END_SEQ = (-1).to_bytes(8, "big", signed=True)


@dataclass(frozen=True)
class EventEndpoints:
    """Where an engine publishes (``kv_events_config``) and where a subscriber connects."""

    port: int
    replay_port: int
    topic: str = "kv@kvshelf-test@tiny"

    @classmethod
    def free(cls) -> EventEndpoints:
        return cls(free_port(), free_port())

    def engine_config(self) -> dict[str, object]:
        """``EngineSpec.kv_events_config``: vLLM's ZMQ publisher bound on these ports."""
        return {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{self.port}",
            "replay_endpoint": f"tcp://*:{self.replay_port}",
            "topic": self.topic,
        }


class EventSubscriber:
    """Collects an engine's event batches by sequence number, on a thread of its own.

    Args:
        endpoints: the engine's publisher.
    """

    def __init__(self, endpoints: EventEndpoints) -> None:
        self._endpoints = endpoints
        self._decoder = msgspec.msgpack.Decoder(KVEventBatch)
        self._context = zmq.Context()
        self._batches: dict[int, KVEventBatch] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="kv-subscriber")
        self._thread.start()

    def _run(self) -> None:
        sub = self._context.socket(zmq.SUB)
        sub.connect(f"tcp://127.0.0.1:{self._endpoints.port}")
        sub.setsockopt_string(zmq.SUBSCRIBE, self._endpoints.topic)
        try:
            while not self._stop.is_set():
                if sub.poll(50):
                    _, seq, payload = sub.recv_multipart()
                    self._add(int.from_bytes(seq, "big"), payload)
        finally:
            sub.close(linger=0)

    def _add(self, seq: int, payload: bytes) -> None:
        batch = self._decoder.decode(payload)
        with self._lock:
            self._batches[seq] = batch

    def replay(self, start_seq: int = 0, timeout_s: float = 10.0) -> int:
        """Ask the publisher for every batch it buffered from ``start_seq`` on.

        Returns:
            How many batches the replay sent.
        """
        socket = self._context.socket(zmq.DEALER)
        socket.connect(f"tcp://127.0.0.1:{self._endpoints.replay_port}")
        try:
            socket.send_multipart((b"", start_seq.to_bytes(8, "big")))
            count = 0
            while True:
                if not socket.poll(int(timeout_s * 1000)):
                    raise TimeoutError("the publisher did not finish the replay")
                _, _, seq, payload = socket.recv_multipart()
                if seq == _END_SEQ:
                    return count
                self._add(int.from_bytes(seq, "big"), payload)
                count += 1
        finally:
            socket.close(linger=0)

    @property
    def next_seq(self) -> int:
        """One past the highest sequence number received."""
        with self._lock:
            return max(self._batches, default=-1) + 1

    def missing(self) -> list[int]:
        """Sequence numbers below the highest received that were not received."""
        with self._lock:
            last = max(self._batches, default=-1)
            return [seq for seq in range(last) if seq not in self._batches]

    def events(self, start_seq: int = 0) -> list[BlockStored | BlockRemoved | AllBlocksCleared]:
        """Every event of the batches from ``start_seq`` on, in publishing order."""
        with self._lock:
            seqs = sorted(seq for seq in self._batches if seq >= start_seq)
            return [event for seq in seqs for event in self._batches[seq].events]

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)
        self._context.term()


def blocks(events: list[object], medium: str) -> Iterator[tuple[bytes | int, object, list[int]]]:
    """``(hash, parent hash, token ids)`` of every block the ``BlockStored`` events of
    ``medium`` among ``events`` describe, one block at a time."""
    for event in events:
        if not isinstance(event, BlockStored) or event.medium != medium:
            continue
        parent = event.parent_block_hash
        size = event.block_size
        for i, block_hash in enumerate(event.block_hashes):
            yield block_hash, parent, list(event.token_ids[i * size : (i + 1) * size])
            parent = block_hash


def descriptions(events: list[object], medium: str) -> dict[object, tuple[object, ...]]:
    """Each block the ``BlockStored`` events of ``medium`` describe, by hash: ``(parent hash,
    token ids, extra keys, block size, LoRA name, LoRA id, group)``, all a router may key on."""
    described = {}
    for event in events:
        if not isinstance(event, BlockStored) or event.medium != medium:
            continue
        parent = event.parent_block_hash
        size = event.block_size
        extra = event.extra_keys or [None] * len(event.block_hashes)
        for i, block_hash in enumerate(event.block_hashes):
            described[block_hash] = (
                parent,
                tuple(event.token_ids[i * size : (i + 1) * size]),
                extra[i],
                size,
                event.lora_name,
                event.lora_id,
                event.group_idx,
            )
            parent = block_hash
    return described
