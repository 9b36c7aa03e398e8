"""Digests of a model's weight files: what makes the model identity follow the weights.

Two modes (``kvshelf.weights_digest``):

- ``sampled`` (default): per file, its name, size, header (a safetensors header whole, else the
  first bytes) and :data:`NUM_SAMPLES` chunks of :data:`SAMPLE_BYTES` spread evenly over it,
  last byte included. It reads about 4 MiB per file whatever its size, once per process (the
  result is kept for the process, by file identity). It can miss a change confined to bytes
  it does not sample in a file whose size and header stay the same (a surgical edit of a few
  weights); a retrained or fine-tuned checkpoint changes nearly every byte and is caught.
- ``full``: a SHA-256 of every byte of every weight file, kept in a cache file by file
  identity (real path, size, mtime, inode), so a restart on unchanged files reads nothing.

No vLLM or torch import: it reads files only.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
import tempfile
import threading
from pathlib import Path

from kvshelf.connector_config import WEIGHTS_DIGEST_FULL, WEIGHTS_DIGEST_SAMPLED

logger = logging.getLogger(__name__)

# Files vLLM may load weights from; hashing a superset is safe (only slower in full mode).
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".npz", ".msgpack")
NUM_SAMPLES = 64
SAMPLE_BYTES = 64 * 1024
# A safetensors header (tensor names, dtypes, shapes, offsets) is hashed whole up to this size;
# other formats contribute their first HEADER_BYTES.
MAX_SAFETENSORS_HEADER = 64 * 1024 * 1024
HEADER_BYTES = 1024 * 1024
_READ_CHUNK = 16 * 1024 * 1024

_FileIdentity = tuple[str, int, int, int, int]
# (mode, file identity) -> digest, for the life of the process (both roles share it when they
# run in one process).
_process_cache: dict[tuple[str, _FileIdentity], str] = {}
_cache_lock = threading.Lock()


def weight_files(model_path: str | os.PathLike[str]) -> list[Path]:
    """The weight files of a model folder (top level, sorted), or the model file itself."""
    path = Path(model_path)
    if path.is_file():
        return [path]
    return sorted(p for p in path.iterdir() if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES))


def weights_digest(model_path: str | os.PathLike[str], mode: str = WEIGHTS_DIGEST_SAMPLED) -> str:
    """Digest the weights of the model at ``model_path``.

    Args:
        model_path: a model folder (or a single weight file, e.g. GGUF).
        mode: ``sampled`` or ``full`` (see the module docstring).

    Returns:
        A hex digest over every weight file's name and digest.

    Raises:
        FileNotFoundError: no weight file there.
    """
    assert mode in (WEIGHTS_DIGEST_SAMPLED, WEIGHTS_DIGEST_FULL), mode
    files = weight_files(model_path)
    if not files:
        raise FileNotFoundError(f"no weight file ({', '.join(WEIGHT_SUFFIXES)}) in {model_path}")
    total = hashlib.sha256(mode.encode())
    for file in files:
        total.update(f"{file.name}\0{file_digest(file, mode)}\n".encode())
    return total.hexdigest()


def file_digest(path: Path, mode: str) -> str:
    """One file's digest, computed once per process (and, in full mode, once per file)."""
    identity = _identity(path)
    key = (mode, identity)
    with _cache_lock:
        cached = _process_cache.get(key)
        if cached is None:
            if mode == WEIGHTS_DIGEST_FULL:
                cached = _full_digest(path, identity)
            else:
                cached = _sampled_digest(path, identity[1])
            _process_cache[key] = cached
    return cached


def _identity(path: Path) -> _FileIdentity:
    real = os.path.realpath(path)
    st = os.stat(real)
    return (real, st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev)


def _sampled_digest(path: Path, size: int) -> str:
    digest = hashlib.sha256(struct.pack("<Q", size))
    with open(path, "rb") as handle:
        digest.update(_header(handle, size))
        span = max(0, size - SAMPLE_BYTES)
        for i in range(NUM_SAMPLES):
            handle.seek(span * i // (NUM_SAMPLES - 1))
            digest.update(handle.read(SAMPLE_BYTES))
    return digest.hexdigest()


def _header(handle, size: int) -> bytes:
    """A safetensors file's whole header, else the file's first bytes."""
    first = handle.read(8)
    if len(first) == 8:
        (length,) = struct.unpack("<Q", first)
        if 0 < length <= min(size - 8, MAX_SAFETENSORS_HEADER):
            body = handle.read(length)
            if body[:1] == b"{":
                return first + body
    handle.seek(0)
    return handle.read(HEADER_BYTES)


def _full_digest(path: Path, identity: _FileIdentity) -> str:
    cache_file = digest_cache_file()
    key = "|".join(map(str, identity[:4]))
    cache = _read_cache(cache_file)
    if key in cache:
        return cache[key]
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_READ_CHUNK):
            digest.update(chunk)
    value = digest.hexdigest()
    # Re-read: another process may have added entries meanwhile.
    cache = _read_cache(cache_file)
    cache[key] = value
    _write_cache(cache_file, cache)
    return value


def digest_cache_file() -> Path:
    """Where full digests are kept: ``$XDG_CACHE_HOME/kvshelf`` or ``~/.cache/kvshelf``."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kvshelf" / "weights-digests.json"


def _read_cache(cache_file: Path) -> dict[str, str]:
    try:
        data = json.loads(cache_file.read_text())
    except (OSError, ValueError):
        return {}
    return {k: v for k, v in data.items() if isinstance(v, str)} if isinstance(data, dict) else {}


def _write_cache(cache_file: Path, cache: dict[str, str]) -> None:
    """Replace the cache file atomically; a cache that cannot be written only costs time."""
    try:
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=cache_file.parent, prefix=".weights-digests.")
        with os.fdopen(fd, "w") as handle:
            json.dump(cache, handle)
        os.replace(tmp, cache_file)
    except OSError as exc:
        logger.warning("kvshelf could not write the weights digest cache %s: %s", cache_file, exc)
