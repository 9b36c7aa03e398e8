"""Shared pytest fixtures. Keep each fixture small; add new ones below."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from testbed.server import ServerProcess


@pytest.fixture
def kvshelf_server() -> Iterator[ServerProcess]:
    """A real kvshelf server process (64 MiB arena, 2 s leases) on a free loopback port."""
    with ServerProcess(l1_size_gb=1 / 16, lease_timeout_s=2.0) as server:
        yield server
