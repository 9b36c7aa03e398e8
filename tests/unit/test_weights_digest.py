"""The weights digest (kvshelf.roles.weights): follows the bytes, not the path; full digests are
cached by file identity."""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import pytest

from kvshelf.connector_config import WEIGHTS_DIGEST_FULL, WEIGHTS_DIGEST_SAMPLED
from kvshelf.roles import weights
from kvshelf.roles.weights import NUM_SAMPLES, SAMPLE_BYTES, weights_digest
from testbed.disk import flip_byte

SIZE = 8 * 1024 * 1024


def write_model(folder: Path, seed: int, size: int = SIZE) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    header = json.dumps({"w": {"dtype": "F32", "shape": [size // 4], "data_offsets": [0, size]}})
    body = bytes((seed * 7 + i * 13) % 251 for i in range(256)) * (size // 256)
    (folder / "model.safetensors").write_bytes(
        struct.pack("<Q", len(header)) + header.encode() + body
    )
    (folder / "config.json").write_text("{}")
    return folder


@pytest.fixture(autouse=True)
def fresh(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(weights, "_process_cache", {})
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))


@pytest.mark.parametrize("mode", [WEIGHTS_DIGEST_SAMPLED, WEIGHTS_DIGEST_FULL])
def test_same_weights_elsewhere_same_digest_other_weights_differ(tmp_path: Path, mode: str) -> None:
    a = write_model(tmp_path / "a", seed=1)
    copy = tmp_path / "copy"
    shutil.copytree(a, copy)
    other = write_model(tmp_path / "other", seed=2)
    assert weights_digest(a, mode) == weights_digest(copy, mode)
    assert weights_digest(a, mode) != weights_digest(other, mode)
    # Non-weight files do not count.
    (copy / "config.json").write_text('{"x": 1}')
    weights.__dict__["_process_cache"].clear()
    assert weights_digest(a, mode) == weights_digest(copy, mode)


def test_sampled_sees_header_size_and_sampled_bytes_full_sees_every_byte(tmp_path: Path) -> None:
    model = write_model(tmp_path / "m", seed=1)
    file = model / "model.safetensors"
    base = {m: weights_digest(model, m) for m in (WEIGHTS_DIGEST_SAMPLED, WEIGHTS_DIGEST_FULL)}
    size = file.stat().st_size
    span = size - SAMPLE_BYTES
    # A byte inside a sample, the header, the last byte: the sampled digest changes.
    for offset in (12, span * 5 // (NUM_SAMPLES - 1) + 100, size - 1):
        flip_byte(file, offset)
        weights._process_cache.clear()
        assert weights_digest(model, WEIGHTS_DIGEST_SAMPLED) != base[WEIGHTS_DIGEST_SAMPLED]
        flip_byte(file, offset)
    # A byte between samples: only the full digest sees it (what the default can miss).
    between = span * 5 // (NUM_SAMPLES - 1) + SAMPLE_BYTES + 1000
    assert between < span * 6 // (NUM_SAMPLES - 1)
    flip_byte(file, between)
    weights._process_cache.clear()
    assert weights_digest(model, WEIGHTS_DIGEST_SAMPLED) == base[WEIGHTS_DIGEST_SAMPLED]
    assert weights_digest(model, WEIGHTS_DIGEST_FULL) != base[WEIGHTS_DIGEST_FULL]


def test_full_digest_is_cached_by_file_identity(tmp_path: Path) -> None:
    model = write_model(tmp_path / "m", seed=1)
    file = model / "model.safetensors"
    first = weights_digest(model, WEIGHTS_DIGEST_FULL)
    cache = json.loads(weights.digest_cache_file().read_text())
    assert len(cache) == 1
    # A restart (empty process cache) on the same file (same path, size, mtime, inode) reads
    # nothing: change a byte behind the cache's back and restore the mtime.
    stat = file.stat()
    flip_byte(file, SIZE // 2 + 3)
    os.utime(file, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    weights._process_cache.clear()
    assert weights_digest(model, WEIGHTS_DIGEST_FULL) == first
    # A file replaced the usual way (new mtime) is hashed again.
    os.utime(file, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    weights._process_cache.clear()
    assert weights_digest(model, WEIGHTS_DIGEST_FULL) != first


def test_no_weight_file_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no weight file"):
        weights_digest(tmp_path / "empty")
