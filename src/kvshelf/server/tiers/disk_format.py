"""The disk tier's files: where each object lives in the directory, and its self-checking format.

Layout of the directory (created owner-only)::

    DIR/<pool name>/layout.json          the pool's PageLayout (to make the pool at start)
    DIR/<pool name>/<rank>-<hash hex>.kv  one object: header + the page's bytes
    DIR/<pool name>/.tmp-...              an object being written; renamed when complete

An object file is ``header + padding + payload``. The header (:data:`HEADER`, then the pool
name and the block hash) carries the key, the pool, the payload's length and an XXH3-64 checksum
over the header's other fields, the padding and the payload, so a reader can tell a complete,
intact object of the key it wants from anything else: a file of another pool or key, a truncated
file, flipped bytes. Files are written under a temporary name and renamed, so a half-written
object never has an object's name.

The zero padding puts the payload at a multiple of :data:`BLOCK_BYTES` (format version 2), so
that a read can bypass the page cache: the part of a payload that is in the page cache is copied
from there (``RWF_NOWAIT`` reads), and the rest is read with ``O_DIRECT`` straight into the L1
page, which costs the kernel about a fifth of the CPU time of a buffered read on the machine
this was measured on (a cold 256 MiB read: 13-29 ms of system time against 60-270 ms) and does
not fill the page cache with objects L1 now holds anyway. File systems without ``O_DIRECT``
(tmpfs), pages or payloads that are not block-aligned, and version 1 files (the payload right
after the header, written by kvshelf before the padding) are read through the page cache.

The overhead per object is the header and its padding: one 4 KiB block (the header is 36
bytes + the pool name (37) + the hash (32 to 36 for vLLM)), and the tier counts every file in
whole 4 KiB blocks against its budget.

Must not import torch or vLLM; reads and writes happen on the disk tier's I/O threads.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import struct
import threading

import xxhash

from kvshelf.protocol import PageLayout

MAGIC = b"KVSHOBJ1"
FORMAT_VERSION = 2
# Version 1 (no padding: the payload right after the key) is still read.
READABLE_VERSIONS = (1, 2)
# magic, version, pool name length, hash length, (padding), rank, payload length, checksum
HEADER = struct.Struct("<8sHHHHIQQ")
_CHECKSUM_OFFSET = HEADER.size - 8
# Block hashes longer than this have no file name that fits a file system's NAME_MAX; vLLM's
# are 32 to 36 bytes. Such keys are not written to disk (counted as dropped writes).
MAX_HASH_BYTES = 100
OBJECT_SUFFIX = ".kv"
TEMP_PREFIX = ".tmp-"
LAYOUT_FILE = "layout.json"
# Budget accounting unit (a file takes whole blocks of the file system), and the alignment of a
# version 2 payload and of O_DIRECT reads.
BLOCK_BYTES = 4096
# Payloads are read and written, and hashed, this much at a time: the checksum then reads each
# chunk while it is still in the CPU's cache instead of making a second pass over memory
# (measured: 4 reader threads on a warm page cache, 4.2 GB/s whole, 8.4 GB/s chunked).
IO_CHUNK_BYTES = 1 << 20
# O_DIRECT reads have no readahead: larger requests keep the device busy (measured on a virtual
# disk: 4 MiB requests from 8 threads 1.5 GB/s, 1 MiB requests from 4 threads 1.0). Each is
# hashed right after it lands, still in the CPU's last-level cache.
DIRECT_CHUNK_BYTES = 4 << 20


class CorruptObject(Exception):
    """An object file that is not an intact object of the expected key."""


def object_name(rank: int, block_hash: bytes) -> str:
    """The file name of a key's object in its pool's folder."""
    return f"{rank}-{block_hash.hex()}{OBJECT_SUFFIX}"


def parse_object_name(name: str) -> tuple[int, bytes] | None:
    """``(rank, block_hash)`` of an object file name, or None for any other name."""
    if not name.endswith(OBJECT_SUFFIX) or name.startswith("."):
        return None
    rank, sep, digits = name[: -len(OBJECT_SUFFIX)].partition("-")
    try:
        block_hash = bytes.fromhex(digits)
        number = int(rank)
    except ValueError:
        return None
    if not sep or not block_hash or number < 0 or rank != str(number):
        return None
    return number, block_hash


def header_bytes(pool: str, block_hash: bytes) -> int:
    """The header's length (the key included) for a key of ``pool``."""
    return HEADER.size + len(pool.encode()) + len(block_hash)


def payload_offset(pool: str, block_hash: bytes, version: int = FORMAT_VERSION) -> int:
    """Where the payload of a key's object starts in its file."""
    end = header_bytes(pool, block_hash)
    return end if version == 1 else _align_up(end)


