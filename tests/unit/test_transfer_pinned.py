"""The arena is registered with CUDA chunk by chunk, as copies reach its pages (so that a
``--no-prefault`` server's arena is not pinned, and so allocated, all at once), and every chunk
is unregistered on close. CUDA's calls are replaced by recorders here."""

from __future__ import annotations

import pytest
import torch

from kvshelf.transfer.pinned import PinnedArena, PinningError

PAGE = 4096


def _arena(calls: list[tuple[str, int, int]], fail_at: int | None = None):
    arena = torch.zeros(10 * PAGE, dtype=torch.uint8)
    base = arena.data_ptr()

    def register(address: int, nbytes: int) -> None:
        if address - base == fail_at:
            raise PinningError("refused")
        calls.append(("register", address - base, nbytes))

    def unregister(address: int) -> None:
        calls.append(("unregister", address - base, 0))

    pinned = PinnedArena(
        arena, PAGE, chunk_bytes=4 * PAGE, register=register, unregister=unregister
    )
    return arena, pinned


def test_chunks_are_registered_on_first_use_and_unregistered_on_close() -> None:
    calls: list[tuple[str, int, int]] = []
    _, pinned = _arena(calls)
    pinned.ensure([1, 2])
    pinned.ensure([3, 0])  # same chunk: nothing new
    assert calls == [("register", 0, 4 * PAGE)]
    pinned.ensure([9])  # the last chunk is short: 2 pages
    assert calls[-1] == ("register", 8 * PAGE, 2 * PAGE)
    assert pinned.registered_chunks == {0, 2}
    pinned.close()
    assert calls[-2:] == [("unregister", 0, 0), ("unregister", 8 * PAGE, 0)]
    assert pinned.registered_chunks == frozenset()


def test_a_refused_registration_raises_and_registers_nothing() -> None:
    calls: list[tuple[str, int, int]] = []
    _, pinned = _arena(calls, fail_at=4 * PAGE)
    with pytest.raises(PinningError, match="refused"):
        pinned.ensure([5])
    assert pinned.registered_chunks == frozenset()
    pinned.ensure([0])
    assert pinned.registered_chunks == {0}
