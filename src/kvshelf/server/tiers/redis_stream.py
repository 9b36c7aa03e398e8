"""Streamed GETs and SETs of pages on the ``redis`` client's own connections.

:func:`get_each` sends a load's GETs at once (one batch per Redis node) and reads the replies
in order with a :class:`~kvshelf.server.tiers.redis_resp.ReplyReader`: each value's reply
header is read here, then the caller receives the value itself, straight into its page. No
value becomes a ``bytes`` of its own, and none is copied but by the socket.
:func:`set_each` sends a store's SETs the same way, each value given in pieces (header, page,
tag) and sent with a scatter-gather call, then reads the ``+OK`` replies.
:func:`exists_each` asks ``EXISTS`` of a probe's keys the same way, and :func:`unlink_each`
deletes keys (``UNLINK``); :func:`scan_step` is one ``SCAN`` step on one node (a shared clear).

Each call has a ``deadline`` for all of its batches: every send and receive gets the time left
(:func:`~kvshelf.server.tiers.redis_resp.arm`), so a Redis that answers slowly, a byte at a
time or not at all fails the call with :class:`TimeoutError` by then, never later.

Connections come from the client's pools (set-up, AUTH and TLS are the client's, each of its
receives bounded by the client's socket timeout only). A batch whose replies were not all
read, for any reason, has its connection closed, never returned to the pool out of step. In a
Redis Cluster the keys are grouped by the master that holds their slot; a key whose slot moved
(``MOVED``/``ASK`` reply) goes through the cluster client's own ``GET``/``SET``/``EXISTS``
afterwards (if time is left), which follows the redirect and updates its slot map (rare: that
value is a ``bytes`` copy). Must not import torch or vLLM.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from kvshelf.server.tiers.redis_resp import (
    FramingError,
    Redirect,
    ReplyReader,
    send_all,
    set_command,
    time_left,
)

# A key SCAN finds that is longer than this is not kvshelf's (a prefix, a pool name and a hash).
MAX_SCANNED_KEY_BYTES = 64 * 1024


def get_each(
    client: Any,
    cluster: bool,
    keys: Sequence[bytes],
    receive: Callable[[int, ReplyReader, int], None],
    take: Callable[[int, bytes | None], None],
    *,
    deadline: float,
) -> None:
    """GET every key of ``keys`` by ``deadline`` (:func:`time.monotonic`). For a value of
    ``size`` bytes, ``receive(i, reader, size)`` consumes exactly those bytes from ``reader``
    (if it raises, the GETs not read yet fail and their connection is closed); a missing key
    is ``take(i, None)``, a redirected one ``take(i, value)`` once the client fetched it.

    Raises:
        FramingError: a reply that is not a value, a nil or a redirect; its connection closed.
        TimeoutError: the deadline passed; values taken before it stay taken.
        redis.RedisError, OSError: a GET failed; values taken before it stay taken.
    """

    def read(reader: ReplyReader, indices: Sequence[int], redirected: list[int]) -> None:
        redirected += read_gets(reader, indices, receive, take)

    commands = [("GET", key) for key in keys]
    for i in _batches(client, cluster, keys, _packed(commands), read, deadline):
        time_left(deadline)
        take(i, client.get(keys[i]))


def exists_each(
    client: Any, cluster: bool, keys: Sequence[bytes], *, deadline: float
) -> list[bool]:
    """Whether each key of ``keys`` exists, asked by ``deadline`` (one ``EXISTS`` per key).

    Raises:
        FramingError: a reply other than an integer or a redirect; its connection closed.
        TimeoutError: the deadline passed.
        redis.RedisError, OSError: an EXISTS failed.
    """
    found = [False] * len(keys)

    def read(reader: ReplyReader, indices: Sequence[int], redirected: list[int]) -> None:
        for i in indices:
            count = reader.integer()
            if isinstance(count, Redirect):
                redirected.append(i)
            else:
                found[i] = count > 0

    commands = [("EXISTS", key) for key in keys]
    for i in _batches(client, cluster, keys, _packed(commands), read, deadline):
        time_left(deadline)
        found[i] = client.exists(keys[i]) > 0
    return found


def unlink_each(client: Any, cluster: bool, keys: Sequence[bytes], *, deadline: float) -> int:
    """UNLINK every key of ``keys`` (one command per key: in a cluster they sit in many slots)
    by ``deadline``; how many existed.

    Raises:
        FramingError: a reply other than an integer or a redirect; its connection closed.
        TimeoutError: the deadline passed.
        redis.RedisError, OSError: an UNLINK failed.
    """
    deleted = 0

    def read(reader: ReplyReader, indices: Sequence[int], redirected: list[int]) -> None:
        nonlocal deleted
        for i in indices:
            count = reader.integer()
            if isinstance(count, Redirect):
                redirected.append(i)
            else:
                deleted += count

    commands = [("UNLINK", key) for key in keys]
    for i in _batches(client, cluster, keys, _packed(commands), read, deadline):
        time_left(deadline)
        deleted += client.unlink(keys[i])
    return deleted


def scan_step(
    pool: Any, cursor: int, match: bytes, count: int, *, deadline: float
) -> tuple[int, list[bytes]]:
    """One ``SCAN cursor MATCH match COUNT count`` on a connection of ``pool`` (one node's), by
    ``deadline``.

    Returns:
        The next cursor (0: the scan is over) and the keys of this step.

    Raises:
        FramingError: a reply that is not a SCAN reply; its connection closed.
        TimeoutError: the deadline passed.
        redis.RedisError, OSError: the SCAN failed.
    """
    keys: list[bytes] = []
    command = ("SCAN", str(cursor), "MATCH", match, "COUNT", str(count))
    time_left(deadline)
    connection = pool.get_connection()
    read_whole = False
    try:
        send_all(connection._sock, connection.pack_command(*command), deadline)
        reader = ReplyReader(connection._sock, deadline)
        if reader.array() != 2:
            raise FramingError("a SCAN reply that is not [cursor, keys]")
        size = reader.bulk()
        if not isinstance(size, int) or size > 20:
            raise FramingError("a SCAN reply without a cursor")
        digits = reader.exact(size)
        reader.end()
        if not digits.isdigit():
            raise FramingError(f"a SCAN cursor that is not a number: {digits[:40]!r}")
        for _ in range(reader.array()):
            size = reader.bulk()
            if not isinstance(size, int):
                raise FramingError("a SCAN reply with a key that is not a string")
            if size > MAX_SCANNED_KEY_BYTES:
                reader.skip(size)  # not one of kvshelf's keys, which are short
            else:
                keys.append(reader.exact(size))
            reader.end()
        if reader.pending:
            raise FramingError(f"{reader.pending} bytes after the SCAN reply")
        read_whole = True
    finally:
        if read_whole:
            connection._sock.settimeout(connection.socket_timeout)
        else:  # replies left unread: the connection is out of step
            connection.disconnect()
        pool.release(connection)
    return int(digits), keys


def read_gets(
    reader: ReplyReader,
    indices: Sequence[int],
    receive: Callable[[int, ReplyReader, int], None],
    take: Callable[[int, bytes | None], None],
) -> list[int]:
    """Read the replies of GETs of ``indices`` off ``reader`` (as :func:`get_each` does);
    the indices redirected."""
    redirected = []
    for i in indices:
        size = reader.bulk()
        if size is None:
            take(i, None)
        elif isinstance(size, Redirect):
            redirected.append(i)
        else:
            receive(i, reader, size)
            reader.end()
    return redirected


def set_each(
    client: Any,
    cluster: bool,
    items: Sequence[tuple[bytes, Sequence[bytes | memoryview]]],
    px_ms: int | None,
    *,
    deadline: float,
) -> None:
    """SET every ``(key, value pieces)`` of ``items`` (with ``PX px_ms`` when given) by
    ``deadline`` (:func:`time.monotonic`).

    Raises:
        FramingError: a reply other than ``+OK`` or a redirect; its connection closed.
        TimeoutError: the deadline passed.
        redis.RedisError, OSError: a SET failed.
    """

    def send(connection: Any, indices: Sequence[int], deadline: float) -> None:
        pieces: list[bytes | memoryview] = []
        for i in indices:
            pieces += set_command(items[i][0], items[i][1], px_ms)
        # The client's socket: connected, AUTH done.
        send_all(connection._sock, pieces, deadline)

    def read(reader: ReplyReader, indices: Sequence[int], redirected: list[int]) -> None:
        for i in indices:
            if reader.status() is not None:
                redirected.append(i)

    keys = [key for key, _ in items]
    for i in _batches(client, cluster, keys, send, read, deadline):
        time_left(deadline)
        client.set(keys[i], b"".join(items[i][1]), px=px_ms)


def _packed(
    commands: Sequence[tuple[str, bytes]],
) -> Callable[[Any, Sequence[int], float], None]:
    """A batch's ``send``: the commands of its indices, packed by the client's connection."""

    def send(connection: Any, indices: Sequence[int], deadline: float) -> None:
        pieces = connection.pack_commands([commands[i] for i in indices])
        send_all(connection._sock, pieces, deadline)

    return send


def _batches(
    client: Any,
    cluster: bool,
    keys: Sequence[bytes],
    send: Callable[[Any, Sequence[int], float], None],
    read: Callable[[ReplyReader, Sequence[int], list[int]], None],
    deadline: float,
) -> list[int]:
    """Send every node's batch of commands, then read each batch's replies, all by
    ``deadline``; the indices redirected elsewhere. A connection whose replies were all read
    gets its socket timeout back before it returns to its pool."""
    batches = _by_node(client, keys) if cluster else [(client.connection_pool, range(len(keys)))]
    sent: list[tuple[Any, Any, Sequence[int]]] = []
    redirected: list[int] = []
    read_whole = 0  # how many of ``sent`` had every reply read
    try:
        for pool, indices in batches:
            time_left(deadline)
            connection = pool.get_connection()
            sent.append((pool, connection, indices))
            send(connection, indices, deadline)
        for _, connection, indices in sent:
            # The client's connected socket (``get_connection`` connected it; redis-py keeps it
            # in ``_sock``): the replies are read here, never by the client's parser.
            reader = ReplyReader(connection._sock, deadline)
            read(reader, indices, redirected)
            if reader.pending:
                raise FramingError(f"{reader.pending} bytes after the last reply")
            read_whole += 1
    finally:
        for done, (pool, connection, _) in enumerate(sent):
            if done >= read_whole:  # replies left unread: the connection is out of step
                connection.disconnect()
            else:
                connection._sock.settimeout(connection.socket_timeout)
            pool.release(connection)
    return redirected


def _by_node(client: Any, keys: Sequence[bytes]) -> list[tuple[Any, list[int]]]:
    """The indices of ``keys`` per cluster master, with that master's connection pool."""
    batches: dict[str, tuple[Any, list[int]]] = {}
    for i, key in enumerate(keys):
        node = client.get_node_from_key(key)
        if node.name not in batches:
            batches[node.name] = (client.get_redis_connection(node).connection_pool, [])
        batches[node.name][1].append(i)
    return list(batches.values())
