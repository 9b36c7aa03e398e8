"""A fake Redis that answers slowly: the one fault a real ``redis-server`` cannot produce.

A real Redis paused (``CLIENT PAUSE``) sends nothing, which a socket timeout catches. A peer
that sends a byte now and then passes every socket timeout while a reply takes for ever (a
congested or failing link, a proxy in between). :class:`DribblingRedis` is that peer: a
loopback TCP server speaking enough RESP2 for the kvshelf Redis tier (``PING``, ``INFO``,
``CLIENT``, ``SELECT``, ``GET``, ``SET``, ``EXISTS``, ``UNLINK``, and ``SCAN`` in one step), in
memory, whose replies to the commands named by :meth:`DribblingRedis.pace` go out one byte per
``byte_interval_s``, or whole after ``delay_s``. Imports neither torch nor vLLM.
"""

from __future__ import annotations

import contextlib
import fnmatch
import socket
import threading
from collections.abc import Iterable
from typing import BinaryIO

HOST = "127.0.0.1"


class DribblingRedis:
    """A RESP2 server on a free loopback port that answers at the pace it is told.

    Replies go out at once until :meth:`pace` slows those of some commands down; every
    connection reads and answers its commands in order, so a slow reply holds back the ones
    after it on that connection, as in Redis.
    """

    def __init__(self) -> None:
        self._listener = socket.create_server((HOST, 0))
        self.port = self._listener.getsockname()[1]
        self.values: dict[bytes, bytes] = {}
        self._lock = threading.Lock()
        self._slow: frozenset[str] = frozenset()
        self._byte_interval_s = 0.0
        self._delay_s = 0.0
        self._stop = threading.Event()
        self._connections: list[socket.socket] = []
        self.commands: list[str] = []
        self._acceptor = threading.Thread(target=self._accept, name="dribbling-redis", daemon=True)
        self._acceptor.start()

    @property
    def url(self) -> str:
        return f"redis://{HOST}:{self.port}"

    def pace(
        self, commands: Iterable[str], *, byte_interval_s: float = 0.0, delay_s: float = 0.0
    ) -> None:
        """From now on, reply to ``commands`` (names, upper case) after ``delay_s``, then one
        byte per ``byte_interval_s``; an empty ``commands`` makes every reply prompt again."""
        with self._lock:
            self._slow = frozenset(commands)
            self._byte_interval_s = byte_interval_s
            self._delay_s = delay_s

    def close(self) -> None:
        """Stop accepting, close every connection (a reply being dribbled stops)."""
        self._stop.set()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accept()
        self._listener.close()
        with self._lock:
            connections, self._connections = self._connections, []
        for connection in connections:
            with contextlib.suppress(OSError):
                connection.shutdown(socket.SHUT_RDWR)
            connection.close()
        self._acceptor.join(5)

    def __enter__(self) -> DribblingRedis:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                connection, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                self._connections.append(connection)
            threading.Thread(
                target=self._serve, args=(connection,), name="dribbling-redis-conn", daemon=True
            ).start()

    def _serve(self, connection: socket.socket) -> None:
        reader = connection.makefile("rb")
        try:
            while not self._stop.is_set():
                command = _read_command(reader)
                if command is None:
                    return
                name = command[0].decode().upper()
                with self._lock:
                    self.commands.append(name)
                    slow = name in self._slow
                    interval, delay = self._byte_interval_s, self._delay_s
                reply = self._reply(name, command[1:])
                if not slow:
                    connection.sendall(reply)
                    continue
                if self._stop.wait(delay):
                    return
                if interval <= 0:
                    connection.sendall(reply)
                    continue
                for i in range(len(reply)):
                    connection.sendall(reply[i : i + 1])
                    if self._stop.wait(interval):
                        return
        except OSError:
            return
        finally:
            reader.close()
            connection.close()

    def _reply(self, name: str, args: list[bytes]) -> bytes:
        if name == "PING":
            return b"+PONG\r\n"
        if name == "INFO":
            return _bulk(b"# Cluster\r\ncluster_enabled:0\r\n")
        if name in ("CLIENT", "SELECT"):
            return b"+OK\r\n"
        if name == "SET":
            with self._lock:
                self.values[args[0]] = args[1]
            return b"+OK\r\n"
        if name == "GET":
            with self._lock:
                value = self.values.get(args[0])
            return b"$-1\r\n" if value is None else _bulk(value)
        if name == "EXISTS":
            with self._lock:
                count = sum(key in self.values for key in args)
            return b":%d\r\n" % count
        if name == "UNLINK":
            with self._lock:
                count = sum(self.values.pop(key, None) is not None for key in args)
            return b":%d\r\n" % count
        if name == "SCAN":
            # Every matching key in one step: the cursor it returns is 0.
            pattern = args[args.index(b"MATCH") + 1] if b"MATCH" in args else b"*"
            with self._lock:
                keys = [key for key in self.values if fnmatch.fnmatchcase(key, pattern)]
            return b"*2\r\n$1\r\n0\r\n*%d\r\n%s" % (len(keys), b"".join(map(_bulk, keys)))
        return b"-ERR unknown command '%s'\r\n" % name.encode()


def _bulk(value: bytes) -> bytes:
    return b"$%d\r\n%s\r\n" % (len(value), value)


def _read_command(reader: BinaryIO) -> list[bytes] | None:
    """One RESP array of bulk strings (what clients send); None at the end of the stream."""
    line = reader.readline()
    if not line:
        return None
    assert line[:1] == b"*", f"not a RESP command: {line[:40]!r}"
    args = []
    for _ in range(int(line[1:])):
        size = int(reader.readline()[1:])
        args.append(reader.read(size + 2)[:size])
    return args
