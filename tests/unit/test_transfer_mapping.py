"""Mapping a shared-memory arena: kvshelf.transfer.mapping."""

from __future__ import annotations

import errno
import mmap
import os
import uuid

import pytest
import torch

from kvshelf.platform.shm import ArenaAccessError
from kvshelf.transfer import map_arena
from testbed.server import resident_bytes

ARENA_BYTES = 1 << 20


@pytest.fixture
def shm_name():
    """A fresh /dev/shm object of ARENA_BYTES, unlinked after the test."""
    name = f"kvshelf-test-{uuid.uuid4().hex}"
    fd = os.open(f"/dev/shm/{name}", os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, ARENA_BYTES)
    finally:
        os.close(fd)
    yield name
    os.unlink(f"/dev/shm/{name}")


def test_mapping_is_shared_with_other_mappings(shm_name):
    with map_arena(shm_name, ARENA_BYTES) as arena:
        assert arena.buffer.dtype == torch.uint8
        assert arena.buffer.numel() == ARENA_BYTES
        arena.buffer[100:104] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)
        fd = os.open(f"/dev/shm/{shm_name}", os.O_RDONLY)
        try:
            with mmap.mmap(fd, ARENA_BYTES, prot=mmap.PROT_READ) as other:
                assert other[100:104] == b"\x01\x02\x03\x04"
        finally:
            os.close(fd)
    assert arena.closed


def test_leading_slash_and_populate(shm_name):
    arena = map_arena("/" + shm_name, ARENA_BYTES // 2, populate=True)
    assert arena.buffer.numel() == ARENA_BYTES // 2
    arena.close()
    arena.close()  # idempotent
    with pytest.raises(ValueError, match="closed"):
        _ = arena.buffer


def test_close_with_live_views_fails_then_succeeds(shm_name):
    arena = map_arena(shm_name, ARENA_BYTES)
    view = arena.buffer[4096:].view(-1, 4096)
    with pytest.raises(BufferError, match="still alive"):
        arena.close()
    assert not arena.closed
    assert arena.buffer.numel() == ARENA_BYTES  # still usable
    del view
    arena.close()
    assert arena.closed


def test_bad_arguments(shm_name):
    # A missing object is another IPC namespace's arena (test_arena_access.py): a clear error.
    with pytest.raises(ArenaAccessError, match="same IPC namespace") as missing:
        map_arena(f"kvshelf-test-missing-{uuid.uuid4().hex}", ARENA_BYTES)
    assert missing.value.errno == errno.ENOENT
    with pytest.raises(ValueError, match="fewer than"):
        map_arena(shm_name, ARENA_BYTES + 1)
    with pytest.raises(ValueError, match="positive"):
        map_arena(shm_name, 0)
    with pytest.raises(ValueError, match="invalid"):
        map_arena("../etc/passwd", ARENA_BYTES)


def test_start_prefault_populates_the_mapping_and_allocates_the_object(shm_name):
    with map_arena(shm_name, ARENA_BYTES) as arena:
        address = arena.buffer.data_ptr()
        assert arena.allocated_bytes == 0 and resident_bytes(address=address) == 0
        prefault = arena.start_prefault()
        assert prefault.wait(timeout_s=30)
        assert resident_bytes(address=address) == ARENA_BYTES
        assert arena.allocated_bytes == ARENA_BYTES
        with pytest.raises(ValueError, match="already"):
            arena.start_prefault()


def test_close_stops_a_running_prefault_first(shm_name):
    arena = map_arena(shm_name, ARENA_BYTES)
    prefault = arena.start_prefault()
    arena.close()
    assert prefault.wait(timeout_s=0)
    assert arena.closed


def test_copies_racing_the_prefault_see_the_same_bytes():
    size = 64 << 20  # large enough that the prefault threads are still running during the copy
    name = f"kvshelf-test-{uuid.uuid4().hex}"
    fd = os.open(f"/dev/shm/{name}", os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, size)
        data = torch.arange(size, dtype=torch.int32).to(torch.uint8)
        with map_arena(name, size) as writer, map_arena(name, size) as reader:
            writer.start_prefault()
            reader.start_prefault()
            writer.buffer.copy_(data)
            assert torch.equal(reader.buffer.clone(), data)
    finally:
        os.close(fd)
        os.unlink(f"/dev/shm/{name}")
