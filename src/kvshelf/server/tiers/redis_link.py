"""The Redis tier's connection: URL and password, single node or Cluster, and a circuit breaker.

:class:`RedisLink` holds the client (the maintained ``redis`` package; a Redis Cluster is
detected from the node given, ``INFO cluster``, and used through ``RedisCluster``, which
follows slot moves and fail-overs) and the breaker: the first failure of any operation opens
it (the tier then answers from nothing: no probes, no loads, writes dropped), and a monitor
thread pings every ``retry_interval_s`` until Redis answers again, then closes it. The outage
is logged when it starts (with the reason, e.g. a wrong password), at most once per
``log_interval_s`` while it lasts, and when it ends.

The password comes from the URL or, when the URL has none, from ``KVSHELF_REDIS_PASSWORD``;
it never appears in a log line (:func:`redacted`).

"Slow" is a failure too: the tier gives each operation a deadline (:attr:`RedisLink.timeout_s`
and more for the bytes it moves), and a ping answered after ``timeout_s`` keeps the breaker
open. :meth:`RedisLink.close` returns within ``timeout_s`` + 1 s: it closes the client's
connections first, which ends a ping in progress. Must not import torch or vLLM.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from typing import Any
from urllib.parse import urlsplit

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

logger = logging.getLogger("kvshelf.server.redis")

PASSWORD_ENV = "KVSHELF_REDIS_PASSWORD"
SCHEMES = ("redis", "rediss")
SOCKET_READ_BYTES = 1 << 20
# Network errors, timeouts, a cluster without a slot's master, a wrong password: all open the
# breaker. OSError covers sockets closed under the client.
FAULTS = (redis.RedisError, OSError)


def check_url(url: str) -> str | None:
    """Why ``url`` is not a Redis URL kvshelf accepts, or None when it is."""
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 (parsing the port is the check)
    except ValueError as exc:
        return str(exc)
    if parts.scheme not in SCHEMES:
        return f"the scheme must be redis:// or rediss://, not {parts.scheme or 'none'}://"
    if not parts.hostname:
        return "no host"
    path = parts.path.strip("/")
    if path and not path.isdigit():
        return f"the database must be a number, not {path!r}"
    return None


def redacted(url: str) -> str:
    """``url`` without its user and password, for logs."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    port = f":{parts.port}" if parts.port else ""
    return f"{parts.scheme}://{host}{port}{parts.path}"


class RedisLink:
    """A Redis (or Redis Cluster) client behind a circuit breaker.

    Args:
        url: ``redis://[user:password@]host:port[/db]`` or ``rediss://`` (TLS).
        timeout_s: the socket timeout of every receive (and of connecting), the deadline of a
            ping, and the least deadline of any operation.
        retry_interval_s: how often the monitor pings while the breaker is open.
        log_interval_s: the shortest time between two log lines about one outage.
    """

    def __init__(
        self,
        url: str,
        *,
        timeout_s: float = 1.0,
        retry_interval_s: float = 1.0,
        log_interval_s: float = 60.0,
    ) -> None:
        self.url = url
        self.cluster = False
        self._timeout_s = timeout_s
        self._retry_interval_s = retry_interval_s
        self._log_interval_s = log_interval_s
        self._client: Any = None
        self._available = False
        self._lock = threading.Lock()
        self._next_log_at = 0.0
        self._quiet = 0
        self._stop = threading.Event()
        self._connect()
        self._monitor = threading.Thread(target=self._watch, name="kvshelf-redis-link", daemon=True)
        self._monitor.start()

    @property
    def timeout_s(self) -> float:
        """The deadline of a ping; the tier's operations get this and more for their bytes."""
        return self._timeout_s

    @property
    def available(self) -> bool:
        """Whether the breaker is closed (Redis answered since the last failure)."""
        return self._available

    def client(self) -> Any:
        """The client while the breaker is closed, else None."""
        return self._client if self._available else None

    def failed(self, what: str, exc: BaseException) -> None:
        """Open the breaker after ``what`` failed with ``exc``; from any thread."""
        with self._lock:
            was = self._available
            self._available = False
            now = time.monotonic()
            if was or now >= self._next_log_at:
                quiet, self._quiet = self._quiet, 0
                self._next_log_at = now + self._log_interval_s
            else:
                self._quiet += 1
                return
        logger.warning(
            "Redis tier %s unavailable: %s failed: %s: %s%s; serving from the local tiers only "
            "until it answers again (checked every %.1f s)%s",
            redacted(self.url),
            what,
            type(exc).__name__,
            exc,
            _hint(exc),
            self._retry_interval_s,
            f"; {quiet} more failures since the last report" if quiet else "",
        )

    def close(self) -> None:
        """Stop the monitor and close the client's connections, within ``timeout_s`` + 1 s.

        The connections are closed first: a ping in progress (a Redis answering slowly) then
        fails at once instead of holding the monitor; a monitor that does not stop in time
        (a connection being set up) is a daemon and is left behind.
        """
        self._stop.set()
        self._close_client()
        self._monitor.join(self._timeout_s + 1.0)
        if self._monitor.is_alive():
            logger.warning("the Redis tier's monitor did not stop in time; left behind")
        self._close_client()

    def _close_client(self) -> None:
        client = self._client
        if client is not None:
            with contextlib.suppress(FAULTS):
                client.close()

    def _connect(self) -> None:
        """Make the client if there is none yet and ping; close the breaker when it answers."""
        try:
            if self._client is None:
                self._client = self._make_client()
            started = time.monotonic()
            self._client.ping()
            took = time.monotonic() - started
            if took > self._timeout_s:
                # A Redis that answers a byte at a time passes every socket timeout.
                raise TimeoutError(f"PING took {took:.1f} s, over the {self._timeout_s} s allowed")
        except FAULTS as exc:
            self.failed("connecting" if self._client is None else "PING", exc)
            return
        with self._lock:
            was = self._available
            self._available = True
        if not was:
            logger.info(
                "Redis tier %s available (%s)",
                redacted(self.url),
                "Redis Cluster" if self.cluster else "single node",
            )

    def _make_client(self) -> Any:
        password = os.environ.get(PASSWORD_ENV) if urlsplit(self.url).password is None else None
        options: dict[str, Any] = {
            "socket_timeout": self._timeout_s,
            "socket_connect_timeout": self._timeout_s,
            "retry": Retry(NoBackoff(), 0),
            # Values are pages of MiBs: 1 MiB socket reads instead of 64 KiB cut the reads' CPU
            # (16 MiB values: 0.45-0.48 CPU s per GB against 0.53-0.73).
            "socket_read_size": SOCKET_READ_BYTES,
            # RESP2: every Redis and Valkey speaks it (RESP3's HELLO needs Redis 6).
            "protocol": 2,
        }
        if password:
            options["password"] = password
        node = redis.Redis.from_url(self.url, **options)
        try:
            enabled = node.info("cluster").get("cluster_enabled", 0)
        except FAULTS:
            node.close()
            raise
        if not enabled:
            return node
        node.close()
        self.cluster = True
        # A cluster has database 0 only; the client learns the other masters from this one.
        return redis.RedisCluster.from_url(self.url, **options)

    def _watch(self) -> None:
        while not self._stop.wait(self._retry_interval_s):
            if not self._available:
                self._connect()


def _hint(exc: BaseException) -> str:
    if isinstance(exc, redis.AuthenticationError) or "NOAUTH" in str(exc):
        return (
            f" (authentication: give the password in the URL or in {PASSWORD_ENV}, and the "
            "user if not 'default')"
        )
    return ""
