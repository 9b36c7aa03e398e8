"""Concurrent writers and readers against a real server: one writer per key, no torn reads."""

from __future__ import annotations

import threading

from kvshelf.protocol import PageLayout
from testbed.server import ServerProcess, map_arena_file

PAGE = 4096
LAYOUT = PageLayout(
    model_fingerprint="m", layout_fingerprint="l", page_bytes=PAGE, world_size=1, rank=0
)
NUM_KEYS = 200


def key(i: int) -> bytes:
    return i.to_bytes(8, "big") * 4


def content(i: int) -> bytes:
    # Every byte of a page depends on its key, so a partly written page never matches.
    return (i.to_bytes(8, "big") * (PAGE // 8))[:PAGE]


def test_one_writer_per_key_and_readers_see_only_committed_pages(
    kvshelf_server: ServerProcess,
) -> None:
    writers = [kvshelf_server.client(timeout_s=5.0) for _ in range(2)]
    reader = kvshelf_server.client(timeout_s=5.0)
    registration = writers[0].register(LAYOUT)
    writers[1].register(LAYOUT)
    pool = registration.pool
    arena = map_arena_file(registration.shm_name)
    barrier = threading.Barrier(3)
    stop_reading = threading.Event()
    written: list[list[int]] = [[], []]
    problems: list[str] = []

    def write(w: int) -> None:
        barrier.wait()
        for i in range(NUM_KEYS):
            reservation = writers[w].reserve(pool, 0, [key(i)])
            (page,) = reservation.pages
            if page is not None:
                # Half the page, then a round trip to the server, then the rest: a reader
                # that could see this page now would find it torn.
                arena[page * PAGE : page * PAGE + PAGE // 2] = content(i)[: PAGE // 2]
                writers[w].stats()
                arena[page * PAGE + PAGE // 2 : (page + 1) * PAGE] = content(i)[PAGE // 2 :]
                writers[w].commit(reservation.reservation_id)
                written[w].append(i)
            else:
                writers[w].abort(reservation.reservation_id)

    def read() -> None:
        barrier.wait()
        while not stop_reading.is_set():
            for i in range(0, NUM_KEYS, 7):
                result = reader.lookup(pool, [key(i)], world_size=1, lock=True)
                if result.num_hit_blocks:
                    page = result.pages[0][0]
                    if arena[page * PAGE : (page + 1) * PAGE] != content(i):
                        problems.append(f"key {i}: page {page} read before it was complete")
                    reader.release(result.lock_id, 0)

    threads = [threading.Thread(target=write, args=(w,)) for w in range(2)]
    threads.append(threading.Thread(target=read))
    for thread in threads:
        thread.start()
    for thread in threads[:2]:
        thread.join()
    stop_reading.set()
    threads[2].join()
    arena.close()

    # Every key was written by exactly one of the two writers.
    assert sorted(written[0] + written[1]) == list(range(NUM_KEYS))
    assert not problems
    stats = reader.stats()
    assert stats["resident_objects"] == NUM_KEYS == stats["committed_objects_total"]
    assert stats["reserve_skipped_objects_total"] == NUM_KEYS
    assert stats["locked_objects"] == 0 and stats["bad_requests_total"] == 0
    for client in (*writers, reader):
        client.close()


def test_reserved_key_is_skipped_until_aborted(kvshelf_server: ServerProcess) -> None:
    with kvshelf_server.client() as first, kvshelf_server.client() as second:
        pool = first.register(LAYOUT).pool
        second.register(LAYOUT)
        held = first.reserve(pool, 0, [key(1), key(2)])
        assert None not in held.pages
        assert second.reserve(pool, 0, [key(1), key(2), key(3)]).pages[:2] == [None, None]
        assert second.lookup(pool, [key(1)], world_size=1, lock=False).num_hit_blocks == 0
        first.abort(held.reservation_id)
        assert None not in second.reserve(pool, 0, [key(1), key(2)]).pages
