"""Pre-faulting mappings: kvshelf.platform.prefault, on real shared-memory objects."""

from __future__ import annotations

import mmap
import os
import resource
import threading
import time
import uuid
from collections.abc import Iterator

import pytest

from kvshelf.platform.prefault import BackgroundPrefault, mapping_address, populate
from testbed.server import resident_bytes

MIB = 1 << 20


@pytest.fixture
def shm_mapping() -> Iterator[mmap.mmap]:
    """A shared mapping of a fresh 64 MiB /dev/shm object (not allocated yet)."""
    path = f"/dev/shm/kvshelf-test-{uuid.uuid4().hex}"
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, 64 * MIB)
        mm = mmap.mmap(fd, 64 * MIB, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
        os.unlink(path)
    yield mm
    mm.close()


def minor_faults_reading(mm: mmap.mmap) -> int:
    """Minor page faults this thread takes reading one byte of every page of ``mm``."""
    before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    for offset in range(0, len(mm), mmap.PAGESIZE):
        mm[offset]
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before


def test_populate_maps_every_page_so_reads_take_no_faults(shm_mapping: mmap.mmap) -> None:
    address = mapping_address(shm_mapping)
    assert resident_bytes(address=address) == 0
    assert populate(address, len(shm_mapping), chunk_bytes=4 * MIB) == len(shm_mapping)
    assert resident_bytes(address=address) == len(shm_mapping)
    assert minor_faults_reading(shm_mapping) < 16


def test_a_mapping_faults_page_by_page_without_populate(shm_mapping: mmap.mmap) -> None:
    # The control of the test above: the fault counter does see the faults.
    assert minor_faults_reading(shm_mapping) >= len(shm_mapping) // mmap.PAGESIZE


def test_populate_stops_between_chunks(shm_mapping: mmap.mmap) -> None:
    calls = []

    def stop() -> bool:
        calls.append(1)
        return len(calls) > 2

    address = mapping_address(shm_mapping)
    assert populate(address, len(shm_mapping), stop=stop, chunk_bytes=MIB) == 2 * MIB
    assert resident_bytes(address=address) == 2 * MIB


def test_populate_rejects_unaligned_ranges_and_unmapped_memory(shm_mapping: mmap.mmap) -> None:
    address = mapping_address(shm_mapping)
    with pytest.raises(ValueError, match="page size"):
        populate(address + 1, MIB)
    with pytest.raises(ValueError, match="page size"):
        populate(address, MIB, chunk_bytes=1000)
    length = len(shm_mapping)
    shm_mapping.close()
    with pytest.raises(OSError) as failure:
        populate(address, length)
    assert failure.value.errno != 0


def test_the_address_export_does_not_block_close(shm_mapping: mmap.mmap) -> None:
    mapping_address(shm_mapping)
    shm_mapping.close()  # would raise BufferError if the export outlived the call


def test_background_prefault_populates_then_ends(shm_mapping: mmap.mmap) -> None:
    address = mapping_address(shm_mapping)
    prefault = BackgroundPrefault(address, len(shm_mapping), "test mapping", chunk_bytes=MIB)
    assert prefault.wait(timeout_s=30)
    assert prefault.populated_bytes == len(shm_mapping)
    assert resident_bytes(address=address) == len(shm_mapping)
    prefault.stop()  # idempotent after the end


def test_background_prefault_stops_early_and_runs_on_its_cpus(shm_mapping: mmap.mmap) -> None:
    cpu = max(os.sched_getaffinity(0))
    address = mapping_address(shm_mapping)
    # One page per call: thousands of calls, so the thread is still running when asked to stop.
    prefault = BackgroundPrefault(
        address, len(shm_mapping), "test mapping", cpus={cpu}, chunk_bytes=mmap.PAGESIZE
    )
    thread = next(t for t in threading.enumerate() if t.name == "kvshelf-prefault")
    deadline = time.monotonic() + 30
    while resident_bytes(address=address) == 0:  # it pins itself before its first chunk
        assert time.monotonic() < deadline
        time.sleep(0.001)
    with open(f"/proc/self/task/{thread.native_id}/status") as f:
        allowed = next(line for line in f if line.startswith("Cpus_allowed_list:"))
    prefault.stop()
    assert not thread.is_alive()
    assert allowed.split()[1] == str(cpu)
    assert 0 < prefault.populated_bytes < len(shm_mapping)
    assert resident_bytes(address=address) == prefault.populated_bytes