def file_sizes(pool: str, block_hash: bytes, payload_bytes: int) -> tuple[int, ...]:
    """The sizes an intact object file of this key can have, one per readable version."""
    return tuple(
        payload_offset(pool, block_hash, version) + payload_bytes for version in READABLE_VERSIONS
    )


def disk_bytes(pool: str, block_hash: bytes, payload_bytes: int) -> int:
    """What one object counts against the budget: its file in whole blocks."""
    return _align_up(payload_offset(pool, block_hash) + payload_bytes)


def write_object(
    path: str, temp_path: str, pool: str, rank: int, block_hash: bytes, payload: memoryview
) -> None:
    """Write one object to ``temp_path``, then rename it to ``path``.

    Raises:
        OSError: anything the file system says (ENOSPC, EIO, EROFS, ENOENT, ...); the
            temporary file is removed.
    """
    pool_bytes = pool.encode()
    fields = (MAGIC, FORMAT_VERSION, len(pool_bytes), len(block_hash), 0, rank, len(payload))
    key = pool_bytes + block_hash
    padding = bytes(payload_offset(pool, block_hash) - HEADER.size - len(key))
    start = HEADER.size + len(key) + len(padding)
    fd = os.open(temp_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        try:
            # The payload first, hashed chunk by chunk as it goes; the header, which holds the
            # checksum, last (the file has its final name only once it is complete).
            hasher = xxhash.xxh3_64(HEADER.pack(*fields, 0)[:_CHECKSUM_OFFSET] + key + padding)
            for offset in range(0, len(payload), IO_CHUNK_BYTES):
                chunk = payload[offset : offset + IO_CHUNK_BYTES]
                hasher.update(chunk)
                _pwrite_all(fd, chunk, start + offset)
            _pwrite_all(fd, HEADER.pack(*fields, hasher.intdigest()) + key + padding, 0)
        finally:
            os.close(fd)
        os.rename(temp_path, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp_path)
        raise


def read_object(path: str, pool: str, rank: int, block_hash: bytes, into: memoryview) -> int:
    """Read a key's object into ``into`` (exactly its payload length) and check it.

    Returns:
        How many payload bytes were read with ``O_DIRECT`` (the rest came from the page cache
        or through it).

    Raises:
        CorruptObject: the file is not an intact object of this pool, key and length.
        OSError: the file cannot be read (FileNotFoundError when it is gone).
    """
    pool_bytes = pool.encode()
    key = pool_bytes + block_hash
    key_end = header_bytes(pool, block_hash)
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        # No readahead for the header: on a cold file it would pull the payload's first blocks
        # through the page cache, which the direct read is there to avoid.
        _advise(fd, "POSIX_FADV_RANDOM")
        # The header, the key and (version 2) the padding: one block at most.
        head = os.pread(fd, _align_up(key_end), 0)
        if len(head) < key_end:
            raise CorruptObject(f"{path}: truncated header")
        magic, version, pool_len, hash_len, _, file_rank, length, checksum = HEADER.unpack_from(
            head
        )
        if (
            magic != MAGIC
            or version not in READABLE_VERSIONS
            or (pool_len, hash_len, file_rank, length)
            != (len(pool_bytes), len(block_hash), rank, len(into))
            or head[HEADER.size : key_end] != key
        ):
            raise CorruptObject(f"{path}: header of another pool, key or length")
        start = payload_offset(pool, block_hash, version)
        if len(head) < start:
            raise CorruptObject(f"{path}: truncated header")
        hasher = xxhash.xxh3_64(head[:_CHECKSUM_OFFSET] + head[HEADER.size : start])
        payload = _Payload(path, fd, start, into, hasher)
        payload.read_cached()
        if version >= 2:
            payload.read_direct()
        if payload.done < length:
            _advise(fd, "POSIX_FADV_SEQUENTIAL")
            payload.read_buffered()
        if os.pread(fd, 1, start + length):
            raise CorruptObject(f"{path}: longer than its header says")
    finally:
        os.close(fd)
    if hasher.intdigest() != checksum:
        raise CorruptObject(f"{path}: checksum mismatch")
    return payload.direct_bytes


class _Payload:
    """The payload of one object file being read into its L1 page, in order, hashed as it comes.

    Each step goes on from where the one before stopped: :meth:`read_cached` takes what the
    page cache holds, :meth:`read_direct` reads block-aligned parts with ``O_DIRECT``, and
    :meth:`read_buffered` whatever is left.
    """

    def __init__(
        self, path: str, fd: int, start: int, into: memoryview, hasher: xxhash.xxh3_64
    ) -> None:
        self.path = path
        self.fd = fd
        self.start = start
        self.into = into
        self.hasher = hasher
        self.done = 0
        self.direct_bytes = 0

    def read_cached(self) -> None:
        """Copy the payload from the page cache for as long as it is there."""
        flags = getattr(os, "RWF_NOWAIT", 0)
        if not flags:
            return
        length = len(self.into)
        while self.done < length:
            try:
                got = os.preadv(self.fd, [self._chunk()], self.start + self.done, flags)
            except BlockingIOError:
                return  # not in the page cache from here on
            except OSError as exc:
                if exc.errno in (errno.EOPNOTSUPP, errno.EINVAL):
                    return  # a file system without non-blocking buffered reads
                raise
            if got == 0:
                raise self._truncated(self.done)
            if self.done + got < length:
                # Stop a partly cached chunk at a block boundary, where O_DIRECT can go on.
                got -= (self.start + self.done + got) % BLOCK_BYTES
                if got == 0:
                    return
            self._took(got)

    def read_direct(self) -> None:
        """Read the whole blocks left with ``O_DIRECT``, when the file system and the
        alignment of the file offset and of the page allow it."""
        whole = (len(self.into) - self.done) // BLOCK_BYTES * BLOCK_BYTES
        if not whole or not hasattr(os, "O_DIRECT"):
            return
        if (self.start + self.done) % BLOCK_BYTES or _address(self.into[self.done :]) % BLOCK_BYTES:
            return
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC | os.O_DIRECT)
        except OSError as exc:
            if exc.errno == errno.EINVAL:
                return  # no O_DIRECT on this file system (tmpfs)
            raise
        try:
            end = self.done + whole
            while self.done < end:
                want = min(DIRECT_CHUNK_BYTES, end - self.done)
                try:
                    got = os.preadv(
                        fd, [self.into[self.done : self.done + want]], self.start + self.done
                    )
                except OSError as exc:
                    if exc.errno == errno.EINVAL and not self.direct_bytes:
                        return  # opened, but the file system refuses direct reads
                    raise
                if got < want:
                    # Direct reads of a regular file only come back short at its end.
                    raise self._truncated(self.done + got)
                self._took(got)
                self.direct_bytes += got
        finally:
            os.close(fd)

    def read_buffered(self) -> None:
        """Read the rest through the page cache."""
        length = len(self.into)
        while self.done < length:
            got = os.preadv(self.fd, [self._chunk()], self.start + self.done)
            if got == 0:
                raise self._truncated(self.done)
            self._took(got)

    def _truncated(self, at: int) -> CorruptObject:
        return CorruptObject(f"{self.path}: truncated after {at} of {len(self.into)} bytes")

    def _chunk(self) -> memoryview:
        return self.into[self.done : self.done + IO_CHUNK_BYTES]

    def _took(self, got: int) -> None:
        # Hashed while the chunk is still in the CPU's cache.
        self.hasher.update(self.into[self.done : self.done + got])
        self.done += got


