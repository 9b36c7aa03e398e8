"""The scheduler role's lookups when the server answers "pending" (a tier below L1 is slow).

The client here is a stand-in that answers as a server with a slow disk does: "pending" while
the lookup lets it load from below L1, the L1 prefix at once otherwise.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from types import SimpleNamespace

import pytest

from kvshelf.client import LookupResult
from kvshelf.metric_types import Counters
from kvshelf.metrics import SCHEDULER
from kvshelf.protocol import max_request_keys
from kvshelf.roles import scheduler_lookups as lookups_module
from kvshelf.roles.scheduler_lookups import Lookups

BLOCK = 4


class SlowDiskClient:
    """Answers every fetching lookup "pending"; a lookup without fetch hits 2 blocks (L1)."""

    def __init__(self) -> None:
        self.sent: list[bool] = []
        self.released: list[int] = []

    def submit_lookup(
        self,
        pool: str,
        hashes: Sequence[bytes],
        *,
        world_size: int,
        lock: bool,
        count_miss: bool = True,
        fetch: bool = True,
        block_keys: int = 1,
        ends: Sequence[Sequence[bytes]] = (),
        tenant: str = "",
    ) -> int:
        self.sent.append(fetch)
        return len(self.sent)

    def poll_lookup(self, ticket: int, wait_s: float = 0.0) -> LookupResult:
        if self.sent[ticket - 1]:
            return LookupResult(0, 0, [], "boot", pending=True)
        return LookupResult(2, ticket, [[7, 8]], "boot")

    def cancel_lookup(self, ticket: int) -> None:
        return None

    def collect_abandoned(self) -> bool:
        return False

    def release_all_nowait(self, lock_id: int, world_size: int) -> None:
        self.released.append(lock_id)


def test_pending_answers_are_asked_again_until_the_wait_ends_then_l1_answers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(lookups_module, "FETCH_WAIT_S", 0.2)
    client = SlowDiskClient()
    lookups = Lookups(Counters(SCHEDULER), lambda *_: None, client, "pool", BLOCK, 1)
    request = SimpleNamespace(
        request_id="r", block_hashes=[b"a", b"b", b"c"], num_tokens=3 * BLOCK + 1
    )
    started = time.monotonic()
    answers = []
    while (answer := lookups.lookup(request, 0)) is None:
        answers.append(answer)
        time.sleep(0.01)
    elapsed = time.monotonic() - started
    # Asked again while pending (never taken as a dead server), then without fetch.
    assert len(answers) >= 2 and elapsed >= 0.2
    assert client.sent[0] and client.sent[-1] is False and all(client.sent[:-1])
    assert answer == 2 * BLOCK
    load = lookups.take_load("r", ([10, 11, 12, 13],), 2 * BLOCK)
    assert load is not None and load.pages == ((7, 8),)


class RecordingClient(SlowDiskClient):
    """Records the keys each lookup names."""

    def __init__(self) -> None:
        super().__init__()
        self.keys: list[int] = []

    def submit_lookup(self, pool: str, hashes: Sequence[bytes], **kwargs: object) -> int:
        self.keys.append(len(hashes) + sum(map(len, kwargs.get("ends", ()))))  # type: ignore[arg-type]
        return super().submit_lookup(pool, hashes, **kwargs)  # type: ignore[arg-type]


def test_a_long_prompt_looks_up_no_more_keys_than_a_request_may_name() -> None:
    world = 64
    client = RecordingClient()
    lookups = Lookups(Counters(SCHEDULER), lambda *_: None, client, "pool", BLOCK, world)
    blocks = max_request_keys(world) + 100
    request = SimpleNamespace(
        request_id="r",
        block_hashes=[i.to_bytes(4, "big") for i in range(blocks)],
        num_tokens=blocks * BLOCK + 1,
    )
    lookups.lookup(request, 0)
    assert client.keys == [max_request_keys(world)]
