"""Offload modes: the eager mode, and which way the scheduler role and lazy offload depend."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvshelf.plan import StoreJob
from kvshelf.roles.offload import EagerOffload, OffloadMode


def job(request_id: str, first_block: int = 0) -> StoreJob:
    return StoreJob(request_id, (first_block,), (request_id.encode(),), first_block)


def test_eager_submits_each_steps_jobs_in_that_step_in_order() -> None:
    mode = EagerOffload()
    assert not mode.capture_on_finish
    jobs = [job("a"), job("b"), job("a", 1)]
    for item in jobs:
        mode.add(item)
    assert mode.drain(64) == jobs
    assert mode.drain(64) == []


def test_eager_keeps_blocks_only_while_stores_are_in_flight() -> None:
    mode = EagerOffload()
    assert mode.finish("a", stores_in_flight=True) is True
    assert mode.finish("b", stores_in_flight=False) is False
    assert mode.store_completed("a") == 0
    assert not mode.has_pending_work()
    assert mode.snapshot() == {}


def test_the_lazy_offloader_is_an_offload_mode() -> None:
    from kvshelf.lazy.offloader import LazyOffloader

    assert issubclass(LazyOffloader, OffloadMode)


@pytest.mark.parametrize("module", ["kvshelf.roles.scheduler", "kvshelf.connector_config"])
def test_module_does_not_import_lazy_offload(module: str) -> None:
    # The exit status is 1 when any module of kvshelf.lazy got imported along.
    code = (
        f"import importlib, sys; importlib.import_module({module!r}); "
        "sys.exit(any(name.split('.')[:2] == ['kvshelf', 'lazy'] for name in sys.modules))"
    )
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0
