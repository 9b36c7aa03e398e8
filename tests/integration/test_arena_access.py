"""The arena is owner-only shared memory: a worker of another user, or in another IPC
namespace, cannot open it. It gets one clear ERROR naming the requirement and vLLM keeps
serving without the cache."""

from __future__ import annotations

import errno
import logging
import os
import uuid

import pytest
import torch

from kvshelf.platform.shm import ArenaAccessError, arena_access_error, shm_path
from kvshelf.roles.worker import WorkerConnector
from kvshelf.testbed.server import ServerProcess
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


def test_a_worker_that_cannot_open_the_arena_logs_one_error_and_serves_without_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    kv_caches = {f"layer{i}": torch.randn(NUM_BLOCKS, 2, 16, 128) for i in range(2)}
    with ServerProcess() as server:
        # As a worker in another IPC namespace sees it: the arena is not there.
        os.unlink(server.shm_path)
        worker = WorkerConnector(
            client_factory=lambda: server.client(timeout_s=5.0),
            model_fingerprint="m",
            layout_fingerprint="l",
            rank=0,
            world_size=1,
            retry_interval_s=0.1,
        )
        with caplog.at_level(logging.ERROR, logger="kvshelf"):
            worker.register_kv_caches(kv_caches, NUM_BLOCKS)
            worker.start_loads([])  # the step loop keeps going
            worker.finish_loads()
        worker.shutdown()
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1, [r.getMessage() for r in errors]
    message = errors[0].getMessage()
    assert "same IPC namespace" in message and "serving without the cache" in message
