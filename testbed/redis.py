"""Real Redis servers for tests and benchmarks: one node, or a Redis Cluster of masters.

:class:`RedisServer` runs ``redis-server`` on a free loopback port without persistence
(``--save '' --appendonly no``: a restart comes back empty) and stops it by its PID;
:func:`redis_cluster` makes a cluster of such nodes with ``redis-cli --cluster create``.
``redis-server`` comes from the distribution (``make install`` installs it as root);
:func:`have_redis` tells tests whether it is there. Imports neither torch nor vLLM.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence

from testbed.server import free_port

HOST = "127.0.0.1"


def have_redis() -> bool:
    """Whether ``redis-server`` and ``redis-cli`` are on the PATH."""
    return shutil.which("redis-server") is not None and shutil.which("redis-cli") is not None


class RedisServer:
    """One ``redis-server`` process on a loopback port.

    Args:
        password: ``requirepass``; None: no password.
        cluster: start it as a cluster node (``--cluster-enabled yes``).
        extra_args: more ``redis-server`` arguments.
    """

    def __init__(
        self, *, password: str | None = None, cluster: bool = False, extra_args: Sequence[str] = ()
    ) -> None:
        self.port = _cluster_port() if cluster else free_port(HOST)
        self.password = password
        self._dir = tempfile.TemporaryDirectory(prefix="kvshelf-redis-")
        self._args = [
            "--port",
            str(self.port),
            "--bind",
            HOST,
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            self._dir.name,
            *(["--requirepass", password] if password else []),
            *(
                ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf"]
                if cluster
                else []
            ),
            *extra_args,
        ]
        self._proc: subprocess.Popen[bytes] | None = None
        self.log_path = os.path.join(self._dir.name, "redis.log")

    @property
    def url(self) -> str:
        """``redis://host:port`` (no password in it)."""
        return f"redis://{HOST}:{self.port}"

    @property
    def pid(self) -> int:
        assert self._proc is not None
        return self._proc.pid

    def start(self, timeout_s: float = 10.0) -> None:
        """Start (again, on the same port, empty) and wait until it answers PING."""
        assert self._proc is None or self._proc.poll() is not None, "already running"
        with open(self.log_path, "ab") as log:
            self._proc = subprocess.Popen(
                ["redis-server", *self._args], stdout=log, stderr=subprocess.STDOUT
            )
        deadline = time.monotonic() + timeout_s
        while self.cli("PING").strip() not in ("PONG", "NOAUTH"):
            if self._proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"redis-server did not start on port {self.port}")
            time.sleep(0.05)

    def cli(self, *args: str) -> str:
        """``redis-cli`` against this server; its output (errors included)."""
        auth = ["-a", self.password, "--no-auth-warning"] if self.password else []
        done = subprocess.run(
            ["redis-cli", "-h", HOST, "-p", str(self.port), *auth, *args],
            capture_output=True,
            text=True,
            timeout=30,
        )
        return done.stdout + done.stderr

    def kill(self) -> None:
        """SIGKILL the server (a crash) and wait for it."""
        self._signal(signal.SIGKILL)

    def stop(self) -> None:
        """SIGTERM the server and wait; SIGKILL if it does not exit in time."""
        self._signal(signal.SIGTERM)

    def close(self) -> None:
        """Stop the server and remove its directory."""
        self.stop()
        self._dir.cleanup()

    def __enter__(self) -> RedisServer:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _signal(self, signum: int) -> None:
        proc = self._proc
        if proc is None or proc.poll() is not None:
            return
        os.kill(proc.pid, signum)
        try:
            proc.wait(10.0)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()


def _cluster_port() -> int:
    """A free port whose cluster bus port (port + 10000) is a free port too."""
    while True:
        port = free_port(HOST)
        if port + 10000 > 65535:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((HOST, port + 10000))
            except OSError:
                continue
        return port


@contextlib.contextmanager
def redis_cluster(masters: int = 3, timeout_s: float = 30.0) -> Iterator[list[RedisServer]]:
    """A Redis Cluster of ``masters`` masters and no replicas on loopback ports."""
    nodes = [RedisServer(cluster=True) for _ in range(masters)]
    try:
        for node in nodes:
            node.start()
        subprocess.run(
            [
                "redis-cli",
                "--cluster",
                "create",
                *(f"{HOST}:{node.port}" for node in nodes),
                "--cluster-replicas",
                "0",
                "--cluster-yes",
            ],
            check=True,
            capture_output=True,
            timeout=timeout_s,
        )
        deadline = time.monotonic() + timeout_s
        while not all("cluster_state:ok" in node.cli("CLUSTER", "INFO") for node in nodes):
            if time.monotonic() > deadline:
                raise RuntimeError("the Redis Cluster did not become ready")
            time.sleep(0.1)
        yield nodes
    finally:
        for node in nodes:
            node.close()