def write_layout(folder: str, layout: PageLayout) -> None:
    """Create a pool's folder (owner-only) with its layout file, written atomically."""
    os.makedirs(folder, mode=0o700, exist_ok=True)
    document = {
        "model_fingerprint": layout.model_fingerprint,
        "layout_fingerprint": layout.layout_fingerprint,
        "page_bytes": layout.page_bytes,
        "world_size": layout.world_size,
    }
    if layout.replicas != 1:
        # Written only for replicated KV: a sharded pool's file is what it always was.
        document["replicas"] = layout.replicas
    # A name of its own per process and thread: two writers of one folder must not rename
    # each other's file away.
    temp = os.path.join(folder, f"{TEMP_PREFIX}{LAYOUT_FILE}-{os.getpid()}-{threading.get_ident()}")
    with open(temp, "w") as f:
        json.dump(document, f)
    os.rename(temp, os.path.join(folder, LAYOUT_FILE))


def read_layout(folder: str) -> PageLayout | None:
    """A pool folder's layout, or None when it has no valid one."""
    try:
        with open(os.path.join(folder, LAYOUT_FILE)) as f:
            document = json.load(f)
        return PageLayout(
            model_fingerprint=str(document["model_fingerprint"]),
            layout_fingerprint=str(document["layout_fingerprint"]),
            page_bytes=int(document["page_bytes"]),
            world_size=int(document["world_size"]),
            rank=0,
            replicas=int(document.get("replicas", 1)),
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _pwrite_all(fd: int, data: bytes | memoryview, offset: int) -> None:
    view = memoryview(data)
    while view:
        written = os.pwrite(fd, view, offset)
        view = view[written:]
        offset += written


def _align_up(size: int) -> int:
    return -(-size // BLOCK_BYTES) * BLOCK_BYTES


def _advise(fd: int, advice: str) -> None:
    """``posix_fadvise`` the whole file, where the platform has it (a hint: errors ignored)."""
    if hasattr(os, "posix_fadvise"):
        with contextlib.suppress(OSError):
            os.posix_fadvise(fd, 0, 0, getattr(os, advice))


def _address(view: memoryview) -> int:
    """The memory address of a writable buffer (for the alignment O_DIRECT needs)."""
    if not len(view):
        return 0
    return ctypes.addressof(ctypes.c_char.from_buffer(view))
