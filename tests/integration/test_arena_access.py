"""The arena is owner-only shared memory: a process of another user, or in another IPC
namespace, cannot open it, and the error says which requirement it broke (the worker's side:
test_worker_threads.py)."""

from __future__ import annotations

import errno
import os
import uuid

import pytest

from kvshelf.platform.shm import ArenaAccessError, arena_access_error, shm_path
from kvshelf.transfer import map_arena

NUM_BLOCKS = 16
NOBODY = 65534


def test_a_missing_arena_names_the_ipc_namespace_requirement() -> None:
    name = f"kvshelf-test-missing-{uuid.uuid4().hex}"
    with pytest.raises(ArenaAccessError) as error:
        map_arena(name, 4096)
    message = error.value.strerror
    assert shm_path(name) in message and "same IPC namespace" in message


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give the arena another owner")
def test_another_users_arena_names_both_users_and_the_same_user_requirement() -> None:
    # Root opens anything, so the refusal itself is simulated; the explanation is real.
    name = f"kvshelf-test-owner-only-{uuid.uuid4().hex}"
    path = shm_path(name)
    os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600))
    try:
        os.chown(path, NOBODY, -1)
        error = arena_access_error(path, PermissionError(errno.EACCES, "Permission denied"))
    finally:
        os.unlink(path)
    assert isinstance(error, ArenaAccessError) and error.errno == errno.EACCES
    message = error.strerror
    assert f"belongs to nobody (uid {NOBODY})" in message and "root (uid 0)" in message
    assert "must run as the same user" in message
