"""A kvshelf server as a child process of this one, on a free loopback port.

`ServerProcess` runs ``python -m kvshelf.server`` with the flags it is given, waits until the
server answers a ping, and stops it (SIGTERM, then SIGKILL, removing an arena a killed server
left behind). ``kvshelf bench transfer`` measures through one; the test bed and the research
benchmarks outside the package start theirs with it too. Imports neither torch nor vLLM.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence

from kvshelf.client import KVShelfClient, ServerUnavailable
from kvshelf.curve import ClientCurve
from kvshelf.platform.shm import ARENA_PREFIX, SHM_DIR, arena_name, shm_path


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class ServerProcess:
    """A ``python -m kvshelf.server`` subprocess on a free loopback port.

    Use as a context manager: entering starts it and waits until it answers a ping, leaving
    stops it (SIGTERM, then SIGKILL) and removes an arena a killed server left behind.

    Args:
        l1_size_gb: arena size in GiB.
        lease_timeout_s: reservation and lock lease.
        eviction_watermark: see ``kvshelf server --help``.
        port: the port; a free one when None.
        extra_args: more command-line flags.
        startup_timeout_s: how long to wait for the first ping answer.
        curve_keys: a ``kvshelf keygen`` folder: the server runs with ``--curve-keys`` and
            :meth:`client` (and the start-up ping) use its client keys.
        env: the environment of the process; None: this one's.
    """

    host = "127.0.0.1"

    def __init__(
        self,
        *,
        l1_size_gb: float = 0.0625,
        lease_timeout_s: float = 30.0,
        eviction_watermark: float = 0.95,
        port: int | None = None,
        extra_args: Sequence[str] = (),
        startup_timeout_s: float = 30.0,
        curve_keys: str | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.env = env
        self.port = port if port is not None else free_port(self.host)
        self._args = [
            "--host",
            self.host,
            "--port",
            str(self.port),
            "--l1-size-gb",
            repr(l1_size_gb),
            "--eviction-watermark",
            repr(eviction_watermark),
            "--lease-timeout-s",
            repr(lease_timeout_s),
            *extra_args,
        ]
        self.curve: ClientCurve | None = None
        if curve_keys is not None:
            self._args += ["--curve-keys", curve_keys]
            self.curve = ClientCurve.load(curve_keys)
        self._startup_timeout_s = startup_timeout_s
        self._proc: subprocess.Popen[bytes] | None = None
        self._log = tempfile.NamedTemporaryFile(prefix="kvshelf-server-", suffix=".log")  # noqa: SIM115
        self._final_log = ""
        self.boot_id: str | None = None

    @property
    def pid(self) -> int:
        """The server's process id."""
        assert self._proc is not None, "server not started"
        return self._proc.pid

    @property
    def shm_path(self) -> str:
        """Path of the current run's arena object."""
        assert self.boot_id is not None, "server not started"
        return shm_path(arena_name(self.port, self.boot_id))

    @property
    def returncode(self) -> int | None:
        """The exit status once the process has ended, else None."""
        assert self._proc is not None, "server not started"
        return self._proc.poll()

    def log(self) -> str:
        """Everything the server wrote to stdout and stderr so far (kept after exit)."""
        if self._log.closed:
            return self._final_log
        with open(self._log.name, errors="replace") as f:
            return f.read()

    def start(self) -> None:
        """Start the process and wait until it answers a ping."""
        assert self._proc is None or self._proc.poll() is not None, "already running"
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "kvshelf.server", *self._args],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=self.env,
        )
        deadline = time.monotonic() + self._startup_timeout_s
        with self.client(timeout_s=0.5, retry_interval_s=0) as client:
            while True:
                if self._proc.poll() is not None:
                    raise RuntimeError(f"kvshelf server exited at startup:\n{self.log()}")
                try:
                    self.boot_id = client.ping()
                    return
                except ServerUnavailable:
                    if time.monotonic() > deadline:
                        self.kill()
                        raise RuntimeError(
                            f"kvshelf server did not answer:\n{self.log()}"
                        ) from None

    def terminate(self, timeout_s: float = 10.0) -> int:
        """Send SIGTERM and wait for the exit.

        Returns:
            The exit status.
        """
        return self._signal_and_wait(signal.SIGTERM, timeout_s)

    def interrupt(self, timeout_s: float = 10.0) -> int:
        """Send SIGINT (Ctrl-C) and wait for the exit.

        Returns:
            The exit status.
        """
        return self._signal_and_wait(signal.SIGINT, timeout_s)

    def send_signal(self, signum: int, timeout_s: float = 10.0) -> int:
        """Send ``signum`` and wait for the exit.

        Returns:
            The exit status.
        """
        return self._signal_and_wait(signum, timeout_s)

    def kill(self) -> None:
        """SIGKILL the server, then remove the arena it could not unlink itself.

        The arena is found by the port in its name, since a server killed during its startup
        has not told its boot id yet.
        """
        self._signal_and_wait(signal.SIGKILL, 10.0)
        for name in os.listdir(SHM_DIR):
            if name.startswith(f"{ARENA_PREFIX}{self.port}-"):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(shm_path(name))

    def restart(self) -> None:
        """Stop the server (SIGTERM) and start a fresh one on the same port: new boot id."""
        self.stop()
        self.start()

    def stop(self) -> None:
        """SIGTERM, escalating to :meth:`kill` if the server does not exit in time."""
        if self._proc is None or self._proc.poll() is not None:
            return
        try:
            self.terminate()
        except subprocess.TimeoutExpired:
            self.kill()

    def client(self, **kwargs: float | bool) -> KVShelfClient:
        """A new client of this server (with its CURVE keys, if any); the caller closes it."""
        return KVShelfClient(self.host, self.port, curve=self.curve, **kwargs)

    def wait_zeroed(self, timeout_s: float = 300.0) -> None:
        """Wait until the server has finished zeroing its arena (``--prefault``, the default).

        A deployed server does this once, long before traffic; a benchmark that starts an
        engine next to a server still zeroing gigabytes measures that instead.

        Raises:
            TimeoutError: still zeroing after ``timeout_s``.
        """
        deadline = time.monotonic() + timeout_s
        with self.client() as client:
            while client.stats()["arena_zeroing"]:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"arena still zeroing after {timeout_s} s")
                time.sleep(0.1)

    def __enter__(self) -> ServerProcess:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
        self._final_log = self.log()
        self._log.close()

    def _signal_and_wait(self, signum: int, timeout_s: float) -> int:
        assert self._proc is not None, "server not started"
        if self._proc.poll() is None:
            self._proc.send_signal(signum)
        return self._proc.wait(timeout_s)
