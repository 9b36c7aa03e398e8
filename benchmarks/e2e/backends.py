"""The cache backends of ``make bench-e2e``: per mode, the cache server and connector config.

`cache_backend` starts what a mode needs (nothing, a kvshelf server, or LMCache's server from
the peer venv, `benchmarks.e2e.peers`) and yields the engine's ``kv_transfer_config`` and
interpreter; `engine_env` is the environment every engine and server child runs in.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from benchmarks.e2e.config import REPO, E2EConfig, Mode
from benchmarks.e2e.peers import LMCACHE_ENV, LMCacheServer, lmcache_connector_config
from testbed.server import ServerProcess


def engine_env(config: E2EConfig, folder: Path) -> dict[str, str]:
    """Return the environment of every engine and server child.

    Multi-process mode, the same reserved cores for every row, offline, vLLM's temporary files
    in ``folder``, kvshelf's sources importable from either venv, and no LMCache telemetry.

    Args:
        config: The run's configuration.
        folder: A scratch folder of this run.

    Returns:
        Variables to set on top of the parent's environment.
    """
    return {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "1" if config.multiprocessing else "0",
        "VLLM_CPU_NUM_OF_RESERVED_CPU": str(config.reserved_cpus),
        "VLLM_CPU_KVCACHE_SPACE": str(config.kv_cache_gib),
        "HF_HUB_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "TMPDIR": str(folder),
        "VLLM_CACHE_ROOT": str(folder / "vllm-cache"),
        "TORCHINDUCTOR_CACHE_DIR": str(folder / "inductor-cache"),
        "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO)]),
        **LMCACHE_ENV,
    }


def kvshelf_connector_config(
    mode: Mode, host: str, port: int, *, lazy_threshold: int, lazy_select_count: int
) -> dict[str, Any]:
    """Return the ``kv_transfer_config`` of a kvshelf mode for the server on ``host:port``.

    Args:
        mode: A kvshelf mode (eager, or lazy with its policy).
        host: The kvshelf server's host.
        port: Its port.
        lazy_threshold: ``lmcache.mp.lazy_offload_threshold`` (FIFO only).
        lazy_select_count: ``lmcache.mp.lazy_offload_select_count`` (FIFO only).

    Returns:
        The config, as vLLM's ``--kv-transfer-config`` takes it.
    """
    extra: dict[str, Any] = {"lmcache.mp.host": host, "lmcache.mp.port": port}
    if mode.lazy_policy is not None:
        extra["lmcache.mp.lazy_offload"] = True
        extra["lmcache.mp.lazy_offload_policy"] = mode.lazy_policy
        if mode.lazy_policy == "FIFO":
            extra["lmcache.mp.lazy_offload_threshold"] = lazy_threshold
            extra["lmcache.mp.lazy_offload_select_count"] = lazy_select_count
    return {
        "kv_connector": "LMCacheMPConnector",
        "kv_connector_module_path": "kvshelf.vllm",
        "kv_role": "kv_both",
        "kv_connector_extra_config": extra,
    }


@contextmanager
def cache_backend(
    mode: Mode, config: E2EConfig, cache_gib: float, lmcache_python: Path | None
) -> Iterator[tuple[dict[str, Any] | None, str]]:
    """Start the cache server of ``mode`` and yield the engine's connector config.

    Args:
        mode: The mode.
        config: The run's configuration (lazy offload settings).
        cache_gib: Cache server size in GiB.
        lmcache_python: The peer venv's interpreter (LMCache modes only).

    Yields:
        ``(kv_transfer_config or None, interpreter of the engine)``.
    """
    fifo = {"lazy_threshold": config.lazy_threshold, "lazy_select_count": config.lazy_select_count}
    if mode.system == "none":
        yield None, sys.executable
    elif mode.system == "kvshelf":
        with ServerProcess(l1_size_gb=cache_gib) as server:
            server.wait_zeroed()
            yield kvshelf_connector_config(mode, server.host, server.port, **fifo), sys.executable
    else:
        assert lmcache_python is not None
        with LMCacheServer(lmcache_python, l1_size_gb=cache_gib) as server:
            yield (
                lmcache_connector_config(server.port, lazy_policy=mode.lazy_policy, **fifo),
                str(lmcache_python),
            )
